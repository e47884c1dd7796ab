"""Convergence guards: watch the per-reduce divergence and recommend a cadence verdict.

After each reduce the coordinator builds a :class:`DivergenceReport` (per-rank
``D_r = ||W_pre − W_post|| / ||W_post||``) and calls ``guard.report(report, k_used, k_max)``
(``k_used`` = steps summed over ranks, ``k_max`` = the largest per-rank step count). The guard
returns a :data:`ConvergenceAction` (:class:`Stable`, :class:`SuppressGrowth` or
:class:`NudgeDown`), which the coordinator maps onto :meth:`flodl.coord.elche.ElChe.apply_verdict`.

Guards:

- :class:`NoGuard`: always Stable (``no_divergence_guard``).
- :class:`TrendGuard`: the production default. SuppressGrowth iff the last three ``d_raw`` strictly
  rise and the last exceeds the threshold; never NudgeDown. Its ring is checkpointed
  (``trend_history``).
- :class:`MsfGuard`: a rate detector on ``λ = ln(D_t / D_{t−1}) / k_max`` with a bias-corrected
  EMA and two independent streaks (suppress at 1e-3, nudge at 1e-2).

Pure: standard-library data modules only; no clock, no I/O.

Choices (where the original is silent or ambiguous):

- :class:`MsfGuard`: a ``D`` at or below the noise floor (1e-8) resets the whole estimator
  (previous ``D``, EMA and its step count), as the original's design says; the Rust code of
  that era only dropped the previous ``D`` and kept the EMA. Streaks then decay on their own because
  ``λ_ema`` is unknown until two valid readings.
- ``d_raw`` ignores NaN deltas and is never below 0 (Rust's ``fold(0.0, f64::max)``).
- ``TrendGuard.restore_history`` keeps the last five values; ``TrendGuard`` telemetry is
  ``{"d_history_last": d}`` (empty before the first report), as in Rust.
- :class:`MsfGuard` has one ``sustain`` knob for both streaks (default 3);
  ``nudge_threshold=math.inf`` disables the nudge.
- :func:`make_guard` rejects a negative or NaN ``divergence_threshold`` with ``ConfigError``.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from flodl.coord.verdicts import ConvergenceAction, NudgeDown, Stable, SuppressGrowth
from flodl.errors import ConfigError

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = [
    "TREND_WINDOW_CAP",
    "TREND_THRESHOLD_DEFAULT",
    "TREND_THRESHOLD_EASGD",
    "MSF_ALPHA",
    "MSF_NOISE_FLOOR",
    "MSF_SUPPRESS_THRESHOLD",
    "MSF_NUDGE_THRESHOLD",
    "MSF_SUSTAIN",
    "MSF_NUDGE_FACTOR",
    "DivergenceReport",
    "ConvergenceAction",
    "ConvergenceGuard",
    "NoGuard",
    "TrendGuard",
    "MsfGuard",
    "make_guard",
    "Stable",
    "SuppressGrowth",
    "NudgeDown",
]

TREND_WINDOW_CAP = 5
"""TrendGuard keeps the last five ``d_raw`` values."""
TREND_THRESHOLD_DEFAULT = 0.05
"""TrendGuard threshold for the overwrite modes."""
TREND_THRESHOLD_EASGD = 0.3
"""TrendGuard threshold when EASGD blending is on (it keeps a standing ~0.1 spread)."""
MSF_ALPHA = 0.9
"""EMA coefficient of the λ estimator."""
MSF_NOISE_FLOOR = 1e-8
"""A divergence at or below this is noise: it resets the λ estimator."""
MSF_SUPPRESS_THRESHOLD = 1e-3
"""``λ_ema`` above this for :data:`MSF_SUSTAIN` events → SuppressGrowth."""
MSF_NUDGE_THRESHOLD = 1e-2
"""``λ_ema`` above this for :data:`MSF_SUSTAIN` events → NudgeDown(:data:`MSF_NUDGE_FACTOR`)."""
MSF_SUSTAIN = 3
"""Events a threshold must be exceeded in a row before it fires."""
MSF_NUDGE_FACTOR = 0.5
"""MsfGuard's nudge factor (halve the anchor)."""


