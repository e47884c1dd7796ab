"""ElChe (docs/design.md §4): phases, trust rings, election, growth, counts, verdicts, state."""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest

from flodl.coord.elche import (
    BATCH_COUNTS_WINDOW_CAP,
    COHORT_BAND,
    DEAD_ZONE,
    DOMINANCE_MARGIN,
    GROWTH_REARM_STABLE,
    GROWTH_STEP_CAP,
    MAX_SPEED_RATIO,
    MISS_LIMIT,
    TRUST_WINDOW_CAP,
    WARMUP_GROWTH_MARGIN,
    ElChe,
    ElCheState,
    NudgeDown,
    Phase,
    Stable,
    SuppressGrowth,
    WindowReport,
)
from flodl.errors import ConfigError, LocalProtocolError


def feed(
    el: ElChe,
    ms_per_batch: Sequence[float],
    *,
    sync_ms: float = 0.0,
    times: int = 1,
    verdict: Stable | SuppressGrowth | NudgeDown | None = None,
) -> None:
    """Run ``times`` windows in which every rank runs its count at the given ms/batch."""
    for _ in range(times):
        counts = el.batch_counts
        el.report_timing(
            [c * m for c, m in zip(counts, ms_per_batch, strict=True)], counts, sync_ms
        )
        if verdict is not None:
            el.apply_verdict(verdict)


def sync_for_overhead(overhead: float, window_ms: float) -> float:
    """The reduce time that makes ``fixed / (window + fixed)`` equal ``overhead``."""
    return overhead * window_ms / (1.0 - overhead)


def stable_el(world_size: int = 2, **kwargs: float | None) -> ElChe:
    """An ElChe in Stable, equal 1 ms/batch speeds, no growth so far."""
    el = ElChe(world_size, **kwargs)  # type: ignore[arg-type]
    feed(el, [1.0] * world_size, times=5)
    assert el.phase is Phase.STABLE
    return el


# ---------------------------------------------------------------------------- constants, phases


def test_constants_match_the_spec() -> None:
    assert (TRUST_WINDOW_CAP, COHORT_BAND, DOMINANCE_MARGIN, MAX_SPEED_RATIO) == (5, 0.15, 0.10, 64)
    assert (BATCH_COUNTS_WINDOW_CAP, GROWTH_REARM_STABLE, GROWTH_STEP_CAP) == (10, 5, 2.0)
    assert (WARMUP_GROWTH_MARGIN, DEAD_ZONE, MISS_LIMIT) == (2.0, 0.05, 5)


def test_phase_values_and_explicit_order() -> None:
    assert [p.value for p in Phase] == ["probe", "warmup", "stable", "mature"]
    assert Phase.PROBE < Phase.WARMUP < Phase.STABLE < Phase.MATURE
    assert Phase.MATURE >= Phase.STABLE >= Phase.STABLE
    assert Phase.WARMUP <= Phase.WARMUP
    assert [p.order for p in Phase] == [0, 1, 2, 3]
    with pytest.raises(TypeError):
        _ = Phase.PROBE < 1


def test_phase_gating_counts() -> None:
    el = ElChe(2)
    assert (el.phase, el.calibration_count, el.calibrated) == (Phase.PROBE, 0, False)
    feed(el, [1.0, 1.0])
    assert (el.phase, el.calibration_count, el.calibrated) == (Phase.WARMUP, 1, True)
    feed(el, [1.0, 1.0], times=3)
    assert (el.phase, el.calibration_count) == (Phase.WARMUP, 4)
    feed(el, [1.0, 1.0])  # the 5th report: the 6th runs in Stable
    assert (el.phase, el.calibration_count) == (Phase.STABLE, 5)
    feed(el, [1.0, 1.0], times=14)
    assert (el.phase, el.calibration_count) == (Phase.STABLE, 19)
    feed(el, [1.0, 1.0])
    assert (el.phase, el.calibration_count) == (Phase.MATURE, 20)
    feed(el, [1.0, 1.0], times=5)
    assert el.phase is Phase.MATURE


def test_report_without_any_reading_does_not_calibrate() -> None:
    el = ElChe(2)
    el.report_timing([0.0, 0.0], [0, 0], 5.0)
    el.report_timing([math.nan, 3.0], [3, 0], 5.0)
    assert (el.phase, el.calibration_count, el.calibrated) == (Phase.PROBE, 0, False)
    assert el.anchor_rank is None
    assert el.batch_counts == [10, 10]


def test_report_timing_rejects_wrong_lengths() -> None:
    el = ElChe(2)
    with pytest.raises(LocalProtocolError):
        el.report_timing([1.0], [1, 1], 0.0)
    with pytest.raises(LocalProtocolError):
        el.report_timing([1.0, 1.0], [1], 0.0)


# ---------------------------------------------------------------------------- constructor


