"""The LR-aware meta-controller above ElChe (``lr_event_meta``, on by default).

Once per averaging cycle, after the guard's verdict, the coordinator calls
``observe(lr, anchor, verdict, phase)``. Two watchers feed one actuator, a :class:`NudgeDown` that
the coordinator passes to :meth:`flodl.coord.elche.ElChe.apply_verdict`:

- **LR-cliff watcher** (precautionary): the last two LRs dropped by more than
  ``sharp_drop_threshold`` (rises and gentle decay are ignored) → ``eff(0.5)``.
- **Convergence watcher** (corrective): the last ``K`` guard verdicts were all SuppressGrowth or
  NudgeDown, with ``K`` = 5 / 3 / 2 in Warmup / Stable / Mature → ``eff(base)`` with base
  0.3 / 0.5 / 0.7.

``eff(base) = clamp(base − (1 − base)·anchor_trend, 0.1, 0.95)`` where
``anchor_trend = (current − mean) / mean`` over the anchor window: a rising anchor (growth fighting
back) amplifies the nudge, a falling one (already correcting) dampens it. When both fire the factors
multiply, clamped again. Phases are hints, not gates, except Probe, which never acts.

Pure: standard-library data modules only; no clock, no I/O.

Choices (where the original is silent or ambiguous):

- ``lr=None`` ("no LR known yet") records nothing and returns ``None``: the windows start with the
  first known LR, as if ``observe`` had not been called (the coordinator is a no-op until then).
- Probe still records into the windows (as in Rust), it only never acts.
- The configuration is validated: ``lr_window_cap ≥ 2`` (the cliff needs two LRs),
  ``guard_window_cap ≥ 5`` (the longest sustain), ``0 < effective_factor_min ≤
  effective_factor_max ≤ 1``, ``sharp_drop_threshold ≥ 0``; violations raise ``ConfigError``.
"""

from __future__ import annotations

import math
from collections import deque
from typing import TYPE_CHECKING

from flodl.coord.elche_state import Phase
from flodl.coord.verdicts import NudgeDown, SuppressGrowth
from flodl.errors import ConfigError

if TYPE_CHECKING:
    from collections.abc import Mapping

    from flodl.coord.verdicts import ConvergenceAction

__all__ = [
    "LR_CLIFF_BASE_FACTOR",
    "SETTLED_EPSILON",
    "BASE_FACTOR",
    "SUSTAIN_K",
    "MetaController",
]

LR_CLIFF_BASE_FACTOR = 0.5
"""Base factor of the LR-cliff watcher (halve the anchor on a hard signal)."""
SETTLED_EPSILON = 0.10
"""``|anchor_trend|`` below this counts as settled (diagnostic only)."""
BASE_FACTOR: Mapping[Phase, float] = {
    Phase.PROBE: 0.3,
    Phase.WARMUP: 0.3,
    Phase.STABLE: 0.5,
    Phase.MATURE: 0.7,
}
"""Convergence-watcher base factor per phase: aggressive while trust is low, gentle later."""
SUSTAIN_K: Mapping[Phase, int] = {Phase.PROBE: 5, Phase.WARMUP: 5, Phase.STABLE: 3, Phase.MATURE: 2}
"""Trailing verdicts that must all be non-Stable for the convergence watcher to fire."""


