"""Data dispatch arithmetic: index space, partitions, epoch-tail windows and the work ledger.

Pure: no I/O, no clock, no threads. Used by the coordinator (a sans-IO state machine) to decide
who trains which batches, and by rank processes to rebuild the same shuffled permutation without
any broadcast (spec §5).

Units:
    Work is tracked in WHOLE BATCHES (drop-last, as the original progressive pool): an epoch of
    ``epoch_samples`` picks has ``B = epoch_samples // batch_size`` batches, and batch ``b`` covers
    positions ``[b·bs, (b+1)·bs)`` of that epoch's slice of the permutation. Ranges are half-open
    :class:`BatchRange` values in batch units. On the wire a plan is expressed in samples
    (``offset = start·bs``, ``size = (stop − start)·bs``): see :func:`to_samples` and
    :func:`from_samples`.

Rules (spec §5, DESIGN §4 "Single step clock", "Transactional dispatch"):
    - Every process computes the same permutation for a data pass: ``random.Random(seed + pass)``
      shuffles ``range(space)``; ``epoch_splits = s`` cuts a pass into ``s`` epochs.
    - One :class:`EpochWork` per epoch is the single source of truth for coverage, for both
      dispatch styles (non-progressive partitions and progressive chunks). A batch is in exactly
      one place: the unassigned pool, a rank's FIFO queue (assigned, maybe done, not committed),
      a rank's committed set, or (on resume) the part an earlier run already covered.
    - A rank trains its assigned ranges strictly in FIFO order, one batch per step; ``advance``
      beyond what was assigned is a protocol violation (:class:`~flodl.errors.LocalProtocolError`
      here; the coordinator turns it into an eviction).
    - A take whose send fails is rolled back exactly (``rollback_take``); a dead rank forfeits every
      assigned-but-uncommitted batch back to the pool; committed batches stay covered.
    - All ledger operations are ``O(#ranges · log)``: no per-batch lists, so 10^6-batch epochs are
      cheap.

Choices (where the spec is silent or ambiguous; also in ``docs/design-notes-chunks.md``):
    - ``epoch_slice``: when ``space % epoch_splits != 0`` the first ``space % epoch_splits`` slices
      of a pass get one extra pick (the same rule as the equal partition split).
    - Proportional splits (ratios, throughput, final window) use exact rational arithmetic
      (:class:`fractions.Fraction`), so floors never drift with float rounding and every result is
      reproducible bit for bit. A float ratio or speed is read as the decimal it prints as
      (``0.3`` is ``3/10``, not the binary double just below it), so ``[.5, .3, .2]`` of 10
      batches is ``[5, 3, 2]``.
    - ``partition_sizes``: ratios are normalized over *alive* ranks only; if the alive ratios sum to
      0 (or no ratio is positive among survivors) the split falls back to equal. Throughput split is
      used only when every alive rank has a finite ``ms_per_batch > 0``; otherwise equal.
      Remainders go one batch per rank in order of ratio (resp. speed) descending, ties to the
      lowest rank index.
    - ``final_window_alloc``: fastest = largest count (ties: lowest rank); crumb order = count
      ascending (ties: lowest rank), round-robin when the crumb exceeds the non-fastest survivors;
      a lone survivor takes the whole remainder (the only case the fastest is padded). Largest
      remainders are ranked by exact fractional part descending, ties to the lowest rank. If every
      alive count is 0 the window is split equally (remainder to the lowest ranks) and then
      consolidated, so the result still sums to ``rem``. ``rem > 0`` with no alive rank is a
      ``ValueError``.
    - ``chunk_batches``: the final-window slot bypasses the reduce-budget cap (the fold-band crumb
      deliberately runs one batch past a slow rank's budget, as in the original); it is still held
      by the reduce barrier and capped to ``remaining``. A rank whose budget is 0 (count 0 under
      Sync/Cadence) gets 0.
    - ``rollback_take`` also undoes the last ``assign`` (the same transactional rule covers a
      failed ``ExtendPartition`` send); only the rank's most recent grant, with no batch advanced,
      can be rolled back, once.
    - ``commit_upto(rank, n)`` with ``n <= committed(rank)`` is a no-op (commits are monotone);
      ``n > done(rank)`` raises.
    - ``assign`` of an empty range is a no-op; empty ranges are never queued.
    - ``coverage_report`` audits the ledger at any time: ``duplicates`` counts batches held in more
      than one place, ``missing`` counts batches held nowhere (lost). When ``is_done()`` this is
      exactly "committed twice" and "uncovered".
"""

from __future__ import annotations

import bisect
import math
import random
from collections import deque
from dataclasses import dataclass, field
from fractions import Fraction
from typing import TYPE_CHECKING