@dataclass(frozen=True, slots=True)
class DivergenceReport:
    """Divergence measured around one reduce (sequences are stored as tuples).

    Attributes:
        deltas: per-rank ``||W_pre − W_post|| / ||W_post||``.
        pre_norms: per-rank ``||W_pre||``, or ``None`` when not computed.
        post_norm: ``||W_post||`` (one value: all ranks share the consensus), or ``None``.
    """

    deltas: tuple[float, ...]
    pre_norms: tuple[float, ...] | None = None
    post_norm: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "deltas", tuple(self.deltas))
        if self.pre_norms is not None:
            object.__setattr__(self, "pre_norms", tuple(self.pre_norms))

    @property
    def d_raw(self) -> float:
        """The primary signal: the worst rank's delta (0 when empty; NaN deltas ignored)."""
        return max([0.0, *(d for d in self.deltas if not math.isnan(d))])

    def cosine_similarities(self) -> tuple[float, ...] | None:
        """Per-rank cosine between pre- and post-reduce params, clamped to [−1, 1].

        ``cos = (pre² + post² − (D·post)²) / (2·pre·post)``; ``None`` without norms or with a
        near-zero post norm, 0 for a near-zero pre norm.
        """
        if self.pre_norms is None or self.post_norm is None or self.post_norm < 1e-10:
            return None
        post = self.post_norm
        out: list[float] = []
        for delta, pre in zip(self.deltas, self.pre_norms, strict=False):
            if pre < 1e-10:
                out.append(0.0)
                continue
            cos = (pre * pre + post * post - (delta * post) ** 2) / (2.0 * pre * post)
            out.append(min(max(cos, -1.0), 1.0))
        return tuple(out)

    def magnitude_shifts(self) -> tuple[float, ...] | None:
        """Per-rank ``||W_pre|| − ||W_post||``; ``None`` without norms."""
        if self.pre_norms is None or self.post_norm is None:
            return None
        return tuple(pre - self.post_norm for pre in self.pre_norms)


@runtime_checkable
class ConvergenceGuard(Protocol):
    """What the coordinator needs from a guard (user guards implement this too)."""

    def report(self, report: DivergenceReport, k_used: int, k_max: int) -> ConvergenceAction:
        """Observe one reduce's divergence and return the recommended action.

        Args:
            report: the divergence measured around the reduce.
            k_used: steps summed over ranks since the previous reduce.
            k_max: the largest per-rank step count since the previous reduce.
        """
        ...

    def telemetry(self) -> dict[str, float]:
        """Diagnostic values for the latest observation (may be empty)."""
        ...

    def reset(self) -> None:
        """Forget all history (run or mode boundary)."""
        ...

    def trend_history(self) -> list[float] | None:
        """The history to checkpoint, or ``None`` when the guard keeps none."""
        ...


class NoGuard:
    """Always Stable: the unconditioned baseline (``no_divergence_guard``)."""

    def report(self, report: DivergenceReport, k_used: int, k_max: int) -> ConvergenceAction:
        """Return :class:`Stable` whatever the report."""
        del report, k_used, k_max
        return Stable()

    def telemetry(self) -> dict[str, float]:
        """No telemetry."""
        return {}

    def reset(self) -> None:
        """Nothing to forget."""

    def trend_history(self) -> list[float] | None:
        """No history."""
        return None