def test_constructor_defaults() -> None:
    el = ElChe(3)
    assert (el.anchor, el.min_anchor, el.max_anchor) == (10, 10, 1000)
    assert el.overhead_target == 0.05
    assert el.max_batch_diff is None
    assert el.window_growth_applicable
    assert el.batch_counts == [10, 10, 10]
    assert el.smoothed_ms == [0.0, 0.0, 0.0]
    assert el.proposal is None
    assert el.growth_enabled
    assert el.anchor_rank is None
    assert el.alive == [True, True, True]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"world_size": 0}, "world_size"),
        ({"anchor": 0}, "anchor"),
        ({"max_anchor": 0}, "max_anchor"),
        ({"min_anchor": 0}, "min_anchor"),
        ({"overhead_target": math.nan}, "overhead_target"),
        ({"max_batch_diff": -1}, "max_batch_diff"),
        ({"anchor": True}, "anchor"),
    ],
)
def test_constructor_rejects_bad_values_naming_the_field(
    kwargs: dict[str, object], field: str
) -> None:
    args: dict[str, object] = {"world_size": 2, **kwargs}
    world_size = args.pop("world_size")
    with pytest.raises(ConfigError, match=field):
        ElChe(world_size, **args)  # type: ignore[arg-type]


def test_constructor_clamps_overhead_target_and_anchor() -> None:
    assert ElChe(2, overhead_target=0.001).overhead_target == 0.01
    assert ElChe(2, overhead_target=0.9).overhead_target == 0.5
    capped = ElChe(2, anchor=50, max_anchor=20)
    assert (capped.anchor, capped.min_anchor, capped.batch_counts) == (20, 20, [20, 20])
    lifted = ElChe(2, anchor=5, min_anchor=8)
    assert (lifted.anchor, lifted.min_anchor) == (8, 8)
    assert ElChe(2, anchor=5, min_anchor=2).anchor == 5


# ---------------------------------------------------------------------------- trust rings


def test_trust_ring_is_the_plain_mean_of_the_last_five() -> None:
    el = ElChe(2)
    for ms in (1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0):
        el.report_timing([ms * 10, 10.0], [10, 10], 0.0)
    assert el.smoothed_ms[0] == pytest.approx(5.0)  # mean of 3..7
    assert el.smoothed_ms_per_batch(0) == pytest.approx(5.0)


def test_the_reading_is_wall_over_actual_batches() -> None:
    el = ElChe(2)
    el.report_timing([40.0, 10.0], [20, 10], 0.0)  # rank 0 over-ran its planned 10
    assert el.smoothed_ms == [2.0, 1.0]


def test_five_consecutive_misses_clear_the_ring() -> None:
    el = ElChe(2)
    el.report_timing([20.0, 10.0], [10, 10], 0.0)
    for _ in range(MISS_LIMIT - 1):
        el.report_timing([0.0, 10.0], [0, 10], 0.0)
    assert el.smoothed_ms[0] == 2.0
    el.report_timing([0.0, 10.0], [0, 10], 0.0)
    assert el.smoothed_ms[0] == 0.0
    assert el.smoothed_ms_per_batch(0) is None


def test_a_valid_reading_resets_the_miss_counter() -> None:
    el = ElChe(2)
    el.report_timing([20.0, 10.0], [10, 10], 0.0)
    for _ in range(MISS_LIMIT - 1):
        el.report_timing([math.inf, 10.0], [10, 10], 0.0)
    el.report_timing([20.0, 10.0], [10, 10], 0.0)
    for _ in range(MISS_LIMIT - 1):
        el.report_timing([-1.0, 10.0], [10, 10], 0.0)
    assert el.smoothed_ms[0] == 2.0


# ---------------------------------------------------------------------------- election


def test_election_uses_the_cohort_band() -> None:
    inside = ElChe(2)
    feed(inside, [1.8, 2.0])  # 1.8 >= 0.85 * 2.0: both eligible, lowest index wins
    assert inside.anchor_rank == 0
    outside = ElChe(2)
    feed(outside, [1.6, 2.0])  # 1.6 < 1.7: only rank 1 is eligible
    assert outside.anchor_rank == 1


def test_election_tie_break_is_the_lowest_index() -> None:
    el = ElChe(3)
    feed(el, [3.0, 3.0, 3.0])
    assert el.anchor_rank == 0


def test_sitting_anchor_keeps_its_seat_within_the_dominance_margin() -> None:
    el = ElChe(3)
    feed(el, [1.0, 2.0, 1.8], times=6)
    assert (el.phase, el.anchor_rank) == (Phase.STABLE, 1)
    feed(el, [1.0, 2.0, 2.1], times=5)  # 2.1 <= 2.0 * 1.10
    assert el.anchor_rank == 1
    feed(el, [1.0, 2.0, 2.5])  # ring mean 2.18: still within the margin
    assert el.anchor_rank == 1
    feed(el, [1.0, 2.0, 2.5])  # ring mean 2.26 > 2.2: the challenger takes the seat
    assert el.anchor_rank == 2