from flodl.errors import FlodlError, LocalProtocolError

if TYPE_CHECKING:
    from collections.abc import Iterable, Sequence

__all__ = [
    # index space and permutation
    "SHUFFLE_BASE_SEED",
    "BatchRange",
    "index_space",
    "permutation",
    "epoch_slice",
    "epoch_batches",
    "pick_to_sample",
    "plan_picks",
    "to_samples",
    "from_samples",
    # partitions
    "partition_sizes",
    "equal_sizes",
    "ratio_to_sizes",
    "throughput_sizes",
    "partition_ranges",
    "carve_ranges",
    "split_among",
    # epoch tail
    "final_window_due",
    "final_window_alloc",
    "consolidate_lone_ones",
    # ledger
    "CoverageError",
    "CoverageReport",
    "EpochWork",
    # progressive chunk sizing
    "POLICIES",
    "is_barrier_paced",
    "reduce_step_budget",
    "cap_to_reduce_budget",
    "chunk_batches",
]

SHUFFLE_BASE_SEED = 42
"""Default shuffle seed; the permutation of data pass ``p`` uses ``seed + p``."""

POLICIES = ("sync", "cadence", "async")
"""Pacing policies understood by :func:`chunk_batches` (``ApplyPolicy`` values)."""


class CoverageError(FlodlError):
    """The work ledger broke exactly-once coverage (a batch held twice, or lost)."""


# ---------------------------------------------------------------------------------------------
# Ranges
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, order=True)
class BatchRange:
    """A half-open range ``[start, stop)`` of batch indices within one epoch.

    Attributes:
        start: first batch index (inclusive), ``>= 0``.
        stop: one past the last batch index, ``>= start`` (an empty range is allowed).
    """

    start: int
    stop: int

    def __post_init__(self) -> None:
        if self.start < 0 or self.stop < self.start:
            raise ValueError(f"invalid batch range [{self.start}, {self.stop})")

    @property
    def size(self) -> int:
        """Number of batches in the range."""
        return self.stop - self.start


def _start(rng: BatchRange) -> int:
    return rng.start


def _merge(ranges: Iterable[BatchRange]) -> list[BatchRange]:
    """Sort and coalesce overlapping or adjacent ranges; drop empty ones."""
    out: list[BatchRange] = []
    for rng in sorted(r for r in ranges if r.size > 0):
        if out and rng.start <= out[-1].stop:
            if rng.stop > out[-1].stop:
                out[-1] = BatchRange(out[-1].start, rng.stop)
        else:
            out.append(rng)
    return out


def _total(ranges: Iterable[BatchRange]) -> int:
    return sum(r.size for r in ranges)


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
    if (left is not None and left.stop > rng.start) or (
        right is not None and right.start < rng.stop
    ):
        raise CoverageError(f"range [{rng.start}, {rng.stop}) overlaps batches already held")
    merge_left = left is not None and left.stop == rng.start
    merge_right = right is not None and right.start == rng.stop
    if left is not None and right is not None and merge_left and merge_right:
        ranges[i - 1] = BatchRange(left.start, right.stop)
        del ranges[i]
    elif left is not None and merge_left:
        ranges[i - 1] = BatchRange(left.start, rng.stop)
    elif right is not None and merge_right:
        ranges[i] = BatchRange(rng.start, right.stop)
    else:
        ranges.insert(i, rng)


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


# ---------------------------------------------------------------------------------------------
# Index space and permutation (spec §5.1)
# ---------------------------------------------------------------------------------------------


def _check_non_negative(name: str, value: int) -> None:
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")


def _check_positive(name: str, value: int) -> None:
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")


def index_space(dataset_len: int, augment: int = 1) -> int:
    """Size of the pick space: ``dataset_len × augment``.

    Args:
        dataset_len: number of samples in the dataset, ``>= 0``.
        augment: augmented views per sample, ``>= 1``.

    Returns:
        The number of picks a data pass shuffles.

    Raises:
        ValueError: a negative length or ``augment < 1``.
    """
    _check_non_negative("dataset_len", dataset_len)
    _check_positive("augment", augment)
    return dataset_len * augment


def permutation(space: int, data_pass: int, seed: int = SHUFFLE_BASE_SEED) -> list[int]:
    """The shuffled pick order of one data pass, identical on every process.

    ``random.Random(seed + data_pass)`` shuffles ``range(space)``; an int seed makes the result
    stable across processes and Python runs.

    Args:
        space: pick-space size (:func:`index_space`), ``>= 0``.
        data_pass: data-pass index, ``>= 0``.
        seed: base shuffle seed (read from the checkpoint coverage block on resume).

    Returns:
        A permutation of ``range(space)``.

    Raises:
        ValueError: a negative ``space`` or ``data_pass``.
    """
    _check_non_negative("space", space)
    _check_non_negative("data_pass", data_pass)
    picks = list(range(space))
    random.Random(seed + data_pass).shuffle(picks)
    return picks


