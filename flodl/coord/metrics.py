"""Metrics: per-epoch aggregation into :class:`EpochMetrics` and sub-epoch window reports.

Pure module. Rules (docs/design.md §2, §7):

* ranks send one ``metrics`` frame per finished chunk (progressive) or partition (sync); per
  rank the records are summed; ``avg_loss`` is the batch-weighted mean over ranks; user scalars
  are a per-rank mean (sum / count) then batch-weighted across ranks; ``epoch_ms`` is the
  coordinator's wall clock from the epoch's first dispatch to its last commit (ranks' clocks are
  never compared); per-rank throughput is samples per second of that rank's share time.
* sub-epoch reports (``reports_per_epoch = n``) fire at the first batch past each ``1/n``
  slice of an epoch's work, n per epoch (:mod:`flodl.coord.reporting`), and build a
  path-keyed node tree
  root → host → rank (root → rank on one host). Interior nodes aggregate their *direct
  children*: ``loss`` work-weighted mean, ``throughput`` sum, ``compute_only_ms`` work-weighted
  mean, ``data_starve_ms`` max; a metric a rank did not measure is absent, never zero.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from flodl.wire.frames import EpochMetrics, Metrics

__all__ = [
    "REDUCTIONS",
    "RankEpoch",
    "EpochAggregator",
    "WindowStats",
    "ReportScheduler",
    "node_paths",
    "window_records",
    "combine_scalars",
]

REDUCTIONS: dict[str, str] = {
    "loss": "mean",
    "throughput": "sum",
    "compute_only_ms": "mean",
    "data_starve_ms": "max",
    "batch_share": "sum",
    "steps": "sum",
}
"""Fixed reductions of the framework metrics (user scalars default to ``mean``)."""


@dataclass(slots=True)
class RankEpoch:
    """One rank's sums over an epoch."""

    loss_sum: float = 0.0
    batches: int = 0
    samples: int = 0
    share_complete_ms: float = 0.0
    compute_only_ms: float = 0.0
    data_starve_ms: float = 0.0
    scalars: dict[str, tuple[float, int]] = field(default_factory=dict)

    def add(self, m: Metrics) -> None:
        self.loss_sum += m.avg_loss * m.batches_processed
        self.batches += m.batches_processed
        self.samples += m.samples_processed
        self.share_complete_ms += m.share_complete_ms
        self.compute_only_ms += m.compute_only_ms
        self.data_starve_ms += m.data_starve_ms
        for name, (total, count) in m.scalars.items():
            s, c = self.scalars.get(name, (0.0, 0))
            self.scalars[name] = (s + total, c + count)


class EpochAggregator:
    """Collects ``metrics`` frames per epoch and builds :class:`EpochMetrics`.

    Args:
        world_size: ranks.
        reductions: user scalar name → ``sum|mean|max|min`` across ranks (default ``mean``,
            batch-weighted); each rank's value is its own per-batch mean.
    """

    def __init__(self, world_size: int, reductions: dict[str, str] | None = None) -> None:
        self.world_size = world_size
        self.reductions = dict(reductions or {})
        self._epochs: dict[int, list[RankEpoch]] = {}

    def add(self, m: Metrics) -> None:
        per_rank = self._epochs.get(m.epoch)
        if per_rank is None:  # not setdefault: building the list per frame would be O(W)
            per_rank = self._epochs[m.epoch] = [RankEpoch() for _ in range(self.world_size)]
        per_rank[m.rank].add(m)

    def finish(
        self,
        epoch: int,
        *,
        epoch_ms: float,
        batch_share: Sequence[float],
        syncs: int,
        anchor: int,
        devices: Sequence[int | None] | None = None,
    ) -> EpochMetrics:
        """Aggregate and forget ``epoch``."""
        ranks = self._epochs.pop(epoch, None) or [RankEpoch() for _ in range(self.world_size)]
        batches = sum(r.batches for r in ranks)
        avg_loss = sum(r.loss_sum for r in ranks) / batches if batches else 0.0
        per_rank_scalars = [
            {k: s / c for k, (s, c) in sorted(r.scalars.items()) if c > 0} for r in ranks
        ]
        scalars = combine_scalars(
            [(means, float(r.batches)) for r, means in zip(ranks, per_rank_scalars, strict=True)],
            self.reductions,
        )
        return EpochMetrics(
            epoch=epoch,
            avg_loss=avg_loss,
            epoch_ms=epoch_ms,
            scalars=scalars,
            per_rank=per_rank_scalars,
            per_rank_loss=[r.loss_sum / r.batches if r.batches else None for r in ranks],
            per_rank_throughput=[
                1000.0 * r.samples / r.share_complete_ms if r.share_complete_ms > 0 else 0.0
                for r in ranks
            ],
            per_rank_batch_share=list(batch_share),
            per_rank_samples=[r.samples for r in ranks],
            per_rank_share_complete_ms=[r.share_complete_ms for r in ranks],
            per_rank_compute_only_ms=[r.compute_only_ms for r in ranks],
            per_rank_data_starve_ms=[r.data_starve_ms for r in ranks],
            device_indices=list(devices) if devices is not None else [None] * self.world_size,
            syncs=syncs,
            anchor=anchor,
        )