def test_pin_holds_through_warmup_then_election_runs_from_stable() -> None:
    el = ElChe(2).with_initial_anchor(0)
    feed(el, [1.0, 2.0], times=5)
    assert (el.phase, el.anchor_rank) == (Phase.STABLE, 0)
    feed(el, [1.0, 2.0])
    assert el.anchor_rank == 1


def test_pinned_anchor_without_readings_is_abandoned_after_five_misses() -> None:
    el = ElChe(3).with_initial_anchor(1)
    for _ in range(MISS_LIMIT - 1):
        el.report_timing([10.0, 0.0, 20.0], [10, 0, 10], 0.0)
        assert (el.anchor_rank, el.calibration_count, el.phase) == (1, 0, Phase.PROBE)
    el.report_timing([10.0, 0.0, 20.0], [10, 0, 10], 0.0)
    assert (el.anchor_rank, el.calibration_count, el.phase) == (2, 1, Phase.WARMUP)
    assert el.batch_counts == [20, 10, 10]


# ---------------------------------------------------------------------------- growth proposal


def test_first_report_never_proposes() -> None:
    el = ElChe(2)
    feed(el, [1.0, 1.0], sync_ms=1000.0)
    assert el.proposal is None


def test_warmup_growth_needs_overhead_above_twice_the_target() -> None:
    el = ElChe(2)  # anchor 10 at 1 ms/batch: a 10 ms window
    feed(el, [1.0, 1.0])
    feed(el, [1.0, 1.0], sync_ms=sync_for_overhead(0.0625, 10.0))
    assert (el.phase, el.proposal) == (Phase.WARMUP, None)  # 0.0625 <= 2 * 0.05
    feed(el, [1.0, 1.0], sync_ms=sync_for_overhead(0.12, 10.0))
    assert el.proposal == 20  # scale min(2.4, 2.0): cap-clamped by design
    assert el.anchor == 10  # proposals are only staged


def test_stable_growth_fires_at_the_plain_target() -> None:
    el = stable_el()
    feed(el, [1.0, 1.0], sync_ms=sync_for_overhead(0.0625, 10.0))
    assert el.proposal == 13  # ceil(10 * 1.25)
    feed(el, [1.0, 1.0], sync_ms=sync_for_overhead(0.04, 10.0))
    assert el.proposal is None  # below target: the stale proposal is cleared


def test_growth_is_capped_at_two_times_per_cycle_and_at_max_anchor() -> None:
    el = stable_el()
    feed(el, [1.0, 1.0], sync_ms=10.0)  # overhead 0.5: scale 10, capped at 2
    assert el.proposal == 20
    capped = stable_el(max_anchor=15)
    feed(capped, [1.0, 1.0], sync_ms=10.0)
    assert capped.proposal == 15
    at_cap = stable_el(anchor=15, max_anchor=15)
    feed(at_cap, [1.0, 1.0], sync_ms=10.0)
    assert at_cap.proposal is None  # grow-only: nothing above the current anchor


def test_a_proposal_after_a_nudge_is_lifted_to_min_anchor() -> None:
    el = stable_el()
    el.apply_verdict(NudgeDown(0.5))
    assert el.anchor == 5
    for _ in range(GROWTH_REARM_STABLE):
        el.apply_verdict(Stable())
    feed(el, [1.0, 1.0], sync_ms=sync_for_overhead(0.06, 5.0))
    assert el.proposal == 10  # ceil(5 * 1.2) = 6, clamped up to min_anchor


def test_fill_alone_is_a_growth_signal_and_is_consumed_once() -> None:
    el = stable_el()
    el.set_window_fill_ms([sync_for_overhead(0.0625, 10.0), 0.0])
    feed(el, [1.0, 1.0])
    assert el.proposal == 13
    feed(el, [1.0, 1.0])
    assert el.proposal is None


def test_no_growth_without_a_fixed_cost() -> None:
    el = stable_el()
    feed(el, [1.0, 1.0], sync_ms=0.0)
    assert el.proposal is None
    feed(el, [1.0, 1.0], sync_ms=math.nan)
    assert el.proposal is None


def test_no_growth_when_window_growth_is_not_applicable() -> None:
    el = stable_el(window_growth_applicable=False)
    feed(el, [1.0, 1.0], sync_ms=10.0)
    assert el.proposal is None
    assert el.propose_anchor(10.0) is None


# ---------------------------------------------------------------------------- batch counts


def test_counts_follow_relative_speed() -> None:
    el = ElChe(3)
    feed(el, [1.0, 1.0, 3.0])
    assert (el.anchor_rank, el.batch_counts) == (2, [30, 30, 10])
    assert el.anchor_wall_ms() == 30.0


