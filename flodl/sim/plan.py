"""Capacity planning: predict each mode's wall time, idle and sync count for a rig.

Pure module behind ``flodl sim``: runs :class:`~flodl.sim.cluster.SimCluster` once per mode on
the same rig description and seed, and formats the comparison. :func:`lockstep_s` predicts
lock-step synchronous data parallelism (DDP: equal shards, a gradient all-reduce every step)
on the same rig, the baseline the comparison is against.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from flodl.config import DEFAULT_BATCH_SIZE, MODES
from flodl.errors import ConfigError
from flodl.sim.cluster import SimCluster, SimTrace

__all__ = ["RigPlan", "parse_speeds", "plan_modes", "lockstep_s", "lockstep_steps", "format_plan"]


@dataclass(frozen=True, slots=True)
class RigPlan:
    """A rig to plan for: relative per-rank slowness and the workload."""

    speeds: tuple[float, ...]
    base_ms: float = 10.0
    dataset_len: int = 50_000
    batch_size: int = DEFAULT_BATCH_SIZE
    epochs: int = 1
    reduce_ms: float = 5.0
    seed: int = 0

    @property
    def ms_per_batch(self) -> list[float]:
        return [s * self.base_ms for s in self.speeds]


def parse_speeds(text: str) -> tuple[float, ...]:
    """Parse ``"1,1,3"`` (relative ms per batch, 1 = fastest) into a tuple.

    Raises:
        ConfigError: empty, non-numeric, non-positive or non-finite entries.
    """
    parts = [p.strip() for p in text.split(",")]
    if not parts or any(not p for p in parts):
        raise ConfigError(f"--speeds: expected comma-separated numbers like 1,1,3, got {text!r}")
    try:
        values = tuple(float(p) for p in parts)
    except ValueError:
        raise ConfigError(f"--speeds: {text!r} has a non-numeric entry") from None
    if any(not (v > 0 and v < float("inf")) for v in values):
        raise ConfigError(f"--speeds: every entry must be a finite number > 0, got {text!r}")
    return values


def lockstep_steps(rig: RigPlan) -> int:
    """Steps (and gradient all-reduces) of one rank under lock-step DDP: every rank gets
    ``ceil(dataset_len / world)`` samples of an epoch (``DistributedSampler`` pads to equal
    shards), cut into batches of ``batch_size``."""
    per_rank = math.ceil(rig.dataset_len / len(rig.speeds))
    return rig.epochs * math.ceil(per_rank / rig.batch_size)


def lockstep_s(rig: RigPlan) -> float:
    """Predicted training seconds under lock-step DDP: each step lasts as long as the slowest
    rank's batch plus one all-reduce of the gradients (``reduce_ms``, the same volume as an
    averaging of the parameters); no overlap of the all-reduce with the backward is assumed
    (a small model's all-reduce is one bucket, sent after the backward)."""
    return lockstep_steps(rig) * (max(rig.ms_per_batch) + rig.reduce_ms) / 1000.0


def plan_modes(rig: RigPlan, modes: Sequence[str] = MODES) -> dict[str, SimTrace]:
    """Simulate every mode on ``rig``; traces keyed by mode, plus ``"solo"`` (fastest rank
    alone, no averaging) as the baseline."""
    out: dict[str, SimTrace] = {}
    fastest = min(rig.ms_per_batch)
    out["solo"] = SimCluster(
        1,
        "cpu_cadence",
        [fastest],
        dataset_len=rig.dataset_len,
        batch_size=rig.batch_size,
        epochs=rig.epochs,
        seed=rig.seed,
        reduce_ms=0.0,
        check_invariants=False,
    ).run()
    for mode in modes:
        out[mode] = SimCluster(
            len(rig.speeds),
            mode,
            rig.ms_per_batch,
            dataset_len=rig.dataset_len,
            batch_size=rig.batch_size,
            epochs=rig.epochs,
            seed=rig.seed,
            reduce_ms=rig.reduce_ms,
            check_invariants=False,
        ).run()
    return out


def format_plan(rig: RigPlan, traces: dict[str, SimTrace]) -> str:
    """A side-by-side table of the plan."""
    solo = traces["solo"].wall_s
    w = len(rig.speeds)
    idle_hdr = " ".join(f"idle r{r:<3}" for r in range(w))
    lines = [
        (
            f"rig: {w} ranks, ms/batch {[round(m, 3) for m in rig.ms_per_batch]}, "
            f"{rig.dataset_len} samples × {rig.epochs} epoch(s), batch {rig.batch_size}, "
            f"reduce {rig.reduce_ms:g} ms (simulated, seed {rig.seed})"
        ),
        f"{'mode':<13} {'wall s':>9} {'vs solo':>8} {'syncs':>7} {'anchor':>7}  {idle_hdr}",
    ]
    rows = list(traces.items())
    for mode, tr in rows[:1]:
        lines.append(_row(mode, tr, solo))
    lock = lockstep_s(rig)
    lines.append(
        f"{'ddp_lockstep':<13} {lock:9.2f} {solo / lock if lock else 0:7.2f}× "
        f"{lockstep_steps(rig):>7} {'-':>7}  (an all-reduce per step; computed, not simulated)"
    )
    for mode, tr in rows[1:]:
        lines.append(_row(mode, tr, solo))
    return "\n".join(lines)


def _row(mode: str, tr: SimTrace, solo: float) -> str:
    idle = " ".join(f"{f * 100:7.1f}% " for f in tr.idle_fraction)
    anchor = str(tr.anchors[-1]) if tr.anchors and mode != "solo" else "-"
    syncs = "-" if mode == "solo" else str(tr.cycles)
    return (
        f"{mode:<13} {tr.wall_s:9.2f} {solo / tr.wall_s if tr.wall_s else 0:7.2f}× "
        f"{syncs:>7} {anchor:>7}  {idle}"
    )
