"""Pure tests of work sizing: partitions, the epoch's final window, progressive chunks."""

from __future__ import annotations

from typing import Any

import pytest
from batchranges import R, batches_of, ranges_of
from hypothesis import given
from hypothesis import strategies as st

from flodl.coord.partition import (
    cap_to_reduce_budget,
    carve_ranges,
    chunk_batches,
    consolidate_lone_ones,
    equal_sizes,
    final_window_alloc,
    final_window_due,
    partition_ranges,
    partition_sizes,
    ratio_to_sizes,
    reduce_step_budget,
    split_among,
    window_chunk,
)
from flodl.errors import LocalProtocolError

# ---------------------------------------------------------------------------------------------
# Partitions
# ---------------------------------------------------------------------------------------------


def test_equal_split_remainder_to_first_alive_ranks() -> None:
    assert partition_sizes(10, 3, alive=[True] * 3) == [4, 3, 3]
    assert partition_sizes(10, 4, alive=[False, True, True, True]) == [0, 4, 3, 3]
    assert partition_sizes(2, 4, alive=[True] * 4) == [1, 1, 0, 0]
    assert partition_sizes(0, 2, alive=[False, False]) == [0, 0]
    assert equal_sizes(7, 2, alive=[True, True]) == [4, 3]


def test_throughput_split_remainder_to_fastest() -> None:
    sizes = partition_sizes(
        10, 3, alive=[True] * 3, ms_per_batch=[10.0, 20.0, 30.0], proportional=True
    )
    # shares 6/11, 3/11, 2/11 of 10 -> floors 5, 2, 1; remainder 2 to ranks 0 then 1
    assert sizes == [6, 3, 1]
    # the slowest rank first in index order: remainder follows speed, not index
    sizes = partition_sizes(
        10, 3, alive=[True] * 3, ms_per_batch=[30.0, 20.0, 10.0], proportional=True
    )
    assert sizes == [1, 3, 6]


def test_throughput_split_needs_known_speeds_and_the_flag() -> None:
    alive = [True, True]
    assert partition_sizes(9, 2, alive=alive, ms_per_batch=[1.0, 2.0]) == [5, 4]
    assert partition_sizes(9, 2, alive=alive, ms_per_batch=[1.0, 0.0], proportional=True) == [
        5,
        4,
    ]
    assert partition_sizes(9, 2, alive=alive, proportional=True) == [5, 4]
    # a dead rank's unknown speed does not matter
    nan = float("nan")
    assert partition_sizes(
        9, 3, alive=[True, False, True], ms_per_batch=[1.0, nan, 2.0], proportional=True
    ) == [6, 0, 3]


def test_ratio_split() -> None:
    assert partition_sizes(10, 3, alive=[True] * 3, ratios=[0.5, 0.3, 0.2]) == [5, 3, 2]
    # remainder to the largest ratios (ties to the lowest rank)
    assert partition_sizes(10, 3, alive=[True] * 3, ratios=[1 / 3, 1 / 3, 1 / 3]) == [4, 3, 3]
    assert partition_sizes(7, 3, alive=[True] * 3, ratios=[0.2, 0.5, 0.3]) == [1, 4, 2]
    # ratios win over throughput; dead ranks are renormalized away
    assert partition_sizes(
        12,
        3,
        alive=[True, False, True],
        ratios=[1.0, 1.0, 2.0],
        ms_per_batch=[1.0, 1.0, 1.0],
        proportional=True,
    ) == [4, 0, 8]
    # surviving ratios all zero: equal split
    assert ratio_to_sizes(5, [0.0, 1.0, 0.0], alive=[True, False, True]) == [3, 0, 2]
    with pytest.raises(LocalProtocolError, match="ratio of rank 1"):
        ratio_to_sizes(5, [1.0, -1.0], alive=[True, True])


def test_partition_rejects_bad_inputs() -> None:
    with pytest.raises(LocalProtocolError, match="no rank is alive"):
        partition_sizes(3, 2, alive=[False, False])
    with pytest.raises(LocalProtocolError, match="alive has"):
        partition_sizes(3, 2, alive=[True])
    with pytest.raises(LocalProtocolError, match="ratios has"):
        partition_sizes(3, 2, alive=[True, True], ratios=[1.0])