def test_counts_converge_to_3a_3a_a_for_speeds_1_1_3() -> None:
    el = ElChe(3)
    feed(el, [1.0, 1.0, 3.0], times=30)
    assert el.batch_counts == [30, 30, 10]
    growing = ElChe(3)
    feed(growing, [1.0, 1.0, 3.0], sync_ms=5.0, times=30, verdict=Stable())
    a = growing.anchor
    counts = growing.batch_counts
    assert a > 10
    assert growing.anchor_rank == 2
    assert counts[0] == counts[1] == 3 * counts[2]
    assert abs(counts[2] - a) <= DEAD_ZONE * a
    assert 5.0 / (3.0 * a + 5.0) <= 0.05  # growth settled at the overhead target


def test_speed_ratio_is_clamped_at_64() -> None:
    el = ElChe(2, anchor=1)
    feed(el, [0.001, 1.0])
    assert el.batch_counts == [64, 1]


def test_dead_zone_holds_a_four_percent_change_and_applies_a_six_percent_one() -> None:
    el = ElChe(2, anchor=100)
    el.restore(ElCheState(100, 0, [1.0, 1.0], "stable", 10))
    assert el.batch_counts == [100, 100]
    feed(el, [1.0, 1 / 1.04], times=TRUST_WINDOW_CAP)
    assert el.smoothed_ms[1] == pytest.approx(1 / 1.04)
    assert el.batch_counts == [100, 100]  # target 104: |4| <= 5 % of 100
    feed(el, [1.0, 1 / 1.06], times=TRUST_WINDOW_CAP)
    assert el.batch_counts == [100, 106]  # target 106: |6| > 5 % of 100


def test_max_batch_diff_clamps_each_update_once_calibrated() -> None:
    el = ElChe(2, max_batch_diff=5).with_initial_anchor(1)
    feed(el, [1.0, 1.0])
    assert el.batch_counts == [10, 10]
    feed(el, [0.25, 1.0])  # ring mean 0.625: target 16, clamped to 10 + 5
    assert el.batch_counts == [15, 10]
    feed(el, [0.25, 1.0])  # ring mean 0.5: target 20
    assert el.batch_counts == [20, 10]


def test_first_calibration_is_not_clamped_by_max_batch_diff() -> None:
    el = ElChe(2, max_batch_diff=1).with_initial_anchor(1)
    feed(el, [0.25, 1.0])
    assert el.batch_counts == [40, 10]


def test_window_cap_scales_to_the_exact_sum_with_the_remainder_to_the_largest() -> None:
    el = ElChe(3)
    feed(el, [1.0, 1.0, 3.0])
    el.set_max_total_batches(50)
    assert el.max_total_batches == 50
    feed(el, [1.0, 1.0, 3.0])
    assert el.batch_counts == [22, 21, 7]  # floors 21, 21, 7 (49) + 1 to rank 0
    assert el.total_batches == 50
    assert el.window_cap_binding
    feed(el, [1.0, 1.0, 3.0])
    assert el.batch_counts == [22, 21, 7]


def test_window_cap_per_rank_floor_of_one_wins() -> None:
    el = ElChe(3)
    el.set_max_total_batches(2)
    feed(el, [1.0, 1.0, 3.0])
    assert el.batch_counts == [1, 1, 1]
    assert el.window_cap_binding


def test_window_cap_binding_suppresses_growth_and_zero_removes_the_cap() -> None:
    el = stable_el()
    el.set_max_total_batches(15)
    feed(el, [1.0, 1.0])
    assert el.window_cap_binding
    feed(el, [1.0, 1.0], sync_ms=10.0)
    assert el.proposal is None
    el.set_max_total_batches(0)
    assert el.max_total_batches is None
    feed(el, [1.0, 1.0])
    assert not el.window_cap_binding
    assert el.batch_counts == [10, 10]
    with pytest.raises(ConfigError, match="max_total_batches"):
        el.set_max_total_batches(-1)


def test_clamp_total_scales_without_changing_state() -> None:
    el = ElChe(3)
    feed(el, [1.0, 1.0, 3.0])
    assert el.clamp_total(50) == [22, 21, 7]  # remainder to the first ranks
    assert el.clamp_total(56) == [24, 24, 8]
    assert el.clamp_total(100) == [30, 30, 10]
    assert el.clamp_total(2) == [1, 1, 1]
    assert el.batch_counts == [30, 30, 10]
    with pytest.raises(LocalProtocolError):
        el.clamp_total(-1)


