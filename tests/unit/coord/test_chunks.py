"""Pure tests of data dispatch: index space, partitions, epoch tail, ledger, chunk sizing."""

from __future__ import annotations

import itertools
import random
from typing import TYPE_CHECKING, Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from flodl.coord.chunks import (
    SHUFFLE_BASE_SEED,
    BatchRange,
    CoverageError,
    EpochWork,
    carve_ranges,
    chunk_batches,
    consolidate_lone_ones,
    epoch_batches,
    epoch_slice,
    equal_sizes,
    final_window_alloc,
    final_window_due,
    from_samples,
    index_space,
    partition_ranges,
    partition_sizes,
    permutation,
    pick_to_sample,
    plan_picks,
    ratio_to_sizes,
    split_among,
    to_samples,
)
from flodl.errors import FlodlError, LocalProtocolError

if TYPE_CHECKING:
    from collections.abc import Iterable

R = BatchRange


def batches_of(ranges: Iterable[BatchRange]) -> list[int]:
    """Expand ranges to batch ids (small test sizes only)."""
    return [b for rng in ranges for b in range(rng.start, rng.stop)]


def ranges_of(batches: Iterable[int]) -> list[BatchRange]:
    """Coalesce batch ids into sorted ranges."""
    out: list[BatchRange] = []
    for b in sorted(batches):
        if out and out[-1].stop == b:
            out[-1] = R(out[-1].start, b + 1)
        else:
            out.append(R(b, b + 1))
    return out


# ---------------------------------------------------------------------------------------------
# Index space and permutation
# ---------------------------------------------------------------------------------------------


def test_permutation_is_pinned_across_runs() -> None:
    # random.Random(int) + shuffle is stable across processes and Python versions.
    assert SHUFFLE_BASE_SEED == 42
    assert permutation(10, 0) == [7, 3, 2, 8, 5, 6, 9, 4, 0, 1]
    assert permutation(10, 1) == [8, 1, 5, 6, 9, 7, 3, 2, 4, 0]
    assert permutation(12, 3, seed=7) == [11, 8, 4, 2, 5, 3, 1, 10, 7, 6, 0, 9]


@given(space=st.integers(0, 500), data_pass=st.integers(0, 50), seed=st.integers(0, 2**31))
def test_permutation_is_deterministic_permutation(space: int, data_pass: int, seed: int) -> None:
    perm = permutation(space, data_pass, seed)
    assert perm == permutation(space, data_pass, seed)
    assert sorted(perm) == list(range(space))


def test_permutation_differs_per_pass_and_seed() -> None:
    assert permutation(100, 0) != permutation(100, 1)
    assert permutation(100, 0, seed=1) == permutation(100, 1, seed=0)  # seed + pass
    assert permutation(100, 0, seed=1) != permutation(100, 0)


@given(
    space=st.integers(0, 1000),
    splits=st.integers(1, 7),
    data_pass=st.integers(0, 3),
)
def test_epoch_slices_tile_the_pass(space: int, splits: int, data_pass: int) -> None:
    slices = [epoch_slice(data_pass * splits + k, space, splits) for k in range(splits)]
    assert all(p == data_pass for p, _, _ in slices)
    assert slices[0][1] == 0
    assert slices[-1][2] == space
    for (_, _, stop), (_, start, _) in itertools.pairwise(slices):
        assert stop == start
    sizes = [stop - start for _, start, stop in slices]
    assert max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)  # the longer slices come first


def test_epoch_slice_and_batches_examples() -> None:
    assert epoch_slice(0, 10) == (0, 0, 10)
    assert epoch_slice(3, 10) == (3, 0, 10)
    assert epoch_slice(5, 10, 3) == (1, 7, 10)  # 10 = 4 + 3 + 3
    assert epoch_slice(3, 10, 3) == (1, 0, 4)
    assert epoch_batches(0, 1000, 32) == 31  # drop-last
    assert epoch_batches(1, 1000, 32, epoch_splits=2) == 15  # 500 // 32


def test_index_space_and_picks() -> None:
    assert index_space(100) == 100
    assert index_space(100, augment=3) == 300
    assert pick_to_sample(7, 3) == (2, 1)
    assert pick_to_sample(7, 1) == (7, 0)
    with pytest.raises(ValueError, match="augment"):
        index_space(10, augment=0)
    with pytest.raises(ValueError, match="epoch_splits"):
        epoch_slice(0, 10, 0)
    with pytest.raises(ValueError, match="batch_size"):
        epoch_batches(0, 10, 0)


