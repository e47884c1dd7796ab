"""A rank started by an external launcher (torchrun, srun, ssh) joining ``flodl coord``.

``python join_main.py --out DIR [--mode M] [--epochs E] [--samples N] [--slow-ms MS]``; the
coordinator's address and
secret come from ``FLODL_COORD`` / ``FLODL_SECRET_FILE``, the rank from the launcher's own
variables. Every rank writes ``DIR/rank<N>.pt``; the primary also writes ``DIR/primary``.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from flodl import ElCheConfig, TensorBatchDataset, Trainer, TrainerConfig


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--mode", default="cpu_cadence")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--save", help="bundle stem (save_path)")
    p.add_argument("--resume", help="bundle stem (resume_from)")
    p.add_argument("--samples", type=int, default=2048)
    p.add_argument("--slow-ms", type=float, default=0.0, help="sleep per step")
    args = p.parse_args()
    steps = [0]

    def loss_fn(model: torch.nn.Module, batch: list[torch.Tensor]) -> torch.Tensor:
        steps[0] += 1
        if args.slow_ms:
            time.sleep(args.slow_ms / 1000.0)
        return F.cross_entropy(model(batch[0]), batch[1])

    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.samples, 16, generator=g)
    y = (x @ torch.randn(16, 4, generator=g)).argmax(dim=1)
    handle = Trainer.run(
        lambda device: torch.nn.Sequential(
            torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)
        ),
        lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
        loss_fn,
        TrainerConfig(
            dataset=TensorBatchDataset(x, y),
            batch_size=32,
            num_epochs=args.epochs,
            elche=ElCheConfig.preset(args.mode),
            save_path=args.save,
            resume_from=args.resume,
        ),
    )
    state = handle.join()
    rank = os.environ.get("FLODL_RANK") or os.environ.get("RANK") or "?"
    out = Path(args.out)
    torch.save({"params": state.params, "steps": steps[0]}, out / f"rank{rank}.pt")
    if handle.is_primary:
        (out / "primary").write_text(rank)


if __name__ == "__main__":
    main()
