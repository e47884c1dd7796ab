"""The per-epoch work ledger: which batch is where, so "trained exactly once" is checkable.

Pure module: no I/O, no clock, no threads (docs/design.md §5). Work is counted in WHOLE BATCHES
(drop-last): an epoch of ``epoch_samples`` picks has ``B = epoch_samples // batch_size``
batches, and batch ``b`` covers positions ``[b·bs, (b+1)·bs)`` of the epoch's slice of the
permutation (:mod:`flodl.sampling`). Ranges are half-open :class:`BatchRange` values in batch
units; on the wire a plan is in samples (:func:`to_samples`, :func:`from_samples`).

Rules:
    - One :class:`EpochWork` per epoch is the single source of truth for coverage, for both
      dispatch styles (whole-epoch partitions and progressive chunks). A batch is in exactly one
      place: the unassigned pool, a rank's FIFO queue (assigned, maybe done, not committed), a
      rank's committed set, or (on resume) the part an earlier run already covered.
    - A rank trains its assigned ranges strictly in FIFO order, one batch per step; ``advance``
      beyond what was assigned is a :class:`~flodl.errors.LocalProtocolError` here (the
      coordinator checks a peer's frame before calling it, so reaching it is our own bug).
    - A take whose send fails is rolled back exactly (``rollback_take``, which also undoes the
      last ``assign``): only the rank's most recent grant, with no batch advanced, once.
    - A dead rank forfeits every assigned-but-uncommitted batch, done or not: work whose
      contribution never reached a finalized reduce is not covered. Committed batches stay.
    - ``commit_upto(rank, n)`` takes a cumulative done count, so the coordinator can capture
      ``done(rank)`` at a reduce trigger and commit exactly that at finalize; ``n`` at or below
      ``committed(rank)`` is a no-op, ``n > done(rank)`` raises.
    - ``assign`` of an empty range is a no-op; empty ranges are never queued.
    - ``coverage_report`` audits the ledger at any time: ``duplicates`` counts batches held in
      more than one place, ``missing`` batches held nowhere. Once ``is_done()`` these are
      exactly "committed twice" and "uncovered". ``check_exactly_once`` raises
      :class:`~flodl.errors.CoverageError`.
    - Every operation is ``O(#ranges · log)``: no per-batch lists, so 10^6-batch epochs are
      cheap.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import (  # (at run time: see docs/design.md §2)
    Iterable,
    Sequence,
)
from dataclasses import dataclass, field

from flodl.checks import require_non_negative, require_positive
from flodl.errors import CoverageError, LocalProtocolError

__all__ = [
    "BatchRange",
    "merge_ranges",
    "range_total",
    "to_samples",
    "from_samples",
    "CoverageReport",
    "EpochWork",
]


# ---------------------------------------------------------------------------------------------
# Ranges
# ---------------------------------------------------------------------------------------------


@dataclass(slots=True, order=True, unsafe_hash=True)
class BatchRange:
    """A half-open range ``[start, stop)`` of batch indices within one epoch.

    Immutable (nothing assigns to a range once built; the ledger replaces ranges, and a
    grant is queued as the very object), hashable, but not declared frozen: a finalize builds
    two per live rank, and a frozen dataclass's constructor costs 2.4× a plain one's (the
    reason :class:`~flodl.coord.effects.Send` is not frozen either; docs/design.md §2,
    "Coordinator cost").

    Attributes:
        start: first batch index (inclusive), ``>= 0``.
        stop: one past the last batch index, ``>= start`` (an empty range is allowed).
    """

    start: int
    stop: int

    def __post_init__(self) -> None:
        if self.start < 0 or self.stop < self.start:
            raise LocalProtocolError(f"invalid batch range [{self.start}, {self.stop})")

    @property
    def size(self) -> int:
        """Number of batches in the range."""
        return self.stop - self.start


def _start(rng: BatchRange) -> int:
    return rng.start


def merge_ranges(ranges: Iterable[BatchRange]) -> list[BatchRange]:
    """Sort and coalesce overlapping or adjacent ranges; drop empty ones."""
    out: list[BatchRange] = []
    for rng in sorted(r for r in ranges if r.size > 0):
        if out and rng.start <= out[-1].stop:
            if rng.stop > out[-1].stop:
                out[-1] = BatchRange(out[-1].start, rng.stop)
        else:
            out.append(rng)
    return out


def range_total(ranges: Iterable[BatchRange]) -> int:
    return sum(r.size for r in ranges)


def _joins(
    left_stop: int | None, right_start: int | None, start: int, stop: int
) -> tuple[bool, bool]:
    """Whether ``[start, stop)``, placed between the held range that ends at ``left_stop`` and
    the one that starts at ``right_start`` (None: no such neighbour), merges with each.

    Raises:
        CoverageError: it overlaps either (a batch would be held twice).
    """
    if (left_stop is not None and left_stop > start) or (
        right_start is not None and right_start < stop
    ):
        raise CoverageError(f"range [{start}, {stop}) overlaps batches already held")
    return left_stop == start, right_start == stop


def _insert_disjoint(ranges: list[BatchRange], rng: BatchRange) -> None:
    """Insert ``rng`` into sorted, disjoint, coalesced ``ranges``, merging adjacent neighbours.

    Raises:
        CoverageError: ``rng`` overlaps a range already held (a batch would be held twice).
    """
    if rng.size == 0:
        return
    i = bisect.bisect_left(ranges, rng.start, key=_start)
    left = ranges[i - 1] if i > 0 else None
    right = ranges[i] if i < len(ranges) else None
    merge_left, merge_right = _joins(
        None if left is None else left.stop,
        None if right is None else right.start,
        rng.start,
        rng.stop,
    )
    if left is not None and right is not None and merge_left and merge_right:
        ranges[i - 1] = BatchRange(left.start, right.stop)
        del ranges[i]
    elif left is not None and merge_left:
        ranges[i - 1] = BatchRange(left.start, rng.stop)
    elif right is not None and merge_right:
        ranges[i] = BatchRange(rng.start, right.stop)
    else:
        ranges.insert(i, rng)


def _insert_span(starts: list[int], stops: list[int], start: int, stop: int) -> None:
    """:func:`_insert_disjoint` for ranges kept as two parallel lists of bounds (a rank's
    committed set, which gains a range every cycle: plain ints are not tracked by the garbage
    collector, range objects are, and at thousands of ranks they were most of the heap its
    full passes scan).

    Raises:
        CoverageError: ``[start, stop)`` overlaps a range already held.
    """
    if stop == start:
        return
    if not starts or stops[-1] <= start:  # past every held range: the common case
        if starts and stops[-1] == start:
            stops[-1] = stop
        else:
            starts.append(start)
            stops.append(stop)
        return
    i = bisect.bisect_left(starts, start)
    merge_left, merge_right = _joins(
        stops[i - 1] if i > 0 else None, starts[i] if i < len(starts) else None, start, stop
    )
    if merge_left and merge_right:
        stops[i - 1] = stops[i]
        del starts[i], stops[i]
    elif merge_left:
        stops[i - 1] = stop
    elif merge_right:
        starts[i] = start
    else:
        starts.insert(i, start)
        stops.insert(i, stop)


def _complement(ranges: Sequence[BatchRange], total: int) -> list[BatchRange]:
    """The parts of ``[0, total)`` not in sorted, disjoint ``ranges``."""
    out: list[BatchRange] = []
    cursor = 0
    for rng in ranges:
        if rng.start > cursor:
            out.append(BatchRange(cursor, rng.start))
        cursor = max(cursor, rng.stop)
    if cursor < total:
        out.append(BatchRange(cursor, total))
    return out


def to_samples(rng: BatchRange, batch_size: int) -> tuple[int, int]:
    """Express a batch range as a wire plan ``(offset, size)`` in samples.

    Raises:
        LocalProtocolError: ``batch_size < 1``.
    """
    if batch_size < 1:  # (the check inline: every chunk handed out passes through here)
        require_positive("batch_size", batch_size)
    return rng.start * batch_size, rng.size * batch_size


def from_samples(offset: int, size: int, batch_size: int) -> BatchRange:
    """Read a wire plan ``(offset, size)`` in samples back as a batch range.

    Raises:
        LocalProtocolError: ``batch_size < 1``, a negative value, or an offset or size that is not a
            whole number of batches.
    """
    require_positive("batch_size", batch_size)
    require_non_negative("offset", offset)
    require_non_negative("size", size)
    if offset % batch_size or size % batch_size:
        raise LocalProtocolError(
            f"plan (offset={offset}, size={size}) is not batch-aligned (batch_size={batch_size})"
        )
    start = offset // batch_size
    return BatchRange(start, start + size // batch_size)


# ---------------------------------------------------------------------------------------------
# The per-epoch work ledger
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CoverageReport:
    """An audit of one :class:`EpochWork` ledger.

    Attributes:
        total: batches in the epoch.
        precovered: batches an earlier run already covered (resume), not work of this ledger.
        committed: batches committed in this ledger (summed over ranks).
        duplicates: batches held in more than one place (committed twice, or committed and still
            pending, or overlapping the precovered part); each extra holding counts once.
        missing: batches held nowhere (neither pending, committed nor precovered).
    """

    total: int
    precovered: int
    committed: int
    duplicates: int
    missing: int

    @property
    def ok(self) -> bool:
        """No batch is held twice and none is lost."""
        return self.duplicates == 0 and self.missing == 0


@dataclass(slots=True)
class _RankLedger:
    """One rank's part of the ledger (mutable, private).

    ``queue`` holds the rank's assigned-but-uncommitted ranges in FIFO (training) order; its first
    ``done_open`` batches are done (trained) but not yet committed. The committed set is kept
    as sorted, disjoint, coalesced ranges ``[c_starts[i], c_stops[i])`` (see
    :func:`_insert_span`).
    """

    queue: deque[BatchRange] = field(default_factory=deque)
    queued: int = 0
    done_open: int = 0
    committed_count: int = 0
    c_starts: list[int] = field(default_factory=list)
    c_stops: list[int] = field(default_factory=list)
    last_grant: BatchRange | None = None

    def committed_ranges(self) -> list[BatchRange]:
        return [BatchRange(a, b) for a, b in zip(self.c_starts, self.c_stops, strict=True)]

    def committed_total(self) -> int:
        return sum(self.c_stops) - sum(self.c_starts)


class EpochWork:
    """The per-epoch work ledger: the single source of truth for coverage.

    Used by both dispatch styles: progressive chunks (:meth:`take`) and non-progressive
    partitions (:meth:`assign`, then :func:`split_among` + :meth:`assign` when a rank dies).
    Called only from the coordinator's state machine (one thread).

    Every batch of ``[0, total_batches)`` is in exactly one place: the unassigned pool, one rank's
    queue (assigned; maybe done; not committed), one rank's committed set, or the precovered part
    (batches an earlier run covered, on resume).

    Args:
        epoch: the epoch index.
        total_batches: whole batches in the epoch (:func:`epoch_batches`).
        world_size: number of ranks.
        uncovered: on resume, the only ranges that are work (the checkpoint's coverage block);
            everything else counts as already covered. ``None``: the whole epoch is work.

    Raises:
        LocalProtocolError: bad sizes, or uncovered ranges outside the epoch.
    """

    __slots__ = ("_pool", "_pool_count", "_precovered", "_ranks", "epoch", "total_batches")

    def __init__(
        self,
        epoch: int,
        total_batches: int,
        world_size: int,
        uncovered: Sequence[BatchRange] | None = None,
    ) -> None:
        require_non_negative("epoch", epoch)
        require_non_negative("total_batches", total_batches)
        require_positive("world_size", world_size)
        self.epoch = epoch
        self.total_batches = total_batches
        if uncovered is None:
            self._pool = [BatchRange(0, total_batches)] if total_batches else []
        else:
            self._pool = merge_ranges(uncovered)
            if self._pool and self._pool[-1].stop > total_batches:
                raise LocalProtocolError(
                    f"uncovered range ends at {self._pool[-1].stop}, past the epoch's "
                    f"{total_batches} batches"
                )
        self._pool_count = range_total(self._pool)
        self._precovered = _complement(self._pool, total_batches)
        self._ranks = [_RankLedger() for _ in range(world_size)]

    def __repr__(self) -> str:
        return (
            f"EpochWork(epoch={self.epoch}, total_batches={self.total_batches}, "
            f"remaining={self._pool_count}, pending={[lg.queued for lg in self._ranks]}, "
            f"committed={[lg.committed_count for lg in self._ranks]})"
        )

    # -- helpers --------------------------------------------------------------------------------

    @property
    def world_size(self) -> int:
        """Number of ranks the ledger tracks."""
        return len(self._ranks)

    @property
    def work_batches(self) -> int:
        """Batches this ledger has to cover (the epoch minus the precovered part)."""
        return self.total_batches - range_total(self._precovered)

    def _ledger(self, rank: int) -> _RankLedger:
        if rank >= 0:  # (a negative index would silently read another rank's ledger)
            try:
                return self._ranks[rank]
            except IndexError:
                pass
        raise LocalProtocolError(
            f"rank {rank} out of range (world_size {len(self._ranks)})", rank=rank
        )

    def _grant(self, ledger: _RankLedger, rng: BatchRange) -> None:
        ledger.queue.append(rng)
        ledger.queued += rng.size
        ledger.last_grant = rng

    # -- dispatch -------------------------------------------------------------------------------

    def take(self, rank: int, max_batches: int) -> BatchRange | None:
        """Take the next chunk for ``rank`` from the lowest unassigned range.

        Args:
            rank: the receiving rank.
            max_batches: chunk size wanted, ``>= 1``; the chunk is shorter when the lowest
                unassigned fragment is.

        Returns:
            The range now queued for ``rank`` (FIFO), or ``None`` when nothing is unassigned.

        Raises:
            LocalProtocolError: a bad rank or ``max_batches < 1``.
        """
        ledger = self._ledger(rank)
        if max_batches < 1:
            raise LocalProtocolError(f"max_batches must be >= 1, got {max_batches}", rank=rank)
        pool = self._pool
        if not pool:
            return None
        head = pool[0]
        start, stop = head.start, head.stop
        if stop - start <= max_batches:  # the whole fragment: it moves as it is
            del pool[0]
            rng = head
        else:
            stop = start + max_batches
            rng = BatchRange(start, stop)
            pool[0] = BatchRange(stop, head.stop)
        self._pool_count -= stop - start
        self._grant(ledger, rng)
        return rng

    def assign(self, rank: int, rng: BatchRange) -> None:
        """Queue a specific range for ``rank`` (partitions and ``ExtendPartition``).

        An empty range is a no-op.

        Raises:
            LocalProtocolError: a bad rank, or ``rng`` not entirely within the unassigned pool.
        """
        ledger = self._ledger(rank)
        if rng.size == 0:
            return
        i = bisect.bisect_right(self._pool, rng.start, key=_start) - 1
        if i < 0 or self._pool[i].stop < rng.stop:
            raise LocalProtocolError(
                f"range [{rng.start}, {rng.stop}) of epoch {self.epoch} is not unassigned",
                rank=rank,
            )
        host = self._pool[i]
        pieces = [
            p
            for p in (BatchRange(host.start, rng.start), BatchRange(rng.stop, host.stop))
            if p.size
        ]
        self._pool[i : i + 1] = pieces
        self._pool_count -= rng.size
        self._grant(ledger, rng)

    def rollback_take(self, rank: int, rng: BatchRange) -> None:
        """Undo ``rank``'s last grant exactly (its send failed): the range returns to the pool.

        Works for the last :meth:`take` or :meth:`assign`, once, provided no batch of it was
        advanced.

        Raises:
            LocalProtocolError: ``rng`` is not that rank's last untouched grant.
        """
        ledger = self._ledger(rank)
        untouched = ledger.done_open <= ledger.queued - rng.size
        if ledger.last_grant != rng or not ledger.queue or ledger.queue[-1] != rng or not untouched:
            raise LocalProtocolError(
                f"[{rng.start}, {rng.stop}) is not rank {rank}'s last untouched grant",
                rank=rank,
            )
        ledger.queue.pop()
        ledger.queued -= rng.size
        ledger.last_grant = None
        _insert_disjoint(self._pool, rng)
        self._pool_count += rng.size

    def release(self, rank: int, rng: BatchRange) -> None:
        """Return the untrained end of one of ``rank``'s queued ranges to the pool (the rank
        gave it back: ``revoke_partition``). An empty range is a no-op.

        Raises:
            LocalProtocolError: ``rng`` is not the end of one of the rank's queued ranges, or
                part of it is already done.
        """
        ledger = self._ledger(rank)
        if rng.size == 0:
            return
        before = 0  # batches queued ahead of the range, in training order
        for i, entry in enumerate(ledger.queue):
            if entry.stop == rng.stop and entry.start <= rng.start:
                if before + (rng.start - entry.start) < ledger.done_open:
                    break  # (a batch of it is done)
                if rng.start == entry.start:
                    del ledger.queue[i]
                else:
                    ledger.queue[i] = BatchRange(entry.start, rng.start)
                if ledger.last_grant == entry:
                    ledger.last_grant = None
                ledger.queued -= rng.size
                _insert_disjoint(self._pool, rng)
                self._pool_count += rng.size
                return
            before += entry.size
        raise LocalProtocolError(
            f"[{rng.start}, {rng.stop}) of epoch {self.epoch} is not the untrained end of a "
            f"range queued for rank {rank}",
            rank=rank,
        )

    # -- progress -------------------------------------------------------------------------------

    def advance(self, rank: int, steps: int = 1) -> int:
        """Mark the next ``steps`` batches of ``rank``'s FIFO queue done (trained); return the
        batches it has in flight after them (what :meth:`in_flight` would say, without a
        second call on every trained batch).

        Raises:
            LocalProtocolError: a bad rank, negative ``steps``, or more steps than batches in
                flight (a protocol violation: the coordinator evicts the rank).
        """
        ledger = self._ledger(rank)
        if steps < 0:
            raise LocalProtocolError(f"steps must be >= 0, got {steps}", rank=rank)
        in_flight = ledger.queued - ledger.done_open
        if steps > in_flight:
            raise LocalProtocolError(
                f"rank {rank} reported {steps} steps in epoch {self.epoch} but has only "
                f"{in_flight} batches in flight",
                rank=rank,
            )
        ledger.done_open += steps
        return in_flight - steps

    def commit(self, rank: int) -> None:
        """Commit every done batch of ``rank`` (a reduce including its contribution finalized)."""
        self.commit_upto(rank, self.done(rank))

    def commit_upto(self, rank: int, done_count: int, *, clamp: bool = False) -> None:
        """Commit ``rank``'s batches up to a cumulative done count (e.g. captured at the trigger).

        Afterwards ``committed(rank) == max(committed(rank), done_count)``; a count at or below
        the committed count is a no-op. With ``clamp``, a count above ``done(rank)`` commits
        ``done(rank)`` (a snapshot older than a forfeit or a rejoin that reset the rank's work).

        Raises:
            LocalProtocolError: a bad rank, or ``done_count > done(rank)`` without ``clamp``.
        """
        ledger = self._ledger(rank)
        if done_count > ledger.committed_count + ledger.done_open:
            if clamp:
                done_count = ledger.committed_count + ledger.done_open
            else:
                raise LocalProtocolError(
                    f"cannot commit {done_count} batches of rank {rank}: only "
                    f"{ledger.committed_count + ledger.done_open} done",
                    rank=rank,
                )
        need = done_count - ledger.committed_count
        if need <= 0:
            return
        queue, starts, stops = ledger.queue, ledger.c_starts, ledger.c_stops
        ledger.queued -= need
        ledger.done_open -= need
        ledger.committed_count += need
        while need > 0:
            head = queue[0]
            size = head.stop - head.start
            if need >= size:  # the whole range is committed
                queue.popleft()
                if ledger.last_grant is head:  # (a grant is queued as the very object)
                    ledger.last_grant = None
                _insert_span(starts, stops, head.start, head.stop)
                need -= size
            else:
                queue[0] = BatchRange(head.start + need, head.stop)
                _insert_span(starts, stops, head.start, head.start + need)
                need = 0

    def forfeit(self, rank: int) -> list[BatchRange]:
        """The rank died: every assigned but uncommitted batch returns to the unassigned pool.

        Its committed batches stay covered.

        Returns:
            The returned ranges, merged and sorted.
        """
        ledger = self._ledger(rank)
        returned = merge_ranges(ledger.queue)
        for rng in returned:
            _insert_disjoint(self._pool, rng)
        self._pool_count += ledger.queued
        ledger.queue.clear()
        ledger.queued = 0
        ledger.done_open = 0
        ledger.last_grant = None
        return returned

    # -- queries --------------------------------------------------------------------------------

    def assigned(self, rank: int) -> int:
        """Batches assigned to ``rank`` and not forfeited (committed + pending)."""
        ledger = self._ledger(rank)
        return ledger.committed_count + ledger.queued

    def done(self, rank: int) -> int:
        """Batches ``rank`` has trained (committed + done-uncommitted); cumulative per epoch."""
        ledger = self._ledger(rank)
        return ledger.committed_count + ledger.done_open

    def committed(self, rank: int) -> int:
        """Batches of ``rank`` committed by a finalized reduce."""
        return self._ledger(rank).committed_count

    def in_flight(self, rank: int) -> int:
        """Batches assigned to ``rank`` and not yet trained (assigned − done)."""
        ledger = self._ledger(rank)
        return ledger.queued - ledger.done_open

    def pending(self, rank: int) -> int:
        """Batches assigned to ``rank`` and not yet committed (assigned − committed)."""
        return self._ledger(rank).queued

    def outstanding(self, rank: int) -> list[BatchRange]:
        """``rank``'s untrained ranges, in the FIFO order it trains them."""
        ledger = self._ledger(rank)
        out: list[BatchRange] = []
        skip = ledger.done_open
        for rng in ledger.queue:
            if skip >= rng.size:
                skip -= rng.size
                continue
            out.append(BatchRange(rng.start + skip, rng.stop))
            skip = 0
        return out

    def remaining(self) -> int:
        """Unassigned batches."""
        return self._pool_count

    def unassigned_ranges(self) -> list[BatchRange]:
        """The unassigned pool: sorted, disjoint, coalesced."""
        return list(self._pool)

    def is_done(self) -> bool:
        """Nothing unassigned and every assigned batch committed."""
        return not self._pool and all(not lg.queue for lg in self._ranks)

    def uncovered_ranges(self) -> list[BatchRange]:
        """Unassigned ∪ assigned-not-committed, merged and sorted (a checkpoint's coverage)."""
        held: list[BatchRange] = list(self._pool)
        for ledger in self._ranks:
            held.extend(ledger.queue)
        return merge_ranges(held)

    def precovered_ranges(self) -> list[BatchRange]:
        """Batches an earlier run covered (resume); empty for a fresh epoch."""
        return list(self._precovered)

    def committed_by_rank(self) -> dict[int, list[BatchRange]]:
        """Each rank's committed ranges, sorted; every rank is a key, in rank order."""
        return {r: lg.committed_ranges() for r, lg in enumerate(self._ranks)}

    # -- coverage proof -------------------------------------------------------------------------

    def coverage_report(self) -> CoverageReport:
        """Audit the ledger by sweeping every holding over ``[0, total_batches)``."""
        holdings: list[BatchRange] = [*self._pool, *self._precovered]
        committed = 0
        events: list[tuple[int, int]] = []
        for ledger in self._ranks:
            holdings.extend(ledger.queue)
            for a, b in zip(ledger.c_starts, ledger.c_stops, strict=True):
                events.append((a, 1))
                events.append((b, -1))
            committed += ledger.committed_total()
        for rng in holdings:
            if rng.size:
                events.append((rng.start, 1))
                events.append((rng.stop, -1))
        events.append((0, 0))
        events.append((self.total_batches, 0))
        events.sort()
        duplicates = missing = depth = 0
        prev = 0
        for pos, delta in events:
            span = pos - prev
            if span:
                if depth == 0 and prev < self.total_batches:
                    missing += min(pos, self.total_batches) - prev
                elif depth > 1:
                    duplicates += (depth - 1) * span
            depth += delta
            prev = pos
        return CoverageReport(
            total=self.total_batches,
            precovered=range_total(self._precovered),
            committed=committed,
            duplicates=duplicates,
            missing=missing,
        )

    def check_exactly_once(self) -> None:
        """Prove exactly-once coverage so far.

        Raises:
            CoverageError: a batch is held twice (e.g. committed twice), a batch is lost (when
                :meth:`is_done`, that is "a batch of the work is uncovered"), or the ledger's
                counters disagree with its ranges.
        """
        report = self.coverage_report()
        if not report.ok:
            raise CoverageError(
                f"epoch {self.epoch}: {report.duplicates} batch(es) held twice, "
                f"{report.missing} batch(es) lost ({report})"
            )
        if self._pool_count != range_total(self._pool):
            raise CoverageError(f"epoch {self.epoch}: pool counter {self._pool_count} is stale")
        for r, ledger in enumerate(self._ranks):
            if (
                ledger.queued != range_total(ledger.queue)
                or ledger.committed_count != ledger.committed_total()
                or not 0 <= ledger.done_open <= ledger.queued
            ):
                raise CoverageError(f"epoch {self.epoch}: rank {r} counters are stale")
