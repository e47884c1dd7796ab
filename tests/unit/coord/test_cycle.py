"""Count gate, averaging cycle, collective sessions and throttles (docs/design.md §2)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from flodl.config import CoordConfig, validated
from flodl.coord.cycle import Cycle, CyclePhase, Sessions, ranks_to_throttle, should_average
from flodl.timeouts import Timeouts


def gate(
    policy: str,
    steps: Sequence[int],
    *,
    counts: Sequence[int] | None = None,
    quiesced: Sequence[bool] | None = None,
    alive: Sequence[int] | None = None,
) -> bool:
    n = len(steps)
    return should_average(
        one_step=policy == "sync",  # Sync's fixed one-step window
        alive=list(range(n)) if alive is None else alive,
        window_steps=steps,
        counts=[1] * n if counts is None else counts,
        quiesced=[False] * n if quiesced is None else quiesced,
    )


# --- should_average -------------------------------------------------------------------------


def test_sync_fires_when_every_live_rank_took_one_step() -> None:
    assert gate("sync", [1, 0]) is False
    assert gate("sync", [1, 1]) is True
    assert gate("sync", [4, 1]) is True


def test_sync_ignores_counts() -> None:
    assert gate("sync", [1, 1], counts=[10, 10]) is True


@pytest.mark.parametrize("policy", ["cadence", "async"])
def test_cadence_and_async_wait_for_each_ranks_count(policy: str) -> None:
    counts = [5, 3]
    assert gate(policy, [5, 2], counts=counts) is False
    assert gate(policy, [4, 3], counts=counts) is False
    assert gate(policy, [5, 3], counts=counts) is True
    assert gate(policy, [7, 3], counts=counts) is True


@pytest.mark.parametrize("policy", ["sync", "cadence", "async"])
def test_a_quiesced_rank_counts_as_hit(policy: str) -> None:
    assert gate(policy, [5, 0], counts=[5, 5], quiesced=[False, True]) is True
    assert gate(policy, [0, 3], counts=[5, 5], quiesced=[False, True]) is False


@pytest.mark.parametrize("policy", ["cadence", "async"])
def test_a_busy_rank_short_of_its_count_blocks_even_beside_a_quiesced_one(policy: str) -> None:
    assert gate(policy, [4, 0], counts=[5, 5], quiesced=[False, True]) is False


@pytest.mark.parametrize("policy", ["sync", "cadence", "async"])
def test_nobody_moved_never_fires(policy: str) -> None:
    assert gate(policy, [0, 0], counts=[5, 5], quiesced=[True, True]) is False


@pytest.mark.parametrize("policy", ["sync", "cadence", "async"])
def test_dead_ranks_are_skipped(policy: str) -> None:
    assert gate(policy, [5, 0, 5], counts=[5, 5, 5], alive=[0, 2]) is True
    assert gate(policy, [5, 9, 0], counts=[5, 5, 5], alive=[0, 2]) is False


@pytest.mark.parametrize("policy", ["sync", "cadence", "async"])
def test_no_live_rank_never_fires(policy: str) -> None:
    assert gate(policy, [5, 5], counts=[1, 1], alive=[]) is False


# --- Cycle ----------------------------------------------------------------------------------


def test_begin_numbers_cycles_and_refuses_overlap() -> None:
    cycle = Cycle(needs_reduce_done=False)
    assert cycle.phase is CyclePhase.IDLE and cycle.number == 0
    assert cycle.begin([0, 1], 3.0) == 1
    assert cycle.pending and cycle.pending_since_at == 3.0
    with pytest.raises(AssertionError):
        cycle.begin([0, 1], 4.0)
    cycle.finish()
    assert cycle.begin([0], 5.0) == 2
    assert cycle.expected == {0} and cycle.acked == {}


def test_ready_when_every_expected_rank_acked() -> None:
    cycle = Cycle(needs_reduce_done=False)
    cycle.begin([0, 1, 2], 0.0)
    assert cycle.ack(0, 10) and cycle.ack(2, 12)
    assert not cycle.ready()
    assert cycle.ack(1, 11)
    assert cycle.ready()
    assert cycle.acked == {0: 10, 1: 11, 2: 12}


def test_unexpected_acks_are_refused() -> None:
    cycle = Cycle(needs_reduce_done=False)
    assert cycle.ack(0, 1) is False  # idle: no cycle to ack
    cycle.begin([0, 1], 0.0)
    assert cycle.ack(5, 1) is False  # not a member of this cycle
    assert cycle.acked == {}


def test_a_dropped_rank_counts_as_acked() -> None:
    cycle = Cycle(needs_reduce_done=False)
    cycle.begin([0, 1], 0.0)
    cycle.ack(0, 4)
    assert not cycle.ready()
    cycle.drop(1)
    assert cycle.ready()
    assert cycle.ack(1, 4) is False  # a late ack from the dropped rank is ignored


def test_cpu_cycle_also_needs_the_reduce_done() -> None:
    cycle = Cycle(needs_reduce_done=True)
    cycle.begin([0, 1], 0.0)
    cycle.ack(0, 3)
    cycle.ack(1, 3)
    assert not cycle.ready()
    cycle.mark_reduce_done((0, 1), 2.0)
    assert cycle.ready()
    assert cycle.contributors == (0, 1) and cycle.weight_total == 2.0


def test_cpu_cycle_reduce_done_alone_is_not_enough() -> None:
    cycle = Cycle(needs_reduce_done=True)
    cycle.begin([0, 1], 0.0)
    cycle.mark_reduce_done((0, 1), 2.0)
    cycle.ack(0, 3)
    assert not cycle.ready()
    cycle.ack(1, 3)
    assert cycle.ready()


def test_cpu_cycle_with_every_rank_dropped_is_ready_without_reduce_done() -> None:
    cycle = Cycle(needs_reduce_done=True)
    cycle.begin([0, 1], 0.0)
    cycle.drop(0)
    cycle.drop(1)
    assert cycle.ready()


def test_begin_resets_reduce_state_of_the_previous_cycle() -> None:
    cycle = Cycle(needs_reduce_done=True)
    cycle.begin([0], 0.0)
    cycle.mark_reduce_done((0,), 1.0)
    cycle.ack(0, 1)
    assert cycle.ready()
    cycle.finish()
    cycle.begin([0], 1.0)
    assert not cycle.reduce_done and cycle.contributors is None and cycle.weight_total is None
    cycle.ack(0, 2)
    assert not cycle.ready()


def test_stale_acks_after_finish_are_ignored() -> None:
    cycle = Cycle(needs_reduce_done=False)
    cycle.begin([0, 1], 0.0)
    cycle.ack(0, 1)
    cycle.ack(1, 1)
    cycle.finish()
    assert cycle.phase is CyclePhase.IDLE
    assert not cycle.ready()  # never fold twice
    assert cycle.ack(0, 2) is False
    cycle.begin([0, 1], 1.0)
    assert cycle.acked == {}  # the previous cycle's acks do not carry over
    assert not cycle.ready()


def test_stall_deadline_uses_the_production_ceiling() -> None:
    config = validated(CoordConfig, world_size=2, dataset_len=64)
    assert config.stall_ceiling_s == 300.0  # max(10 × 30 s, 300 s)
    cycle = Cycle(needs_reduce_done=True)
    assert cycle.stall_deadline(config.stall_ceiling_s) is None
    cycle.begin([0, 1], 12.5)
    assert cycle.stall_deadline(config.stall_ceiling_s) == 312.5
    cycle.finish()
    assert cycle.stall_deadline(config.stall_ceiling_s) is None


def test_stall_ceiling_scales_with_a_longer_heartbeat_timeout() -> None:
    config = validated(CoordConfig, world_size=2, dataset_len=64, timeouts=Timeouts(45.0))
    assert config.stall_ceiling_s == 450.0


# --- Sessions -------------------------------------------------------------------------------


def test_sessions_reform_renumbers_survivors_by_ascending_global_rank() -> None:
    sessions = Sessions(session=0, members=(0, 1, 2, 3))
    assert sessions.store_prefix("run") == "run/s0"
    assert sessions.reform([3, 0, 2]) == (1, (0, 2, 3))
    assert sessions.store_prefix("run") == "run/s1"
    assert sessions.reform([3, 2]) == (2, (2, 3))
    assert sessions.store_prefix("job") == "job/s2"


# --- ranks_to_throttle ----------------------------------------------------------------------


def test_throttle_needs_max_batch_diff_and_two_live_ranks() -> None:
    assert (
        ranks_to_throttle(alive=[0, 1], window_steps=[9, 0], max_batch_diff=None, already=set())
        == []
    )
    assert ranks_to_throttle(alive=[0], window_steps=[9, 0], max_batch_diff=0, already=set()) == []


def test_throttle_ranks_more_than_m_ahead_of_the_slowest() -> None:
    steps = [5, 2, 3, 4]
    got = ranks_to_throttle(alive=[0, 1, 2, 3], window_steps=steps, max_batch_diff=2, already=set())
    assert got == [0]
    lockstep = ranks_to_throttle(
        alive=[0, 1, 2, 3], window_steps=steps, max_batch_diff=0, already=set()
    )
    assert lockstep == [0, 2, 3]


def test_throttle_is_sent_once_per_window_and_skips_dead_ranks() -> None:
    steps = [5, 2, 9]
    assert ranks_to_throttle(alive=[0, 1], window_steps=steps, max_batch_diff=1, already={0}) == []
    assert ranks_to_throttle(alive=[0, 1], window_steps=steps, max_batch_diff=1, already=set()) == [
        0
    ]