@given(
    total=st.integers(0, 10_000),
    world=st.integers(1, 6).flatmap(
        lambda w: st.tuples(
            st.lists(st.booleans(), min_size=w, max_size=w).filter(any),
            st.lists(st.floats(0.01, 1000.0), min_size=w, max_size=w),
            st.lists(st.floats(0.0, 10.0), min_size=w, max_size=w),
        )
    ),
    mode=st.sampled_from(["equal", "throughput", "ratios"]),
)
def test_partition_sizes_sum_exactly(
    total: int, world: tuple[list[bool], list[float], list[float]], mode: str
) -> None:
    alive, ms, ratios = world
    sizes = partition_sizes(
        total,
        len(alive),
        alive=alive,
        ms_per_batch=ms if mode == "throughput" else None,
        ratios=ratios if mode == "ratios" else None,
        proportional=mode == "throughput",
    )
    assert sum(sizes) == total
    assert all(s == 0 for s, a in zip(sizes, alive, strict=True) if not a)
    assert all(s >= 0 for s in sizes)
    if mode == "equal":
        live = [s for s, a in zip(sizes, alive, strict=True) if a]
        assert max(live) - min(live) <= 1


def test_partition_ranges_are_consecutive() -> None:
    assert partition_ranges([4, 0, 3]) == [R(0, 4), R(4, 4), R(4, 7)]
    assert partition_ranges([2, 2], start=5) == [R(5, 7), R(7, 9)]


def test_carve_and_split_among() -> None:
    work = [R(10, 13), R(20, 25)]
    assert carve_ranges(work, [2, 4, 2]) == [[R(10, 12)], [R(12, 13), R(20, 23)], [R(23, 25)]]
    with pytest.raises(LocalProtocolError, match="only 8 batches"):
        carve_ranges(work, [5, 4])
    # 8 batches among 3 survivors: 3, 3, 2, lowest ranks first, contiguous pieces
    assert split_among(work, [4, 0, 2]) == [
        (0, R(10, 13)),
        (2, R(20, 23)),
        (4, R(23, 25)),
    ]
    assert split_among([R(0, 1)], [3, 1]) == [(1, R(0, 1))]
    assert split_among([], []) == []
    with pytest.raises(LocalProtocolError, match="no survivor"):
        split_among(work, [])


@given(
    batches=st.sets(st.integers(0, 200), max_size=120),
    survivors=st.sets(st.integers(0, 7), min_size=1),
)
def test_split_among_covers_work_exactly(batches: set[int], survivors: set[int]) -> None:
    pieces = split_among(ranges_of(batches), survivors)
    assert sorted(batches_of(p for _, p in pieces)) == sorted(batches)
    per_rank = {r: sum(p.size for q, p in pieces if q == r) for r in survivors}
    assert max(per_rank.values()) - min(per_rank.values()) <= 1
    assert [r for r, _ in pieces] == sorted(r for r, _ in pieces)


# ---------------------------------------------------------------------------------------------
# Epoch tail
# ---------------------------------------------------------------------------------------------


def no_lone_one(alloc: list[int]) -> bool:
    return all(n != 1 for n in alloc)


def test_final_window_proportional_rig_tail() -> None:
    # The observed rig tail: remaining 72, schedule [71, 18, 15].
    alloc = final_window_alloc(72, [71, 18, 15], [True, True, True])
    assert sum(alloc) == 72
    assert no_lone_one(alloc)
    assert alloc[0] > alloc[1]
    assert alloc[0] > alloc[2]
    assert alloc == [49, 13, 10]


@pytest.mark.parametrize("rem", range(2, 21))
def test_final_window_tiny_windows_consolidate(rem: int) -> None:
    alloc = final_window_alloc(rem, [71, 18, 15], [True, True, True])
    assert sum(alloc) == rem
    assert no_lone_one(alloc), alloc


def test_final_window_fold_band_pads_slow_not_fastest() -> None:
    alloc = final_window_alloc(106, [71, 18, 15], [True, True, True])
    assert alloc == [71, 19, 16]
    alloc = final_window_alloc(105, [71, 18, 15], [True, True, True])
    assert alloc == [71, 18, 16]  # one crumb: the slowest
    # fastest in the middle; a tie for fastest goes to the lowest rank
    assert final_window_alloc(23, [5, 10, 5], [True] * 3) == [7, 10, 6]
    assert final_window_alloc(22, [10, 10, 1], [True] * 3) == [10, 10, 2]


