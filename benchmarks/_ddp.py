"""The plain ``torch.nn.parallel.DistributedDataParallel`` baseline, and the step accounting
every system of ``bench_hetero`` shares: both are the product's own lock-step runner
(:mod:`flodl.demo.lockstep`, what ``flodl demo`` compares flodl with), re-exported here with
the benchmarks' one slowed rank and one thread per rank.

:class:`TimedStep` applies the one slowdown method and counts the busy time the same way in
every system (see :mod:`flodl.demo.lockstep`). Idle fraction = ``1 − busy / span``, where
``span`` is the training span of the run (first forward on any rank to the last forward on
any rank), also identical for every system.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from _common import ensure_repo_on_path

ensure_repo_on_path()

from flodl.demo.lockstep import (  # noqa: E402 - after the path fix
    TimedStep,
    batches,
    equal_split,
    free_port,
    read_step_record,
    run_lockstep,
)

__all__ = [
    "SLOW_RANK",
    "TimedStep",
    "batches",
    "read_step_record",
    "equal_split",
    "free_port",
    "run_ddp",
]

SLOW_RANK = 1
"""The rank (or replica) slowed in every system."""


def run_ddp(cfg: dict[str, Any], out_dir: Path, timeout_s: float = 600.0) -> dict[str, Any]:
    """Train with DDP on Gloo: ``cfg`` has world, samples, seed, epochs, batch_size, factor,
    step_per_forward; one thread per rank, rank :data:`SLOW_RANK` slowed ``factor``×. Returns
    per-rank summaries plus ``metric`` and ``total_s`` (spawn to the last process's exit)."""
    return run_lockstep(
        world=int(cfg["world"]),
        samples=int(cfg["samples"]),
        seed=int(cfg["seed"]),
        epochs=int(cfg["epochs"]),
        batch_size=int(cfg["batch_size"]),
        slow={SLOW_RANK: float(cfg["factor"])},
        step_per_forward=float(cfg["step_per_forward"]),
        threads=1,
        out_dir=out_dir,
        timeout_s=timeout_s,
    )