def test_samples_round_trip_and_plan_picks() -> None:
    rng = R(3, 7)
    assert to_samples(rng, 32) == (96, 128)
    assert from_samples(96, 128, 32) == rng
    assert from_samples(0, 0, 8) == R(0, 0)
    with pytest.raises(ValueError, match="batch-aligned"):
        from_samples(95, 128, 32)
    with pytest.raises(ValueError, match="batch-aligned"):
        from_samples(96, 100, 32)
    perm = permutation(40, 0)
    _, start, _ = epoch_slice(1, 40, 2)
    offset, size = to_samples(R(1, 3), 4)
    assert plan_picks(perm, start, offset, size) == perm[24:32]
    with pytest.raises(ValueError, match="past the permutation"):
        plan_picks(perm, start, 16, 8)


def test_batch_range_rejects_inverted() -> None:
    with pytest.raises(ValueError, match="invalid batch range"):
        R(5, 4)
    with pytest.raises(ValueError, match="invalid batch range"):
        R(-1, 4)
    assert R(4, 4).size == 0


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
    with pytest.raises(ValueError, match="ratio of rank 1"):
        ratio_to_sizes(5, [1.0, -1.0], alive=[True, True])


def test_partition_rejects_bad_inputs() -> None:
    with pytest.raises(ValueError, match="no rank is alive"):
        partition_sizes(3, 2, alive=[False, False])
    with pytest.raises(ValueError, match="alive has"):
        partition_sizes(3, 2, alive=[True])
    with pytest.raises(ValueError, match="ratios has"):
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
    with pytest.raises(ValueError, match="only 8 batches"):
        carve_ranges(work, [5, 4])
    # 8 batches among 3 survivors: 3, 3, 2, lowest ranks first, contiguous pieces
    assert split_among(work, [4, 0, 2]) == [
        (0, R(10, 13)),
        (2, R(20, 23)),
        (4, R(23, 25)),
    ]
    assert split_among([R(0, 1)], [3, 1]) == [(1, R(0, 1))]
    assert split_among([], []) == []
    with pytest.raises(ValueError, match="no survivor"):
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
    with pytest.raises(ValueError, match="no rank is alive"):
        final_window_alloc(3, [3, 3], [False, False])
    with pytest.raises(ValueError, match="counts has"):
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
# EpochWork
# ---------------------------------------------------------------------------------------------


def test_take_walks_the_pool_and_rollback_restores_it_exactly() -> None:
    work = EpochWork(epoch=0, total_batches=100, world_size=2)
    assert work.take(0, 30) == R(0, 30)
    before = work.unassigned_ranges()
    got = work.take(1, 30)
    assert got == R(30, 60)
    assert work.remaining() == 40
    assert work.in_flight(1) == 30
    work.rollback_take(1, got)
    assert work.unassigned_ranges() == before == [R(30, 100)]
    assert work.remaining() == 70
    assert (work.assigned(1), work.in_flight(1), work.pending(1)) == (0, 0, 0)
    # the very same chunk can be taken again
    assert work.take(1, 30) == R(30, 60)
    work.check_exactly_once()


def test_rollback_rejects_anything_but_the_last_untouched_take() -> None:
    work = EpochWork(0, 100, 2)
    first = work.take(0, 10)
    second = work.take(0, 10)
    assert first is not None
    assert second is not None
    with pytest.raises(LocalProtocolError, match="last untouched grant"):
        work.rollback_take(0, first)
    with pytest.raises(LocalProtocolError, match="last untouched grant"):
        work.rollback_take(1, second)
    work.advance(0, 11)  # one step into `second`
    with pytest.raises(LocalProtocolError, match="last untouched grant") as exc:
        work.rollback_take(0, second)
    assert exc.value.rank == 0
    third = work.take(0, 5)
    assert third is not None
    work.rollback_take(0, third)
    with pytest.raises(LocalProtocolError):
        work.rollback_take(0, third)  # once
    work.check_exactly_once()