def test_recent_batch_share() -> None:
    assert ElChe(2).recent_batch_share() == [0.5, 0.5]
    hinted = ElChe(2).with_speed_ratio(1, 3.0)
    assert hinted.recent_batch_share() == [0.75, 0.25]
    el = ElChe(2)
    feed(el, [1.0, 1.0])  # snapshot [10, 10]
    feed(el, [1.0, 3.0], times=5)  # ring mean of rank 1 reaches 3.0 in Stable
    shares = el.recent_batch_share()
    assert sum(shares) == pytest.approx(1.0)
    assert 0.5 < shares[0] < 0.75
    feed(el, [1.0, 3.0], times=BATCH_COUNTS_WINDOW_CAP)
    assert el.recent_batch_share() == pytest.approx([0.75, 0.25])


def test_anchor_wall_ms_is_zero_before_calibration() -> None:
    assert ElChe(2).anchor_wall_ms() == 0.0


# ---------------------------------------------------------------------------- callback slack


def test_callback_slack_shrinks_the_coming_window_and_one_recompute_restores_it() -> None:
    el = ElChe(2, anchor=30)
    feed(el, [1.0, 2.0])
    assert el.batch_counts == [60, 30]
    el.apply_callback_slack([0.0, 20.0])  # 20 ms at 2 ms/batch = 10 batches
    assert el.batch_counts == [60, 20]  # at once: no later recompute of this cycle undoes it
    assert el.pending_callback_slack_ms == [0.0, 20.0]
    feed(el, [1.0, 2.0])
    assert el.batch_counts == [60, 30]
    assert el.pending_callback_slack_ms == [0.0, 0.0]


def test_callback_slack_restore_bypasses_the_dead_zone_and_keeps_one_batch() -> None:
    el = ElChe(2, anchor=30)
    feed(el, [1.0, 2.0])
    el.apply_callback_slack([0.0, 2.0])  # one batch: inside the 5 % dead zone
    assert el.batch_counts == [60, 29]
    feed(el, [1.0, 2.0])
    assert el.batch_counts == [60, 30]
    el.apply_callback_slack([1e6, 0.0])
    assert el.batch_counts[0] == 1


def test_callback_slack_rejects_a_wrong_length() -> None:
    with pytest.raises(LocalProtocolError):
        ElChe(2).apply_callback_slack([1.0])


# ---------------------------------------------------------------------------- verdict seam


def test_stable_commits_the_proposal_and_recomputes() -> None:
    el = stable_el()
    feed(el, [1.0, 1.0], sync_ms=sync_for_overhead(0.0625, 10.0))
    el.apply_verdict(Stable())
    assert (el.anchor, el.proposal, el.batch_counts) == (13, None, [13, 13])


def test_nudge_down_after_a_staged_proposal_leaves_the_nudged_anchor() -> None:
    el = stable_el()
    feed(el, [1.0, 1.0], sync_ms=10.0)
    assert el.proposal == 20
    el.apply_verdict(NudgeDown(0.5))
    assert el.anchor == 5
    assert el.proposal is None
    assert not el.growth_enabled
    el.apply_verdict(Stable())
    assert el.anchor == 5  # the pre-nudge proposal was discarded, not committed
    assert el.batch_counts == [5, 5]


def test_suppress_growth_drops_the_proposal_and_latches_growth_off_until_five_stables() -> None:
    el = stable_el()
    pressure = sync_for_overhead(0.0625, 10.0)
    feed(el, [1.0, 1.0], sync_ms=pressure)
    assert el.proposal == 13
    el.apply_verdict(SuppressGrowth())
    assert el.anchor == 10
    assert el.proposal is None
    assert not el.growth_enabled
    for _ in range(GROWTH_REARM_STABLE - 1):
        feed(el, [1.0, 1.0], sync_ms=pressure)
        assert el.proposal is None
        el.apply_verdict(Stable())
        assert not el.growth_enabled
    feed(el, [1.0, 1.0], sync_ms=pressure)
    assert el.proposal is None
    el.apply_verdict(Stable())
    assert el.growth_enabled
    assert el.anchor == 10
    feed(el, [1.0, 1.0], sync_ms=pressure)
    assert el.proposal == 13


def test_a_non_stable_verdict_restarts_the_rearm_streak() -> None:
    el = stable_el()
    el.apply_verdict(SuppressGrowth())
    for _ in range(GROWTH_REARM_STABLE - 1):
        el.apply_verdict(Stable())
    el.apply_verdict(NudgeDown(1.0))
    for _ in range(GROWTH_REARM_STABLE - 1):
        el.apply_verdict(Stable())
    assert not el.growth_enabled
    el.apply_verdict(Stable())
    assert el.growth_enabled


def test_nudge_anchor_down_bypasses_min_anchor_and_clamps_the_factor() -> None:
    el = stable_el()
    el.nudge_anchor_down(math.nan)
    assert el.anchor == 10
    el.nudge_anchor_down(2.0)  # clamped to 1.0: never grows
    assert el.anchor == 10
    el.nudge_anchor_down(0.5)
    assert (el.anchor, el.min_anchor, el.batch_counts) == (5, 10, [5, 5])
    el.nudge_anchor_down(0.01)  # clamped to 0.1: ceil(0.5) = 1
    assert el.anchor == 1
    el.nudge_anchor_down(0.1)
    assert el.anchor == 1