class TrendGuard:
    """Three strict rises above the threshold → SuppressGrowth (never NudgeDown).

    Args:
        threshold: the last ``d_raw`` must exceed this (default 0.05; 0.3 with EASGD).

    Raises:
        ConfigError: ``threshold`` is negative or NaN.
    """

    def __init__(self, threshold: float = TREND_THRESHOLD_DEFAULT) -> None:
        if math.isnan(threshold) or threshold < 0:
            raise ConfigError(f"divergence_threshold must be >= 0, got {threshold!r}")
        self._threshold = float(threshold)
        self._history: deque[float] = deque(maxlen=TREND_WINDOW_CAP)

    @property
    def threshold(self) -> float:
        """The divergence threshold."""
        return self._threshold

    def report(self, report: DivergenceReport, k_used: int, k_max: int) -> ConvergenceAction:
        """Push ``d_raw`` into the ring of five and apply the three-rises rule."""
        del k_used, k_max
        self._history.append(report.d_raw)
        h = self._history
        if len(h) >= 3 and h[-1] > h[-2] > h[-3] and h[-1] > self._threshold:
            return SuppressGrowth()
        return Stable()

    def telemetry(self) -> dict[str, float]:
        """``{"d_history_last": d}`` for the latest sample (empty before the first)."""
        return {"d_history_last": self._history[-1]} if self._history else {}

    def reset(self) -> None:
        """Clear the ring."""
        self._history.clear()

    def trend_history(self) -> list[float] | None:
        """The ring, oldest first (a copy), for the checkpoint."""
        return list(self._history)

    def restore_history(self, history: Sequence[float]) -> None:
        """Replace the ring with a checkpointed history (its last five values)."""
        self._history.clear()
        self._history.extend(float(v) for v in history)