def test_take_returns_short_fragments_and_none_when_drained() -> None:
    work = EpochWork(0, 10, 2, uncovered=[R(0, 2), R(5, 10)])
    assert work.take(0, 4) == R(0, 2)  # a fragment smaller than asked
    assert work.take(1, 4) == R(5, 9)
    assert work.take(0, 4) == R(9, 10)
    assert work.take(1, 4) is None
    with pytest.raises(LocalProtocolError, match="max_batches"):
        work.take(0, 0)
    with pytest.raises(LocalProtocolError, match="out of range"):
        work.take(2, 1)


def test_fifo_advance_across_several_ranges_and_commit() -> None:
    work = EpochWork(0, 60, 2)
    work.assign(0, R(0, 5))
    work.assign(0, R(20, 23))
    work.assign(0, R(40, 44))
    work.advance(0, 4)
    assert work.outstanding(0) == [R(4, 5), R(20, 23), R(40, 44)]
    work.advance(0, 3)  # crosses into the second range
    assert work.outstanding(0) == [R(22, 23), R(40, 44)]
    assert (work.done(0), work.in_flight(0), work.committed(0), work.pending(0)) == (7, 5, 0, 12)
    work.commit(0)
    assert work.committed_by_rank()[0] == [R(0, 5), R(20, 22)]
    assert (work.done(0), work.in_flight(0), work.committed(0), work.pending(0)) == (7, 5, 7, 5)
    assert work.uncovered_ranges() == [R(5, 20), R(22, 60)]
    with pytest.raises(LocalProtocolError, match="only 5 batches in flight") as exc:
        work.advance(0, 6)
    assert exc.value.rank == 0
    assert work.done(0) == 7  # unchanged by the refused advance
    work.advance(0, 5)
    work.commit_upto(0, 9)  # a reduce that saw 9 done batches
    assert work.committed(0) == 9
    assert work.committed_by_rank()[0] == [R(0, 5), R(20, 23), R(40, 41)]
    work.commit_upto(0, 3)  # stale: no-op
    assert work.committed(0) == 9
    with pytest.raises(LocalProtocolError, match="only 12 done"):
        work.commit_upto(0, 13)
    work.commit(0)
    assert work.pending(0) == 0
    assert work.committed_by_rank() == {0: [R(0, 5), R(20, 23), R(40, 44)], 1: []}
    work.check_exactly_once()


def test_assign_must_lie_in_the_pool() -> None:
    work = EpochWork(0, 20, 2)
    work.assign(0, R(5, 10))
    assert work.unassigned_ranges() == [R(0, 5), R(10, 20)]
    with pytest.raises(LocalProtocolError, match="not unassigned"):
        work.assign(1, R(8, 12))
    with pytest.raises(LocalProtocolError, match="not unassigned"):
        work.assign(1, R(18, 21))
    work.assign(1, R(7, 7))  # empty: no-op
    work.assign(1, R(0, 5))
    work.assign(1, R(10, 20))
    assert work.remaining() == 0
    assert not work.is_done()
    work.check_exactly_once()


def test_forfeit_returns_exactly_the_uncommitted_work() -> None:
    work = EpochWork(0, 50, 3)
    for r, size in ((0, 10), (1, 10), (2, 10), (0, 10)):
        work.take(r, size)
    work.advance(0, 15)
    work.commit_upto(0, 12)  # 12 committed, 3 done-uncommitted, 5 untrained
    # rank 0 holds [0, 10) and [30, 40): committed [0, 10) + [30, 32), done [32, 35)
    returned = work.forfeit(0)
    assert returned == [R(32, 40)]
    assert work.committed_by_rank()[0] == [R(0, 10), R(30, 32)]
    assert (work.assigned(0), work.done(0), work.pending(0), work.in_flight(0)) == (12, 12, 0, 0)
    assert work.unassigned_ranges() == [R(32, 50)]
    assert work.remaining() == 18
    # non-progressive repair: survivors split the returned work and extend their partitions
    for rank, piece in split_among(returned, [1, 2]):
        work.assign(rank, piece)
    assert work.outstanding(1) == [R(10, 20), R(32, 36)]
    assert work.outstanding(2) == [R(20, 30), R(36, 40)]
    work.check_exactly_once()
    for r in (1, 2):
        work.advance(r, work.in_flight(r))
        work.commit(r)
    work.assign(1, R(40, 50))
    work.advance(1, 10)
    work.commit(1)
    assert work.is_done()
    work.check_exactly_once()
    covered = sorted(b for rs in work.committed_by_rank().values() for b in batches_of(rs))
    assert covered == list(range(50))


