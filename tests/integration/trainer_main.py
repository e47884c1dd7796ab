"""A user script for the Trainer tier tests: ``python trainer_main.py --tag T [options]``.

The launcher re-executes this very script per rank (``--tag`` lets the test find every process
of one run). ``--crash-rank R --crash-step S`` makes rank R raise in train_step at step S;
``--lr-drop-at S`` gives every rank a ``scheduler_fn`` that cuts the LR 10× from step S;
``--heartbeat-timeout T`` sets the run's one timeout knob; ``--show-env NAME`` prints a
variable in every process; ``--bf16-wire`` averages through bf16 (the launcher prints whether
every final parameter is a bf16 value); ``--log-info`` sends every process's INFO log to stderr.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import time

import torch
import torch.nn.functional as F

from flodl import ElCheConfig, TensorBatchDataset, Trainer


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tag", required=True)
    p.add_argument("--ranks", type=int, default=3)
    p.add_argument("--mode", default="cpu_cadence")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--samples", type=int, default=4096)
    p.add_argument("--crash-rank", type=int, default=-1)
    p.add_argument("--crash-step", type=int, default=0)
    p.add_argument("--lr-drop-at", type=int, default=-1)
    p.add_argument("--heartbeat-timeout", type=float, default=None)
    p.add_argument("--respawn", type=int, default=0)
    p.add_argument("--slow-ms", type=float, default=0.0, help="sleep per step")
    p.add_argument("--show-env", action="append", default=[], help="print this variable")
    p.add_argument("--bf16-wire", action="store_true", help="average through bf16")
    p.add_argument("--log-info", action="store_true", help="flodl's INFO log to stderr")
    args = p.parse_args()
    if args.log_info:
        logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    restart = int(os.environ.get("FLODL_RESTART_COUNT", "0"))  # set in a respawned rank
    print(
        f"process rank={os.environ.get('FLODL_RANK', 'launcher')}"
        + (f" restart={restart}" if restart else ""),
        flush=True,
    )
    for name in args.show_env:
        print(f"env {name}={os.environ.get(name)}", flush=True)

    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.samples, 16, generator=g)
    y = (x @ torch.randn(16, 4, generator=g)).argmax(dim=1)
    steps = {"n": 0}
    me = int(os.environ.get("FLODL_RANK", "-1"))

    def train_step(model: torch.nn.Module, batch: list[torch.Tensor]) -> torch.Tensor:
        steps["n"] += 1
        if me == args.crash_rank and steps["n"] == args.crash_step and restart == 0:
            raise RuntimeError(f"injected failure on rank {me} at step {steps['n']}")
        if args.slow_ms:
            time.sleep(args.slow_ms / 1000.0)
        return F.cross_entropy(model(batch[0]), batch[1])

    builder = (
        Trainer.builder(
            lambda device: torch.nn.Sequential(
                torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)
            ).to(device),
            lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
            train_step,
        )
        .dataset(TensorBatchDataset(x, y))
        .batch_size(32)
        .num_epochs(args.epochs)
        .elche(ElCheConfig.preset(args.mode).model_copy(update={"bf16_wire": args.bf16_wire}))
        .local_ranks(args.ranks)
        .metrics_fn(lambda m: print(f"epoch {m.epoch} loss {m.avg_loss:.4f}", flush=True))
    )
    if args.respawn:
        builder = builder.respawn(args.respawn)
    if args.heartbeat_timeout is not None:
        builder = builder.heartbeat_timeout(args.heartbeat_timeout)
    if args.lr_drop_at >= 0:
        drop = args.lr_drop_at
        builder = builder.scheduler_fn(lambda rank: lambda step: 0.1 if step < drop else 0.01)
    sigterm = signal.getsignal(signal.SIGTERM)
    handle = builder.run()
    state = handle.join()
    print(f"DONE params={len(state.params)} world={handle.world_size}", flush=True)
    print(f"sigterm-restored={signal.getsignal(signal.SIGTERM) is sigterm}", flush=True)
    exact = all(torch.equal(p, p.bfloat16().float()) for p in state.params)
    print(f"bf16-exact={exact}", flush=True)


if __name__ == "__main__":
    main()
