"""ElChe's data: the tuning constants, the lifecycle :class:`Phase`, one window's
:class:`WindowReport` and the checkpointed :class:`ElCheState`. Pure: no clock, no I/O.
"""

from __future__ import annotations

import math
from collections.abc import (  # (at run time: see docs/design.md §2)
    Mapping,
    Sequence,
)
from dataclasses import dataclass
from enum import Enum

from flodl.errors import ConfigError, LocalProtocolError

__all__ = [
    "TRUST_WINDOW_CAP",
    "COHORT_BAND",
    "DOMINANCE_MARGIN",
    "MAX_SPEED_RATIO",
    "BATCH_COUNTS_WINDOW_CAP",
    "GROWTH_REARM_STABLE",
    "GROWTH_STEP_CAP",
    "WARMUP_GROWTH_MARGIN",
    "DEAD_ZONE",
    "MISS_LIMIT",
    "Phase",
    "IntArg",
    "WindowReport",
    "ElCheState",
]


TRUST_WINDOW_CAP = 5
"""Per-rank ring of recent ms/batch readings; the smoothed value is the plain mean (0 if empty)."""
COHORT_BAND = 0.15
"""A rank is anchor-eligible when its smoothed ms is ≥ (1 − band) × the slowest alive rank's."""
DOMINANCE_MARGIN = 0.10
"""A challenger replaces the sitting anchor only when its ms is > (1 + margin) × the anchor's."""
MAX_SPEED_RATIO = 64
"""Clamp on slow_ms / ms, so a degenerate tiny sample cannot produce a 1e5-batch schedule."""
BATCH_COUNTS_WINDOW_CAP = 10
"""Snapshots of ``batch_counts`` kept for :meth:`~flodl.coord.elche.ElChe.recent_batch_share`."""
GROWTH_REARM_STABLE = 5
"""Consecutive Stable verdicts that re-arm growth after any non-Stable one."""
GROWTH_STEP_CAP = 2.0
"""Largest multiplicative anchor growth per cycle."""
WARMUP_GROWTH_MARGIN = 2.0
"""During Warmup a proposal needs overhead > margin × target (so it is cap-clamped by design)."""
DEAD_ZONE = 0.05
"""A rank's count changes only when |target − current| > DEAD_ZONE × current."""
MISS_LIMIT = 5
"""Consecutive missing readings after which a rank's trust ring is cleared (= TRUST_WINDOW_CAP)."""


class Phase(Enum):
    """Lifecycle phase; monotonic and ordered (``Phase.STABLE >= Phase.WARMUP``).

    Probe: no calibration yet. Warmup: the anchor pin holds, growth may act from the 2nd
    calibration above the warmup margin. Stable: election and growth at the real target.
    Mature: same as Stable inside ElChe; the meta-controller reads it.
    """

    PROBE = "probe"
    WARMUP = "warmup"
    STABLE = "stable"
    MATURE = "mature"

    @property
    def order(self) -> int:
        """Explicit position in the lifecycle (probe 0 … mature 3); comparisons use it."""
        return _PHASE_ORDER.index(self)

    def __lt__(self, other: object) -> bool:
        if not isinstance(other, Phase):
            return NotImplemented
        return self.order < other.order

    def __le__(self, other: object) -> bool:
        if not isinstance(other, Phase):
            return NotImplemented
        return self.order <= other.order

    def __gt__(self, other: object) -> bool:
        if not isinstance(other, Phase):
            return NotImplemented
        return self.order > other.order

    def __ge__(self, other: object) -> bool:
        if not isinstance(other, Phase):
            return NotImplemented
        return self.order >= other.order


_PHASE_ORDER: tuple[Phase, ...] = (Phase.PROBE, Phase.WARMUP, Phase.STABLE, Phase.MATURE)


IntArg = int | bool
"""An int argument a constructor checks with :func:`is_int`, spelled with ``bool`` so the
compiled core (mypyc) passes the check the object as given: it converts a bool to an int at a
call to a plain ``int`` parameter, and ``True`` would pass as 1 (docs/design.md §2)."""


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


