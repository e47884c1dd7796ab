"""Convergence guards (docs/design.md §4): the report, NoGuard, TrendGuard, MsfGuard, make_guard."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import pytest

from flodl.coord.guards import (
    MSF_ALPHA,
    MSF_NOISE_FLOOR,
    ConvergenceAction,
    ConvergenceGuard,
    DivergenceReport,
    MsfGuard,
    NoGuard,
    NudgeDown,
    Stable,
    SuppressGrowth,
    TrendGuard,
    make_guard,
)
from flodl.errors import ConfigError


def rep(*deltas: float) -> DivergenceReport:
    return DivergenceReport(deltas=deltas)


def run(guard: ConvergenceGuard, ds: Sequence[float], k_max: int = 4) -> list[ConvergenceAction]:
    return [guard.report(rep(d), 2 * k_max, k_max) for d in ds]


def geometric(start: float, rate: float, n: int) -> list[float]:
    """``n`` divergences growing so that ``ln(D_t / D_{t-1}) / k_max`` is ``rate`` at k_max 1."""
    return [start * math.exp(rate * i) for i in range(n)]


# ---------------------------------------------------------------------------- DivergenceReport


def test_d_raw_is_the_worst_rank() -> None:
    assert rep(0.01, 0.05, 0.03).d_raw == 0.05
    assert rep().d_raw == 0.0
    assert rep(math.nan, 0.02).d_raw == 0.02
    r = DivergenceReport(deltas=[0.1, 0.2], pre_norms=[1.0, 2.0])  # type: ignore[arg-type]
    assert r.deltas == (0.1, 0.2)
    assert r.pre_norms == (1.0, 2.0)


def test_cosine_and_magnitude_shift() -> None:
    assert rep(0.01).cosine_similarities() is None
    assert rep(0.01).magnitude_shifts() is None
    full = DivergenceReport(deltas=(0.001, 0.02), pre_norms=(10.0, 9.8), post_norm=10.0)
    cos = full.cosine_similarities()
    assert cos is not None
    assert cos[0] > 0.999
    expected = (9.8**2 + 10.0**2 - (0.02 * 10.0) ** 2) / (2 * 9.8 * 10.0)
    assert cos[1] == pytest.approx(expected)
    assert full.magnitude_shifts() == pytest.approx((0.0, -0.2))
    zero_pre = DivergenceReport(deltas=(0.5,), pre_norms=(0.0,), post_norm=1.0)
    assert zero_pre.cosine_similarities() == (0.0,)
    assert DivergenceReport((0.5,), (1.0,), 0.0).cosine_similarities() is None


# ---------------------------------------------------------------------------- NoGuard


def test_no_guard_is_always_stable() -> None:
    guard = NoGuard()
    assert isinstance(guard, ConvergenceGuard)
    assert run(guard, [0.1, 0.2, 0.3, 0.9]) == [Stable()] * 4
    assert guard.telemetry() == {}
    assert guard.trend_history() is None
    guard.reset()


# ---------------------------------------------------------------------------- TrendGuard


def test_trend_guard_suppresses_on_three_strict_rises_above_threshold() -> None:
    guard = TrendGuard()
    assert guard.threshold == 0.05
    assert run(guard, [0.03, 0.04, 0.051]) == [Stable(), Stable(), SuppressGrowth()]
    assert run(guard, [0.06]) == [SuppressGrowth()]  # 0.04 < 0.051 < 0.06 still rising


def test_trend_guard_needs_three_samples() -> None:
    assert run(TrendGuard(0.01), [0.5, 0.9]) == [Stable(), Stable()]


def test_trend_guard_non_strict_rise_is_stable() -> None:
    assert run(TrendGuard(), [0.06, 0.07, 0.07]) == [Stable()] * 3
    assert run(TrendGuard(), [0.06, 0.06, 0.07]) == [Stable()] * 3
    assert run(TrendGuard(), [0.08, 0.07, 0.09]) == [Stable()] * 3


def test_trend_guard_last_value_must_exceed_the_threshold() -> None:
    assert run(TrendGuard(), [0.01, 0.02, 0.05]) == [Stable()] * 3  # 0.05 is not > 0.05
    assert run(TrendGuard(0.3), [0.1, 0.2, 0.29]) == [Stable()] * 3


def test_trend_guard_never_nudges() -> None:
    actions = run(TrendGuard(), geometric(0.1, 1.0, 30))
    assert not any(isinstance(a, NudgeDown) for a in actions)


def test_trend_guard_history_ring_restore_and_reset() -> None:
    guard = TrendGuard()
    assert isinstance(guard, ConvergenceGuard)
    assert guard.telemetry() == {}
    run(guard, [0.01 * i for i in range(1, 8)])
    assert guard.trend_history() == pytest.approx([0.03, 0.04, 0.05, 0.06, 0.07])
    assert guard.telemetry() == {"d_history_last": pytest.approx(0.07)}
    resumed = TrendGuard()
    resumed.restore_history([0.001, 0.002, 0.03, 0.04, 0.05, 0.06])
    assert resumed.trend_history() == [0.002, 0.03, 0.04, 0.05, 0.06]
    assert run(resumed, [0.07]) == [SuppressGrowth()]  # the restored ring counts
    guard.reset()
    assert guard.trend_history() == []


def test_trend_guard_rejects_a_bad_threshold() -> None:
    with pytest.raises(ConfigError, match="divergence_threshold"):
        TrendGuard(-0.1)
    with pytest.raises(ConfigError, match="divergence_threshold"):
        TrendGuard(math.nan)


# ---------------------------------------------------------------------------- MsfGuard


def test_msf_first_event_has_no_lambda() -> None:
    guard = MsfGuard()
    assert isinstance(guard, ConvergenceGuard)
    assert guard.report(rep(0.05), 8, 4) == Stable()
    assert guard.lambda_raw is None
    assert guard.lambda_ema is None
    assert guard.telemetry() == {}
    assert guard.trend_history() is None


def test_msf_lambda_raw_uses_k_max_not_k_used() -> None:
    guard = MsfGuard()
    guard.report(rep(0.01), 8, 4)
    guard.report(rep(0.02), 12, 4)
    assert guard.lambda_raw == pytest.approx(math.log(2) / 4)


def test_msf_lambda_ema_matches_a_hand_computation_with_bias_correction() -> None:
    guard = MsfGuard()
    events = [(0.01, 4), (0.02, 4), (0.03, 2), (0.015, 5), (0.06, 1)]
    guard.report(rep(events[0][0]), 8, events[0][1])
    a, e = MSF_ALPHA, 0.0
    for t, ((prev, _), (d, k)) in enumerate(itertools.pairwise(events), start=1):
        guard.report(rep(d), 2 * k, k)
        lam = math.log(d / prev) / k
        e = a * e + (1 - a) * lam
        assert guard.lambda_raw == pytest.approx(lam)
        assert guard.lambda_ema == pytest.approx(e / (1 - a**t))
        assert guard.telemetry() == {
            "lambda_raw": pytest.approx(lam),
            "lambda_ema": pytest.approx(e / (1 - a**t)),
        }
    # The first corrected value equals the first raw one: 0.1·λ / (1 − 0.9).
    fresh = MsfGuard()
    run(fresh, [0.01, 0.02])
    assert fresh.lambda_ema == pytest.approx(fresh.lambda_raw)


def test_msf_noise_floor_resets_the_estimator() -> None:
    guard = MsfGuard()
    run(guard, [0.01, 0.02, 0.05])  # EMA has two updates
    guard.report(rep(MSF_NOISE_FLOOR / 10), 8, 4)
    assert guard.lambda_raw is None
    assert guard.lambda_ema is None
    assert guard.telemetry() == {}
    guard.report(rep(0.02), 8, 4)  # no previous D any more
    assert guard.lambda_raw is None
    assert guard.lambda_ema is None
    guard.report(rep(0.04), 8, 4)
    assert guard.lambda_raw == pytest.approx(math.log(2) / 4)
    assert guard.lambda_ema == pytest.approx(guard.lambda_raw)  # t restarted at 1
    guard.report(rep(MSF_NOISE_FLOOR), 8, 4)  # at the floor is noise too
    assert guard.lambda_ema is None


def test_msf_k_max_zero_gives_no_lambda() -> None:
    guard = MsfGuard()
    guard.report(rep(0.01), 0, 0)
    guard.report(rep(0.02), 0, 0)
    assert guard.lambda_raw is None
    assert guard.lambda_ema is None


def test_msf_suppress_streak_fires_every_third_event() -> None:
    guard = MsfGuard()
    actions = run(guard, geometric(0.01, 0.005, 8), k_max=1)  # λ = 5e-3: above 1e-3 only
    assert actions == [
        Stable(), Stable(), Stable(), SuppressGrowth(),  # streaks count from the 2nd event
        Stable(), Stable(), SuppressGrowth(), Stable(),
    ]  # fmt: skip


def test_msf_nudge_wins_and_firing_resets_only_its_own_streak() -> None:
    guard = MsfGuard()
    actions = run(guard, geometric(0.01, 0.05, 8), k_max=1)  # λ = 5e-2: above both
    assert actions == [
        Stable(), Stable(), Stable(),
        NudgeDown(0.5),  # both streaks at 3: the nudge wins, the suppress streak stays at 3
        SuppressGrowth(),  # suppress streak 4
        Stable(),  # suppress 1, nudge 2
        NudgeDown(0.5),  # nudge 3
        SuppressGrowth(),  # suppress 3
    ]  # fmt: skip


def test_msf_decaying_divergence_never_fires() -> None:
    actions = run(MsfGuard(), geometric(0.5, -0.7, 30), k_max=1)
    assert actions == [Stable()] * 30


def test_msf_reset_clears_state() -> None:
    guard = MsfGuard()
    run(guard, geometric(0.01, 0.05, 3), k_max=1)
    guard.reset()
    assert guard.lambda_ema is None
    assert guard.telemetry() == {}
    assert run(guard, geometric(0.01, 0.05, 3), k_max=1) == [Stable()] * 3  # streaks restarted


def test_msf_rejects_bad_settings() -> None:
    with pytest.raises(ConfigError, match="alpha"):
        MsfGuard(alpha=1.0)
    with pytest.raises(ConfigError, match="sustain"):
        MsfGuard(sustain=0)
    with pytest.raises(ConfigError, match="nudge_factor"):
        MsfGuard(nudge_factor=0.0)
    assert run(MsfGuard(nudge_threshold=math.inf), geometric(0.01, 0.05, 4), 1)[-1] == (
        SuppressGrowth()
    )


# ---------------------------------------------------------------------------- make_guard


def test_make_guard_precedence() -> None:
    user = MsfGuard()
    assert make_guard(convergence_guard=user, no_divergence_guard=True) is user
    assert isinstance(make_guard(no_divergence_guard=True, divergence_threshold=0.2), NoGuard)
    default = make_guard()
    assert isinstance(default, TrendGuard)
    assert default.threshold == 0.05
    easgd = make_guard(easgd_alpha=0.5)
    assert isinstance(easgd, TrendGuard)
    assert easgd.threshold == 0.3
    explicit = make_guard(easgd_alpha=0.5, divergence_threshold=0.1)
    assert isinstance(explicit, TrendGuard)
    assert explicit.threshold == 0.1
    with pytest.raises(ConfigError, match="divergence_threshold"):
        make_guard(divergence_threshold=-1.0)
