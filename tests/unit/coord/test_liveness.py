"""Liveness ledger (docs/design.md §2 "Liveness") with the production timeout."""

from __future__ import annotations

import pytest
from fakeclock import FakeClock

from flodl.config import MaxFailure
from flodl.coord.liveness import Liveness, RankState, unrecoverable_reason
from flodl.timeouts import DEFAULT_HEARTBEAT_TIMEOUT_S

TIMEOUT = DEFAULT_HEARTBEAT_TIMEOUT_S  # 30 s, the production default


def joined(world_size: int = 3, at: float = 0.0) -> Liveness:
    live = Liveness(world_size, TIMEOUT)
    for r in range(world_size):
        live.join(r, at)
    return live


def test_fake_clock_refuses_to_go_backwards() -> None:
    clock = FakeClock(5.0)
    with pytest.raises(ValueError, match="cannot go back"):
        clock.advance(-0.1)
    with pytest.raises(ValueError, match="cannot go back"):
        clock.advance_to(4.0)
    assert clock.now == 5.0


def test_production_timeout_is_30s() -> None:
    assert TIMEOUT == 30.0


def test_ranks_start_joining_and_are_neither_alive_nor_stale() -> None:
    live = Liveness(2, TIMEOUT)
    assert [live.state(r) for r in (0, 1)] == [RankState.JOINING] * 2
    assert live.alive() == [] and live.joined_count() == 0
    assert live.stale(1e6) == []
    assert live.next_deadline() is None


def test_join_makes_a_rank_alive_at_now() -> None:
    live = Liveness(3, TIMEOUT)
    live.join(2, 7.5)
    assert live.alive() == [2]
    assert live.alive_mask() == [False, False, True]
    assert live.joined_count() == 1
    assert live.last_seen_at(2) == 7.5


def test_stale_exactly_at_the_timeout_boundary() -> None:
    clock = FakeClock(100.0)
    live = joined(2, at=clock.now)
    clock.advance_to(129.999)
    assert live.stale(clock.now) == []
    clock.advance_to(130.0)
    assert live.stale(clock.now) == [0, 1]


@pytest.mark.parametrize("seen_at", [0.7, 29.999, 0.1, 12345.678, 1e6 + 0.3])
def test_a_rank_is_stale_exactly_at_its_reported_deadline(seen_at: float) -> None:
    # next_deadline() and stale() must agree bit for bit, or a tick at the deadline finds
    # nobody stale and the shell re-arms the same instant forever (0.7 + 30 - 30 > 0.7).
    live = joined(1, at=seen_at)
    deadline = live.next_deadline()
    assert deadline == seen_at + TIMEOUT
    assert live.stale(deadline) == [0]


def test_seen_refreshes_and_never_goes_back() -> None:
    clock = FakeClock()
    live = joined(2)
    clock.advance_to(20.0)
    live.seen(0, clock.now)
    live.seen(0, 10.0)  # a late-delivered older timestamp must not rewind
    assert live.last_seen_at(0) == 20.0
    clock.advance_to(30.0)
    assert live.stale(clock.now) == [1]
    clock.advance_to(49.999)
    assert live.stale(clock.now) == [1]
    clock.advance_to(50.0)
    assert live.stale(clock.now) == [0, 1]


def test_seen_does_not_revive_a_dead_or_joining_rank() -> None:
    live = Liveness(2, TIMEOUT)
    live.join(0, 0.0)
    live.seen(1, 5.0)
    assert live.state(1) is RankState.JOINING
    assert live.declare_dead(0, "gone")
    live.seen(0, 5.0)
    assert live.state(0) is RankState.DEAD
    assert live.last_seen_at(0) == 0.0


def test_next_deadline_is_the_earliest_alive_rank_going_stale() -> None:
    live = joined(3)
    live.seen(0, 12.0)
    live.seen(1, 4.0)
    live.seen(2, 8.0)
    # frames only move instants later, so the cached deadline is an early bound (never late) …
    early = live.next_deadline()
    assert early is not None
    assert early <= 4.0 + TIMEOUT
    # … made exact by the scan a tick does when that early deadline comes
    assert live.stale(early) == []
    assert live.next_deadline() == 4.0 + TIMEOUT
    live.declare_dead(1, "x")
    assert live.next_deadline() == 8.0 + TIMEOUT
    live.mark_exited(2)
    assert live.next_deadline() == 12.0 + TIMEOUT
    live.declare_dead(0, "y")
    assert live.next_deadline() is None


class _CountingRanks(list):  # type: ignore[type-arg]
    """The ledger's rank list, counting full passes over it."""

    scans = 0

    def __iter__(self):  # type: ignore[no-untyped-def]
        _CountingRanks.scans += 1
        return super().__iter__()


def test_a_run_s_exits_rescan_only_when_the_earliest_rank_leaves() -> None:
    """Every rank sends ``exiting`` last (its frame makes it the latest seen), so the W exits
    of a run's end keep the cached deadline: O(1) each, not an O(W) scan (it was O(W²))."""
    world = 200
    live = joined(world)
    live._ranks = _CountingRanks(live._ranks)
    live.stale(1.0)  # exact: every rank at 0 + TIMEOUT
    _CountingRanks.scans = 0
    for r in range(world - 1):
        live.seen(r, 10.0 + r)  # its exiting frame
        live.mark_exited(r)
        assert live.next_deadline() == TIMEOUT  # the last rank's, never late
    assert _CountingRanks.scans == 0
    live.seen(world - 1, 500.0)
    live.mark_exited(world - 1)
    assert live.next_deadline() is None