@dataclass(frozen=True, slots=True)
class WindowReport:
    """One reduce window's observations, built by the coordinator from its window ledger.

    Carries both timing scales so the scale-selection policy lives here, next to the relative
    allocation model it protects. All sequences are per rank (length ``world_size``) and are
    stored as tuples.

    Attributes:
        wall_ms: compute-only wall (ms): the sum of ``batch_ms`` this window.
        steps: steps this window (the divisor matching ``wall_ms``).
        delivered_ms: marginal delivered wall (ms): ``batch_ms + data_ms`` with the window's
            first batch excluded; ``0.0`` for a rank without a delivered sample.
        delivered_batches: the divisor matching ``delivered_ms``; ``0`` without a sample.
        fill_ms: first-batch excess over the marginal rate (ms): the window-pressure signal.
        delivered_coherent: the caller's attestation that every alive mover has a delivered
            sample this window.
        sync_ms: duration (ms) of the reduce that closed the previous window.

    Raises:
        LocalProtocolError: the per-rank sequences differ in length.
    """

    wall_ms: Sequence[float]
    steps: Sequence[int]
    delivered_ms: Sequence[float]
    delivered_batches: Sequence[int]
    fill_ms: Sequence[float]
    delivered_coherent: bool
    sync_ms: float

    def __post_init__(self) -> None:
        for name in ("wall_ms", "steps", "delivered_ms", "delivered_batches", "fill_ms"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        n = len(self.wall_ms)
        lengths = {
            len(self.steps),
            len(self.delivered_ms),
            len(self.delivered_batches),
            len(self.fill_ms),
        }
        if lengths != {n}:
            raise LocalProtocolError(
                f"WindowReport per-rank sequences differ in length: wall_ms has {n}, "
                f"others {sorted(lengths)}"
            )

    def select_feed(
        self, *, delivered_capable: bool, alive: Sequence[bool] | None = None
    ) -> tuple[list[float], list[int]]:
        """The ``(ms, batches)`` pair ElChe schedules on this window (the scale selection).

        ElChe's allocation is relative, so every rank must be fed on one scale. The delivered
        scale is used only when the mode is delivered-capable (CPU Cadence/Async, NCCL Cadence;
        never Sync), the caller attests coherence, and every alive rank with ``steps > 0`` has a
        delivered sample; ranks without a sample then fall back to their compute pair. Otherwise
        every rank feeds compute-only ``(wall_ms, steps)``.

        Args:
            delivered_capable: whether the mode rides the delivered feed at all.
            alive: per-rank liveness; ``None`` means every rank is alive.

        Returns:
            Per-rank ms and per-rank batch counts, as new lists.
        """
        compute = (list(self.wall_ms), list(self.steps))
        if not (delivered_capable and self.delivered_coherent):
            return compute
        mask = [True] * len(self.wall_ms) if alive is None else alive
        ms: list[float] = []
        batches: list[int] = []
        for up, wall, steps, d_ms, d_batches in zip(
            mask, self.wall_ms, self.steps, self.delivered_ms, self.delivered_batches, strict=True
        ):
            if d_batches > 0 and d_ms > 0.0:  # a delivered sample
                ms.append(d_ms)
                batches.append(d_batches)
            elif up and steps > 0:  # a live mover without one: every rank on the compute scale
                return compute
            else:
                ms.append(wall)
                batches.append(steps)
        return ms, batches


_PHASE_NAMES = frozenset(p.value for p in Phase)


@dataclass(frozen=True, slots=True)
class ElCheState:
    """ElChe's checkpointed trajectory (user knobs are not saved: they come from config).

    Attributes:
        anchor: batches the anchor rank runs per window.
        anchor_rank: the elected anchor rank, or ``None`` before the first election.
        smoothed_ms_per_batch: per-rank trust-ring mean (0 where a rank had no reading).
        phase: ``"probe"``, ``"warmup"``, ``"stable"`` or ``"mature"``.
        calibration_count: successful timing reports so far.
        trend_history: the convergence guard's ring, filled in by the coordinator; ``None`` from
            :meth:`~flodl.coord.elche.ElChe.to_state`.

    Raises:
        ConfigError: a field is out of range; the message names it.
    """

    anchor: int
    anchor_rank: int | None
    smoothed_ms_per_batch: list[float]
    phase: str
    calibration_count: int
    trend_history: list[float] | None = None

    def __post_init__(self) -> None:
        if not is_int(self.anchor) or self.anchor < 1:
            raise ConfigError(f"anchor must be an int >= 1, got {self.anchor!r}")
        if self.anchor_rank is not None and (not is_int(self.anchor_rank) or self.anchor_rank < 0):
            raise ConfigError(f"anchor_rank must be None or an int >= 0, got {self.anchor_rank!r}")
        if not all(
            is_number(v) and math.isfinite(v) and v >= 0 for v in self.smoothed_ms_per_batch
        ):
            raise ConfigError(
                "smoothed_ms_per_batch must hold finite numbers >= 0, "
                f"got {self.smoothed_ms_per_batch!r}"
            )
        if self.phase not in _PHASE_NAMES:
            raise ConfigError(f"phase must be one of {sorted(_PHASE_NAMES)}, got {self.phase!r}")
        if not is_int(self.calibration_count) or self.calibration_count < 0:
            raise ConfigError(
                f"calibration_count must be an int >= 0, got {self.calibration_count!r}"
            )
        if self.trend_history is not None and not all(is_number(v) for v in self.trend_history):
            raise ConfigError(f"trend_history must hold numbers, got {self.trend_history!r}")

    def resized(self, world_size: int) -> ElCheState:
        """This trajectory for a run of ``world_size`` ranks (a resume at another world size,
        docs/design.md §6, "Resume at another world size").

        Ranks that exist in both keep their speed; ranks that did not exist at the save get 0
        (no reading: ElChe gives them the anchor's count, a calibration window, and their first
        report measures them); ranks past ``world_size`` are dropped, and so is an anchor rank
        among them (the next report elects one). The anchor, phase, calibration count and
        trend history carry over: they describe the run, not a rank.

        Raises:
            LocalProtocolError: ``world_size`` < 1.
        """
        if world_size < 1:
            raise LocalProtocolError(f"resized: world_size must be >= 1, got {world_size}")
        saved = list(self.smoothed_ms_per_batch)
        speeds = saved[:world_size] + [0.0] * max(0, world_size - len(saved))
        anchor_rank = self.anchor_rank
        if anchor_rank is not None and anchor_rank >= world_size:
            anchor_rank = None
        return ElCheState(
            anchor=self.anchor,
            anchor_rank=anchor_rank,
            smoothed_ms_per_batch=speeds,
            phase=self.phase,
            calibration_count=self.calibration_count,
            trend_history=self.trend_history,
        )

    def to_dict(self) -> dict[str, object]:
        """Plain JSON-ready dict with the snake_case field names."""
        return {
            "anchor": self.anchor,
            "anchor_rank": self.anchor_rank,
            "smoothed_ms_per_batch": list(self.smoothed_ms_per_batch),
            "phase": self.phase,
            "calibration_count": self.calibration_count,
            "trend_history": None if self.trend_history is None else list(self.trend_history),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, object]) -> ElCheState:
        """Inverse of :meth:`to_dict`.

        Unknown keys are ignored; a missing ``trend_history`` reads as ``None``.

        Raises:
            ConfigError: a field is missing or has the wrong type; the message names it.
        """
        anchor_rank = _field(data, "anchor_rank")
        if anchor_rank is not None and not isinstance(anchor_rank, int):
            raise ConfigError(f"anchor_rank must be None or an int, got {anchor_rank!r}")
        phase = _field(data, "phase")
        if not isinstance(phase, str):
            raise ConfigError(f"phase must be a string, got {phase!r}")
        trend = data.get("trend_history")
        return cls(
            anchor=_int_field(data, "anchor"),
            anchor_rank=anchor_rank,
            smoothed_ms_per_batch=_float_list(
                _field(data, "smoothed_ms_per_batch"), "smoothed_ms_per_batch"
            ),
            phase=phase,
            calibration_count=_int_field(data, "calibration_count"),
            trend_history=None if trend is None else _float_list(trend, "trend_history"),
        )


def _field(data: Mapping[str, object], key: str) -> object:
    if key not in data:
        raise ConfigError(f"{key} is missing from the ElChe state")
    return data[key]


def _int_field(data: Mapping[str, object], key: str) -> int:
    value = _field(data, key)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ConfigError(f"{key} must be an int, got {value!r}")
    return value


def _float_list(value: object, key: str) -> list[float]:
    if not isinstance(value, list | tuple):
        raise ConfigError(f"{key} must be a list of numbers, got {value!r}")
    out: list[float] = []
    for v in value:
        if not isinstance(v, int | float) or isinstance(v, bool):
            raise ConfigError(f"{key} must be a list of numbers, got {value!r}")
        out.append(float(v))
    return out
