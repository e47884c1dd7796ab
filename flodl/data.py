"""Datasets the framework batches itself.

A :class:`BatchDataset` returns a whole batch for a list of sample indices (the fast path);
:class:`TensorBatchDataset` is the shipped implementation over in-memory tensors, and
:class:`MapDataset` adapts any map-style dataset whose items are tuples of tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import torch

__all__ = ["BatchDataset", "TensorBatchDataset", "MapDataset", "as_batch_dataset"]


@runtime_checkable
class BatchDataset(Protocol):
    """``len(ds)`` samples; ``get_batch(indices)`` returns one tensor per field, batched."""

    def __len__(self) -> int: ...

    def get_batch(self, indices: Sequence[int]) -> list[torch.Tensor]: ...


class TensorBatchDataset:
    """Tensors sharing their first dimension; a batch is one ``index_select`` per tensor."""

    def __init__(self, *tensors: torch.Tensor) -> None:
        if not tensors:
            raise ValueError("TensorBatchDataset needs at least one tensor")
        n = tensors[0].shape[0] if tensors[0].dim() > 0 else 0
        for i, t in enumerate(tensors):
            if t.dim() == 0 or t.shape[0] != n:
                raise ValueError(
                    f"tensor {i} has leading size {tuple(t.shape)[:1]}, expected ({n},): "
                    "every tensor needs the same number of samples"
                )
        self.tensors = tensors
        self._n = int(n)

    def __len__(self) -> int:
        return self._n

    def get_batch(self, indices: Sequence[int]) -> list[torch.Tensor]:
        idx = torch.as_tensor(indices, dtype=torch.long)
        return [t.index_select(0, idx) for t in self.tensors]


class MapDataset:
    """Adapts a map-style dataset (``ds[i]`` is a tuple of tensors) by stacking items."""

    def __init__(self, dataset: Any) -> None:
        if not hasattr(dataset, "__getitem__") or not hasattr(dataset, "__len__"):
            raise TypeError("a dataset needs __len__ and __getitem__ (or get_batch)")
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def get_batch(self, indices: Sequence[int]) -> list[torch.Tensor]:
        items = [self.dataset[i] for i in indices]
        if not items:
            raise ValueError("empty batch")
        first = items[0]
        if not isinstance(first, tuple | list) or not all(
            isinstance(x, torch.Tensor) for x in first
        ):
            raise TypeError(
                f"dataset item {indices[0]} is {type(first).__name__}: items must be tuples "
                "of tensors"
            )
        return [torch.stack([item[f] for item in items]) for f in range(len(first))]


def as_batch_dataset(dataset: Any) -> BatchDataset:
    """``dataset`` itself if it has ``get_batch``, else a :class:`MapDataset` around it."""
    if isinstance(dataset, BatchDataset):
        return dataset
    return MapDataset(dataset)
