"""Train a small classifier with N local CPU ranks (tier 2): the same call as one CPU.

    python examples/local_ranks.py [--ranks 3] [--mode cpu_cadence] [--epochs 3]

The launcher re-executes this script once per rank (so the lambdas below are fine); the code
after ``join()`` runs once, in the launcher.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from flodl import ElCheConfig, TensorBatchDataset, Trainer


def make_data(n: int = 4096, features: int = 16, classes: int = 4) -> TensorBatchDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, features, generator=g)
    w = torch.randn(features, classes, generator=g)
    y = (x @ w).argmax(dim=1)
    return TensorBatchDataset(x, y)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, default=3)
    parser.add_argument("--mode", default="cpu_cadence")
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()

    handle = (
        Trainer.builder(
            lambda device: torch.nn.Sequential(
                torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)
            ).to(device),
            lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
            lambda model, batch: F.cross_entropy(model(batch[0]), batch[1]),
        )
        .dataset(make_data())
        .batch_size(32)
        .num_epochs(args.epochs)
        .elche(ElCheConfig.preset(args.mode))
        .local_ranks(args.ranks)
        .metrics_fn(lambda m: print(f"epoch {m.epoch}: loss {m.avg_loss:.4f}", flush=True))
        .run()
    )
    state = handle.join()
    print(f"done: {len(state.params)} parameter tensors, world {handle.world_size}")


if __name__ == "__main__":
    main()
