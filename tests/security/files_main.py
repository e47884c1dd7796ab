"""A user script for the hostile-file tests: ``python files_main.py --tag T --resume STEM``.

Runs the launcher tier (``local_ranks``) or the single-device tier on a small MLP, resuming from
``--resume``. A :class:`flodl.FlodlError` is printed as one line and exits 2 (what a careful
user script does); anything else propagates (a traceback and exit 1: what the tests look for).
``--hidden`` changes the model (a bundle saved with another value is "from another model").
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

from flodl import ElCheConfig, FlodlError, TensorBatchDataset, Trainer


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--tag", required=True)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--samples", type=int, default=256)
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--save")
    p.add_argument("--resume")
    args = p.parse_args()

    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.samples, 16, generator=g)
    y = (x @ torch.randn(16, 4, generator=g)).argmax(dim=1)

    def model(device: torch.device) -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(
            torch.nn.Linear(16, args.hidden), torch.nn.ReLU(), torch.nn.Linear(args.hidden, 4)
        ).to(device)

    def step(m: torch.nn.Module, batch: list[torch.Tensor]) -> torch.Tensor:
        return F.cross_entropy(m(batch[0]), batch[1])

    builder = (
        Trainer.builder(model, lambda params: torch.optim.SGD(params, lr=0.1), step)
        .dataset(TensorBatchDataset(x, y))
        .batch_size(32)
        .num_epochs(args.epochs)
        .elche(ElCheConfig.preset("cpu_cadence"))
    )
    if args.ranks > 1:
        builder = builder.local_ranks(args.ranks)
    if args.save:
        builder = builder.save_path(args.save).checkpoint_every(1)
    if args.resume:
        builder = builder.resume_from(args.resume)
    try:
        handle = builder.run()
        handle.join()
    except FlodlError as exc:
        print(f"files_main: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return 2
    print("DONE", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
