"""The cooperative tier: you own the training loop, the coordinator keeps the cadence.

    python examples/cooperative_worker.py [--ranks 2] [--epochs 2] [--save runs/worker/ckpt]

Each rank process runs the loop below on its share of the data; between batches the worker
obeys the coordinator (averaging, dispatch, evals, checkpoints). In the launcher process the
loop yields nothing and ``finish()`` returns the final consensus, so the code after it runs
once. With ``--save``, run it again with ``--resume`` to continue from the saved bundle.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from flodl import ElCheConfig, TensorBatchDataset, Trainer


def make_data(n: int = 4096) -> tuple[TensorBatchDataset, tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)  # every rank re-runs this script: same data
    w = torch.randn(16, 4, generator=g)
    x, held = torch.randn(n, 16, generator=g), torch.randn(512, 16, generator=g)
    return TensorBatchDataset(x, (x @ w).argmax(1)), (held, (held @ w).argmax(1))


def accuracy(model: torch.nn.Module, held: tuple[torch.Tensor, torch.Tensor]) -> float:
    with torch.no_grad():
        return float((model(held[0]).argmax(1) == held[1]).float().mean())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--save")
    parser.add_argument("--resume")
    args = parser.parse_args()
    train, held = make_data()

    builder = (
        Trainer.builder(
            lambda device: torch.nn.Sequential(
                torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)
            ).to(device),
            lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
            None,  # no train_step: the loop below computes the loss
        )
        .dataset(train)
        .batch_size(32)
        .num_epochs(args.epochs)
        .elche(ElCheConfig.cpu_cadence())
        .local_ranks(args.ranks)
        .eval_dataset(held)
        .eval_fn(accuracy)
        .eval_result_fn(lambda epoch, acc: print(f"eval after epoch {epoch}: {acc:.3f}"))
    )
    if args.save:
        builder = builder.save_path(args.save)
    if args.resume:
        builder = builder.resume_from(args.resume)
    worker = builder.into_worker()
    for batch in worker.batches():
        x, y = batch
        loss = F.cross_entropy(worker.model(x), y)
        worker.step(loss)  # backward, clipping, optimizer step, report to the coordinator
    state = worker.finish()
    print(f"done: {len(state.params)} parameter tensors, world {worker.world_size}")


if __name__ == "__main__":
    main()
