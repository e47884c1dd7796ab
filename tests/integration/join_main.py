"""A rank started by an external launcher (torchrun, srun, ssh) joining ``flodl coord``.

``python join_main.py --out DIR [--mode M] [--epochs E] [--samples N] [--slow-ms MS]``; the
coordinator's address and
secret come from ``FLODL_COORD`` / ``FLODL_SECRET_FILE``, the rank from the launcher's own
variables. Every rank writes ``DIR/rank<N>.pt``; the primary also writes ``DIR/primary``.

Under torchrun: ``--resume-if-saved`` resumes from ``--save`` when its meta exists (what a
restarted worker does), and ``--fail-once R`` makes rank ``R`` of the first attempt
(``TORCHELASTIC_RESTART_COUNT`` 0) exit 1 once a bundle is committed.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tiny_job import train


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--mode", default="cpu_cadence")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--save", help="bundle stem (save_path)")
    p.add_argument("--resume", help="bundle stem (resume_from)")
    p.add_argument("--samples", type=int, default=2048)
    p.add_argument("--slow-ms", type=float, default=0.0, help="sleep per step")
    p.add_argument("--checkpoint-every", type=int)
    p.add_argument("--resume-if-saved", action="store_true")
    p.add_argument("--fail-once", type=int, help="rank that fails on the first attempt")
    args = p.parse_args()
    steps = [0]
    rank = os.environ.get("FLODL_RANK") or os.environ.get("RANK") or "?"
    saved = args.save is not None and Path(f"{args.save}.meta.json").exists()
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    fails = args.fail_once is not None and first_attempt and rank == str(args.fail_once)

    def loss_fn(model: torch.nn.Module, batch: list[torch.Tensor]) -> torch.Tensor:
        steps[0] += 1
        if fails and Path(f"{args.save}.meta.json").exists():
            print(f"rank {rank}: failing on purpose after a committed bundle", flush=True)
            os._exit(1)
        if args.slow_ms:
            time.sleep(args.slow_ms / 1000.0)
        return F.cross_entropy(model(batch[0]), batch[1])

    handle = train(
        loss_fn,
        samples=args.samples,
        epochs=args.epochs,
        mode=args.mode,
        save_path=args.save,
        resume_from=args.save if args.resume_if_saved and saved else args.resume,
        checkpoint_every=args.checkpoint_every,
    )
    state = handle.join()
    out = Path(args.out)
    torch.save({"params": state.params, "steps": steps[0]}, out / f"rank{rank}.pt")
    if handle.is_primary:
        (out / "primary").write_text(rank)


if __name__ == "__main__":
    main()
