"""Lock-step data parallelism on the demo task: the baselines ``flodl demo`` and the benchmarks
measure flodl against (docs/design.md §9).

:func:`run_lockstep` trains with real ``torch.nn.parallel.DistributedDataParallel`` on Gloo,
one spawned process per rank on this host: every rank gets an equal shard of each epoch
(``torch.utils.data.DistributedSampler`` semantics, :func:`equal_split`), and every step
all-reduces the gradients, so each step waits for the slowest rank. With ``period`` it runs
local SGD instead: ``torch``'s ``PeriodicModelAverager`` averages the parameters every
``period`` steps. A rank is slowed by the same :class:`~flodl.demo.slowdown.Slowdown` the flodl
ranks use, through :class:`TimedStep`, which also counts the rank's busy time the same way for
every system.

:class:`TimedStep` wraps the demo task's ``train_step`` (forward + loss): it applies the
slowdown and counts the step's compute plus the slowdown as busy, never a wait for another
rank (its two measures are in its docstring). A rank's counters live in a small fixed-size
file rewritten in place after every step (``os.pwrite``): flodl's rank processes end with
``os._exit``, so nothing after their training loop is guaranteed to run.
"""

from __future__ import annotations

import json
import math
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from flodl.errors import FlodlError

__all__ = [
    "TimedStep",
    "read_step_record",
    "equal_split",
    "batches",
    "free_port",
    "spawn_and_join",
    "run_lockstep",
    "MEASURES",
]

_RECORD_BYTES = 256
MEASURES = ("forward", "thread_cpu")
"""How :class:`TimedStep` measures the compute it slows and counts as busy."""


class TimedStep:
    """``train_step`` slowed by ``slowdown`` and timed; see the module docstring.

    Two measures (``measure``):

    * ``"forward"``: the slowdown's :meth:`~flodl.demo.slowdown.Slowdown.forward` estimate (sleep
      ``(factor − 1) × step_per_forward ×`` the forward's wall time; busy = that estimate of the
      whole step + the sleep).
    * ``"thread_cpu"``: the step's own CPU time on the calling thread (``time.thread_time``):
      the forward of this call plus everything the thread ran since the previous call returned
      (the previous step's backward and optimizer step, the batch fetch), so time spent blocked
      in a collective or waiting for a core is never multiplied; it sleeps ``(factor − 1) ×``
      that after the forward. Busy = that CPU time + the sleep. Exact on one torch thread.

    Args:
        train_step: ``train_step(model, batch) -> loss`` (forward + loss only).
        slowdown: a :class:`~flodl.demo.slowdown.Slowdown` (inactive on a rank not slowed).
        step_per_forward: full-step cost in forwards (the same value the slowdown uses).
        record_path: file that holds this rank's counters (rewritten after every step).
        measure: ``"forward"`` or ``"thread_cpu"``, as above.
    """

    def __init__(
        self,
        train_step: Callable[[Any, Any], torch.Tensor],
        slowdown: Any,
        step_per_forward: float,
        record_path: str | os.PathLike[str] | None = None,
        measure: str = "forward",
    ) -> None:
        if measure not in MEASURES:
            raise FlodlError(f"TimedStep: measure {measure!r} is not one of {MEASURES}")
        self.measure = measure
        self._cpu_mark: float | None = None
        self._thread: int | None = None
        self.train_step = train_step
        self.slowdown = slowdown
        self.step_per_forward = step_per_forward
        self.steps = 0
        self.busy_s = 0.0
        self.cpu_s = 0.0
        """The compute the slowdown multiplied, summed (``busy_s`` without the sleeps): per step,
        it shows how fast the machine ran this rank's steps, whatever the system around them."""
        self.t_first: float | None = None
        self.t_last = 0.0
        self._fd: int | None = None
        if record_path is not None:
            self._fd = os.open(record_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)

    def __call__(self, model: Any, batch: Any) -> torch.Tensor:
        t0 = time.perf_counter()
        if self.measure == "thread_cpu":
            c0 = time.thread_time()
            same_thread = self._thread == threading.get_ident()
            since = (
                0.0 if self._cpu_mark is None or not same_thread else max(0.0, c0 - self._cpu_mark)
            )
            self._thread = threading.get_ident()
            loss = self.train_step(model, batch)
            cpu = since + max(0.0, time.thread_time() - c0)
            slept = self.slowdown.pause(cpu)
            self._cpu_mark = time.thread_time()
            t1 = time.perf_counter()
            self.busy_s += cpu + slept
            self.cpu_s += cpu
        else:
            slept0 = self.slowdown.slept_s
            with self.slowdown.forward():
                loss = self.train_step(model, batch)
            t1 = time.perf_counter()
            slept = self.slowdown.slept_s - slept0
            forward = max(0.0, (t1 - t0) - slept)
            self.busy_s += forward * self.step_per_forward + slept
            self.cpu_s += forward * self.step_per_forward
        self.steps += 1
        if self.t_first is None:
            self.t_first = t0
        self.t_last = t1
        if self._fd is not None:
            os.pwrite(self._fd, self._record(), 0)
        return loss

    def _record(self) -> bytes:
        return json.dumps(self.summary()).encode().ljust(_RECORD_BYTES)

    def summary(self) -> dict[str, Any]:
        """The counters as a dict (``t0``/``t1``: ``time.perf_counter`` seconds, system-wide)."""
        return {
            "steps": self.steps,
            "busy_s": self.busy_s,
            "cpu_s": self.cpu_s,
            "t0": self.t_first,
            "t1": self.t_last,
        }


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