def combine_scalars(
    parts: Sequence[tuple[dict[str, float], float]], reductions: dict[str, str]
) -> dict[str, float]:
    """Combine user scalars over ``(values, work)`` parts by each name's reduction: ``mean``
    (default) work-weighted (plain mean when no part has work), ``sum``, ``max``, ``min``. A
    name no part measured is absent."""
    names = sorted({k for values, _ in parts for k in values})
    out: dict[str, float] = {}
    for k in names:
        pairs = [(values[k], w) for values, w in parts if k in values]
        how = reductions.get(k, "mean")
        vals = [v for v, _ in pairs]
        if how == "sum":
            out[k] = sum(vals)
        elif how == "max":
            out[k] = max(vals)
        elif how == "min":
            out[k] = min(vals)
        else:
            total = sum(w for _, w in pairs)
            out[k] = sum(v * w for v, w in pairs) / total if total > 0 else sum(vals) / len(vals)
    return out


@dataclass(slots=True)
class WindowStats:
    """One rank's accumulators over the current averaging window."""

    steps: int = 0
    compute_ms: float = 0.0
    data_ms: float = 0.0
    loss_sum: float = 0.0
    first_ms: float | None = None
    samples: int = 0

    def reset(self) -> WindowStats:
        """Empty again, for the next window; returns itself."""
        self.steps = 0
        self.compute_ms = self.data_ms = self.loss_sum = 0.0
        self.first_ms = None
        self.samples = 0
        return self

    def add(self, batch_ms: float, data_ms: float, loss: float, samples: int) -> None:
        if self.first_ms is None:
            self.first_ms = batch_ms + data_ms
        self.steps += 1
        self.compute_ms += batch_ms
        self.data_ms += data_ms
        self.loss_sum += loss
        self.samples += samples

    def node(self, batch_share: float) -> dict[str, float]:
        """The rank's report node; metrics it did not measure are absent."""
        if self.steps == 0:
            return {"batch_share": batch_share, "steps": 0.0}
        busy = self.compute_ms + self.data_ms
        out = {
            "loss": self.loss_sum / self.steps,
            "compute_only_ms": self.compute_ms / self.steps,
            "data_starve_ms": self.data_ms,
            "batch_share": batch_share,
            "steps": float(self.steps),
        }
        if busy > 0:
            out["throughput"] = 1000.0 * self.samples / busy
        return out


class ReportScheduler:
    """Fires ≤ n sub-epoch reports per epoch, one per call at most, each at the first call
    past the next 1/n slice (epochs counted apart: two may be open at once)."""

    def __init__(self, reports_per_epoch: int | None) -> None:
        self.n = reports_per_epoch
        self._fired: dict[int, int] = {}

    def due(self, epoch: int, done_batches: int, epoch_batches: int) -> bool:
        """Called at each trained batch; True when a report should be emitted now."""
        if self.n is None:
            return False
        fired = self._fired.get(epoch, 0)
        if fired >= self.n or epoch_batches <= 0:
            return False
        threshold = (fired + 1) * epoch_batches / self.n
        if done_batches + 1e-9 >= threshold:
            self._fired[epoch] = fired + 1
            return True
        return False

    def forget(self, epoch: int) -> None:
        """The epoch closed."""
        self._fired.pop(epoch, None)


def node_paths(world_size: int, hosts: Sequence[str] | None) -> list[str]:
    """The record path of each rank: ``root/rankN`` on one host, else ``root/<host>/rankN``."""
    if hosts is None or len(set(hosts)) <= 1:
        return [f"root/rank{r}" for r in range(world_size)]
    return [f"root/{hosts[r]}/rank{r}" for r in range(world_size)]


def _combine(
    children: Sequence[dict[str, float]], reductions: dict[str, str] | None = None
) -> dict[str, float]:
    out: dict[str, float] = {}
    work = [c.get("steps", 0.0) for c in children]
    total_work = sum(work)
    for key in ("loss", "compute_only_ms"):
        pairs = [(c[key], w) for c, w in zip(children, work, strict=True) if key in c]
        if pairs:
            wsum = sum(w for _, w in pairs)
            out[key] = (
                sum(v * w for v, w in pairs) / wsum
                if wsum > 0
                else sum(v for v, _ in pairs) / len(pairs)
            )
    for key in ("throughput", "batch_share"):
        vals = [c[key] for c in children if key in c]
        if vals:
            out[key] = sum(vals)
    starve = [c["data_starve_ms"] for c in children if "data_starve_ms" in c]
    if starve:
        out["data_starve_ms"] = max(starve)
    out["steps"] = total_work
    if reductions is not None:  # user scalars, by their declared reduction
        extra = [
            ({k: v for k, v in c.items() if k not in REDUCTIONS and isinstance(v, float)}, w)
            for c, w in zip(children, work, strict=True)
        ]
        out.update(combine_scalars(extra, reductions))
    return out


def window_records(
    rank_nodes: dict[int, dict[str, float]],
    paths: Sequence[str],
    engine: dict[str, Any],
    reductions: dict[str, str] | None = None,
) -> list[tuple[str, dict[str, Any]]]:
    """Build (path, node) records for one report: ranks, then hosts, then root (with the
    engine metrics such as anchor and sync_ms)."""
    records: list[tuple[str, dict[str, Any]]] = []
    by_parent: dict[str, list[dict[str, float]]] = {}
    for rank in sorted(rank_nodes):
        node = rank_nodes[rank]
        records.append((paths[rank], dict(node)))
        parent = paths[rank].rsplit("/", 1)[0]
        by_parent.setdefault(parent, []).append(node)
    host_nodes: list[dict[str, float]] = []
    for parent in sorted(p for p in by_parent if p != "root"):
        combined = _combine(by_parent[parent], reductions)
        host_nodes.append(combined)
        records.append((parent, dict(combined)))
    root_children = by_parent.get("root", []) + host_nodes
    root: dict[str, Any] = dict(_combine(root_children, reductions)) if root_children else {}
    root.update(engine)
    records.append(("root", root))
    return records
