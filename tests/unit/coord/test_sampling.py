"""Pure tests of the shared data order: index space, permutation, epoch slices, plans."""

from __future__ import annotations

import itertools

import pytest
from batchranges import R
from hypothesis import given
from hypothesis import strategies as st

from flodl.coord.ledger import from_samples, to_samples
from flodl.errors import LocalProtocolError
from flodl.sampling import (
    SHUFFLE_BASE_SEED,
    epoch_batches,
    epoch_slice,
    index_space,
    permutation,
    pick_to_sample,
    plan_picks,
)

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
    with pytest.raises(LocalProtocolError, match="augment"):
        index_space(10, augment=0)
    with pytest.raises(LocalProtocolError, match="epoch_splits"):
        epoch_slice(0, 10, 0)
    with pytest.raises(LocalProtocolError, match="batch_size"):
        epoch_batches(0, 10, 0)


def test_samples_round_trip_and_plan_picks() -> None:
    rng = R(3, 7)
    assert to_samples(rng, 32) == (96, 128)
    assert from_samples(96, 128, 32) == rng
    assert from_samples(0, 0, 8) == R(0, 0)
    with pytest.raises(LocalProtocolError, match="batch-aligned"):
        from_samples(95, 128, 32)
    with pytest.raises(LocalProtocolError, match="batch-aligned"):
        from_samples(96, 100, 32)
    perm = permutation(40, 0)
    _, start, _ = epoch_slice(1, 40, 2)
    offset, size = to_samples(R(1, 3), 4)
    assert plan_picks(perm, start, offset, size) == perm[24:32]
    with pytest.raises(LocalProtocolError, match="past the permutation"):
        plan_picks(perm, start, 16, 8)


def test_batch_range_rejects_inverted() -> None:
    with pytest.raises(LocalProtocolError, match="invalid batch range"):
        R(5, 4)
    with pytest.raises(LocalProtocolError, match="invalid batch range"):
        R(-1, 4)
    assert R(4, 4).size == 0