def epoch_slice(epoch: int, space: int, epoch_splits: int = 1) -> tuple[int, int, int]:
    """Where epoch ``epoch`` lives in the permutations.

    Epoch ``e`` is slice ``e % s`` of data pass ``e // s``; the ``s`` slices of a pass tile
    ``[0, space)`` and differ in size by at most one pick (the first ``space % s`` are longer).

    Args:
        epoch: epoch index, ``>= 0``.
        space: pick-space size, ``>= 0``.
        epoch_splits: epochs per data pass ``s``, ``>= 1``.

    Returns:
        ``(data_pass, start, stop)``: the epoch covers positions ``[start, stop)`` of
        ``permutation(space, data_pass)``.

    Raises:
        ValueError: a negative argument or ``epoch_splits < 1``.
    """
    _check_non_negative("epoch", epoch)
    _check_non_negative("space", space)
    _check_positive("epoch_splits", epoch_splits)
    data_pass, k = divmod(epoch, epoch_splits)
    base, extra = divmod(space, epoch_splits)
    start = k * base + min(k, extra)
    stop = start + base + (1 if k < extra else 0)
    return data_pass, start, stop


def epoch_batches(epoch: int, space: int, batch_size: int, epoch_splits: int = 1) -> int:
    """Whole batches in epoch ``epoch`` (drop-last): ``epoch_samples // batch_size``.

    Args:
        epoch: epoch index, ``>= 0``.
        space: pick-space size, ``>= 0``.
        batch_size: samples per batch, ``>= 1``.
        epoch_splits: epochs per data pass, ``>= 1``.

    Returns:
        The number of batches ``B`` of the epoch's :class:`EpochWork`.
    """
    _check_positive("batch_size", batch_size)
    _, start, stop = epoch_slice(epoch, space, epoch_splits)
    return (stop - start) // batch_size


def pick_to_sample(pick: int, augment: int) -> tuple[int, int]:
    """Map a pick to ``(sample, view)``: ``(pick // augment, pick % augment)``.

    Raises:
        ValueError: a negative pick or ``augment < 1``.
    """
    _check_non_negative("pick", pick)
    _check_positive("augment", augment)
    return divmod(pick, augment)


def plan_picks(perm: Sequence[int], epoch_start: int, offset: int, size: int) -> list[int]:
    """The picks a wire plan names: ``perm[epoch_start + offset : epoch_start + offset + size]``.

    Args:
        perm: the data pass's :func:`permutation`.
        epoch_start: the epoch's ``start`` from :func:`epoch_slice`.
        offset: plan offset in samples, relative to the epoch start.
        size: plan size in samples.

    Returns:
        The picks, in training order.

    Raises:
        ValueError: a negative argument, or a plan reaching past the permutation.
    """
    _check_non_negative("epoch_start", epoch_start)
    _check_non_negative("offset", offset)
    _check_non_negative("size", size)
    lo = epoch_start + offset
    if lo + size > len(perm):
        raise ValueError(f"plan [{lo}, {lo + size}) reaches past the permutation ({len(perm)})")
    return list(perm[lo : lo + size])


def to_samples(rng: BatchRange, batch_size: int) -> tuple[int, int]:
    """Express a batch range as a wire plan ``(offset, size)`` in samples.

    Raises:
        ValueError: ``batch_size < 1``.
    """
    _check_positive("batch_size", batch_size)
    return rng.start * batch_size, rng.size * batch_size