def test_final_window_dead_ranks_and_lone_survivor() -> None:
    alloc = final_window_alloc(40, [71, 18, 15], [True, False, True])
    assert alloc[1] == 0
    assert sum(alloc) == 40
    assert no_lone_one(alloc)
    # crumb round-robins over the non-fastest survivors when it outnumbers them
    assert final_window_alloc(15, [5, 3, 2], [True, False, True]) == [5, 0, 10]
    # a lone survivor takes everything
    assert final_window_alloc(9, [4, 6], [False, True]) == [0, 9]
    # an irreducible lone 1 is left for the fallback
    assert final_window_alloc(1, [71, 18, 15], [True] * 3) == [1, 0, 0]


def test_final_window_zero_schedule_and_errors() -> None:
    assert final_window_alloc(5, [0, 0, 0], [True, True, False]) == [3, 2, 0]
    assert final_window_alloc(4, [0, 0, 0], [True] * 3) == [2, 0, 2]  # equal, consolidated
    assert final_window_alloc(0, [3, 3], [False, False]) == [0, 0]
    with pytest.raises(LocalProtocolError, match="no rank is alive"):
        final_window_alloc(3, [3, 3], [False, False])
    with pytest.raises(LocalProtocolError, match="counts has"):
        final_window_alloc(3, [3], [True, True])


def test_consolidate_examples() -> None:
    alive = [True, True, True]
    assert consolidate_lone_ones([1, 1, 0], alive) == [0, 2, 0]
    out = consolidate_lone_ones([2, 1, 1], alive)
    assert no_lone_one(out)
    assert sum(out) == 4
    assert consolidate_lone_ones([1, 0, 5], [True, True, False]) == [1, 0, 5]  # dead peer


def test_final_window_due() -> None:
    counts, alive = [10, 5], [True, True]
    assert not final_window_due(0, counts, alive)
    assert final_window_due(16, counts, alive)
    assert not final_window_due(17, counts, alive)  # Σ + W
    assert final_window_due(11, counts, [True, False])


@given(
    data=st.integers(1, 6).flatmap(
        lambda w: st.tuples(
            st.lists(st.integers(0, 100), min_size=w, max_size=w),
            st.lists(st.booleans(), min_size=w, max_size=w).filter(any),
        )
    ),
    rem=st.integers(0, 800),
)
def test_final_window_alloc_properties(data: tuple[list[int], list[bool]], rem: int) -> None:
    counts, alive = data
    alloc = final_window_alloc(rem, counts, alive)
    live = [r for r in range(len(counts)) if alive[r]]
    total = sum(counts[r] for r in live)
    assert sum(alloc) == rem
    assert all(alloc[r] == 0 for r in range(len(counts)) if not alive[r])
    assert all(a >= 0 for a in alloc)
    if total > 0 and rem >= total:
        assert all(alloc[r] >= counts[r] for r in live)
        fastest = max(live, key=lambda r: (counts[r], -r))
        if len(live) > 1:
            assert alloc[fastest] == counts[fastest]  # never padded
            crumb = rem - total
            pads = [alloc[r] - counts[r] for r in live if r != fastest]
            assert max(pads) - min(pads) <= 1
            if crumb < len(live) - 1:
                assert max(pads) <= 1
    else:
        # proportional (or zero-schedule) sub-window: no lone 1 unless irreducible
        nonzero = [r for r in live if alloc[r] > 0]
        if rem >= 2:
            assert no_lone_one(alloc), alloc
        else:
            assert len(nonzero) == rem


# ---------------------------------------------------------------------------------------------
# Progressive chunk sizing
# ---------------------------------------------------------------------------------------------


def size(**overrides: Any) -> int:
    args: dict[str, Any] = {
        "barrier_paced": True,
        "count": 10,
        "steps_in_window": 0,
        "remaining": 1000,
        "sum_counts": 30,
        "final_slot": None,
        "max_overshoot": 0,
        "calibrated": True,
        "world_size": 2,
        "total_batches": 1000,
        "min_chunk_batches": 1,
    }
    args.update(overrides)
    return chunk_batches(**args)


def test_chunk_holds_at_the_reduce_barrier_or_an_empty_pool() -> None:
    assert size(remaining=0) == 0
    assert size(steps_in_window=10) == 0
    assert size(steps_in_window=12) == 0
    assert size(barrier_paced=False, steps_in_window=12, max_overshoot=3) > 0
    assert size(barrier_paced=False, steps_in_window=13, max_overshoot=3) == 0
    assert size(count=0) == 0  # Sync/Cadence budget 0
    assert size(steps_in_window=10, final_slot=5) == 0  # the barrier holds the slot too


