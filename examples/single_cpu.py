"""Tier 1: one CPU, in process, no coordinator: the same Trainer call (without
``.device("cpu")`` the default ``auto`` trains on the GPU when one is visible, and on one rank
per GPU when several are).

python examples/single_cpu.py
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from flodl import TensorBatchDataset, Trainer


def main() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 16, generator=g)
    y = (x @ torch.randn(16, 4, generator=g)).argmax(dim=1)
    handle = (
        Trainer.builder(
            lambda device: torch.nn.Sequential(
                torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)
            ).to(device),
            lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
            lambda model, batch: F.cross_entropy(model(batch[0]), batch[1]),
        )
        .dataset(TensorBatchDataset(x, y))
        .device("cpu")  # the default, "auto", would take a GPU where one is visible
        .batch_size(32)
        .num_epochs(3)
        .metrics_fn(lambda m: print(f"epoch {m.epoch}: loss {m.avg_loss:.4f}"))
        .run()
    )
    state = handle.join()
    print(f"done: {len(state.params)} parameter tensors")


if __name__ == "__main__":
    main()