class MsfGuard:
    """Rate detector on the across-event Lyapunov proxy ``λ = ln(D_t / D_{t−1}) / k_max``.

    ``λ_raw`` exists only when both ``D`` are above the noise floor and ``k_max > 0``; a ``D`` at
    or below the floor resets the estimator. ``e ← α·e + (1−α)·λ_raw``, reported bias-corrected
    as ``λ_ema = e / (1 − α^t)`` (``t`` = updates since reset). Two independent streaks count
    consecutive events with ``λ_ema`` above each threshold; a streak reaching ``sustain`` fires
    and resets only itself; the nudge wins when both fire on one event.

    Args:
        alpha: EMA coefficient in (0, 1).
        noise_floor: divergence at or below this is noise.
        suppress_threshold: λ_ema level for SuppressGrowth.
        nudge_threshold: λ_ema level for NudgeDown (``math.inf`` disables it).
        sustain: consecutive events a threshold must hold (both streaks).
        nudge_factor: the NudgeDown factor.

    Raises:
        ConfigError: an argument is out of range; the message names it.
    """

    def __init__(
        self,
        *,
        alpha: float = MSF_ALPHA,
        noise_floor: float = MSF_NOISE_FLOOR,
        suppress_threshold: float = MSF_SUPPRESS_THRESHOLD,
        nudge_threshold: float = MSF_NUDGE_THRESHOLD,
        sustain: int = MSF_SUSTAIN,
        nudge_factor: float = MSF_NUDGE_FACTOR,
    ) -> None:
        if not 0.0 < alpha < 1.0:
            raise ConfigError(f"alpha must be in (0, 1), got {alpha!r}")
        if not noise_floor >= 0.0:
            raise ConfigError(f"noise_floor must be >= 0, got {noise_floor!r}")
        if math.isnan(suppress_threshold) or math.isnan(nudge_threshold):
            raise ConfigError("suppress_threshold and nudge_threshold must not be NaN")
        if sustain < 1:
            raise ConfigError(f"sustain must be >= 1, got {sustain!r}")
        if not 0.0 < nudge_factor <= 1.0:
            raise ConfigError(f"nudge_factor must be in (0, 1], got {nudge_factor!r}")
        self._alpha = alpha
        self._noise_floor = noise_floor
        self._suppress_threshold = suppress_threshold
        self._nudge_threshold = nudge_threshold
        self._sustain = sustain
        self._nudge_factor = nudge_factor
        self._prev_d: float | None = None
        self._ema_raw = 0.0
        self._ema_t = 0
        self._suppress_streak = 0
        self._nudge_streak = 0
        self._lambda_raw: float | None = None
        self._lambda_ema: float | None = None

    @property
    def lambda_raw(self) -> float | None:
        """The latest ``λ_raw`` (``None`` when the latest event produced none)."""
        return self._lambda_raw

    @property
    def lambda_ema(self) -> float | None:
        """The latest bias-corrected ``λ_ema`` (``None`` before the first ``λ_raw``)."""
        return self._lambda_ema

    def report(self, report: DivergenceReport, k_used: int, k_max: int) -> ConvergenceAction:
        """Update the estimator with ``d_raw`` and the streaks; return the action."""
        del k_used
        self._observe(report.d_raw, k_max)
        level = -math.inf if self._lambda_ema is None else self._lambda_ema
        self._suppress_streak = self._suppress_streak + 1 if level > self._suppress_threshold else 0
        self._nudge_streak = self._nudge_streak + 1 if level > self._nudge_threshold else 0
        if self._nudge_streak >= self._sustain and math.isfinite(self._nudge_threshold):
            self._nudge_streak = 0
            return NudgeDown(self._nudge_factor)
        if self._suppress_streak >= self._sustain:
            self._suppress_streak = 0
            return SuppressGrowth()
        return Stable()

    def telemetry(self) -> dict[str, float]:
        """``lambda_raw`` and ``lambda_ema`` for the latest event, each when known."""
        out: dict[str, float] = {}
        if self._lambda_raw is not None:
            out["lambda_raw"] = self._lambda_raw
        if self._lambda_ema is not None:
            out["lambda_ema"] = self._lambda_ema
        return out

    def reset(self) -> None:
        """Clear the estimator, both streaks and the telemetry."""
        self._reset_estimator()
        self._suppress_streak = 0
        self._nudge_streak = 0

    def trend_history(self) -> list[float] | None:
        """None: MsfGuard re-warms from scratch on resume."""
        return None

    def _observe(self, d: float, k_max: int) -> None:
        if not d > self._noise_floor:
            self._reset_estimator()
            return
        prev = self._prev_d
        self._prev_d = d
        if prev is None or k_max <= 0:
            self._lambda_raw = None
        else:
            self._lambda_raw = math.log(d / prev) / k_max
            self._ema_raw = self._alpha * self._ema_raw + (1.0 - self._alpha) * self._lambda_raw
            self._ema_t += 1
        if self._ema_t > 0:
            self._lambda_ema = self._ema_raw / (1.0 - self._alpha**self._ema_t)

    def _reset_estimator(self) -> None:
        self._prev_d = None
        self._ema_raw = 0.0
        self._ema_t = 0
        self._lambda_raw = None
        self._lambda_ema = None


def make_guard(
    *,
    convergence_guard: ConvergenceGuard | None = None,
    no_divergence_guard: bool = False,
    divergence_threshold: float | None = None,
    easgd_alpha: float | None = None,
) -> ConvergenceGuard:
    """Pick the run's guard with the config precedence of docs/design.md §4.

    A user ``convergence_guard`` wins; else ``no_divergence_guard`` gives :class:`NoGuard`; else
    a :class:`TrendGuard` at ``divergence_threshold``, defaulting to 0.3 when ``easgd_alpha`` is
    set (EASGD) and 0.05 otherwise.

    Raises:
        ConfigError: ``divergence_threshold`` is negative or NaN.
    """
    if convergence_guard is not None:
        return convergence_guard
    if no_divergence_guard:
        return NoGuard()
    if divergence_threshold is None:
        divergence_threshold = (
            TREND_THRESHOLD_EASGD if easgd_alpha is not None else TREND_THRESHOLD_DEFAULT
        )
    return TrendGuard(divergence_threshold)
