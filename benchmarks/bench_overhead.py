"""What does flodl cost over plain PyTorch when there is nothing to balance?

    python benchmarks/bench_overhead.py [--repeat 3] [--epochs 1] [--samples 64000]
    python benchmarks/bench_overhead.py --markdown [JSON]   # the docs section, from the JSON

(a) **One device.** flodl's single-device tier (``Trainer.builder(...).run().join()`` without
ranks: in process, no coordinator) against a plain torch loop (shuffle with ``randperm``,
index the tensors, ``zero_grad``/forward/``backward``/``step``) on the demo task
(:func:`flodl.demo.demo_task`), same model, optimizer, epochs and batch size, one CPU thread
each, in this process. Target: flodl ≤ 1.05× the plain loop's time.

(b) **Two equal ranks.** flodl with 2 local CPU ranks in ``nccl_sync`` (parameter averaging
after every step over ``torch.distributed``, here Gloo) against
``torch.nn.parallel.DistributedDataParallel`` on Gloo (2 processes started with
``torch.multiprocessing.spawn``; each rank trains its half of every epoch's permutation, batch
size per rank step the same as flodl's, gradients all-reduced every step), same model,
optimizer, epochs, one CPU thread per rank. Target: flodl ≤ 1.10× DDP's time. Two times are
reported: *training* (flodl: the sum of its epochs' ``epoch_ms``; DDP: rank 0 from a barrier
after the model is wrapped to a barrier after the last step) and *end to end* (the whole
command, as seen by this script: interpreter and torch start-up of the launcher and of every
rank process, formation, training, shutdown).

Timings are best of ``--repeat`` runs, the two systems alternating (A B, B A, …) so machine
drift hits both; ratios are of the best times.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from _common import (
    RESULTS_DIR,
    RunStamp,
    add_markdown_option,
    ensure_repo_on_path,
    markdown_table,
    met_text,
    print_table,
    section_head,
    write_json,
)

ensure_repo_on_path()

from flodl.demo.run import BATCH_SIZE  # noqa: E402 - the demo's batch size per rank step

SEED = 0
TARGET_SINGLE = 1.05
TARGET_DDP = 1.10
RESULT_TAG = "OVERHEAD-RESULT "


# ---------------------------------------------------------------------------------------------
# (a) one device, in this process
# ---------------------------------------------------------------------------------------------


def flodl_single(task: Any, epochs: int) -> float:
    from flodl import Trainer

    t0 = time.perf_counter()
    (
        Trainer.builder(task.model_factory, task.optim_factory, task.train_step)
        .dataset(task.train)
        .device("cpu")  # on the CPU, like the baselines it is compared with
        .batch_size(BATCH_SIZE)
        .num_epochs(epochs)
        .seed(SEED)
        .progress(False)
        .run()
        .join()
    )
    return time.perf_counter() - t0


def torch_single(task: Any, epochs: int) -> float:
    import torch

    t0 = time.perf_counter()
    model = task.model_factory("cpu")
    optim = task.optim_factory(model.parameters())
    x, y = task.train.tensors
    n = len(y)
    g = torch.Generator().manual_seed(SEED)
    model.train()
    for _ in range(epochs):
        perm = torch.randperm(n, generator=g)
        for start in range(0, n - BATCH_SIZE + 1, BATCH_SIZE):
            idx = perm[start : start + BATCH_SIZE]
            optim.zero_grad(set_to_none=True)
            loss = task.train_step(model, [x[idx], y[idx]])
            loss.backward()
            optim.step()
    return time.perf_counter() - t0


# ---------------------------------------------------------------------------------------------
# (b) two equal ranks, each system in its own command
# ---------------------------------------------------------------------------------------------


def one_flodl(samples: int, epochs: int) -> dict[str, Any]:
    """The launcher of 2 ``nccl_sync`` ranks (each rank process re-runs this command)."""
    from flodl import ElCheConfig, Trainer
    from flodl.demo import demo_task

    task = demo_task(samples=samples, seed=SEED)
    epoch_ms: list[float] = []
    (
        Trainer.builder(task.model_factory, task.optim_factory, task.train_step)
        .dataset(task.train)
        .device("cpu")  # on the CPU, like the baselines it is compared with
        .batch_size(BATCH_SIZE)
        .num_epochs(epochs)
        .seed(SEED)
        .elche(ElCheConfig.nccl_sync())
        .local_ranks(2)
        .progress(False)
        .metrics_fn(lambda m: epoch_ms.append(m.epoch_ms))
        .run()
        .join()
    )
    return {"train_s": sum(epoch_ms) / 1000.0}


def _ddp_rank(rank: int, world: int, port: int, samples: int, epochs: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from flodl.demo import demo_task

    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        task = demo_task(samples=samples, seed=SEED)
        model = DistributedDataParallel(task.model_factory("cpu"))
        optim = task.optim_factory(model.parameters())
        x, y = task.train.tensors
        n = len(y)
        per_rank = n // world
        g = torch.Generator().manual_seed(SEED)
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(epochs):
            perm = torch.randperm(n, generator=g)[rank::world][:per_rank]
            for start in range(0, per_rank - BATCH_SIZE + 1, BATCH_SIZE):
                idx = perm[start : start + BATCH_SIZE]
                optim.zero_grad(set_to_none=True)
                loss = task.train_step(model, [x[idx], y[idx]])
                loss.backward()  # type: ignore[no-untyped-call]
                optim.step()
        dist.barrier()
        if rank == 0:
            Path(out).write_text(json.dumps({"train_s": time.perf_counter() - t0}))
    finally:
        dist.destroy_process_group()


def one_ddp(samples: int, epochs: int) -> dict[str, Any]:
    import socket
    import tempfile

    import torch.multiprocessing as tmp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "ddp.json")
        tmp.spawn(  # type: ignore[attr-defined,no-untyped-call]
            _ddp_rank, args=(2, port, samples, epochs, out), nprocs=2, join=True
        )
        result: dict[str, Any] = json.loads(Path(out).read_text())
    return result


def spawn(system: str, samples: int, epochs: int, timeout: float) -> dict[str, Any]:
    """Run ``--one SYSTEM`` as its own command; returns its result plus the end-to-end time."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--one", system]
    cmd += ["--samples", str(samples), "--epochs", str(epochs)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLODL_")}
    t0 = time.perf_counter()
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, env=env, check=False
    )
    end_to_end = time.perf_counter() - t0
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_TAG):
            result: dict[str, Any] = json.loads(line[len(RESULT_TAG) :])
            result["end_to_end_s"] = end_to_end
            return result
    raise RuntimeError(
        f"{system} failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    )


def report(
    settings: dict[str, Any],
    single: dict[str, list[float]],
    multi: dict[str, list[dict[str, Any]]],
    load_before: tuple[float, float, float],
    header: dict[str, Any],
) -> dict[str, Any]:
    """The result file: ``header`` (:meth:`RunStamp.header`), the load averages, the
    ``settings``, and per comparison the times, the best of each system, the ratio of the best
    times and whether it meets the target."""
    best_a = {k: min(v) for k, v in single.items()}
    ratio_a = best_a["flodl"] / best_a["torch"]
    best_train = {k: min(r["train_s"] for r in v) for k, v in multi.items()}
    best_e2e = {k: min(r["end_to_end_s"] for r in v) for k, v in multi.items()}
    ratio_train = best_train["flodl"] / best_train["ddp"]
    return {
        **header,
        "load_average": {"before": load_before, "after": os.getloadavg()},
        "settings": settings,
        "single": {
            "times_s": single,
            "best_s": best_a,
            "ratio": ratio_a,
            "target": TARGET_SINGLE,
            "met": ratio_a <= TARGET_SINGLE,
            "steps": settings["epochs"] * (settings["samples"] // settings["batch_size"]),
        },
        "two_ranks": {
            "runs": multi,
            "best_train_s": best_train,
            "best_end_to_end_s": best_e2e,
            "ratio_train": ratio_train,
            "ratio_end_to_end": best_e2e["flodl"] / best_e2e["ddp"],
            "target": TARGET_DDP,
            "met": ratio_train <= TARGET_DDP,
            "steps_per_rank": settings["epochs"]
            * (settings["samples"] // 2 // settings["batch_size"]),
        },
    }


def print_report(data: dict[str, Any]) -> None:
    """Print both comparisons of a result file as the terminal tables."""
    s, one, two = data["settings"], data["single"], data["two_ranks"]
    best_a, steps_a, ratio_a = one["best_s"], one["steps"], one["ratio"]
    best_train, best_e2e, steps_b = (
        two["best_train_s"],
        two["best_end_to_end_s"],
        two["steps_per_rank"],
    )

    def verdict(ratio: float, target: float) -> str:
        return f"≤ {target:.2f}× — {'met' if ratio <= target else 'NOT met'}"

    print_table(
        f"(a) one device, {steps_a:,} steps of batch {s['batch_size']} ({s['epochs']} epoch(s) of "
        f"{s['samples']:,} windows), 1 thread, best of {s['single_repeat']}",
        ["system", "best s", "ms/step", "ratio", "target"],
        [
            ["plain torch loop", best_a["torch"], 1000 * best_a["torch"] / steps_a, 1.0, ""],
            [
                "flodl (single device)",
                best_a["flodl"],
                1000 * best_a["flodl"] / steps_a,
                ratio_a,
                verdict(ratio_a, one["target"]),
            ],
        ],
    )
    print_table(
        f"(b) 2 equal CPU ranks (Gloo), {steps_b:,} steps of batch {s['batch_size']} per rank, "
        f"1 thread each, best of {s['repeat']}",
        ["system", "training s", "ms/step", "end-to-end s", "training ratio", "e2e ratio"],
        [
            [
                "torch DDP (gloo)",
                best_train["ddp"],
                1000 * best_train["ddp"] / steps_b,
                best_e2e["ddp"],
                1.0,
                1.0,
            ],
            [
                "flodl nccl_sync",
                best_train["flodl"],
                1000 * best_train["flodl"] / steps_b,
                best_e2e["flodl"],
                two["ratio_train"],
                two["ratio_end_to_end"],
            ],
        ],
    )
    print(
        f"\n(b) flodl / DDP training time {two['ratio_train']:.2f}×, target "
        f"{verdict(two['ratio_train'], two['target'])}"
    )
    load = data["load_average"]
    print(f"load average before {load['before']}, after {load['after']}")


def markdown(data: dict[str, Any]) -> str:
    """The docs/benchmarks.md section for a result file (every figure from it)."""
    s, one, two = data["settings"], data["single"], data["two_ranks"]
    train, e2e = two["best_train_s"], two["best_end_to_end_s"]
    per_step_ms = 1000 * (train["flodl"] - train["ddp"]) / two["steps_per_rank"]
    lines = [
        *section_head("Homogeneous overhead", data, f"{data['took_s']:.0f} s"),
        "",
        (
            f"The demo task, batch {s['batch_size']} per step, {s['epochs']} epoch(s) of "
            f"{s['samples']:,} windows, one CPU thread per process. World 1: flodl's "
            "single-device tier against a plain torch loop (same model, optimizer and batches), "
            f"{one['steps']:,} steps each, in one process, alternating, best of "
            f"{s['single_repeat']}. 2 equal ranks: flodl `nccl_sync` against "
            f"`DistributedDataParallel`, both on Gloo, {two['steps_per_rank']:,} steps per rank, "
            f"each run its own command, alternating, best of {s['repeat']}; training time (flodl: "
            "its epochs' `epoch_ms`; DDP: rank 0 between barriers) and end to end (the whole "
            "command, process start included)."
        ),
        "",
        *markdown_table(
            ["comparison", "flodl", "baseline", "ratio", "target"],
            [
                [
                    (
                        "world 1: the single-device tier vs a plain torch loop "
                        f"(1 thread, best of {s['single_repeat']})"
                    ),
                    f"{one['best_s']['flodl']:.2f} s",
                    f"{one['best_s']['torch']:.2f} s",
                    f"{one['ratio']:.2f}×",
                    f"≤ {one['target']:.2f}×: {met_text(one['met'])}",
                ],
                [
                    (
                        "2 equal ranks: `nccl_sync` vs DDP on Gloo, training time "
                        f"(best of {s['repeat']})"
                    ),
                    f"{train['flodl']:.2f} s",
                    f"{train['ddp']:.2f} s",
                    f"{two['ratio_train']:.2f}×",
                    f"≤ {two['target']:.2f}×: {met_text(two['met'])}",
                ],
                [
                    "the same, end to end including process start",
                    f"{e2e['flodl']:.2f} s",
                    f"{e2e['ddp']:.2f} s",
                    f"{two['ratio_end_to_end']:.2f}×",
                    "–",
                ],
            ],
        ),
        "",
        (
            f"With 2 ranks, flodl's training time is {abs(per_step_ms):.2f} ms per step "
            f"{'more' if per_step_ms >= 0 else 'less'} than DDP's (best runs, "
            f"{two['steps_per_rank']:,} steps per rank)."
        ),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    raw = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=3, help="runs per system (best of)")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--samples", type=int, default=64_000, help="training windows")
    parser.add_argument("--single-repeat", type=int, default=5, help="runs per system in (a)")
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--json", default=str(RESULTS_DIR / "overhead.json"))
    add_markdown_option(parser, RESULTS_DIR / "overhead.json")
    parser.add_argument("--one", choices=("flodl", "ddp"), help=argparse.SUPPRESS)
    args = parser.parse_args(raw)
    if args.one:
        result = (one_flodl if args.one == "flodl" else one_ddp)(args.samples, args.epochs)
        print(RESULT_TAG + json.dumps(result), flush=True)
        return 0
    if args.markdown is not None:
        print(markdown(json.loads(Path(args.markdown).read_text())))
        return 0
    if min(args.repeat, args.single_repeat, args.epochs, args.samples) < 1:
        parser.error("--repeat, --single-repeat, --epochs and --samples must be >= 1")

    import torch

    from flodl.demo import demo_task

    stamp = RunStamp("bench_overhead", raw)
    load_before = os.getloadavg()
    # (a) ------------------------------------------------------------------------------------
    torch.set_num_threads(1)
    task = demo_task(samples=args.samples, seed=SEED)
    flodl_single(task, 1)  # warm-up: first-call costs of both paths, not measured
    torch_single(task, 1)
    single: dict[str, list[float]] = {"flodl": [], "torch": []}
    for i in range(args.single_repeat):
        order = ("flodl", "torch") if i % 2 == 0 else ("torch", "flodl")
        for system in order:
            fn = flodl_single if system == "flodl" else torch_single
            single[system].append(fn(task, args.epochs))

    # (b) ------------------------------------------------------------------------------------
    multi: dict[str, list[dict[str, Any]]] = {"flodl": [], "ddp": []}
    for i in range(args.repeat):
        order = ("flodl", "ddp") if i % 2 == 0 else ("ddp", "flodl")
        for system in order:
            multi[system].append(spawn(system, args.samples, args.epochs, args.timeout))
    settings = {
        "samples": args.samples,
        "epochs": args.epochs,
        "batch_size": BATCH_SIZE,
        "repeat": args.repeat,
        "single_repeat": args.single_repeat,
    }
    data = report(settings, single, multi, load_before, stamp.header("overhead", "torch"))
    print_report(data)
    path = write_json(args.json, data)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
