"""The plain ``torch.nn.parallel.DistributedDataParallel`` baseline, and the step accounting
every system of ``bench_hetero`` shares.

:class:`TimedStep` wraps the demo task's ``train_step`` (forward + loss) for *every* system:
it applies the one slowdown method (:meth:`flodl.demo.Slowdown.forward`: sleep ``(factor −
1) × step_per_forward ×`` the measured forward) and counts the rank's busy time the same way
everywhere: ``step_per_forward × forward + sleep`` per step, i.e. the estimated compute of a
whole step (forward, backward, optimizer step) plus the slowdown, never a wait for another
rank. Idle fraction = ``1 − busy / span``, where ``span`` is the training span of the run
(first forward on any rank to the last forward on any rank), also identical for every system.

A rank's counters live in a small fixed-size file rewritten in place after every step
(``os.pwrite``): flodl's rank processes end with ``os._exit``, so nothing after the training
loop is guaranteed to run in them.
"""

from __future__ import annotations

import json
import math
import os
import socket
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "SLOW_RANK",
    "TimedStep",
    "read_step_record",
    "equal_split",
    "free_port",
    "run_ddp",
]

SLOW_RANK = 1
"""The rank (or replica) slowed in every system."""

_RECORD_BYTES = 160


class TimedStep:
    """``train_step`` slowed by ``slowdown`` and timed; see the module docstring.

    Args:
        train_step: ``train_step(model, batch) -> loss`` (forward + loss only).
        slowdown: a :class:`flodl.demo.Slowdown` (inactive on a rank that is not slowed).
        step_per_forward: full-step cost in forwards (the same value the slowdown uses).
        record_path: file that holds this rank's counters (rewritten after every step).
    """

    def __init__(
        self,
        train_step: Callable[[Any, Any], torch.Tensor],
        slowdown: Any,
        step_per_forward: float,
        record_path: str | os.PathLike[str] | None = None,
    ) -> None:
        self.train_step = train_step
        self.slowdown = slowdown
        self.step_per_forward = step_per_forward
        self.steps = 0
        self.busy_s = 0.0
        self.t_first: float | None = None
        self.t_last = 0.0
        self._fd: int | None = None
        if record_path is not None:
            self._fd = os.open(record_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)

    def __call__(self, model: Any, batch: Any) -> torch.Tensor:
        t0 = time.perf_counter()
        slept0 = self.slowdown.slept_s
        with self.slowdown.forward():
            loss = self.train_step(model, batch)
        t1 = time.perf_counter()
        slept = self.slowdown.slept_s - slept0
        forward = max(0.0, (t1 - t0) - slept)
        self.busy_s += forward * self.step_per_forward + slept
        self.steps += 1
        if self.t_first is None:
            self.t_first = t0
        self.t_last = t1
        if self._fd is not None:
            os.pwrite(self._fd, self._record(), 0)
        return loss

    def _record(self) -> bytes:
        text = json.dumps(
            {"steps": self.steps, "busy_s": self.busy_s, "t0": self.t_first, "t1": self.t_last}
        )
        return text.encode().ljust(_RECORD_BYTES)

    def summary(self) -> dict[str, Any]:
        """The counters as a dict (``t0``/``t1``: ``time.perf_counter`` seconds, system-wide)."""
        return {"steps": self.steps, "busy_s": self.busy_s, "t0": self.t_first, "t1": self.t_last}


def read_step_record(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """A rank's counters as :class:`TimedStep` last wrote them, or None if absent or empty."""
    try:
        raw = Path(path).read_bytes()[:_RECORD_BYTES].strip()
    except OSError:
        return None
    if not raw:
        return None
    try:
        data: dict[str, Any] = json.loads(raw)
    except ValueError:
        return None
    return data


def equal_split(n: int, world: int, rank: int, epoch: int, seed: int) -> list[int]:
    """``torch.utils.data.DistributedSampler`` semantics (shuffle, pad to equal length by
    wrapping around, then every ``world``-th index): this rank's indices for ``epoch``."""
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
    per_rank = math.ceil(n / world)
    perm += perm[: per_rank * world - n]
    return perm[rank::world]


def batches(indices: Sequence[int], batch_size: int) -> list[Sequence[int]]:
    """``indices`` cut into consecutive batches (the last one may be short)."""
    return [indices[i : i + batch_size] for i in range(0, len(indices), batch_size)]


def free_port() -> int:
    """A TCP port of 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


# ---------------------------------------------------------------------------------------------
# DDP
# ---------------------------------------------------------------------------------------------


def _ddp_worker(rank: int, cfg: dict[str, Any], port: int, out_dir: str) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from flodl.demo import Slowdown, demo_task

    torch.set_num_threads(1)
    world = int(cfg["world"])
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        task = demo_task(samples=cfg["samples"], seed=cfg["seed"])
        spf = float(cfg["step_per_forward"])
        slowdown = Slowdown.for_rank({SLOW_RANK: cfg["factor"]}, rank=rank, step_per_forward=spf)
        timed = TimedStep(task.train_step, slowdown, spf, Path(out_dir) / f"rank{rank}.steps")
        model = DistributedDataParallel(task.model_factory("cpu"))
        optim = task.optim_factory(model.parameters())
        dist.barrier()
        for epoch in range(cfg["epochs"]):
            mine = equal_split(len(task.train), world, rank, epoch, cfg["seed"])
            for idx in batches(mine, cfg["batch_size"]):
                batch = task.train.get_batch(idx)
                optim.zero_grad(set_to_none=True)
                loss = timed(model, batch)
                loss.backward()  # type: ignore[no-untyped-call]
                optim.step()
        dist.barrier()
        result: dict[str, Any] = {"rank": rank, **timed.summary()}
        if rank == 0:
            result["metric"] = task.eval_fn(model.module, task.held_out)
        tmp = Path(out_dir) / f"rank{rank}.json.tmp"
        tmp.write_text(json.dumps(result))
        tmp.replace(Path(out_dir) / f"rank{rank}.json")
    finally:
        dist.destroy_process_group()


def run_ddp(cfg: dict[str, Any], out_dir: Path, timeout_s: float = 600.0) -> dict[str, Any]:
    """Train with DDP on Gloo: ``cfg`` has world, samples, seed, epochs, batch_size, factor,
    step_per_forward. Returns per-rank summaries plus ``metric`` and ``total_s`` (spawn to
    the last process's exit)."""
    import torch.multiprocessing as mp

    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    ctx = mp.start_processes(  # type: ignore[attr-defined,no-untyped-call]
        _ddp_worker,
        args=(cfg, free_port(), str(out_dir)),
        nprocs=int(cfg["world"]),
        join=False,
        start_method="spawn",
    )
    deadline = time.perf_counter() + timeout_s
    try:
        while not ctx.join(timeout=max(0.1, deadline - time.perf_counter())):
            if time.perf_counter() >= deadline:
                raise TimeoutError(f"DDP did not finish within {timeout_s:.0f} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    total_s = time.perf_counter() - t0
    ranks = [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(cfg["world"])]
    return {"ranks": ranks, "metric": ranks[0]["metric"], "total_s": total_s}
