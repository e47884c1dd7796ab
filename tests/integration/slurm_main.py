"""A rank started by ``srun``: it joins ``flodl coord`` knowing only what SLURM tells every task.

``python slurm_main.py --out DIR [--epochs E] [--samples N] [--slow-ms MS]
[--crash-rank R --crash-step S] [--tag T]``. The coordinator's address, secret file and run id
come from ``FLODL_COORD`` / ``FLODL_SECRET_FILE`` / ``FLODL_RUN_ID``, exported once for the whole
step; the rank and world size from ``SLURM_PROCID`` / ``SLURM_NTASKS`` (nothing rank-specific
is set by hand). Rank ``R`` ends its first incarnation (``FLODL_RESTART_COUNT`` unset or 0) with
``os._exit(1)`` at its ``S``-th step, as a crashed task would, leaving ``DIR/crashed``; its
restarted incarnation writes ``DIR/restarted`` once the coordinator admitted it (the rank
runtime's "rejoins the run" log line, right after its ``accept``). The other ranks hold their
training (at most 60 s) from when they see ``DIR/crashed`` until ``DIR/restarted`` exists, so
the run is still going when the new incarnation is admitted, however long its start takes on a
loaded machine (instead of a run made long enough by a guess; holding only until the new
process started left the run to end first, while it was still connecting, under CI's load).
Each incarnation of rank r that ends its run writes ``DIR/rank<r>.<incarnation>.json`` (its
steps).
``--tag`` is ignored: a test finds its processes by it.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tiny_job import train

from flodl.launch.env import ENV_RESTART, rank_env


class _Admitted(logging.Handler):
    """Touches ``path`` when the rank runtime says the coordinator admitted this rejoin."""

    def __init__(self, path: Path) -> None:
        super().__init__(logging.INFO)
        self.path = path

    def emit(self, record: logging.LogRecord) -> None:
        if "rejoins the run" in record.getMessage():
            self.path.touch()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--samples", type=int, default=1024)
    p.add_argument("--slow-ms", type=float, default=0.0, help="sleep per step")
    p.add_argument("--crash-rank", type=int, default=-1)
    p.add_argument("--crash-step", type=int, default=0)
    p.add_argument("--tag", default="")
    args = p.parse_args()
    ranks = rank_env()
    assert ranks is not None, "not a rank: FLODL_COORD or SLURM_PROCID is missing"
    rank = ranks[0]
    incarnation = int(os.environ.get(ENV_RESTART) or "0")
    out = Path(args.out)
    crashed, restarted = out / "crashed", out / "restarted"
    if rank == args.crash_rank and incarnation > 0:
        logging.getLogger("flodl.rank.runtime").addHandler(_Admitted(restarted))
        logging.getLogger("flodl.rank.runtime").setLevel(logging.INFO)
    steps = [0]

    def hold() -> None:
        """The crashed rank's new incarnation is starting: wait for it (bounded)."""
        if args.crash_rank < 0 or rank == args.crash_rank or not crashed.exists():
            return
        deadline = time.monotonic() + 60
        while not restarted.exists() and time.monotonic() < deadline:
            time.sleep(0.05)

    def loss_fn(model: torch.nn.Module, batch: list[torch.Tensor]) -> torch.Tensor:
        steps[0] += 1
        if rank == args.crash_rank and steps[0] == args.crash_step and incarnation == 0:
            crashed.touch()
            os._exit(1)  # a crash: no cleanup, no goodbye to the coordinator
        hold()
        if args.slow_ms:
            time.sleep(args.slow_ms / 1000.0)
        return F.cross_entropy(model(batch[0]), batch[1])

    handle = train(loss_fn, samples=args.samples, epochs=args.epochs, mode="cpu_cadence")
    handle.join()
    done = {"rank": rank, "incarnation": incarnation, "steps": steps[0]}
    (out / f"rank{rank}.{incarnation}.json").write_text(json.dumps(done))


if __name__ == "__main__":
    main()