class MetaController:
    """LR-aware meta-controller: reactive anchor nudges ElChe's own feedback cannot absorb.

    Owned and driven by the coordinator (one thread, no locks).

    Args:
        lr_window_cap: LRs kept (the cliff uses the last two).
        anchor_window_cap: anchors kept for ``anchor_trend``.
        guard_window_cap: guard verdicts kept (≥ the longest sustain, 5).
        sharp_drop_threshold: single-cycle relative LR drop that counts as a cliff.
        effective_factor_min: lower clamp of every emitted factor.
        effective_factor_max: upper clamp of every emitted factor.

    Raises:
        ConfigError: an argument is out of range; the message names it.
    """

    def __init__(
        self,
        lr_window_cap: int = 3,
        anchor_window_cap: int = 5,
        guard_window_cap: int = 5,
        sharp_drop_threshold: float = 0.3,
        effective_factor_min: float = 0.1,
        effective_factor_max: float = 0.95,
    ) -> None:
        if lr_window_cap < 2:
            raise ConfigError(f"lr_window_cap must be >= 2, got {lr_window_cap!r}")
        if anchor_window_cap < 1:
            raise ConfigError(f"anchor_window_cap must be >= 1, got {anchor_window_cap!r}")
        longest = max(SUSTAIN_K.values())
        if guard_window_cap < longest:
            raise ConfigError(f"guard_window_cap must be >= {longest}, got {guard_window_cap!r}")
        if not (math.isfinite(sharp_drop_threshold) and sharp_drop_threshold >= 0):
            raise ConfigError(
                f"sharp_drop_threshold must be finite and >= 0, got {sharp_drop_threshold!r}"
            )
        if not 0.0 < effective_factor_min <= 1.0:
            raise ConfigError(
                f"effective_factor_min must be in (0, 1], got {effective_factor_min!r}"
            )
        if not effective_factor_min <= effective_factor_max <= 1.0:
            raise ConfigError(
                "effective_factor_max must be in [effective_factor_min, 1], "
                f"got {effective_factor_max!r}"
            )
        self._sharp_drop_threshold = sharp_drop_threshold
        self._factor_min = effective_factor_min
        self._factor_max = effective_factor_max
        self._lr_window: deque[float] = deque(maxlen=lr_window_cap)
        self._anchor_window: deque[int] = deque(maxlen=anchor_window_cap)
        self._guard_window: deque[ConvergenceAction] = deque(maxlen=guard_window_cap)
        self.last_causes: tuple[str, ...] = ()
        """Why the latest :meth:`observe` nudged: ``"LR cliff a → b"`` and/or
        ``"k non-Stable verdicts"``; empty when it did not."""

    @property
    def lr_window(self) -> tuple[float, ...]:
        """Recorded LRs, oldest first."""
        return tuple(self._lr_window)

    @property
    def anchor_window(self) -> tuple[int, ...]:
        """Recorded anchors, oldest first."""
        return tuple(self._anchor_window)

    @property
    def guard_window(self) -> tuple[ConvergenceAction, ...]:
        """Recorded guard verdicts, oldest first."""
        return tuple(self._guard_window)

    def observe(
        self, lr: float | None, anchor: int, verdict: ConvergenceAction, phase: Phase
    ) -> NudgeDown | None:
        """Record one averaging cycle, run both watchers and return the combined nudge.

        Args:
            lr: the first rank's most recent LR, ``None`` while no LR is known (then this is a
                no-op that records nothing).
            anchor: ElChe's anchor before this cycle's verdicts (the nudge goes first).
            verdict: the convergence guard's action this cycle.
            phase: ElChe's phase.

        Returns:
            ``NudgeDown(factor)`` with the final factor (base, trend term and clamps applied;
            compounded when both watchers fire), or ``None``.
        """
        self.last_causes = ()
        if lr is None:
            return None
        self._lr_window.append(lr)
        self._anchor_window.append(anchor)
        self._guard_window.append(verdict)
        if phase is Phase.PROBE:
            return None
        trend = self.anchor_trend()
        factors: list[float] = []
        causes: list[str] = []
        if self._sharp_drop_detected():
            factors.append(self._effective_factor(LR_CLIFF_BASE_FACTOR, trend))
            causes.append(f"LR cliff {self._lr_window[-2]:g} → {self._lr_window[-1]:g}")
        if self._convergence_pattern_fires(phase):
            factors.append(self._effective_factor(BASE_FACTOR[phase], trend))
            causes.append(f"{SUSTAIN_K[phase]} non-Stable guard verdicts")
        if not factors:
            return None
        self.last_causes = tuple(causes)
        return NudgeDown(self._clamp(math.prod(factors)))

    def anchor_trend(self) -> float:
        """``(current − mean) / mean`` over the anchor window; 0 with < 2 samples or mean ≤ 0."""
        if len(self._anchor_window) < 2:
            return 0.0
        mean = sum(self._anchor_window) / len(self._anchor_window)
        if mean <= 0:
            return 0.0
        return (self._anchor_window[-1] - mean) / mean

    def is_settled(self) -> bool:
        """Diagnostic: ``|anchor_trend| < SETTLED_EPSILON``."""
        return abs(self.anchor_trend()) < SETTLED_EPSILON

    def reset(self) -> None:
        """Forget all three windows."""
        self._lr_window.clear()
        self._anchor_window.clear()
        self._guard_window.clear()

    def _sharp_drop_detected(self) -> bool:
        if len(self._lr_window) < 2:
            return False
        prev, now = self._lr_window[-2], self._lr_window[-1]
        if not prev > 0 or not now < prev:
            return False
        return (prev - now) / prev > self._sharp_drop_threshold

    def _convergence_pattern_fires(self, phase: Phase) -> bool:
        k = SUSTAIN_K[phase]
        if len(self._guard_window) < k:
            return False
        recent = list(self._guard_window)[-k:]
        return all(isinstance(v, SuppressGrowth | NudgeDown) for v in recent)

    def _effective_factor(self, base: float, trend: float) -> float:
        return self._clamp(base - (1.0 - base) * trend)

    def _clamp(self, factor: float) -> float:
        return min(max(factor, self._factor_min), self._factor_max)