def _worker(rank: int, cfg: dict[str, Any], port: int, out_dir: str) -> None:
    import torch.distributed as dist
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
    from torch.nn.parallel import DistributedDataParallel

    from flodl.demo.slowdown import Slowdown
    from flodl.demo.task import demo_task

    torch.set_num_threads(int(cfg["threads"]))
    world = int(cfg["world"])
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        task = demo_task(samples=cfg["samples"], seed=cfg["seed"], **cfg["task"])
        spf = float(cfg["step_per_forward"])
        slow = {int(r): float(f) for r, f in cfg["slow"].items()}
        slowdown = Slowdown.for_rank(slow, rank=rank, step_per_forward=spf)
        record = Path(out_dir) / f"rank{rank}.steps"
        timed = TimedStep(task.train_step, slowdown, spf, record, measure=cfg["measure"])
        period = cfg["period"]
        model: torch.nn.Module = task.model_factory("cpu")
        averager = None
        if period is None:
            model = DistributedDataParallel(model)
        else:  # local SGD: every rank starts from the same seeded weights
            averager = PeriodicModelAverager(period=int(period), warmup_steps=0)
        optim = task.optim_factory(model.parameters())
        dist.barrier()
        t_start = time.perf_counter()
        for epoch in range(cfg["epochs"]):
            mine = equal_split(len(task.train), world, rank, epoch, cfg["seed"])
            for idx in batches(mine, cfg["batch_size"]):
                batch = task.train.get_batch(idx)
                optim.zero_grad(set_to_none=True)
                loss = timed(model, batch)
                loss.backward()  # type: ignore[no-untyped-call]
                optim.step()
                if averager is not None:
                    averager.average_parameters(model.parameters())
        syncs = timed.steps
        if averager is not None:
            # PeriodicModelAverager averages after steps 0, period, 2·period, …; every rank ran
            # the same step count, so one last average makes the steps after that shared too
            steps, every = averager.step, int(period)
            syncs = -(-steps // every)
            if steps > 0 and (steps - 1) % every != 0:
                for p in model.parameters():
                    dist.all_reduce(p.data)
                    p.data.div_(world)
                syncs += 1
        dist.barrier()
        t_end = time.perf_counter()
        result: dict[str, Any] = {
            "rank": rank,
            **timed.summary(),
            "t_start": t_start,
            "t_end": t_end,
            "syncs": syncs,
        }
        if rank == 0:
            plain = model.module if isinstance(model, DistributedDataParallel) else model
            result["metric"] = task.eval_fn(plain, task.held_out)
            result["loss"] = task.loss_fn(plain, task.held_out)
        tmp = Path(out_dir) / f"rank{rank}.json.tmp"
        tmp.write_text(json.dumps(result))
        tmp.replace(Path(out_dir) / f"rank{rank}.json")
    finally:
        dist.destroy_process_group()
    # Leave without the interpreter's finalization. A Gloo worker thread of torch's process
    # group can still release a tensor while the interpreter exits; taking the GIL then ends
    # that thread with pthread_exit inside C++ code, which aborts the process (SIGABRT,
    # "terminate called without an active exception") after its result was written, and the
    # spawner then kills the ranks still evaluating: a lost round, in 2 of 48 repeated x3
    # local-SGD runs here. The result is on disk; there is nothing left to finalize.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn_and_join(
    fn: Callable[..., None], args: tuple[Any, ...], nprocs: int, timeout_s: float, what: str
) -> float:
    """Run ``fn(i, *args)`` in ``nprocs`` spawned processes and wait for all of them; every
    process still alive when this returns or raises is killed. Returns the seconds from spawn to
    the last exit.

    Raises:
        FlodlError: a process failed, or they did not all finish within ``timeout_s``.
    """
    import torch.multiprocessing as mp

    t0 = time.perf_counter()
    ctx = mp.start_processes(  # type: ignore[attr-defined,no-untyped-call]
        fn, args=args, nprocs=nprocs, join=False, start_method="spawn"
    )
    deadline = time.perf_counter() + timeout_s
    try:
        while not ctx.join(timeout=max(0.1, deadline - time.perf_counter())):
            if time.perf_counter() >= deadline:
                raise FlodlError(f"{what} did not finish within {timeout_s:.0f} s")
    except mp.ProcessRaisedException as exc:  # type: ignore[attr-defined]
        raise FlodlError(f"{what} failed: {str(exc).strip().splitlines()[-1]}") from None
    except mp.ProcessExitedException as exc:  # type: ignore[attr-defined]
        raise FlodlError(f"{what} failed: {exc}") from None
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join()
    return time.perf_counter() - t0