def test_chunk_final_slot_first_and_exempt_from_the_budget() -> None:
    assert size(final_slot=11, remaining=40) == 11  # fold-band crumb: count + 1
    assert size(final_slot=11, remaining=7) == 7
    assert size(final_slot=0) == 0
    assert size(barrier_paced=False, final_slot=3, calibrated=False) == 3


def test_chunk_edge_schedule() -> None:
    assert size(remaining=25, count=10, sum_counts=30) == 10
    assert size(remaining=8, count=10, sum_counts=30) == 8
    assert size(remaining=25, count=10, steps_in_window=4) == 6  # budget cap
    # Async edge: share-capped, no min_chunk floor, no proportional split
    assert (
        size(barrier_paced=False, remaining=25, count=10, min_chunk_batches=20, max_overshoot=50)
        == 10
    )


def test_chunk_barrier_paced_one_window_per_chunk() -> None:
    assert size(count=7) == 7
    assert size(count=7, calibrated=False) == 7
    assert size(count=7, steps_in_window=5) == 2


def test_chunk_async_probe_and_calibrated() -> None:
    # uncalibrated probe: max(total / (W·10), 4)
    assert size(barrier_paced=False, calibrated=False, count=100, sum_counts=200) == 50
    assert (
        size(barrier_paced=False, calibrated=False, count=100, total_batches=60, sum_counts=200)
        == 4
    )
    assert (
        size(barrier_paced=False, calibrated=False, count=30, sum_counts=60, max_overshoot=5) == 35
    )
    # calibrated: max(ceil(remaining·count/Σ), min_chunk), capped by count + max_overshoot
    assert size(barrier_paced=False, count=30, sum_counts=70, max_overshoot=1000) == 429
    assert size(barrier_paced=False, count=30, sum_counts=70, max_overshoot=20) == 50
    assert (
        size(
            barrier_paced=False,
            count=1,
            remaining=100,
            sum_counts=60,
            min_chunk_batches=8,
            max_overshoot=10,
        )
        == 8
    )
    assert (
        size(barrier_paced=False, count=30, sum_counts=70, steps_in_window=25, max_overshoot=20)
        == 25
    )


def test_chunk_rejects_a_negative_value() -> None:
    with pytest.raises(LocalProtocolError, match="remaining"):
        size(remaining=-1)


@given(
    barrier_paced=st.booleans(),
    count=st.integers(0, 50),
    steps=st.integers(0, 60),
    remaining=st.integers(0, 500),
    extra=st.integers(0, 100),
    overshoot=st.integers(0, 10),
    calibrated=st.booleans(),
)
def test_chunk_never_crosses_the_budget_or_the_pool(
    barrier_paced: bool,
    count: int,
    steps: int,
    remaining: int,
    extra: int,
    overshoot: int,
    calibrated: bool,
) -> None:
    got = size(
        barrier_paced=barrier_paced,
        count=count,
        steps_in_window=steps,
        remaining=remaining,
        sum_counts=count + extra,
        max_overshoot=overshoot,
        calibrated=calibrated,
    )
    budget = count + (0 if barrier_paced else overshoot)
    assert 0 <= got <= remaining
    assert got <= max(0, budget - steps)
    if remaining and steps < budget:
        assert got >= 1 or count == 0


@given(
    count=st.integers(0, 300),
    steps=st.integers(0, 300),
    remaining=st.integers(0, 2000),
    sum_counts=st.integers(0, 5000),
)
def test_a_barrier_paced_chunk_outside_the_final_window_is_the_rest_of_the_count(
    count: int, steps: int, remaining: int, sum_counts: int
) -> None:
    # The rule as chunk_batches' general path spells it (rules 2 and 3 size the chunk at the
    # count, then the reduce-budget cap, then the pool): the dispatcher's per-rank shortcut,
    # window_chunk, and chunk_batches itself must both agree with it.
    budget = reduce_step_budget(count, barrier_paced=True)
    held = remaining == 0 or steps >= budget
    rule = 0 if held else min(cap_to_reduce_budget(count, budget, steps), remaining)
    assert window_chunk(count, steps, remaining) == rule
    got = size(count=count, steps_in_window=steps, remaining=remaining, sum_counts=sum_counts)
    assert got == rule


def test_a_barrier_paced_chunk_still_refuses_a_negative_count_or_overshoot() -> None:
    with pytest.raises(LocalProtocolError, match="count"):
        size(count=-1)
    with pytest.raises(LocalProtocolError, match="max_overshoot"):
        size(max_overshoot=-1)
