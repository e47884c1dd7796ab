"""The balance bound of a heterogeneous rig: how fast perfect load balance with free
communication could train, measured on this machine in the same sitting as the systems.

Every rank of the rig trains the same model with the same slowdown, batch size and thread count
as in the real runs, all at once (so they compete for the machine's cores as in a real run), but
with no communication at all: each process runs steps for a fixed time and counts the samples it
finished in the middle of that time (the start and the end, when some processes are still
loading or already done, are left out). A perfectly balanced system with free averaging would
finish ``samples`` in ``samples / Σ throughput_r``: the bound on the training span.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch
from _ddp import TimedStep

from flodl.demo.lockstep import spawn_and_join

__all__ = ["run_bound"]


def _worker(rank: int, cfg: dict[str, Any], barrier: Any, out_dir: str) -> None:
    from flodl.demo import Slowdown, demo_task

    torch.set_num_threads(int(cfg["threads"]))
    task = demo_task(samples=cfg["samples"], seed=cfg["seed"], **cfg["task"])
    spf = float(cfg["step_per_forward"])
    slow = {int(r): float(f) for r, f in cfg["slow"].items()}
    slowdown = Slowdown.for_rank(slow, rank=rank, step_per_forward=spf)
    timed = TimedStep(task.train_step, slowdown, spf, measure=cfg["measure"])
    model = task.model_factory("cpu")
    optim = task.optim_factory(model.parameters())
    batch_size = int(cfg["batch_size"])
    n = len(task.train)
    barrier.wait()
    t0 = time.perf_counter()
    lo, hi = t0 + float(cfg["warmup_s"]), t0 + float(cfg["warmup_s"]) + float(cfg["measure_s"])
    stop = hi + float(cfg["warmup_s"])
    counted = 0
    counted_steps = 0
    counted_cpu = 0.0
    step = 0
    while True:
        start = (step * batch_size + rank * 7919) % max(1, n - batch_size)
        batch = task.train.get_batch(list(range(start, start + batch_size)))
        optim.zero_grad(set_to_none=True)
        cpu0 = timed.cpu_s
        timed(model, batch).backward()  # type: ignore[no-untyped-call]
        optim.step()
        step += 1
        now = time.perf_counter()
        if lo <= now <= hi:
            counted += batch_size
            counted_steps += 1
            counted_cpu += timed.cpu_s - cpu0
        if now >= stop:
            break
    result = {
        "rank": rank,
        "samples_per_s": counted / float(cfg["measure_s"]),
        "steps": step,
        "cpu_ms_per_step": 1000.0 * counted_cpu / counted_steps if counted_steps else None,
    }
    tmp = Path(out_dir) / f"bound{rank}.json.tmp"
    tmp.write_text(json.dumps(result))
    tmp.replace(Path(out_dir) / f"bound{rank}.json")


def run_bound(cfg: dict[str, Any], out_dir: Path, timeout_s: float = 300.0) -> dict[str, Any]:
    """Measure the rig's balance bound. ``cfg``: world, samples (of one epoch), seed,
    batch_size, slow (rank → factor), step_per_forward, task (``demo_task`` sizes), measure
    (:class:`TimedStep`'s), threads, warmup_s, measure_s. Returns ``throughput`` (samples/s per
    rank), ``span_s`` (``samples / Σ throughput``: the bound), ``cpu_ms_per_step`` (per rank, in
    the measuring window: the step's compute without the slowdown's sleep, as
    :class:`TimedStep` counts it) and ``total_s``."""
    import torch.multiprocessing as mp

    out_dir.mkdir(parents=True, exist_ok=True)
    world = int(cfg["world"])
    cfg = {**cfg, "slow": {str(r): float(f) for r, f in cfg["slow"].items()}}
    barrier = mp.get_context("spawn").Barrier(world)
    total_s = spawn_and_join(
        _worker, (cfg, barrier, str(out_dir)), world, timeout_s, "the balance-bound run"
    )
    ranks = [json.loads((out_dir / f"bound{r}.json").read_text()) for r in range(world)]
    throughput = [float(r["samples_per_s"]) for r in ranks]
    total = sum(throughput)
    span = float(cfg["samples"]) / total if total > 0 else float("inf")
    return {
        "throughput": throughput,
        "span_s": span,
        "cpu_ms_per_step": [r["cpu_ms_per_step"] for r in ranks],
        "total_s": total_s,
    }