def test_relax_up_adds_one_and_stops_at_max_anchor() -> None:
    el = stable_el(max_anchor=11)
    el.apply_verdict(Stable(relax_up=True))
    assert (el.anchor, el.batch_counts) == (11, [11, 11])
    el.apply_verdict(Stable(relax_up=True))
    assert el.anchor == 11


def test_relax_up_is_refused_when_the_spread_would_pass_max_batch_diff() -> None:
    el = ElChe(2, anchor=49, max_batch_diff=100)
    feed(el, [1.0, 3.0])
    el.apply_verdict(Stable(relax_up=True))  # 50: round(150) - 50 = 100 <= 100
    assert el.anchor == 50
    el.apply_verdict(Stable(relax_up=True))  # 51: 153 - 51 = 102 > 100
    assert el.anchor == 50


def test_apply_verdict_rejects_other_types() -> None:
    with pytest.raises(LocalProtocolError):
        ElChe(2).apply_verdict("stable")


# ---------------------------------------------------------------------------- speed hints


def test_speed_ratio_hint_sets_counts_and_pins_the_anchor() -> None:
    assert not ElChe(2).has_speed_hint()
    el = ElChe(2).with_speed_ratio(1, 2.3)
    assert (el.batch_counts, el.anchor_rank, el.has_speed_hint()) == ([23, 10], 1, True)
    slow = ElChe(2).with_speed_ratio(0, 0.5)  # ratios below 1 mean equal speed
    assert (slow.batch_counts, slow.has_speed_hint()) == ([10, 10], False)
    with pytest.raises(ConfigError, match="slow_rank"):
        ElChe(2).with_speed_ratio(2, 2.0)
    with pytest.raises(ConfigError, match="ratio"):
        ElChe(2).with_speed_ratio(0, math.inf)


def test_speed_ratio_pin_holds_through_warmup() -> None:
    el = ElChe(2).with_speed_ratio(0, 2.0)
    feed(el, [1.0, 2.0], times=5)
    assert el.anchor_rank == 0
    feed(el, [1.0, 2.0])
    assert el.anchor_rank == 1


def test_partition_ratios_pin_the_smallest_ratio_rank() -> None:
    el = ElChe(3).with_partition_ratios([0.5, 0.2, 0.3])
    assert (el.anchor_rank, el.batch_counts, el.has_speed_hint()) == (1, [10, 10, 10], False)
    tie = ElChe(3).with_partition_ratios([0.4, 0.2, 0.2])
    assert tie.anchor_rank == 1
    first = ElChe(3).with_speed_ratio(0, 2.0).with_partition_ratios([0.5, 0.2, 0.3])
    assert first.anchor_rank == 0  # the speed-ratio pin outranks partition_ratios
    later = ElChe(3).with_partition_ratios([0.5, 0.2, 0.3]).with_speed_ratio(2, 2.0)
    assert later.anchor_rank == 2
    with pytest.raises(ConfigError, match="partition_ratios"):
        ElChe(3).with_partition_ratios([0.5, 0.5])
    with pytest.raises(ConfigError, match="partition_ratios"):
        ElChe(2).with_partition_ratios([0.0, 0.0])


# ---------------------------------------------------------------------------- report_window


def window(
    *,
    wall: Sequence[float],
    steps: Sequence[int],
    delivered: Sequence[float],
    delivered_batches: Sequence[int],
    coherent: bool = True,
    fill: Sequence[float] | None = None,
    sync_ms: float = 0.0,
) -> WindowReport:
    return WindowReport(
        wall_ms=wall,
        steps=steps,
        delivered_ms=delivered,
        delivered_batches=delivered_batches,
        fill_ms=fill if fill is not None else [0.0] * len(wall),
        delivered_coherent=coherent,
        sync_ms=sync_ms,
    )


def test_select_feed_uses_delivered_only_when_coherent_and_capable() -> None:
    rep = window(
        wall=[10.0, 20.0], steps=[10, 10], delivered=[18.0, 36.0], delivered_batches=[9, 9]
    )
    assert rep.wall_ms == (10.0, 20.0)  # stored as tuples
    assert rep.select_feed(delivered_capable=True) == ([18.0, 36.0], [9, 9])
    assert rep.select_feed(delivered_capable=False) == ([10.0, 20.0], [10, 10])  # Sync
    incoherent = window(
        wall=[10.0, 20.0], steps=[10, 10], delivered=[18.0, 36.0], delivered_batches=[9, 9],
        coherent=False,
    )  # fmt: skip
    assert incoherent.select_feed(delivered_capable=True) == ([10.0, 20.0], [10, 10])


