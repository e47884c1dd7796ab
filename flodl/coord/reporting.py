"""Reporting: what the coordinator tells the observers when an epoch closes and, with
``reports_per_epoch``, at reduce boundaries inside an epoch (docs/design.md §7).

Pure module. The arithmetic lives in :mod:`flodl.coord.metrics`; this module turns a closed
epoch or a finished window into effects: ``epoch_aggregated`` to every live rank, the ``epoch``
record (batch counts, heartbeat ages, ElChe's phase) and :class:`~flodl.coord.effects.EpochDone`
after it (sinks merge the two), and the sub-epoch ``node`` records of the root → host → rank
tree.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from flodl.config import CoordConfig
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
from flodl.wire.frames import EpochAggregated, Metrics

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

    def on_metrics(self, frame: Metrics) -> None:
        self.aggregator.add(frame)

    def close_epoch(
        self, closed: ClosedEpoch, now: float, elche: ElChe, syncs: int, out: list[Effect]
    ) -> None:
        """An epoch's every batch is committed: its metrics to the ranks and the observers."""
        epoch = closed.epoch
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
                },
            )
        )
        out.append(EpochDone(metrics))  # after its record: sinks merge the two

    def maybe_report(
        self,
        work: EpochWork | None,
        windows: Sequence[WindowStats],
        *,
        sync_ms: float,
        now: float,
        elche: ElChe,
        syncs: int,
        d_raw: float | None,
        telemetry: Mapping[str, Any],
        out: list[Effect],
    ) -> None:
        """The sub-epoch report of a finished window, when one is due."""
        if self.config.reports_per_epoch is None or work is None:
            return
        world = self.config.world_size
        committed = sum(work.committed(r) for r in range(world))
        if not self.reports.due(work.epoch, committed, work.total_batches):
            return
        shares = elche.recent_batch_share()
        nodes = {r: windows[r].node(shares[r]) for r in range(world)}
        engine: dict[str, Any] = {
            "epoch": work.epoch,
            "epoch_progress": committed / max(1, work.total_batches),
            "anchor": elche.anchor,
            "sync_ms": sync_ms,
            "batch_counts": elche.batch_counts,
            "syncs": syncs,
            "heartbeat_age_s": self.membership.heartbeat_ages(now),
            "ranks": self.membership.alive_count(),
        }
        if d_raw is not None:
            engine["d_raw"] = d_raw
        if "lambda_ema" in telemetry:
            engine["lambda_ema"] = telemetry["lambda_ema"]
        for path, node in window_records(nodes, self.paths, engine):
            out.append(Record(path, "node", node))