def from_samples(offset: int, size: int, batch_size: int) -> BatchRange:
    """Read a wire plan ``(offset, size)`` in samples back as a batch range.

    Raises:
        ValueError: ``batch_size < 1``, a negative value, or an offset or size that is not a
            whole number of batches.
    """
    _check_positive("batch_size", batch_size)
    _check_non_negative("offset", offset)
    _check_non_negative("size", size)
    if offset % batch_size or size % batch_size:
        raise ValueError(
            f"plan (offset={offset}, size={size}) is not batch-aligned (batch_size={batch_size})"
        )
    start = offset // batch_size
    return BatchRange(start, start + size // batch_size)


# ---------------------------------------------------------------------------------------------
# Partitions (spec §5.2, §5.5)
# ---------------------------------------------------------------------------------------------


def _alive_ranks(world_size: int, alive: Sequence[bool]) -> list[int]:
    _check_positive("world_size", world_size)
    if len(alive) != world_size:
        raise ValueError(f"alive has {len(alive)} entries, world_size is {world_size}")
    return [r for r in range(world_size) if alive[r]]


def _require_someone(total: int, ranks: Sequence[int]) -> None:
    if total > 0 and not ranks:
        raise ValueError(f"{total} batches to split but no rank is alive")


def equal_sizes(total_batches: int, world_size: int, *, alive: Sequence[bool]) -> list[int]:
    """Equal split of ``total_batches`` over alive ranks, remainder to the first alive ranks.

    Raises:
        ValueError: bad arguments, or work with no alive rank.
    """
    _check_non_negative("total_batches", total_batches)
    ranks = _alive_ranks(world_size, alive)
    _require_someone(total_batches, ranks)
    sizes = [0] * world_size
    if not ranks:
        return sizes
    base, extra = divmod(total_batches, len(ranks))
    for i, r in enumerate(ranks):
        sizes[r] = base + (1 if i < extra else 0)
    return sizes


def _decimal(value: float) -> Fraction:
    """A finite float read as the decimal it prints as (``0.3`` is exactly ``3/10``)."""
    return Fraction(repr(float(value)))


def _weighted_sizes(
    total: int, weights: dict[int, Fraction], order: Sequence[int], world_size: int
) -> list[int]:
    """Floor of ``total·w/Σw`` per rank, the remainder one batch each in ``order``."""
    sizes = [0] * world_size
    weight_sum = sum(weights.values(), Fraction(0))
    for r, w in weights.items():
        sizes[r] = math.floor(total * w / weight_sum)
    leftover = total - sum(sizes)
    i = 0
    while leftover > 0:
        sizes[order[i % len(order)]] += 1
        leftover -= 1
        i += 1
    return sizes


def ratio_to_sizes(
    total_batches: int, ratios: Sequence[float], *, alive: Sequence[bool]
) -> list[int]:
    """Split by explicit ratios: normalize over alive ranks, floor, remainder to largest ratios.

    Ties in ratio go to the lowest rank. If the alive ratios sum to 0 the split is equal.

    Raises:
        ValueError: a length mismatch, a negative or non-finite ratio, or work with no alive rank.
    """
    _check_non_negative("total_batches", total_batches)
    world_size = len(ratios)
    ranks = _alive_ranks(world_size, alive)
    _require_someone(total_batches, ranks)
    for r, ratio in enumerate(ratios):
        if not math.isfinite(ratio) or ratio < 0:
            raise ValueError(f"ratio of rank {r} must be finite and >= 0, got {ratio}")
    weights = {r: _decimal(ratios[r]) for r in ranks}
    if sum(weights.values(), Fraction(0)) == 0:
        return equal_sizes(total_batches, world_size, alive=alive)
    order = sorted(ranks, key=lambda r: (-weights[r], r))
    return _weighted_sizes(total_batches, weights, order, world_size)


def throughput_sizes(
    total_batches: int, ms_per_batch: Sequence[float], *, alive: Sequence[bool]
) -> list[int]:
    """Split by throughput (``1/ms`` shares), floor, remainder to the fastest ranks.

    Ties in speed go to the lowest rank.

    Raises:
        ValueError: a length mismatch, an alive rank without a finite positive speed, or work with
            no alive rank.
    """
    _check_non_negative("total_batches", total_batches)
    world_size = len(ms_per_batch)
    ranks = _alive_ranks(world_size, alive)
    _require_someone(total_batches, ranks)
    for r in ranks:
        ms = ms_per_batch[r]
        if not math.isfinite(ms) or ms <= 0:
            raise ValueError(f"ms_per_batch of rank {r} must be finite and > 0, got {ms}")
    weights = {r: 1 / _decimal(ms_per_batch[r]) for r in ranks}
    order = sorted(ranks, key=lambda r: (-weights[r], r))
    return _weighted_sizes(total_batches, weights, order, world_size)


def partition_sizes(
    total_batches: int,
    world_size: int,
    *,
    alive: Sequence[bool],
    ms_per_batch: Sequence[float] | None = None,
    ratios: Sequence[float] | None = None,
    proportional: bool = False,
) -> list[int]:
    """Per-rank partition sizes, in batches, of a non-progressive epoch (spec §5.2).

    Priority: explicit ``ratios`` (:func:`ratio_to_sizes`); else, when ``proportional`` and every
    alive rank has a known speed (``ms_per_batch`` finite and ``> 0``), the throughput split
    (:func:`throughput_sizes`); else the equal split (:func:`equal_sizes`).

    Args:
        total_batches: batches to split, ``>= 0``.
        world_size: number of ranks.
        alive: per-rank liveness; dead ranks get 0.
        ms_per_batch: smoothed per-rank ms per batch (ElChe), or ``None`` when unknown.
        ratios: ``partition_ratios`` from the config, or ``None``.
        proportional: the policy sizes by throughput (Cadence/Async, calibrated or hinted).

    Returns:
        ``world_size`` sizes summing exactly to ``total_batches``.

    Raises:
        ValueError: inconsistent lengths, bad values, or work with no alive rank.
    """
    _check_non_negative("total_batches", total_batches)
    ranks = _alive_ranks(world_size, alive)
    if ratios is not None:
        if len(ratios) != world_size:
            raise ValueError(f"ratios has {len(ratios)} entries, world_size is {world_size}")
        return ratio_to_sizes(total_batches, ratios, alive=alive)
    if proportional and ms_per_batch is not None:
        if len(ms_per_batch) != world_size:
            raise ValueError(
                f"ms_per_batch has {len(ms_per_batch)} entries, world_size is {world_size}"
            )
        known = bool(ranks) and all(
            math.isfinite(ms_per_batch[r]) and ms_per_batch[r] > 0 for r in ranks
        )
        if known:
            return throughput_sizes(total_batches, ms_per_batch, alive=alive)
    return equal_sizes(total_batches, world_size, alive=alive)


def partition_ranges(sizes: Sequence[int], start: int = 0) -> list[BatchRange]:
    """Consecutive ranges of the given sizes, rank order, beginning at batch ``start``.

    Raises:
        ValueError: a negative size or start.
    """
    _check_non_negative("start", start)
    out: list[BatchRange] = []
    cursor = start
    for size in sizes:
        _check_non_negative("size", size)
        out.append(BatchRange(cursor, cursor + size))
        cursor += size
    return out


def carve_ranges(ranges: Iterable[BatchRange], sizes: Sequence[int]) -> list[list[BatchRange]]:
    """Cut the (merged, sorted) ``ranges`` into consecutive pieces of the given sizes.

    Piece ``i`` is the next ``sizes[i]`` batches in batch order; it is a list because it may span
    several disjoint ranges. Use it to lay a partition over non-contiguous work (resume, or the
    work a dead rank returned).

    Returns:
        One list of ranges per size, each summing to that size.

    Raises:
        ValueError: a negative size, or sizes summing past the batches available.
    """
    merged = _merge(ranges)
    available = _total(merged)
    for size in sizes:
        _check_non_negative("size", size)
    if sum(sizes) > available:
        raise ValueError(f"sizes sum to {sum(sizes)} but only {available} batches are available")
    out: list[list[BatchRange]] = []
    idx, offset = 0, 0  # current range and position within it
    for size in sizes:
        pieces: list[BatchRange] = []
        need = size
        while need > 0:
            rng = merged[idx]
            take = min(need, rng.size - offset)
            pieces.append(BatchRange(rng.start + offset, rng.start + offset + take))
            need -= take
            offset += take
            if offset == rng.size:
                idx, offset = idx + 1, 0
        out.append(pieces)
    return out


def split_among(
    ranges: Iterable[BatchRange], alive_ranks: Iterable[int]
) -> list[tuple[int, BatchRange]]:
    """Split returned work equally among survivors (spec §5.5, non-progressive path).

    Survivors are taken in ascending rank order; each gets ``n // k`` batches, the first
    ``n % k`` one more, as consecutive pieces of the sorted work. The coordinator then passes
    each piece to :meth:`EpochWork.assign` and sends one ``ExtendPartition`` per piece.

    Args:
        ranges: the work to split (e.g. what :meth:`EpochWork.forfeit` returned).
        alive_ranks: the surviving ranks.

    Returns:
        ``(rank, piece)`` pairs, sorted by rank then batch; ranks with a 0 share are absent.

    Raises:
        ValueError: work to split but no survivor, or a negative rank.
    """
    merged = _merge(ranges)
    ranks = sorted(set(alive_ranks))
    if ranks and ranks[0] < 0:
        raise ValueError(f"negative rank {ranks[0]}")
    n = _total(merged)
    if n == 0:
        return []
    if not ranks:
        raise ValueError(f"{n} batches to split but no survivor")
    base, extra = divmod(n, len(ranks))
    sizes = [base + (1 if i < extra else 0) for i in range(len(ranks))]
    return [
        (rank, piece)
        for rank, pieces in zip(ranks, carve_ranges(merged, sizes), strict=True)
        for piece in pieces
    ]


# ---------------------------------------------------------------------------------------------
# Epoch tail (spec §5.4)
# ---------------------------------------------------------------------------------------------


def _check_counts(counts: Sequence[int], alive: Sequence[bool]) -> None:
    if len(counts) != len(alive):
        raise ValueError(f"counts has {len(counts)} entries, alive has {len(alive)}")
    for r, c in enumerate(counts):
        if c < 0:
            raise ValueError(f"count of rank {r} must be >= 0, got {c}")


def final_window_due(rem: int, counts: Sequence[int], alive: Sequence[bool]) -> bool:
    """Whether the remainder is a final window: ``0 < rem < Σcounts_alive + W`` (barrier-paced).

    ``W`` is the world size (``len(counts)``), as in the spec.
    """
    _check_counts(counts, alive)
    total = sum(c for c, a in zip(counts, alive, strict=True) if a)
    return 0 < rem < total + len(counts)


def consolidate_lone_ones(alloc: Sequence[int], alive: Sequence[bool]) -> list[int]:
    """Repair lone-1 allocations: a rank with exactly 1 batch gives it to the smallest ≥1 peer.

    Repeats while some alive rank holds exactly 1 (lowest rank first) and another alive rank
    holds ``>= 1`` (smallest such, ties to the lowest rank). A lone 1 with no such peer is left
    as is (irreducible). The sum is unchanged.

    Returns:
        A new allocation list.
    """
    out = list(alloc)
    if len(out) != len(alive):
        raise ValueError(f"alloc has {len(out)} entries, alive has {len(alive)}")
    while True:
        orphan = next((r for r in range(len(out)) if alive[r] and out[r] == 1), None)
        if orphan is None:
            return out
        peers = [p for p in range(len(out)) if p != orphan and alive[p] and out[p] >= 1]
        if not peers:
            return out
        peer = min(peers, key=lambda p: (out[p], p))
        out[peer] += 1
        out[orphan] = 0


def final_window_alloc(rem: int, counts: Sequence[int], alive: Sequence[bool]) -> list[int]:
    """Allocate an epoch's final reduce window of ``rem`` batches (spec §5.4).

    Fold band (``rem >= Σcounts_alive``): every alive rank gets its count, then the crumb
    ``rem − Σ`` goes one batch per rank to the slowest (smallest count, ties to the lowest rank)
    alive ranks other than the fastest (largest count, ties to the lowest rank), round-robin if the
    crumb outnumbers them; the fastest is never padded unless it is the only survivor.

    Proportional sub-window (``rem < Σcounts_alive``): largest-remainder split of ``rem`` over the
    alive counts (exact fractions; ties to the lowest rank), then :func:`consolidate_lone_ones`.

    Args:
        rem: batches left in the epoch, ``>= 0``.
        counts: the live ElChe schedule ``batch_counts``.
        alive: per-rank liveness; dead ranks get 0.

    Returns:
        Per-rank slots summing exactly to ``rem``.

    Raises:
        ValueError: a length mismatch, a negative value, or ``rem > 0`` with no alive rank.
    """
    _check_non_negative("rem", rem)
    _check_counts(counts, alive)
    world = len(counts)
    alloc = [0] * world
    ranks = [r for r in range(world) if alive[r]]
    _require_someone(rem, ranks)
    if rem == 0:
        return alloc
    total = sum(counts[r] for r in ranks)
    if total == 0:
        base, extra = divmod(rem, len(ranks))
        for i, r in enumerate(ranks):
            alloc[r] = base + (1 if i < extra else 0)
        return consolidate_lone_ones(alloc, alive)

    if rem >= total:
        for r in ranks:
            alloc[r] = counts[r]
        crumb = rem - total
        fastest = max(ranks, key=lambda r: (counts[r], -r))
        order = sorted((r for r in ranks if r != fastest), key=lambda r: (counts[r], r))
        if not order:
            alloc[fastest] += crumb
            return alloc
        for i in range(crumb):
            alloc[order[i % len(order)]] += 1
        return alloc

    fracs: list[tuple[Fraction, int]] = []
    for r in ranks:
        whole, part = divmod(rem * counts[r], total)
        alloc[r] = whole
        fracs.append((Fraction(part, total), r))
    fracs.sort(key=lambda fr: (-fr[0], fr[1]))
    leftover = rem - sum(alloc)
    for i in range(leftover):
        alloc[fracs[i % len(fracs)][1]] += 1
    return consolidate_lone_ones(alloc, alive)


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
    ``done_open`` batches are done (trained) but not yet committed.
    """

    queue: deque[BatchRange] = field(default_factory=deque)
    queued: int = 0
    done_open: int = 0
    committed_count: int = 0
    committed: list[BatchRange] = field(default_factory=list)
    last_grant: BatchRange | None = None


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
        ValueError: bad sizes, or uncovered ranges outside the epoch.
    """

    __slots__ = ("_pool", "_pool_count", "_precovered", "_ranks", "epoch", "total_batches")

    def __init__(
        self,
        epoch: int,
        total_batches: int,
        world_size: int,
        uncovered: Sequence[BatchRange] | None = None,
    ) -> None:
        _check_non_negative("epoch", epoch)
        _check_non_negative("total_batches", total_batches)
        _check_positive("world_size", world_size)
        self.epoch = epoch
        self.total_batches = total_batches
        if uncovered is None:
            self._pool = [BatchRange(0, total_batches)] if total_batches else []
        else:
            self._pool = _merge(uncovered)
            if self._pool and self._pool[-1].stop > total_batches:
                raise ValueError(
                    f"uncovered range ends at {self._pool[-1].stop}, past the epoch's "
                    f"{total_batches} batches"
                )
        self._pool_count = _total(self._pool)
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
        return self.total_batches - _total(self._precovered)

    def _ledger(self, rank: int) -> _RankLedger:
        if not 0 <= rank < len(self._ranks):
            raise LocalProtocolError(
                f"rank {rank} out of range (world_size {len(self._ranks)})", rank=rank
            )
        return self._ranks[rank]

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
        if not self._pool:
            return None
        head = self._pool[0]
        rng = BatchRange(head.start, min(head.stop, head.start + max_batches))
        if rng.stop == head.stop:
            del self._pool[0]
        else:
            self._pool[0] = BatchRange(rng.stop, head.stop)
        self._pool_count -= rng.size
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

    # -- progress -------------------------------------------------------------------------------

    def advance(self, rank: int, steps: int = 1) -> None:
        """Mark the next ``steps`` batches of ``rank``'s FIFO queue done (trained).

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

    def commit(self, rank: int) -> None:
        """Commit every done batch of ``rank`` (a reduce including its contribution finalized)."""
        self.commit_upto(rank, self.done(rank))

    def commit_upto(self, rank: int, done_count: int) -> None:
        """Commit ``rank``'s batches up to a cumulative done count (e.g. captured at the trigger).

        Afterwards ``committed(rank) == max(committed(rank), done_count)``; a count at or below
        the committed count is a no-op.

        Raises:
            LocalProtocolError: a bad rank, or ``done_count > done(rank)``.
        """
        ledger = self._ledger(rank)
        if done_count > ledger.committed_count + ledger.done_open:
            raise LocalProtocolError(
                f"cannot commit {done_count} batches of rank {rank}: only "
                f"{ledger.committed_count + ledger.done_open} done",
                rank=rank,
            )
        need = done_count - ledger.committed_count
        while need > 0:
            head = ledger.queue[0]
            n = min(need, head.size)
            if n == head.size:
                ledger.queue.popleft()
                if ledger.last_grant == head:
                    ledger.last_grant = None
            else:
                ledger.queue[0] = BatchRange(head.start + n, head.stop)
            _insert_disjoint(ledger.committed, BatchRange(head.start, head.start + n))
            ledger.queued -= n
            ledger.done_open -= n
            ledger.committed_count += n
            need -= n

    def forfeit(self, rank: int) -> list[BatchRange]:
        """The rank died: every assigned but uncommitted batch returns to the unassigned pool.

        Its committed batches stay covered.

        Returns:
            The returned ranges, merged and sorted.
        """
        ledger = self._ledger(rank)
        returned = _merge(ledger.queue)
        for rng in returned:
            _insert_disjoint(self._pool, rng)
        self._pool_count += ledger.queued
        ledger.queue.clear()
        ledger.queued = 0
        ledger.done_open = 0
        ledger.last_grant = None
        return returned

    split_among = staticmethod(split_among)

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
        return _merge(held)

    def precovered_ranges(self) -> list[BatchRange]:
        """Batches an earlier run covered (resume); empty for a fresh epoch."""
        return list(self._precovered)

    def committed_by_rank(self) -> dict[int, list[BatchRange]]:
        """Each rank's committed ranges, sorted; every rank is a key, in rank order."""
        return {r: list(lg.committed) for r, lg in enumerate(self._ranks)}

    # -- coverage proof -------------------------------------------------------------------------

    def coverage_report(self) -> CoverageReport:
        """Audit the ledger by sweeping every holding over ``[0, total_batches)``."""
        holdings: list[BatchRange] = [*self._pool, *self._precovered]
        committed = 0
        for ledger in self._ranks:
            holdings.extend(ledger.queue)
            holdings.extend(ledger.committed)
            committed += _total(ledger.committed)
        events: list[tuple[int, int]] = []
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
            precovered=_total(self._precovered),
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
        if self._pool_count != _total(self._pool):
            raise CoverageError(f"epoch {self.epoch}: pool counter {self._pool_count} is stale")
        for r, ledger in enumerate(self._ranks):
            if (
                ledger.queued != _total(ledger.queue)
                or ledger.committed_count != _total(ledger.committed)
                or not 0 <= ledger.done_open <= ledger.queued
            ):
                raise CoverageError(f"epoch {self.epoch}: rank {r} counters are stale")


# ---------------------------------------------------------------------------------------------
# Progressive chunk sizing (spec §5.3)
# ---------------------------------------------------------------------------------------------


def _check_policy(policy: str) -> None:
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")


def is_barrier_paced(policy: str) -> bool:
    """Sync and Cadence never hand a rank a step crossing a reduce or epoch barrier."""
    _check_policy(policy)
    return policy != "async"


def reduce_step_budget(policy: str, count: int, max_overshoot: int = 0) -> int:
    """Steps a rank may take between reduces: ``count``, plus ``max_overshoot`` under Async."""
    _check_policy(policy)
    _check_non_negative("count", count)
    _check_non_negative("max_overshoot", max_overshoot)
    return count if is_barrier_paced(policy) else count + max_overshoot


def cap_to_reduce_budget(sized: int, budget: int, steps_in_window: int) -> int:
    """``min(sized, max(1, budget − steps_in_window))``: a chunk lands on the reduce boundary."""
    return min(sized, max(1, budget - steps_in_window))


def chunk_batches(
    *,
    policy: str,
    count: int,
    steps_in_window: int,
    remaining: int,
    sum_counts: int,
    final_slot: int | None,
    max_overshoot: int = 0,
    calibrated: bool,
    world_size: int,
    total_batches: int,
    min_chunk_batches: int = 1,
) -> int:
    """Size of a rank's next progressive chunk, in batches (spec §5.3 ``compute_chunk_batches``).

    Holds (returns 0) when nothing is unassigned or the reduce barrier is reached
    (``steps_in_window >= reduce_step_budget``). Otherwise, in priority order:

    1. a pinned final-window slot (:func:`final_window_alloc`): ``min(slot, remaining)``, exempt
       from the budget cap;
    2. edge schedule, ``remaining < sum_counts``: ``min(count, remaining)``;
    3. barrier-paced (Sync/Cadence): ``min(count, remaining)``: one chunk = one reduce window;
    4. Async uncalibrated: probe ``max(total_batches // (world_size·10), 4)``;
    5. Async calibrated: ``max(ceil(remaining·count / sum_counts), min_chunk_batches)``
       (``min_chunk_batches`` when ``sum_counts`` is 0);

    each of 2–5 capped with :func:`cap_to_reduce_budget` and to ``remaining``.

    Args:
        policy: ``"sync"``, ``"cadence"`` or ``"async"``.
        count: the rank's ``batch_counts[r]`` (pre-calibration: the anchor).
        steps_in_window: steps the rank took since the last reduce.
        remaining: unassigned batches of the pool (:meth:`EpochWork.remaining`).
        sum_counts: ``Σ batch_counts`` over alive ranks.
        final_slot: the rank's slot in the pinned final-window plan, or ``None``.
        max_overshoot: Async overshoot budget.
        calibrated: ElChe is calibrated or has a speed hint.
        world_size: number of ranks.
        total_batches: batches of the epoch.
        min_chunk_batches: floor of the Async calibrated chunk.

    Returns:
        Batches to take for the rank; 0 to hold.

    Raises:
        ValueError: an unknown policy or a negative/invalid value.
    """
    for name, value in (
        ("steps_in_window", steps_in_window),
        ("remaining", remaining),
        ("sum_counts", sum_counts),
        ("total_batches", total_batches),
    ):
        _check_non_negative(name, value)
    _check_positive("world_size", world_size)
    _check_positive("min_chunk_batches", min_chunk_batches)
    if final_slot is not None:
        _check_non_negative("final_slot", final_slot)
    budget = reduce_step_budget(policy, count, max_overshoot)
    if remaining == 0 or steps_in_window >= budget:
        return 0
    if final_slot is not None:
        return min(final_slot, remaining)
    if (sum_counts > 0 and remaining < sum_counts) or is_barrier_paced(policy):
        sized = count
    elif not calibrated:
        sized = max(total_batches // (world_size * 10), 4)
    elif sum_counts == 0:
        sized = min_chunk_batches
    else:
        sized = max(-(-remaining * count // sum_counts), min_chunk_batches)
    return min(cap_to_reduce_budget(sized, budget, steps_in_window), remaining)
