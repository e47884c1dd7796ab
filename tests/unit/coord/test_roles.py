"""Callback roles (docs/design.md §2): Fastest election, stickiness, pinned ranks, retries."""

from __future__ import annotations

import pytest

from flodl.coord.roles import EWMA_ALPHA, CheckpointRetry, Roles, elect_fastest


def roles_of(roles: Roles) -> tuple[int, int, int]:
    return (roles.epoch_callback_role, roles.eval_role, roles.checkpoint_role)


# --- elect_fastest --------------------------------------------------------------------------


def test_elect_fastest_picks_the_lowest_smoothed_ms() -> None:
    rank, why = elect_fastest([0, 1, 2], [12.0, 7.5, 9.0])
    assert rank == 1
    assert "1" in why and "7.500" in why


def test_elect_fastest_ties_go_to_the_lowest_rank() -> None:
    assert elect_fastest([0, 1, 2, 3], [9.0, 5.0, 7.0, 5.0])[0] == 1
    assert elect_fastest([3, 2], [0.0, 0.0, 4.0, 4.0])[0] == 2


def test_elect_fastest_skips_dead_and_uncalibrated_ranks() -> None:
    assert elect_fastest([1, 2], [1.0, 0.0, 6.0])[0] == 2  # rank 0 dead, rank 1 unmeasured


def test_elect_fastest_uncalibrated_falls_back_to_the_lowest_live_rank() -> None:
    rank, why = elect_fastest([2, 1, 3], [0.0, 0.0, 0.0, 0.0])
    assert rank == 1
    assert "lowest live rank 1" in why


# --- Roles: Fastest -------------------------------------------------------------------------


def test_fastest_roles_start_on_rank_zero_and_dirty() -> None:
    roles = Roles("fastest")
    assert roles_of(roles) == (0, 0, 0)
    assert roles.dirty and not roles.elected


def test_first_calibration_elects_the_fastest_for_all_three_roles() -> None:
    roles = Roles("fastest")
    roles.dirty = False
    why = roles.on_first_calibration([0, 1, 2], [5.0, 3.0, 4.0])
    assert roles_of(roles) == (1, 1, 1)
    assert roles.elected and roles.dirty
    assert "fastest live rank 1" in why


def test_first_calibration_ties_go_to_the_lowest_rank() -> None:
    roles = Roles("fastest")
    roles.on_first_calibration([0, 1, 2], [5.0, 3.0, 3.0])
    assert roles_of(roles) == (1, 1, 1)


def test_first_calibration_without_timings_picks_the_lowest_live_rank() -> None:
    roles = Roles("fastest")
    why = roles.on_first_calibration([1, 2], [0.0, 0.0, 0.0])
    assert roles_of(roles) == (1, 1, 1)
    assert "lowest live rank 1" in why


def test_election_is_sticky_a_later_faster_rank_does_not_take_over() -> None:
    roles = Roles("fastest")
    roles.on_first_calibration([0, 1, 2], [5.0, 3.0, 4.0])
    roles.dirty = False
    assert roles.on_first_calibration([0, 1, 2], [5.0, 3.0, 0.5]) == ""
    assert roles_of(roles) == (1, 1, 1)
    assert not roles.dirty


def test_a_non_role_death_does_not_re_elect() -> None:
    roles = Roles("fastest")
    roles.on_first_calibration([0, 1, 2], [5.0, 3.0, 4.0])
    roles.dirty = False
    assert roles.on_death(0, [1, 2], [5.0, 3.0, 0.5]) == ""
    assert roles_of(roles) == (1, 1, 1)
    assert not roles.dirty


def test_role_rank_death_re_elects_the_fastest_survivor() -> None:
    roles = Roles("fastest")
    roles.on_first_calibration([0, 1, 2], [5.0, 3.0, 4.0])
    roles.dirty = False
    why = roles.on_death(1, [0, 2], [5.0, 3.0, 4.0])
    assert roles_of(roles) == (2, 2, 2)
    assert roles.dirty
    assert "role rank 1 died" in why and "2" in why


def test_role_rank_death_before_calibration_falls_back_to_lowest_live() -> None:
    roles = Roles("fastest")
    why = roles.on_death(0, [1, 2], [0.0, 0.0, 0.0])
    assert roles_of(roles) == (1, 1, 1)
    assert "lowest live rank 1" in why


def test_death_with_nobody_left_changes_nothing() -> None:
    roles = Roles("fastest")
    assert roles.on_death(0, [], [0.0]) == ""
    assert roles_of(roles) == (0, 0, 0)


# --- Roles: pinned Rank(n) ------------------------------------------------------------------


def test_pinned_rank_holds_all_roles_and_ignores_calibration() -> None:
    roles = Roles(2)
    assert roles_of(roles) == (2, 2, 2)
    assert roles.on_first_calibration([0, 1, 2], [1.0, 2.0, 9.0]) == ""
    assert roles_of(roles) == (2, 2, 2)


