"""Pure tests of the per-epoch work ledger, against a per-batch model."""

from __future__ import annotations

import random
from typing import Any

import pytest
from batchranges import R, batches_of, ranges_of
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from flodl.coord.ledger import BatchRange, EpochWork, _insert_span, merge_ranges
from flodl.coord.partition import (
    split_among,
)
from flodl.errors import CoverageError, FlodlError, LocalProtocolError

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
    assert work.advance(0, 4) == 8  # (what is left in flight)
    assert work.outstanding(0) == [R(4, 5), R(20, 23), R(40, 44)]
    assert work.advance(0, 3) == 5  # crosses into the second range
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
    assert work.advance(0, 5) == 0 == work.in_flight(0)
    work.commit_upto(0, 9)  # a reduce that saw 9 done batches
    assert work.committed(0) == 9
    assert work.committed_by_rank()[0] == [R(0, 5), R(20, 23), R(40, 41)]
    work.commit_upto(0, 3)  # stale: no-op
    assert work.committed(0) == 9
    with pytest.raises(LocalProtocolError, match="only 12 done"):
        work.commit_upto(0, 13)
    assert work.committed(0) == 9  # unchanged by the refused commit
    work.commit_upto(0, 13, clamp=True)  # a snapshot above what is done commits what is done
    assert (work.committed(0), work.done(0), work.pending(0)) == (12, 12, 0)
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


def test_release_gives_back_only_the_untrained_end_of_a_queued_range() -> None:
    work = EpochWork(0, 30, 2)
    work.assign(0, R(0, 10))
    work.assign(0, R(20, 30))
    work.advance(0, 4)
    work.commit_upto(0, 2)  # rank 0: committed [0, 2), done [2, 4), untrained [4, 10), [20, 30)
    work.release(0, R(25, 30))
    work.release(0, R(7, 10))
    assert work.outstanding(0) == [R(4, 7), R(20, 25)]
    assert work.unassigned_ranges() == [R(7, 20), R(25, 30)]
    assert (work.pending(0), work.in_flight(0)) == (10, 8)  # [2, 4) done, 8 untrained
    for bad in (R(3, 7), R(20, 24), R(8, 10), R(26, 30)):  # a done batch; not an end; not held
        with pytest.raises(LocalProtocolError):
            work.release(0, bad)
    assert work.outstanding(0) == [R(4, 7), R(20, 25)]  # the refusals changed nothing
    work.release(0, R(4, 7))  # every untrained batch of a range: the range is gone
    assert work.outstanding(0) == [R(20, 25)]
    work.assign(1, R(4, 20))
    work.assign(1, R(25, 30))
    work.check_exactly_once()


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
    with pytest.raises(LocalProtocolError, match="past the epoch"):
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
    ledger.c_starts.insert(0, 3)  # the committed set holds [3, 5) a second time
    ledger.c_stops.insert(0, 5)
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
    lost.c_starts[:], lost.c_stops[:] = [0], [9]
    lost.committed_count = 9
    assert work.is_done()
    with pytest.raises(CoverageError, match="1 batch\\(es\\) lost"):
        work.check_exactly_once()


def test_a_committed_set_kept_as_bounds_merges_and_refuses_overlaps() -> None:
    starts: list[int] = []
    stops: list[int] = []

    def held() -> list[BatchRange]:
        return [R(a, b) for a, b in zip(starts, stops, strict=True)]

    _insert_span(starts, stops, 10, 20)  # into nothing
    _insert_span(starts, stops, 30, 40)  # past every range, not adjacent
    _insert_span(starts, stops, 40, 45)  # past every range, adjacent: merged
    assert held() == [R(10, 20), R(30, 45)]
    _insert_span(starts, stops, 0, 5)  # before every range
    _insert_span(starts, stops, 5, 8)  # merges to its left only
    _insert_span(starts, stops, 25, 30)  # merges to its right only
    assert held() == [R(0, 8), R(10, 20), R(25, 45)]
    _insert_span(starts, stops, 20, 25)  # merges both sides
    _insert_span(starts, stops, 9, 9)  # empty: nothing
    assert held() == [R(0, 8), R(10, 45)]
    for a, b in ((7, 9), (9, 11), (40, 50), (2, 3)):
        with pytest.raises(CoverageError, match="overlaps"):
            _insert_span(starts, stops, a, b)
    assert held() == [R(0, 8), R(10, 45)]  # a refused range changes nothing


def test_the_bounds_form_holds_what_merged_ranges_would() -> None:
    rng = random.Random(3)
    cuts = sorted(rng.sample(range(1, 500), 80))
    pieces = [R(a, b) for a, b in zip([0, *cuts], [*cuts, 500], strict=True)]
    rng.shuffle(pieces)
    starts: list[int] = []
    stops: list[int] = []
    for k, piece in enumerate(pieces, start=1):
        _insert_span(starts, stops, piece.start, piece.stop)
        assert [R(a, b) for a, b in zip(starts, stops, strict=True)] == merge_ranges(pieces[:k])
    assert (starts, stops) == ([0], [500])


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
    """Random take/assign/rollback/release/advance/commit/forfeit against an explicit
    per-batch model."""

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

    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        """The rank gives back the untrained end of its last queued range (a revoke); asking
        for one batch more than is untrained there is refused and changes nothing."""
        rank = self._rank(data)
        tail = self.work.outstanding(rank)
        if not tail:
            queue = self.queue[rank]
            if queue:  # all done: even its last batch cannot be given back
                with pytest.raises(LocalProtocolError):
                    self.work.release(rank, R(queue[-1], queue[-1] + 1))
            return
        last = tail[-1]
        k = data.draw(st.integers(1, last.size + 1))
        if k > last.size:
            if last.start > 0 and last.start - 1 in self.queue[rank]:
                with pytest.raises(LocalProtocolError):
                    self.work.release(rank, R(last.start - 1, last.stop))
            return
        self.work.release(rank, R(last.stop - k, last.stop))
        ids = batches_of([R(last.stop - k, last.stop)])
        assert self.queue[rank][-k:] == ids
        del self.queue[rank][-k:]
        self.pool |= set(ids)
        self.last_grant[rank] = None

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