def test_resume_from_uncovered_ranges() -> None:
    uncovered = [R(40, 60), R(10, 20), R(15, 25)]  # unsorted, overlapping: merged
    work = EpochWork(3, 100, 2, uncovered=uncovered)
    assert work.unassigned_ranges() == [R(10, 25), R(40, 60)]
    assert work.precovered_ranges() == [R(0, 10), R(25, 40), R(60, 100)]
    assert work.work_batches == 35
    assert work.uncovered_ranges() == [R(10, 25), R(40, 60)]
    while (got := work.take(0, 8)) is not None:
        work.advance(0, got.size)
    work.commit(0)
    assert work.is_done()
    work.check_exactly_once()
    report = work.coverage_report()
    assert (report.total, report.precovered, report.committed) == (100, 65, 35)
    assert report.ok
    assert work.uncovered_ranges() == []
    with pytest.raises(ValueError, match="past the epoch"):
        EpochWork(0, 10, 1, uncovered=[R(5, 11)])


def test_check_exactly_once_catches_a_double_commit_and_a_lost_batch() -> None:
    assert issubclass(CoverageError, FlodlError)
    work = EpochWork(0, 10, 2)
    work.take(0, 5)
    work.take(1, 5)
    for r in (0, 1):
        work.advance(r, 5)
        work.commit(r)
    work.check_exactly_once()
    ledger: Any = work._ranks[1]  # corrupt the audit target on purpose
    ledger.committed.insert(0, R(3, 5))
    ledger.committed_count += 2
    report = work.coverage_report()
    assert (report.duplicates, report.missing) == (2, 0)
    with pytest.raises(CoverageError, match="2 batch\\(es\\) held twice"):
        work.check_exactly_once()

    work = EpochWork(0, 10, 1)
    work.take(0, 10)
    work.advance(0, 10)
    work.commit(0)
    lost: Any = work._ranks[0]
    lost.committed[:] = [R(0, 9)]
    lost.committed_count = 9
    assert work.is_done()
    with pytest.raises(CoverageError, match="1 batch\\(es\\) lost"):
        work.check_exactly_once()


def test_large_epoch_operations_are_range_based() -> None:
    total = 1_000_000
    work = EpochWork(0, total, 4)
    rng = random.Random(0)
    rounds = 0
    alive = [0, 1, 2, 3]
    while work.remaining():
        for rank in alive:
            got = work.take(rank, rng.randrange(500, 5000))
            if got is not None:
                work.advance(rank, got.size - (1 if rounds % 7 == 0 else 0))
        if rounds == 50:
            returned = work.forfeit(3)
            alive.remove(3)
            assert sum(r.size for r in returned) > 0
        for rank in range(3):
            work.commit(rank)
        rounds += 1
    for rank in range(3):
        work.advance(rank, work.in_flight(rank))
        work.commit(rank)
    assert work.is_done()
    work.check_exactly_once()
    by_rank = work.committed_by_rank()
    assert sum(work.committed(r) for r in range(4)) == total
    # committed ranges coalesce: the ledger stays proportional to ranges, not batches
    assert sum(len(v) for v in by_rank.values()) < 2000


# ---------------------------------------------------------------------------------------------
# A random schedule against a per-batch model
# ---------------------------------------------------------------------------------------------


