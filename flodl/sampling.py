"""The shuffled order of the data, identical on every process (docs/design.md §5).

Pure module: no I/O, no clock. Every process (the coordinator, every rank, the single-device
loop) computes the same permutation of a data pass from the seed alone, so a plan on the wire
is only an ``(offset, size)`` into it and nothing is ever broadcast:

* the pick space is ``dataset_len × augment`` (:func:`index_space`); pick ``p`` is view
  ``p % augment`` of sample ``p // augment`` (:func:`pick_to_sample`);
* data pass ``p`` is ``random.Random(seed + p)`` shuffling ``range(space)``
  (:func:`permutation`);
* ``epoch_splits = s`` cuts a pass into ``s`` epochs (:func:`epoch_slice`); when
  ``space % s != 0`` the first ``space % s`` slices get one extra pick (the same rule as the
  equal partition split); an epoch trains ``epoch_samples // batch_size`` whole batches
  (drop-last, :func:`epoch_batches`).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from flodl.checks import require_non_negative, require_positive
from flodl.errors import LocalProtocolError

__all__ = [
    "SHUFFLE_BASE_SEED",
    "index_space",
    "permutation",
    "epoch_slice",
    "epoch_batches",
    "pick_to_sample",
    "plan_picks",
]

SHUFFLE_BASE_SEED = 42
"""Default shuffle seed; the permutation of data pass ``p`` uses ``seed + p``."""


def index_space(dataset_len: int, augment: int = 1) -> int:
    """Size of the pick space: ``dataset_len × augment``.

    Args:
        dataset_len: number of samples in the dataset, ``>= 0``.
        augment: augmented views per sample, ``>= 1``.

    Returns:
        The number of picks a data pass shuffles.

    Raises:
        LocalProtocolError: a negative length or ``augment < 1``.
    """
    require_non_negative("dataset_len", dataset_len)
    require_positive("augment", augment)
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
        LocalProtocolError: a negative ``space`` or ``data_pass``.
    """
    require_non_negative("space", space)
    require_non_negative("data_pass", data_pass)
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
        LocalProtocolError: a negative argument or ``epoch_splits < 1``.
    """
    require_non_negative("epoch", epoch)
    require_non_negative("space", space)
    require_positive("epoch_splits", epoch_splits)
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
        The number of batches ``B`` of the epoch's :class:`~flodl.coord.ledger.EpochWork`.
    """
    require_positive("batch_size", batch_size)
    _, start, stop = epoch_slice(epoch, space, epoch_splits)
    return (stop - start) // batch_size


def pick_to_sample(pick: int, augment: int) -> tuple[int, int]:
    """Map a pick to ``(sample, view)``: ``(pick // augment, pick % augment)``.

    Raises:
        LocalProtocolError: a negative pick or ``augment < 1``.
    """
    require_non_negative("pick", pick)
    require_positive("augment", augment)
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
        LocalProtocolError: a negative argument, or a plan reaching past the permutation.
    """
    require_non_negative("epoch_start", epoch_start)
    require_non_negative("offset", offset)
    require_non_negative("size", size)
    lo = epoch_start + offset
    if lo + size > len(perm):
        raise LocalProtocolError(
            f"plan [{lo}, {lo + size}) reaches past the permutation ({len(perm)})"
        )
    return list(perm[lo : lo + size])