def run_lockstep(
    *,
    world: int,
    samples: int,
    seed: int,
    epochs: int,
    batch_size: int,
    slow: Mapping[int, float],
    step_per_forward: float,
    threads: int,
    out_dir: Path,
    timeout_s: float = 600.0,
    task: Mapping[str, int] | None = None,
    measure: str = "forward",
    period: int | None = None,
) -> dict[str, Any]:
    """Train the demo task with DDP on Gloo, ``world`` spawned processes on this host (or, with
    ``period``, local SGD: ``torch``'s ``PeriodicModelAverager`` averaging the parameters every
    ``period`` steps instead of the gradients every step).

    Args:
        world: ranks (processes).
        samples, seed: :func:`~flodl.demo.task.demo_task`'s (and the shuffle's) arguments.
        epochs, batch_size: per rank, as in the flodl run.
        slow: rank → slowdown factor.
        step_per_forward: the slowdown's full-step cost in forwards.
        threads: ``torch.set_num_threads`` of each rank.
        out_dir: where the ranks write their counters and results.
        timeout_s: the whole run's limit; every process is killed when it passes.
        task: more :func:`~flodl.demo.task.demo_task` sizes (``context``, ``embed``, ``hidden``).
        measure: :class:`TimedStep`'s measure (``"forward"`` or ``"thread_cpu"``).
        period: None for DDP; else local SGD's averaging period in steps.

    Returns:
        ``ranks`` (per-rank counters: steps, busy_s, t_start, t_end, syncs), ``metric`` and
        ``loss`` (rank 0's held-out accuracy and cross entropy), ``total_s`` (spawn to the last
        process's exit), ``train_s`` (first rank past the start barrier to the last past the end
        barrier) and ``syncs`` (gradient all-reduces, one per step; or parameter averagings).

    Raises:
        FlodlError: a rank failed or the run passed ``timeout_s``.
    """
    if measure not in MEASURES:
        raise FlodlError(f"run_lockstep: measure {measure!r} is not one of {MEASURES}")
    cfg = {
        "world": world,
        "samples": samples,
        "seed": seed,
        "epochs": epochs,
        "batch_size": batch_size,
        "slow": {str(r): float(f) for r, f in slow.items()},
        "step_per_forward": step_per_forward,
        "threads": max(1, threads),
        "task": dict(task or {}),
        "measure": measure,
        "period": period,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    what = "lock-step DDP" if period is None else "local SGD (PeriodicModelAverager)"
    total_s = spawn_and_join(_worker, (cfg, free_port(), str(out_dir)), world, timeout_s, what)
    ranks = [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(world)]
    return {
        "ranks": ranks,
        "metric": ranks[0]["metric"],
        "loss": ranks[0]["loss"],
        "total_s": total_s,
        "train_s": max(r["t_end"] for r in ranks) - min(r["t_start"] for r in ranks),
        "syncs": ranks[0]["syncs"],
    }
