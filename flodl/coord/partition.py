"""How work is sized and split: partitions, the epoch's final window, progressive chunks.

Pure module: no I/O, no clock (docs/design.md §5). The coordinator's dispatch asks these
functions *how much* each rank gets; :mod:`flodl.coord.ledger` records *which* batches it got.

Choices (where the original is silent or ambiguous):
    - Proportional splits (ratios, throughput, final window) use exact rational arithmetic
      (:class:`fractions.Fraction`), so floors never drift with float rounding and every result
      is reproducible bit for bit. A float ratio or speed is read as the decimal it prints as
      (``0.3`` is ``3/10``, not the binary double just below it), so ``[.5, .3, .2]`` of 10
      batches is ``[5, 3, 2]``.
    - ``partition_sizes``: ratios are normalized over *alive* ranks only; if the alive ratios
      sum to 0 (or no ratio is positive among survivors) the split falls back to equal.
      Throughput split is used only when every alive rank has a finite ``ms_per_batch > 0``;
      otherwise equal. Remainders go one batch per rank in order of ratio (resp. speed)
      descending, ties to the lowest rank index.
    - ``final_window_alloc``: fastest = largest count (ties: lowest rank); crumb order = count
      ascending (ties: lowest rank), round-robin when the crumb exceeds the non-fastest
      survivors; a lone survivor takes the whole remainder (the only case the fastest is
      padded). Largest remainders are ranked by exact fractional part descending, ties to the
      lowest rank. If every alive count is 0 the window is split equally (remainder to the
      lowest ranks) and then consolidated, so the result still sums to ``rem``. ``rem > 0``
      with no alive rank is a :class:`~flodl.errors.LocalProtocolError`.
    - ``chunk_batches``: the final-window slot bypasses the reduce-budget cap (the fold-band
      crumb deliberately runs one batch past a slow rank's budget, as in the original); it is
      still held by the reduce barrier and capped to ``remaining``. A rank whose budget is 0
      (count 0 under Sync/Cadence) gets 0.
"""

from __future__ import annotations

import math
from collections.abc import (  # (at run time: see docs/design.md §2)
    Iterable,
    Sequence,
)
from fractions import Fraction

from flodl.checks import require_non_negative, require_positive
from flodl.coord.ledger import BatchRange, merge_ranges, range_total
from flodl.errors import LocalProtocolError

__all__ = [
    "partition_sizes",
    "equal_sizes",
    "ratio_to_sizes",
    "throughput_sizes",
    "partition_ranges",
    "carve_ranges",
    "split_among",
    "final_window_due",
    "final_window_alloc",
    "consolidate_lone_ones",
    "reduce_step_budget",
    "cap_to_reduce_budget",
    "chunk_batches",
    "window_chunk",
]


# ---------------------------------------------------------------------------------------------
# Partitions (docs/design.md §5)
# ---------------------------------------------------------------------------------------------


def _alive_ranks(world_size: int, alive: Sequence[bool]) -> list[int]:
    require_positive("world_size", world_size)
    if len(alive) != world_size:
        raise LocalProtocolError(f"alive has {len(alive)} entries, world_size is {world_size}")
    return [r for r in range(world_size) if alive[r]]


def _require_someone(total: int, ranks: Sequence[int]) -> None:
    if total > 0 and not ranks:
        raise LocalProtocolError(f"{total} batches to split but no rank is alive")


