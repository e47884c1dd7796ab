"""The small job the tier-4 rank scripts train (``join_main.py``, ``slurm_main.py``): a 16-32-4
MLP on a seeded synthetic dataset, so every rank of a run builds the same data and model."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from flodl import ElCheConfig, TensorBatchDataset, Trainer, TrainerConfig
from flodl.handle import TrainerHandle

Loss = Callable[[torch.nn.Module, list[torch.Tensor]], torch.Tensor]


def train(loss_fn: Loss, *, samples: int, epochs: int, mode: str, **config: Any) -> TrainerHandle:
    """``Trainer.run`` of the tiny job; ``config``: further ``TrainerConfig`` fields."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(samples, 16, generator=g)
    y = (x @ torch.randn(16, 4, generator=g)).argmax(dim=1)
    return Trainer.run(
        lambda device: torch.nn.Sequential(
            torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)
        ).to(device),
        lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
        loss_fn,
        TrainerConfig(
            dataset=TensorBatchDataset(x, y),
            batch_size=32,
            num_epochs=epochs,
            elche=ElCheConfig.preset(mode),
            **config,
        ),
    )
