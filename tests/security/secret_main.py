"""A user script for the secret hygiene tests: ``python secret_main.py --tag T [options]``.

Logs at DEBUG in every process (the launcher re-executes this script per rank, so the ranks
log at DEBUG too). With ``--ranks N`` (N > 1) it is the launcher of N local ranks; started
with ``FLODL_RANK`` & co. in the environment it is a rank of a standalone ``flodl coord``.
``--out-dir`` adds a bundle, a record log and a saved dashboard there (files the test greps
for the secret). ``--step-sleep`` slows each step so a test can look at the live processes.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from flodl import ElCheConfig, TensorBatchDataset, Trainer


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--tag", required=True)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--samples", type=int, default=2048)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--mode", default="cpu_cadence")
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--out-dir")
    args = p.parse_args()
    logging.basicConfig(
        level=logging.DEBUG,
        stream=sys.stderr,
        format="%(process)d %(levelname)s %(name)s: %(message)s",
    )

    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.samples, 16, generator=g)
    y = (x @ torch.randn(16, 4, generator=g)).argmax(dim=1)

    def step(m: torch.nn.Module, batch: list[torch.Tensor]) -> torch.Tensor:
        if args.step_sleep:
            time.sleep(args.step_sleep)
        return F.cross_entropy(m(batch[0]), batch[1])

    builder = (
        Trainer.builder(
            lambda device: torch.nn.Sequential(
                torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)
            ).to(device),
            lambda params: torch.optim.SGD(params, lr=0.1),
            step,
        )
        .dataset(TensorBatchDataset(x, y))
        .batch_size(32)
        .num_epochs(args.epochs)
        .elche(ElCheConfig.preset(args.mode))
    )
    if args.ranks > 1:
        builder = builder.local_ranks(args.ranks)
    if args.out_dir:
        out = Path(args.out_dir)
        builder = (
            builder.save_path(str(out / "bundle"))
            .checkpoint_every(1)
            .record_log(str(out / "records"))
            .save_dashboard(str(out / "dashboard.html"))
        )
    state = builder.run().join()
    print(f"DONE params={len(state.params)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