def equal_sizes(total_batches: int, world_size: int, *, alive: Sequence[bool]) -> list[int]:
    """Equal split of ``total_batches`` over alive ranks, remainder to the first alive ranks.

    Raises:
        LocalProtocolError: bad arguments, or work with no alive rank.
    """
    require_non_negative("total_batches", total_batches)
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
        LocalProtocolError: a length mismatch, a negative or non-finite ratio, or work with
            no alive rank.
    """
    require_non_negative("total_batches", total_batches)
    world_size = len(ratios)
    ranks = _alive_ranks(world_size, alive)
    _require_someone(total_batches, ranks)
    for r, ratio in enumerate(ratios):
        if not math.isfinite(ratio) or ratio < 0:
            raise LocalProtocolError(f"ratio of rank {r} must be finite and >= 0, got {ratio}")
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
        LocalProtocolError: a length mismatch, an alive rank without a finite positive speed,
            or work with no alive rank.
    """
    require_non_negative("total_batches", total_batches)
    world_size = len(ms_per_batch)
    ranks = _alive_ranks(world_size, alive)
    _require_someone(total_batches, ranks)
    for r in ranks:
        ms = ms_per_batch[r]
        if not math.isfinite(ms) or ms <= 0:
            raise LocalProtocolError(f"ms_per_batch of rank {r} must be finite and > 0, got {ms}")
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
    """Per-rank partition sizes, in batches, of a non-progressive epoch (docs/design.md §5).

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
        LocalProtocolError: inconsistent lengths, bad values, or work with no alive rank.
    """
    require_non_negative("total_batches", total_batches)
    ranks = _alive_ranks(world_size, alive)
    if ratios is not None:
        if len(ratios) != world_size:
            raise LocalProtocolError(
                f"ratios has {len(ratios)} entries, world_size is {world_size}"
            )
        return ratio_to_sizes(total_batches, ratios, alive=alive)
    if proportional and ms_per_batch is not None:
        if len(ms_per_batch) != world_size:
            raise LocalProtocolError(
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
        LocalProtocolError: a negative size or start.
    """
    require_non_negative("start", start)
    out: list[BatchRange] = []
    cursor = start
    for size in sizes:
        require_non_negative("size", size)
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
        LocalProtocolError: a negative size, or sizes summing past the batches available.
    """
    merged = merge_ranges(ranges)
    available = range_total(merged)
    for size in sizes:
        require_non_negative("size", size)
    if sum(sizes) > available:
        raise LocalProtocolError(
            f"sizes sum to {sum(sizes)} but only {available} batches are available"
        )
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
    """Split returned work equally among survivors (docs/design.md §5, non-progressive path).

    Survivors are taken in ascending rank order; each gets ``n // k`` batches, the first
    ``n % k`` one more, as consecutive pieces of the sorted work. The coordinator then passes
    each piece to :meth:`~flodl.coord.ledger.EpochWork.assign` and sends one
    ``ExtendPartition`` per piece.

    Args:
        ranges: the work to split (what :meth:`~flodl.coord.ledger.EpochWork.forfeit`
            returned).
        alive_ranks: the surviving ranks.

    Returns:
        ``(rank, piece)`` pairs, sorted by rank then batch; ranks with a 0 share are absent.

    Raises:
        LocalProtocolError: work to split but no survivor, or a negative rank.
    """
    merged = merge_ranges(ranges)
    ranks = sorted(set(alive_ranks))
    if ranks and ranks[0] < 0:
        raise LocalProtocolError(f"negative rank {ranks[0]}")
    n = range_total(merged)
    if n == 0:
        return []
    if not ranks:
        raise LocalProtocolError(f"{n} batches to split but no survivor")
    base, extra = divmod(n, len(ranks))
    sizes = [base + (1 if i < extra else 0) for i in range(len(ranks))]
    return [
        (rank, piece)
        for rank, pieces in zip(ranks, carve_ranges(merged, sizes), strict=True)
        for piece in pieces
    ]


# ---------------------------------------------------------------------------------------------
# Epoch tail (docs/design.md §5)
# ---------------------------------------------------------------------------------------------


def _check_counts(counts: Sequence[int], alive: Sequence[bool]) -> None:
    if len(counts) != len(alive):
        raise LocalProtocolError(f"counts has {len(counts)} entries, alive has {len(alive)}")
    for r, c in enumerate(counts):
        if c < 0:
            raise LocalProtocolError(f"count of rank {r} must be >= 0, got {c}")


def final_window_due(rem: int, counts: Sequence[int], alive: Sequence[bool]) -> bool:
    """Whether the remainder is a final window: ``0 < rem < Σcounts_alive + W`` (barrier-paced).

    ``W`` is the world size (``len(counts)``), as in the original.
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
        raise LocalProtocolError(f"alloc has {len(out)} entries, alive has {len(alive)}")
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
    """Allocate an epoch's final reduce window of ``rem`` batches (docs/design.md §5).

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
        LocalProtocolError: a length mismatch, a negative value, or ``rem > 0`` with no alive rank.
    """
    require_non_negative("rem", rem)
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
# Progressive chunk sizing
# ---------------------------------------------------------------------------------------------


def reduce_step_budget(count: int, max_overshoot: int = 0, *, barrier_paced: bool) -> int:
    """Steps a rank may take between reduces: ``count``, plus ``max_overshoot`` when the mode
    is not barrier-paced (Async)."""
    if count < 0 or max_overshoot < 0:  # (the checks inline: the dispatcher asks per chunk)
        require_non_negative("count", count)
        require_non_negative("max_overshoot", max_overshoot)
    return count if barrier_paced else count + max_overshoot


def cap_to_reduce_budget(sized: int, budget: int, steps_in_window: int) -> int:
    """``min(sized, max(1, budget − steps_in_window))``: a chunk lands on the reduce boundary."""
    return min(sized, max(1, budget - steps_in_window))


def window_chunk(count: int, steps_in_window: int, remaining: int) -> int:
    """A barrier-paced rank's next chunk outside the epoch's final window: the rest of its
    window's count, at most what is unassigned; 0 to hold (the window is trained, or nothing
    is unassigned). :func:`chunk_batches` rules 2 and 3 with the budget cap, which coincide
    when the mode is barrier-paced: the dispatcher calls this directly for every rank of a
    finalize (docs/design.md §2, "Coordinator cost")."""
    if remaining <= 0 or steps_in_window >= count:
        return 0
    rest = count - steps_in_window
    return rest if rest < remaining else remaining  # (min(remaining, rest), 8× cheaper)


def chunk_batches(
    *,
    barrier_paced: bool,
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
    checked: bool = True,
) -> int:
    """Size of a rank's next progressive chunk, in batches (the original's
    ``compute_chunk_batches``; docs/design.md §5).

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
        barrier_paced: the mode never hands a step across a reduce barrier (Sync, Cadence);
            one chunk is then one reduce window.
        count: the rank's ``batch_counts[r]`` (pre-calibration: the anchor).
        steps_in_window: steps the rank took since the last reduce.
        remaining: unassigned batches of the pool (:meth:`~flodl.coord.ledger.EpochWork.remaining`).
        sum_counts: ``Σ batch_counts`` over alive ranks.
        final_slot: the rank's slot in the pinned final-window plan, or ``None``.
        max_overshoot: the overshoot budget (ignored when barrier-paced).
        calibrated: ElChe is calibrated or has a speed hint.
        world_size: number of ranks.
        total_batches: batches of the epoch.
        min_chunk_batches: floor of the Async calibrated chunk.
        checked: validate the arguments; the dispatcher's hot path passes False, since it reads
            every one from its own ledger and cohort, where they hold by construction (the
            simulator checks the ledger after every step).

    Returns:
        Batches to take for the rank; 0 to hold.

    Raises:
        LocalProtocolError: a negative or invalid value.
    """
    if checked:
        for name, value in (
            ("steps_in_window", steps_in_window),
            ("remaining", remaining),
            ("sum_counts", sum_counts),
            ("total_batches", total_batches),
        ):
            require_non_negative(name, value)
        require_positive("world_size", world_size)
        require_positive("min_chunk_batches", min_chunk_batches)
        if final_slot is not None:
            require_non_negative("final_slot", final_slot)
    budget = reduce_step_budget(count, max_overshoot, barrier_paced=barrier_paced)
    if barrier_paced and final_slot is None:  # (rules 2 and 3 coincide; the budget is the count)
        return window_chunk(budget, steps_in_window, remaining)
    if remaining == 0 or steps_in_window >= budget:
        return 0
    if final_slot is not None:
        return min(final_slot, remaining)
    if (sum_counts > 0 and remaining < sum_counts) or barrier_paced:
        sized = count
    elif not calibrated:
        sized = max(total_batches // (world_size * 10), 4)
    elif sum_counts == 0:
        sized = min_chunk_batches
    else:
        sized = max(-(-remaining * count // sum_counts), min_chunk_batches)
    return min(cap_to_reduce_budget(sized, budget, steps_in_window), remaining)
