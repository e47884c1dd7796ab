"""Batch-range helpers shared by the ledger, partition and sampling tests."""

from __future__ import annotations

from collections.abc import Iterable

from flodl.coord.ledger import BatchRange

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