def test_select_feed_never_mixes_scales() -> None:
    partial = window(
        wall=[10.0, 20.0, 5.0], steps=[10, 10, 1], delivered=[18.0, 36.0, 0.0],
        delivered_batches=[9, 9, 0],
    )  # fmt: skip
    # Rank 2 moved (1 step) without a delivered sample: everyone feeds compute.
    assert partial.select_feed(delivered_capable=True) == ([10.0, 20.0, 5.0], [10, 10, 1])
    # A dead rank does not spoil coherence; a rank without steps keeps its compute pair.
    assert partial.select_feed(delivered_capable=True, alive=[True, True, False]) == (
        [18.0, 36.0, 5.0],
        [9, 9, 1],
    )
    idle = window(wall=[10.0, 0.0], steps=[10, 0], delivered=[18.0, 0.0], delivered_batches=[9, 0])
    assert idle.select_feed(delivered_capable=True) == ([18.0, 0.0], [9, 0])


def test_report_window_feeds_the_selected_scale() -> None:
    el = ElChe(2)
    el.report_window(
        window(wall=[10.0, 10.0], steps=[10, 10], delivered=[9.0, 27.0], delivered_batches=[9, 9]),
        delivered_capable=True,
    )
    assert el.smoothed_ms == [1.0, 3.0]
    assert el.calibration_count == 1
    el.report_window(
        window(wall=[10.0, 10.0], steps=[10, 10], delivered=[9.0, 27.0], delivered_batches=[9, 9]),
        delivered_capable=False,
    )
    assert el.smoothed_ms == [1.0, 2.0]


def test_report_window_all_zero_reports_nothing() -> None:
    el = ElChe(2)
    el.report_window(
        window(wall=[0.0, 0.0], steps=[0, 0], delivered=[0.0, 0.0], delivered_batches=[0, 0],
               fill=[5.0, 5.0]),
        delivered_capable=True,
    )  # fmt: skip
    assert el.calibration_count == 0
    assert el.phase is Phase.PROBE


def test_report_window_stages_the_fill_for_growth() -> None:
    el = stable_el()
    el.report_window(
        window(wall=[10.0, 10.0], steps=[10, 10], delivered=[0.0, 0.0], delivered_batches=[0, 0],
               coherent=False, fill=[10.0, 0.0]),
        delivered_capable=True,
    )  # fmt: skip
    assert el.proposal == 20


def test_window_report_lengths_are_checked() -> None:
    with pytest.raises(LocalProtocolError):
        window(wall=[1.0, 1.0], steps=[1], delivered=[0.0, 0.0], delivered_batches=[0, 0])
    with pytest.raises(LocalProtocolError):
        ElChe(3).report_window(
            window(wall=[1.0, 1.0], steps=[1, 1], delivered=[0.0, 0.0], delivered_batches=[0, 0]),
            delivered_capable=False,
        )


# ---------------------------------------------------------------------------- dead ranks


def test_mark_dead_zeroes_the_count_and_reelects_the_anchor() -> None:
    el = ElChe(3)
    feed(el, [1.0, 1.0, 3.0])
    assert el.anchor_rank == 2
    el.mark_dead(2)
    assert (el.alive, el.anchor_rank, el.batch_counts) == ([True, True, False], 0, [10, 10, 0])
    assert el.smoothed_ms[2] == 0.0
    feed(el, [1.0, 2.0, 3.0], times=10)
    assert el.anchor_rank == 1
    assert el.batch_counts[2] == 0
    el.mark_dead(2)  # idempotent
    with pytest.raises(LocalProtocolError):
        el.mark_dead(3)


def test_dead_ranks_are_outside_election_and_the_window_cap() -> None:
    el = ElChe(3)
    feed(el, [1.0, 1.0, 3.0])
    el.mark_dead(1)
    el.set_max_total_batches(20)
    feed(el, [1.0, 1.0, 3.0])
    assert el.batch_counts == [15, 0, 5]
    assert el.clamp_total(8) == [6, 0, 2]
    el.mark_dead(2)
    assert el.anchor_rank == 0
    assert not el.has_speed_hint()


def test_mark_dead_before_any_reading_leaves_the_election_to_the_next_report() -> None:
    el = ElChe(2).with_initial_anchor(1)
    el.mark_dead(1)
    assert (el.anchor_rank, el.batch_counts) == (None, [10, 0])
    feed(el, [1.0, 1.0])
    assert el.anchor_rank == 0


# ---------------------------------------------------------------------------- checkpoint state


def test_to_state_round_trips_through_dict_and_restore() -> None:
    el = ElChe(3)
    feed(el, [1.0, 1.0, 3.0], sync_ms=5.0, times=8, verdict=Stable())
    state = el.to_state()
    assert state.trend_history is None
    assert state.phase == "stable"
    data = state.to_dict()
    assert set(data) == {
        "anchor", "anchor_rank", "smoothed_ms_per_batch", "phase", "calibration_count",
        "trend_history",
    }  # fmt: skip
    assert ElCheState.from_dict(data) == state
    resumed = ElChe(3)
    resumed.restore(ElCheState.from_dict(data))
    assert resumed.to_state() == state
    assert resumed.calibrated
    assert resumed.phase is Phase.STABLE
    assert resumed.batch_counts == [3 * state.anchor, 3 * state.anchor, state.anchor]


