"""LR-aware meta-controller (docs/design.md §4): Probe silence, LR cliff, convergence, eff()."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from flodl.coord.elche_state import Phase
from flodl.coord.meta import BASE_FACTOR, SUSTAIN_K, MetaController
from flodl.coord.verdicts import ConvergenceAction, NudgeDown, Stable, SuppressGrowth
from flodl.errors import ConfigError

STABLE = Stable()
SUPPRESS = SuppressGrowth()
NUDGE = NudgeDown(0.5)


def observe_all(
    meta: MetaController,
    phase: Phase,
    steps: Sequence[tuple[float | None, int, ConvergenceAction]],
) -> list[NudgeDown | None]:
    return [meta.observe(lr, anchor, verdict, phase) for lr, anchor, verdict in steps]


def factor(action: NudgeDown | None) -> float:
    assert action is not None
    return action.factor


def test_per_phase_tables_match_the_spec() -> None:
    assert [SUSTAIN_K[p] for p in (Phase.WARMUP, Phase.STABLE, Phase.MATURE)] == [5, 3, 2]
    assert [BASE_FACTOR[p] for p in (Phase.WARMUP, Phase.STABLE, Phase.MATURE)] == [0.3, 0.5, 0.7]


def test_probe_is_silent_but_records() -> None:
    meta = MetaController()
    actions = observe_all(meta, Phase.PROBE, [(0.1, 10, NUDGE)] * 5 + [(0.01, 10, NUDGE)])
    assert actions == [None] * 6
    assert meta.lr_window == (0.1, 0.1, 0.01)
    assert len(meta.guard_window) == 5


def test_unknown_lr_is_a_no_op_that_records_nothing() -> None:
    meta = MetaController()
    assert observe_all(meta, Phase.STABLE, [(None, 10, SUPPRESS)] * 4) == [None] * 4
    assert len(meta.lr_window) == len(meta.anchor_window) == len(meta.guard_window) == 0


def test_single_observation_is_silent() -> None:
    assert MetaController().observe(0.1, 100, STABLE, Phase.STABLE) is None


def test_lr_cliff_fires_eff_half() -> None:
    meta = MetaController()
    actions = observe_all(meta, Phase.WARMUP, [(0.1, 10, STABLE), (0.05, 10, STABLE)])
    assert actions == [None, NudgeDown(0.5)]  # flat anchor: trend 0, eff(0.5) = 0.5
    assert meta.last_causes == ("LR cliff 0.1 → 0.05",)
    assert meta.observe(0.05, 10, STABLE, Phase.WARMUP) is None  # one-shot per drop
    causes: tuple[str, ...] = meta.last_causes  # observe() reset it: mypy kept the narrowing
    assert causes == ()


def test_lr_rises_and_gentle_drops_are_ignored() -> None:
    meta = MetaController()
    steps = [(0.01, 10, STABLE), (0.1, 10, STABLE), (0.075, 10, STABLE), (0.06, 10, STABLE)]
    assert observe_all(meta, Phase.STABLE, steps) == [None] * 4  # warmup rise, 25 %, 20 %
    assert meta.observe(0.0, 10, STABLE, Phase.STABLE) == NudgeDown(0.5)  # 100 % drop
    assert meta.observe(0.1, 10, STABLE, Phase.STABLE) is None  # from 0: no ratio


@pytest.mark.parametrize(
    ("phase", "k", "base"), [(Phase.WARMUP, 5, 0.3), (Phase.STABLE, 3, 0.5), (Phase.MATURE, 2, 0.7)]
)
def test_convergence_watcher_needs_k_non_stable_verdicts(phase: Phase, k: int, base: float) -> None:
    meta = MetaController()
    verdicts: list[ConvergenceAction] = [SUPPRESS, NUDGE] * 3
    actions = observe_all(meta, phase, [(0.1, 10, v) for v in verdicts[:k]])
    assert actions[:-1] == [None] * (k - 1)
    assert factor(actions[-1]) == pytest.approx(base)
    assert meta.last_causes == (f"{k} non-Stable guard verdicts",)
    assert meta.observe(0.1, 10, STABLE, phase) is None  # one Stable breaks the pattern


def test_a_stable_inside_the_last_k_blocks_the_watcher() -> None:
    meta = MetaController()
    steps = [(0.1, 10, v) for v in (SUPPRESS, STABLE, SUPPRESS, SUPPRESS)]
    assert observe_all(meta, Phase.STABLE, steps) == [None] * 4
    assert meta.observe(0.1, 10, SUPPRESS, Phase.STABLE) == NudgeDown(0.5)


def test_anchor_trend() -> None:
    meta = MetaController()
    assert meta.anchor_trend() == 0.0
    meta.observe(0.1, 10, STABLE, Phase.STABLE)
    assert meta.anchor_trend() == 0.0  # fewer than two samples
    for anchor in (10, 10, 10, 20):
        meta.observe(0.1, anchor, STABLE, Phase.STABLE)
    assert meta.anchor_window == (10, 10, 10, 10, 20)
    assert meta.anchor_trend() == pytest.approx((20 - 12) / 12)
    assert not meta.is_settled()
    meta.observe(0.1, 12, STABLE, Phase.STABLE)  # window 10 10 10 20 12: mean 12.4
    assert meta.anchor_trend() == pytest.approx((12 - 12.4) / 12.4)
    assert meta.is_settled()


@pytest.mark.parametrize(
    ("anchors", "expected"),
    [
        ((10, 10, 10, 10, 20), 0.5 - 0.5 * (20 - 12) / 12),  # rising anchor amplifies
        ((20, 20, 20, 20, 10), 0.5 - 0.5 * (10 - 18) / 18),  # falling anchor dampens
        ((1, 1, 1, 1, 100), 0.1),  # clamped low
        ((100, 100, 100, 100, 1), 0.95),  # clamped high
    ],
)
def test_effective_factor_applies_the_anchor_trend_and_clamps(
    anchors: tuple[int, ...], expected: float
) -> None:
    meta = MetaController()
    lrs = (0.1, 0.1, 0.1, 0.1, 0.01)  # the cliff fires on the last cycle only
    actions = [
        meta.observe(lr, a, STABLE, Phase.STABLE) for lr, a in zip(lrs, anchors, strict=True)
    ]
    assert actions[:-1] == [None] * 4
    assert factor(actions[-1]) == pytest.approx(expected)


def test_both_watchers_firing_multiply() -> None:
    meta = MetaController()
    steps = [(0.1, 10, SUPPRESS), (0.1, 10, SUPPRESS), (0.01, 10, SUPPRESS)]
    assert factor(observe_all(meta, Phase.STABLE, steps)[-1]) == pytest.approx(0.5 * 0.5)
    warm = MetaController()
    nudges: list[tuple[float | None, int, ConvergenceAction]] = [(0.1, 10, NUDGE)] * 4
    nudges.append((0.01, 10, NUDGE))
    assert factor(observe_all(warm, Phase.WARMUP, nudges)[-1]) == pytest.approx(0.5 * 0.3)


def test_the_product_is_clamped_again() -> None:
    meta = MetaController()
    steps = [(0.1, 10, SUPPRESS), (0.1, 10, SUPPRESS), (0.01, 14, SUPPRESS)]
    # trend (14 − 34/3) / (34/3) ≈ 0.235: eff(0.5) ≈ 0.382 each, product ≈ 0.146
    trend = (14 - 34 / 3) / (34 / 3)
    eff = 0.5 - 0.5 * trend
    assert factor(observe_all(meta, Phase.STABLE, steps)[-1]) == pytest.approx(eff * eff)
    steep = MetaController()
    steps = [(0.1, 1, SUPPRESS), (0.1, 1, SUPPRESS), (0.01, 3, SUPPRESS)]
    assert factor(observe_all(steep, Phase.STABLE, steps)[-1]) == pytest.approx(0.1)
    loose = MetaController(effective_factor_min=0.2)
    assert factor(observe_all(loose, Phase.STABLE, steps)[-1]) == pytest.approx(0.2)


def test_windows_are_capped_and_reset() -> None:
    meta = MetaController()
    for i in range(10):
        meta.observe(0.1 + i, i, STABLE, Phase.STABLE)
    assert meta.lr_window == pytest.approx((7.1, 8.1, 9.1))
    assert meta.anchor_window == (5, 6, 7, 8, 9)
    assert len(meta.guard_window) == 5
    meta.reset()
    assert len(meta.lr_window) == len(meta.anchor_window) == len(meta.guard_window) == 0


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"lr_window_cap": 1}, "lr_window_cap"),
        ({"anchor_window_cap": 0}, "anchor_window_cap"),
        ({"guard_window_cap": 4}, "guard_window_cap"),
        ({"sharp_drop_threshold": -0.1}, "sharp_drop_threshold"),
        ({"effective_factor_min": 0.0}, "effective_factor_min"),
        ({"effective_factor_max": 0.05}, "effective_factor_max"),
        ({"effective_factor_max": 1.5}, "effective_factor_max"),
    ],
)
def test_config_is_validated(kwargs: dict[str, float], field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        MetaController(**kwargs)  # type: ignore[arg-type]
