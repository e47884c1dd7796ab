"""What a simulated run is told (:class:`Failure`, the faults to inject) and what it tells
back (:class:`SimTrace`). Pure module (docs/design.md §3)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from flodl.wire.frames import EpochMetrics

__all__ = ["Failure", "SimTrace"]


@dataclass(frozen=True, slots=True)
class Failure:
    """A fault injected at virtual time ``at_s``.

    ``kind``: ``"kill"`` (process dies; the launcher reports it after ``detect_delay_s``),
    ``"hang"`` (the rank goes silent; only the heartbeat timeout notices), ``"rejoin"`` (a new
    incarnation of a killed rank starts and says ``hello``: docs/design.md §2, "Rejoin"; it
    must come at least a heartbeat interval after the kill, so that nothing of the old
    incarnation is still scheduled. For a hung rank it is the end of the hung process, which
    the launcher reports as a kill's, and the new incarnation's ``hello`` a heartbeat
    interval later).
    """

    rank: int
    at_s: float
    kind: Literal["kill", "hang", "rejoin"] = "kill"
    ms_per_batch: float | None = None
    """``rejoin``: the new incarnation's speed (``None``: the old one's)."""


@dataclass(slots=True)
class SimTrace:
    """What a simulated run did."""

    mode: str
    seed: int
    ok: bool = False
    reason: str = ""
    save_reason: str | None = None
    wall_s: float = 0.0
    cycles: int = 0
    anchors: list[int] = field(default_factory=list)
    batch_counts: list[list[int]] = field(default_factory=list)
    busy_s: list[float] = field(default_factory=list)
    idle_s: list[float] = field(default_factory=list)
    samples: list[int] = field(default_factory=list)
    epochs: list[EpochMetrics] = field(default_factory=list)
    coverage_ok: list[bool] = field(default_factory=list)
    deaths: list[tuple[float, int, str]] = field(default_factory=list)
    rank_failures: list[tuple[float, int, str]] = field(default_factory=list)
    """Ranks that failed on their own (a data-plane timeout, a refused upload): never
    expected without a fault injected into them."""
    shutdowns_with_save: int = 0
    rejoins: list[tuple[float, int, int]] = field(default_factory=list)
    """(virtual time, rank, incarnation) of every rejoin the coordinator accepted."""
    rejoin_refusals: list[tuple[float, int, str]] = field(default_factory=list)
    """(virtual time, rank, reason) of every rejoin it refused."""
    alerts: list[tuple[float, str, str]] = field(default_factory=list)
    """(virtual time, class, detail) of every alert the coordinator raised."""
    reports: list[tuple[float, int, float]] = field(default_factory=list)
    epoch_fns: list[tuple[float, int, int]] = field(default_factory=list)
    """(virtual time, epoch, rank) of every ``epoch_fn`` a rank ran (with ``epoch_fn_ms``)."""
    """(virtual time, epoch, epoch_progress) of every sub-epoch report (``reports_per_epoch``)."""
    epoch_at: list[float] = field(default_factory=list)
    """Virtual time each epoch of ``epochs`` closed."""
    records: list[dict[str, Any]] = field(default_factory=list)
    """``keep_records``: every record and alert, as the record log holds them (``ts``: virtual
    ms)."""
    contribution: list[dict[str, Any]] = field(default_factory=list)
    """The last ``contribution`` record's per-rank figures and advice
    (:mod:`flodl.coord.contribution`)."""
    digest: str = ""
    steps: int = 0

    @property
    def idle_fraction(self) -> list[float]:
        return [i / self.wall_s if self.wall_s > 0 else 0.0 for i in self.idle_s]

    def summary(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "seed": self.seed,
            "ok": self.ok,
            "reason": self.reason,
            "wall_s": round(self.wall_s, 3),
            "syncs": self.cycles,
            "final_anchor": self.anchors[-1] if self.anchors else None,
            "final_counts": self.batch_counts[-1] if self.batch_counts else None,
            "idle_fraction": [round(f, 4) for f in self.idle_fraction],
            "samples": self.samples,
        }