def test_trend_history_survives_the_dict_round_trip() -> None:
    state = ElCheState(12, 1, [1.0, 2.0], "mature", 30, trend_history=[0.01, 0.02])
    assert ElCheState.from_dict(state.to_dict()) == state
    data = state.to_dict()
    del data["trend_history"]
    assert ElCheState.from_dict(data).trend_history is None


def test_restore_rejects_a_world_size_mismatch() -> None:
    with pytest.raises(ConfigError, match="world_size"):
        ElChe(2).restore(ElCheState(10, 0, [1.0, 1.0, 1.0], "stable", 7))


def test_a_state_resized_to_more_ranks_keeps_known_speeds_and_calibrates_the_new_ones() -> None:
    saved = ElCheState(10, 2, [1.0, 1.0, 2.0], "stable", 7, trend_history=[0.1])
    grown = saved.resized(4)
    assert grown.smoothed_ms_per_batch == [1.0, 1.0, 2.0, 0.0]
    assert (grown.anchor, grown.anchor_rank, grown.phase, grown.calibration_count) == (
        10, 2, "stable", 7
    )  # fmt: skip
    assert grown.trend_history == [0.1]
    el = ElChe(4)
    el.restore(grown)
    assert el.calibrated and el.anchor_rank == 2
    # ranks 0 and 1 are twice the anchor's speed; rank 3, never measured, runs the anchor's
    # count (its calibration window) ...
    assert el.batch_counts == [20, 20, 10, 10]
    # ... and its first reading gives it its proportional count (4x the anchor's speed)
    feed(el, [1.0, 1.0, 2.0, 0.5], verdict=Stable())
    assert el.batch_counts[3] == 40


def test_a_state_resized_to_fewer_ranks_drops_them_and_re_elects_a_dropped_anchor() -> None:
    saved = ElCheState(10, 2, [1.0, 1.5, 2.0], "mature", 30)
    shrunk = saved.resized(2)
    assert shrunk.smoothed_ms_per_batch == [1.0, 1.5]
    assert shrunk.anchor_rank is None  # rank 2 is gone: the restore elects among the rest
    el = ElChe(2)
    el.restore(shrunk)
    assert el.anchor_rank == 1  # the slowest that remains
    assert el.batch_counts == [15, 10]
    assert saved.resized(3) == saved
    with pytest.raises(LocalProtocolError, match="world_size"):
        saved.resized(0)


def test_restore_seeds_rings_with_the_saved_mean() -> None:
    el = ElChe(2)
    el.restore(ElCheState(10, 1, [1.0, 2.0], "warmup", 3))
    assert el.smoothed_ms == [1.0, 2.0]
    assert el.calibrated
    feed(el, [1.0, 4.0])
    assert el.smoothed_ms[1] == 3.0  # one seeded sample + one new reading
    empty = ElChe(2)
    empty.restore(ElCheState(10, None, [0.0, 0.0], "probe", 0))
    assert not empty.calibrated
    assert empty.smoothed_ms_per_batch(0) is None


def test_restore_clamps_the_anchor_to_the_configured_max() -> None:
    el = ElChe(2, max_anchor=50)
    el.restore(ElCheState(200, 0, [1.0, 1.0], "stable", 9))
    assert el.anchor == 50
    assert el.batch_counts == [50, 50]


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"anchor": None}, "anchor"),
        ({"anchor": 0}, "anchor"),
        ({"anchor_rank": "1"}, "anchor_rank"),
        ({"smoothed_ms_per_batch": [1.0, "x"]}, "smoothed_ms_per_batch"),
        ({"smoothed_ms_per_batch": [1.0, -1.0]}, "smoothed_ms_per_batch"),
        ({"phase": "steady"}, "phase"),
        ({"calibration_count": 1.5}, "calibration_count"),
        ({"trend_history": "0.1"}, "trend_history"),
    ],
)
def test_from_dict_rejects_bad_fields_naming_them(change: dict[str, object], field: str) -> None:
    data = ElCheState(10, 0, [1.0, 1.0], "stable", 7).to_dict()
    data.update(change)
    with pytest.raises(ConfigError, match=field):
        ElCheState.from_dict(data)


def test_from_dict_rejects_a_missing_field() -> None:
    data = ElCheState(10, 0, [1.0, 1.0], "stable", 7).to_dict()
    del data["phase"]
    with pytest.raises(ConfigError, match="phase"):
        ElCheState.from_dict(data)
