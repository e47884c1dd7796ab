"""Reporting: what the coordinator tells the observers when an epoch closes and, with
``reports_per_epoch``, inside an epoch (docs/design.md §7).

Pure module. The arithmetic lives in :mod:`flodl.coord.metrics`; this module turns a closed
epoch or the epoch's progress into effects: ``epoch_aggregated`` to every live rank, the
``epoch`` record (batch counts, heartbeat ages, ElChe's phase) and
:class:`~flodl.coord.effects.EpochDone` after it (sinks merge the two), and the sub-epoch
``node`` records of the root → host → rank tree.

Sub-epoch reports (``reports_per_epoch = n``) follow the ``batch`` frames the ranks already
send, not the averaging cycles: the ``k``-th report of an epoch fires at the batch that brings
the epoch's trained batches to ``k/n`` of the batches this run trains in it, so every epoch
gets exactly ``n`` (one per batch at most: an epoch of fewer than ``n`` batches gets one per
batch), however few averaging cycles it has. A report's rank nodes cover the batches since the
previous report (none for a rank that is not alive at the report); its engine numbers
(``sync_ms``, ``d_raw``, ``lambda_ema``) are the last finalized cycle's. (At reduce
boundaries, a cadence window that grew past ``1/n`` of an epoch gave it fewer than ``n``.)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from flodl.config import CoordConfig
from flodl.coord.contribution import Contribution
from flodl.coord.dispatch import ClosedEpoch
from flodl.coord.effects import Alert, Effect, EpochDone, Record
from flodl.coord.elche import ElChe
from flodl.coord.ledger import EpochWork
from flodl.coord.membership import Membership
from flodl.coord.metrics import (
    EpochAggregator,
    ReportScheduler,
    WindowStats,
    node_paths,
    window_records,
)
from flodl.wire.frames import Batch, EpochAggregated, Metrics

__all__ = ["Reporting"]


class Reporting:
    """Epoch metrics and sub-epoch reports.

    Args:
        config: the run's configuration.
        membership: the roster (live ranks get ``epoch_aggregated``; heartbeat ages).
    """

    def __init__(self, config: CoordConfig, membership: Membership) -> None:
        self.config = config
        self.membership = membership
        self.aggregator = EpochAggregator(config.world_size, dict(config.scalar_reductions))
        self.reports = ReportScheduler(config.reports_per_epoch)
        self.paths = node_paths(config.world_size, config.hosts)
        self._since = [WindowStats() for _ in range(config.world_size)]
        """Each rank's batches since the last sub-epoch report."""
        self._trained: dict[int, int] = {}
        """Batches trained per open epoch (redone ones included), for the report schedule."""
        self._cycle: dict[str, Any] = {"syncs": 0}
        """The last finalized cycle's engine numbers (``sync_ms``, ``d_raw``, ``lambda_ema``)."""
        barrier = config.elche.traits.barrier_paced
        self.contribution = Contribution(config.world_size, barrier=barrier)
        self._started_at: float | None = None

    def start(self, now: float) -> None:
        """Training starts (a resumed segment too): records' ``t_s`` counts from here."""
        self._started_at = now
        self.contribution.start(now)

    def _t(self, now: float) -> float:
        return round(now - (self._started_at if self._started_at is not None else now), 4)

    def window(
        self,
        cycle: int,
        now: float,
        sync_ms: float,
        windows: Sequence[WindowStats],
        ranks: Sequence[int],
        out: list[Effect],
    ) -> None:
        """A cycle finalized: the ``window`` record of what each of ``ranks`` (the live ranks)
        did in it: steps, busy, idle, induced idle, ms per batch
        (:mod:`flodl.coord.contribution`)."""
        data = self.contribution.on_cycle(now, sync_ms, windows, ranks)
        out.append(Record("root", "window", {"cycle": cycle, "t_s": self._t(now), **data}))

    def on_metrics(self, frame: Metrics) -> None:
        self.aggregator.add(frame)

    def close_epoch(
        self, closed: ClosedEpoch, now: float, elche: ElChe, syncs: int, out: list[Effect]
    ) -> None:
        """An epoch's every batch is committed: its metrics to the ranks and the observers."""
        epoch = closed.epoch
        self._trained.pop(epoch, None)
        self.reports.forget(epoch)
        if not closed.coverage.ok:
            out.append(
                Alert(
                    "coverage",
                    "root",
                    f"epoch {epoch} coverage broken: {closed.coverage}",
                    "critical",
                )
            )
        metrics = self.aggregator.finish(
            epoch,
            epoch_ms=max(0.0, (now - closed.started_at) * 1000.0),
            batch_share=elche.recent_batch_share(),
            syncs=syncs,
            anchor=elche.anchor,
            devices=self.membership.devices,
        )
        out.extend(self.membership.broadcast(EpochAggregated(metrics=metrics)))
        out.append(
            Record(
                "root",
                "epoch",
                {
                    "epoch": epoch,
                    "avg_loss": metrics.avg_loss,
                    "batch_counts": list(elche.batch_counts),
                    "heartbeat_age_s": self.membership.heartbeat_ages(now),
                    "phase": elche.phase.value,
                    "ranks": self.membership.alive_count(),
                    "t_s": self._t(now),
                },
            )
        )
        out.append(EpochDone(metrics))  # after its record: sinks merge the two
        live = self.membership.alive()
        out.append(
            Record(
                "root",
                "contribution",
                {"epoch": epoch, "ranks": self.contribution.figures(live)},
            )
        )

    def after_cycle(
        self, *, sync_ms: float, syncs: int, d_raw: float | None, telemetry: Mapping[str, Any]
    ) -> None:
        """A cycle finalized: its engine numbers go into the sub-epoch reports that follow."""
        if self.config.reports_per_epoch is None:
            return
        self._cycle = {"sync_ms": sync_ms, "syncs": syncs}
        if d_raw is not None:
            self._cycle["d_raw"] = d_raw
        if "lambda_ema" in telemetry:
            self._cycle["lambda_ema"] = telemetry["lambda_ema"]

    def on_batch(
        self, batch: Batch, work: EpochWork | None, now: float, elche: ElChe, out: list[Effect]
    ) -> None:
        """A trained batch (of ``work``'s epoch): the sub-epoch report it completes, if any."""
        if self.config.reports_per_epoch is None or work is None:
            return
        self._since[batch.rank].add(
            batch.batch_ms, batch.data_ms, batch.loss, self.config.batch_size
        )
        epoch = work.epoch
        trained = self._trained.get(epoch, 0) + 1
        self._trained[epoch] = trained
        if not self.reports.due(epoch, trained, work.work_batches):
            return
        world = self.config.world_size
        done = work.total_batches - work.work_batches + sum(work.done(r) for r in range(world))
        shares = elche.recent_batch_share()
        alive, empty = self.membership.is_alive, WindowStats()
        # a rank that died since the last report reports nothing measured (absent, not zero)
        nodes = {r: (self._since[r] if alive(r) else empty).node(shares[r]) for r in range(world)}
        self._since = [WindowStats() for _ in range(world)]
        engine: dict[str, Any] = {
            "epoch": epoch,
            "epoch_progress": min(1.0, done / max(1, work.total_batches)),
            "anchor": elche.anchor,
            "batch_counts": list(elche.batch_counts),
            "heartbeat_age_s": self.membership.heartbeat_ages(now),
            "ranks": self.membership.alive_count(),
            **self._cycle,
        }
        for path, node in window_records(nodes, self.paths, engine):
            out.append(Record(path, "node", node))