def test_the_death_of_the_earliest_rank_moves_the_deadline_to_the_next() -> None:
    live = joined(3)
    live.seen(1, 5.0)
    live.seen(2, 9.0)
    live.stale(1.0)
    assert live.next_deadline() == TIMEOUT  # rank 0's
    live.declare_dead(2, "x")  # not the earliest: kept
    assert live.next_deadline() == TIMEOUT
    live.declare_dead(0, "y")  # the earliest: rescanned, never re-armed at its instant
    assert live.next_deadline() == 5.0 + TIMEOUT


def test_exiting_is_a_latch_excluded_from_staleness_and_never_dead() -> None:
    live = joined(2)
    assert live.mark_exited(1) is True
    assert live.state(1) is RankState.EXITED
    assert live.alive() == [0]
    assert live.stale(10 * TIMEOUT) == [0]  # the exited rank is never scanned
    assert live.declare_dead(1, "connection lost: eof") is False
    assert live.state(1) is RankState.EXITED
    assert live.dead() == []
    assert live.reason(1) == ""
    assert live.mark_exited(1) is False  # latched once


def test_declare_dead_happens_once_and_keeps_the_first_reason() -> None:
    live = joined(3)
    assert live.declare_dead(1, "no frame for 30 s") is True
    assert live.declare_dead(1, "process exited with code -9") is False
    assert live.reason(1) == "no frame for 30 s"
    assert live.dead() == [1]
    assert live.alive() == [0, 2]
    assert live.mark_exited(1) is False  # a dead rank cannot exit cleanly afterwards
    assert live.state(1) is RankState.DEAD


# --- unrecoverable_reason -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("world_size", "dead", "alive", "backend", "max_failure", "expected"),
    [
        # absolute: breach at dead >= n
        (4, 1, 3, "cpu", MaxFailure(absolute=2), None),
        (4, 2, 2, "cpu", MaxFailure(absolute=2), "max_failure_exceeded"),
        (3, 1, 2, "collective", MaxFailure(absolute=1), "max_failure_exceeded"),
        # percent: breach at dead >= ceil(p * W)
        (4, 1, 3, "cpu", MaxFailure(percent=0.5), None),
        (4, 2, 2, "cpu", MaxFailure(percent=0.5), "max_failure_exceeded"),
        (3, 1, 2, "cpu", MaxFailure(percent=0.34), None),  # ceil(1.02) = 2
        (3, 2, 1, "cpu", MaxFailure(percent=0.34), "max_failure_exceeded"),
        # max_failure precedes the backend floors
        (2, 2, 0, "cpu", MaxFailure(absolute=1), "max_failure_exceeded"),
        # no rank left
        (3, 3, 0, "cpu", None, "all_ranks_lost"),
        (3, 3, 0, "collective", None, "all_ranks_lost"),
        # a lone collective survivor has nobody to average with; CPU goes on
        (3, 2, 1, "collective", None, "single_survivor"),
        (2, 1, 1, "collective", None, "single_survivor"),
        (3, 2, 1, "cpu", None, None),
        (1, 0, 1, "collective", None, None),  # a one-rank world is not a survivor situation
        # partial loss is tolerated by default
        (4, 1, 3, "collective", None, None),
        (4, 3, 1, "cpu", None, None),
    ],
)
def test_unrecoverable_reason_table(
    world_size: int,
    dead: int,
    alive: int,
    backend: str,
    max_failure: MaxFailure | None,
    expected: str | None,
) -> None:
    verdict = unrecoverable_reason(
        world_size=world_size,
        dead=dead,
        alive=alive,
        needs_two=backend == "collective",
        max_failure=max_failure,
    )
    if expected is None:
        assert verdict is None
    else:
        assert verdict is not None
        assert verdict[0] == expected


def test_max_failure_reason_names_dead_world_and_limit() -> None:
    verdict = unrecoverable_reason(
        world_size=5, dead=2, alive=3, needs_two=False, max_failure=MaxFailure(absolute=2)
    )
    assert verdict is not None
    reason, detail = verdict
    assert reason == "max_failure_exceeded"
    assert "2 of 5" in detail and "fewer than 2" in detail


def test_max_failure_percent_reason_names_the_computed_limit() -> None:
    verdict = unrecoverable_reason(
        world_size=10, dead=3, alive=7, needs_two=False, max_failure=MaxFailure(percent=0.25)
    )
    assert verdict is not None
    assert verdict[0] == "max_failure_exceeded"
    assert "3 of 10" in verdict[1] and "fewer than 3" in verdict[1]  # ceil(2.5) = 3


def test_all_ranks_lost_reason_names_the_world() -> None:
    verdict = unrecoverable_reason(world_size=4, dead=4, alive=0, needs_two=False, max_failure=None)
    assert verdict == ("all_ranks_lost", "all 4 ranks lost")


def test_single_survivor_reason_names_survivors_and_world() -> None:
    verdict = unrecoverable_reason(world_size=3, dead=2, alive=1, needs_two=True, max_failure=None)
    assert verdict is not None
    assert verdict[0] == "single_survivor"
    assert "1 rank left of 3" in verdict[1]


def test_alive_is_a_fresh_list_that_follows_every_transition() -> None:
    live = joined(3)
    mine = live.alive()
    mine.append(99)  # the caller's copy: the ledger's cached list is untouched
    assert live.alive() == [0, 1, 2]
    live.declare_dead(1, "x")
    assert live.alive() == [0, 2]
    live.mark_exited(2)
    assert live.alive() == [0]
    live.rejoin(1, 5.0)
    assert live.alive() == [0, 1]