def test_pinned_rank_death_moves_every_role_to_the_fastest_survivor() -> None:
    roles = Roles(2)
    roles.dirty = False
    why = roles.on_death(2, [0, 1], [9.0, 1.0, 5.0])
    assert roles_of(roles) == (1, 1, 1)  # the Fastest rule, not the lowest live rank
    assert roles.dirty
    assert why == (
        "pinned rank 2 died: callback roles moved to fastest live rank 1 (1.000 ms/batch) "
        "until it holds the consensus again"
    )
    assert roles.on_death(0, [1], [9.0, 1.0, 5.0]) == ""  # the heir holds them now
    assert roles.on_death(1, [0], [9.0, 1.0, 5.0]) != "" and roles_of(roles) == (0, 0, 0)


def test_pinned_rank_uncalibrated_death_falls_back_to_the_lowest_live_rank() -> None:
    roles = Roles(2)
    assert "lowest live rank 0" in roles.on_death(2, [0, 1], [0.0, 0.0, 0.0])
    assert roles_of(roles) == (0, 0, 0)


def test_pinned_rank_takes_its_roles_back_once_it_holds_the_consensus() -> None:
    roles = Roles(2)
    roles.on_death(2, [0, 1], [9.0, 1.0, 5.0])
    roles.dirty = False
    assert roles.on_consensus(0) == ""  # not the pinned rank: nothing moves
    assert not roles.dirty
    why = roles.on_consensus(2)
    assert why == "pinned rank 2 holds the consensus again: callback roles back on it"
    assert roles_of(roles) == (2, 2, 2) and roles.dirty
    assert roles.on_consensus(2) == ""  # already there


def test_fastest_roles_never_go_back_to_a_rank_that_rejoins() -> None:
    roles = Roles("fastest")
    roles.on_first_calibration([0, 1, 2], [5.0, 3.0, 4.0])
    roles.on_death(1, [0, 2], [5.0, 3.0, 4.0])
    assert roles.on_consensus(1) == "" and roles_of(roles) == (2, 2, 2)  # sticky


def test_a_rank_absent_at_formation_lends_its_roles() -> None:
    pinned = Roles(1)
    why = pinned.on_absent(1, [0, 2], [0.0, 0.0, 0.0])
    assert "pinned rank 1 has not joined" in why and roles_of(pinned) == (0, 0, 0)
    assert pinned.on_consensus(1) != "" and roles_of(pinned) == (1, 1, 1)
    fastest = Roles("fastest")
    assert "role rank 0 has not joined" in fastest.on_absent(0, [1, 2], [0.0, 0.0, 0.0])
    assert roles_of(fastest) == (1, 1, 1) and not fastest.elected  # the election still comes
    assert Roles(2).on_absent(0, [1, 2], [0.0, 0.0, 0.0]) == ""  # it held no role


def test_pinned_rank_ignores_other_deaths() -> None:
    roles = Roles(2)
    roles.dirty = False
    assert roles.on_death(0, [1, 2], [1.0, 1.0, 1.0]) == ""
    assert roles_of(roles) == (2, 2, 2)
    assert not roles.dirty


# --- cost EWMA ------------------------------------------------------------------------------


def test_ewma_alpha_is_0_3_and_the_first_sample_is_raw() -> None:
    assert EWMA_ALPHA == 0.3
    roles = Roles("fastest")
    assert roles.cost("eval", 1) == 0.0
    assert roles.observe_cost("eval", 1, 100.0) == 100.0
    assert roles.observe_cost("eval", 1, 200.0) == pytest.approx(130.0)
    assert roles.observe_cost("eval", 1, 130.0) == pytest.approx(130.0)
    assert roles.cost("eval", 1) == pytest.approx(130.0)


def test_ewma_is_kept_per_kind_and_rank() -> None:
    roles = Roles("fastest")
    roles.observe_cost("eval", 0, 50.0)
    roles.observe_cost("checkpoint", 0, 400.0)
    roles.observe_cost("eval", 1, 10.0)
    assert roles.cost("eval", 0) == 50.0
    assert roles.cost("checkpoint", 0) == 400.0
    assert roles.cost("eval", 1) == 10.0
    assert roles.cost("epoch_fn", 0) == 0.0


# --- CheckpointRetry ------------------------------------------------------------------------


def test_checkpoint_retry_goes_to_the_lowest_untried_live_rank_then_gives_up() -> None:
    retry = CheckpointRetry(version=4)
    assert retry.first(2) == 2
    assert retry.target == 2
    assert retry.next_target([3, 0, 2, 1]) == 0
    assert retry.next_target([3, 0, 2, 1]) == 1
    assert retry.target == 1
    assert retry.next_target([3, 0, 2, 1]) == 3
    assert retry.next_target([3, 0, 2, 1]) is None
    assert retry.target is None
    assert retry.tried == {0, 1, 2, 3}


def test_checkpoint_retry_skips_dead_ranks() -> None:
    retry = CheckpointRetry(version=1)
    retry.first(0)
    assert retry.next_target([2]) == 2  # rank 1 is dead: not a candidate
    assert retry.next_target([2]) is None