class LedgerMachine(RuleBasedStateMachine):
    """Random take/assign/rollback/advance/commit/forfeit against an explicit per-batch model."""

    def __init__(self) -> None:
        super().__init__()
        self.work = EpochWork(0, 0, 1)
        self.total = 0
        self.world = 1
        self.pool: set[int] = set()
        self.work_set: set[int] = set()
        self.queue: list[list[int]] = []
        self.done: list[int] = []
        self.committed: list[list[int]] = []
        self.last_grant: list[list[int] | None] = []
        self.alive: list[bool] = []

    @initialize(
        total=st.integers(0, 60),
        world=st.integers(1, 4),
        resume=st.none() | st.sets(st.integers(0, 59)),
    )
    def setup(self, total: int, world: int, resume: set[int] | None) -> None:
        self.total, self.world = total, world
        if resume is None:
            self.work = EpochWork(0, total, world)
            self.pool = set(range(total))
        else:
            self.pool = {b for b in resume if b < total}
            self.work = EpochWork(0, total, world, uncovered=ranges_of(self.pool))
        self.work_set = set(self.pool)
        self.queue = [[] for _ in range(world)]
        self.done = [0] * world
        self.committed = [[] for _ in range(world)]
        self.last_grant = [None] * world
        self.alive = [True] * world

    def _rank(self, data: st.DataObject) -> int:
        return data.draw(st.sampled_from([r for r in range(self.world) if self.alive[r]]))

    def _grant(self, rank: int, rng: BatchRange) -> None:
        ids = batches_of([rng])
        assert set(ids) <= self.pool
        self.pool -= set(ids)
        self.queue[rank].extend(ids)
        self.last_grant[rank] = ids

    @rule(data=st.data(), size=st.integers(1, 12))
    def take(self, data: st.DataObject, size: int) -> None:
        rank = self._rank(data)
        got = self.work.take(rank, size)
        if not self.pool:
            assert got is None
            return
        assert got is not None
        low = min(self.pool)
        run = low
        while run + 1 in self.pool and run + 1 < low + size:
            run += 1
        assert got == R(low, run + 1)
        self._grant(rank, got)

    @precondition(lambda self: bool(self.pool))
    @rule(data=st.data())
    def assign(self, data: st.DataObject) -> None:
        rank = self._rank(data)
        start = data.draw(st.sampled_from(sorted(self.pool)))
        stop = start + 1
        limit = data.draw(st.integers(1, 10))
        while stop in self.pool and stop - start < limit:
            stop += 1
        self.work.assign(rank, R(start, stop))
        self._grant(rank, R(start, stop))

    @rule(data=st.data())
    def rollback(self, data: st.DataObject) -> None:
        rank = self._rank(data)
        ids, queue = self.last_grant[rank], self.queue[rank]
        valid = (
            ids is not None
            and len(queue) >= len(ids)
            and queue[len(queue) - len(ids) :] == ids
            and self.done[rank] <= len(queue) - len(ids)
        )
        if valid and ids is not None:
            self.work.rollback_take(rank, R(ids[0], ids[-1] + 1))
            del queue[len(queue) - len(ids) :]
            self.pool |= set(ids)
            self.last_grant[rank] = None
        else:
            tail = self.work.outstanding(rank)
            probe = tail[-1] if tail else R(0, 1)
            with pytest.raises(LocalProtocolError):
                self.work.rollback_take(rank, probe)

    @rule(data=st.data())
    def advance(self, data: st.DataObject) -> None:
        rank = self._rank(data)
        in_flight = len(self.queue[rank]) - self.done[rank]
        steps = data.draw(st.integers(0, in_flight + 1))
        if steps > in_flight:
            with pytest.raises(LocalProtocolError):
                self.work.advance(rank, steps)
            return
        self.work.advance(rank, steps)
        self.done[rank] += steps

    @rule(data=st.data())
    def commit(self, data: st.DataObject) -> None:
        rank = self._rank(data)
        upto = data.draw(st.integers(0, self.done[rank]))
        self.work.commit_upto(rank, len(self.committed[rank]) + upto)
        self.committed[rank].extend(self.queue[rank][:upto])
        del self.queue[rank][:upto]
        self.done[rank] -= upto

    @precondition(lambda self: sum(self.alive) > 1)
    @rule(data=st.data())
    def kill(self, data: st.DataObject) -> None:
        rank = self._rank(data)
        returned = self.work.forfeit(rank)
        assert returned == ranges_of(self.queue[rank])
        self.pool |= set(self.queue[rank])
        self.queue[rank] = []
        self.done[rank] = 0
        self.last_grant[rank] = None
        self.alive[rank] = False

    @invariant()
    def ledger_matches_model(self) -> None:
        work = self.work
        assert work.remaining() == len(self.pool)
        assert work.unassigned_ranges() == ranges_of(self.pool)
        pending = {b for q in self.queue for b in q}
        assert work.uncovered_ranges() == ranges_of(self.pool | pending)
        for r in range(self.world):
            assert work.committed(r) == len(self.committed[r])
            assert work.done(r) == len(self.committed[r]) + self.done[r]
            assert work.pending(r) == len(self.queue[r])
            assert batches_of(work.outstanding(r)) == self.queue[r][self.done[r] :]
            assert work.committed_by_rank()[r] == ranges_of(self.committed[r])
        work.check_exactly_once()

    def teardown(self) -> None:
        # survivors finish the epoch; dead ranks take no part
        work = self.work
        survivors = [r for r in range(self.world) if self.alive[r]]
        for _ in range(self.total + 1):
            for r in survivors:
                work.take(r, 3)
                work.advance(r, work.in_flight(r))
                work.commit(r)
            if work.is_done():
                break
        assert work.is_done()
        work.check_exactly_once()
        seen: list[int] = []
        for ranges in work.committed_by_rank().values():
            seen.extend(batches_of(ranges))
        assert sorted(seen) == sorted(self.work_set)  # every batch of the work exactly once


LedgerMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestLedgerMachine = LedgerMachine.TestCase


# ---------------------------------------------------------------------------------------------
# Progressive chunk sizing
# ---------------------------------------------------------------------------------------------


def size(**overrides: Any) -> int:
    args: dict[str, Any] = {
        "policy": "cadence",
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
    assert size(policy="sync", steps_in_window=12) == 0
    assert size(policy="async", steps_in_window=12, max_overshoot=3) > 0
    assert size(policy="async", steps_in_window=13, max_overshoot=3) == 0
    assert size(count=0) == 0  # Sync/Cadence budget 0
    assert size(steps_in_window=10, final_slot=5) == 0  # the barrier holds the slot too


def test_chunk_final_slot_first_and_exempt_from_the_budget() -> None:
    assert size(final_slot=11, remaining=40) == 11  # fold-band crumb: count + 1
    assert size(final_slot=11, remaining=7) == 7
    assert size(final_slot=0) == 0
    assert size(policy="async", final_slot=3, calibrated=False) == 3


def test_chunk_edge_schedule() -> None:
    assert size(remaining=25, count=10, sum_counts=30) == 10
    assert size(remaining=8, count=10, sum_counts=30) == 8
    assert size(remaining=25, count=10, steps_in_window=4) == 6  # budget cap
    # Async edge: share-capped, no min_chunk floor, no proportional split
    assert (
        size(policy="async", remaining=25, count=10, min_chunk_batches=20, max_overshoot=50) == 10
    )


def test_chunk_barrier_paced_one_window_per_chunk() -> None:
    assert size(policy="cadence", count=7) == 7
    assert size(policy="sync", count=7, calibrated=False) == 7
    assert size(policy="cadence", count=7, steps_in_window=5) == 2


def test_chunk_async_probe_and_calibrated() -> None:
    # uncalibrated probe: max(total / (W·10), 4)
    assert size(policy="async", calibrated=False, count=100, sum_counts=200) == 50
    assert size(policy="async", calibrated=False, count=100, total_batches=60, sum_counts=200) == 4
    assert size(policy="async", calibrated=False, count=30, sum_counts=60, max_overshoot=5) == 35
    # calibrated: max(ceil(remaining·count/Σ), min_chunk), capped by count + max_overshoot
    assert size(policy="async", count=30, sum_counts=70, max_overshoot=1000) == 429
    assert size(policy="async", count=30, sum_counts=70, max_overshoot=20) == 50
    assert (
        size(
            policy="async",
            count=1,
            remaining=100,
            sum_counts=60,
            min_chunk_batches=8,
            max_overshoot=10,
        )
        == 8
    )
    assert size(policy="async", count=30, sum_counts=70, steps_in_window=25, max_overshoot=20) == 25


def test_chunk_rejects_unknown_policy() -> None:
    with pytest.raises(ValueError, match="policy"):
        size(policy="lockstep")
    with pytest.raises(ValueError, match="remaining"):
        size(remaining=-1)


@given(
    policy=st.sampled_from(["sync", "cadence", "async"]),
    count=st.integers(0, 50),
    steps=st.integers(0, 60),
    remaining=st.integers(0, 500),
    extra=st.integers(0, 100),
    overshoot=st.integers(0, 10),
    calibrated=st.booleans(),
)
def test_chunk_never_crosses_the_budget_or_the_pool(
    policy: str,
    count: int,
    steps: int,
    remaining: int,
    extra: int,
    overshoot: int,
    calibrated: bool,
) -> None:
    got = size(
        policy=policy,
        count=count,
        steps_in_window=steps,
        remaining=remaining,
        sum_counts=count + extra,
        max_overshoot=overshoot,
        calibrated=calibrated,
    )
    budget = count + (overshoot if policy == "async" else 0)
    assert 0 <= got <= remaining
    assert got <= max(0, budget - steps)
    if remaining and steps < budget:
        assert got >= 1 or count == 0
