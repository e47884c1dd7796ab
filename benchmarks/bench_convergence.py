"""Does data-parallel training with flodl reach the accuracy of one rank training alone?

    python benchmarks/bench_convergence.py [--seeds 3] [--epochs 2] [--samples 32000]
        [--modes nccl_sync,nccl_cadence,cpu_sync,cpu_cadence,cpu_async] [--ranks 2,3]

The demo task (:func:`flodl.demo.demo_task`: next-character prediction over the Python
standard library's source) trained solo (world 1, in process, one CPU thread) and with each
mode at each rank count (equal-speed local CPU ranks; the ``nccl_*`` modes use Gloo here,
there being no GPU), with the same total epochs, batch size per step and seeds. For every
(mode, ranks) it reports the final held-out next-character accuracy, mean ± sd over seeds, the
difference to solo in percentage points, and whether it meets the target: within 0.5 pp of
solo, or at most 2 % relative loss (better than solo counts as met).

Each training run is its own process (``--one MODE RANKS SEED``): the launcher re-executes
that command once per rank, so every rank reaches the same ``Trainer`` call. Seeds run in the
outer loop so machine drift spreads over every configuration. The corpus differs between
Python versions, so the accuracies are comparable only on one interpreter.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from _common import RESULTS_DIR, ensure_repo_on_path, machine_info, print_table, write_json

ensure_repo_on_path()

from flodl.demo.run import BATCH_SIZE  # noqa: E402 - the demo's batch size per rank step

MODES = ("nccl_sync", "nccl_cadence", "cpu_sync", "cpu_cadence", "cpu_async")
TARGET_PP = 0.5
TARGET_REL = 0.02
RESULT_TAG = "CONVERGENCE-RESULT "


def run_one(mode: str, ranks: int, seed: int, epochs: int, samples: int) -> dict[str, Any]:
    """One training run (in this process, or as the launcher of ``ranks`` rank processes)."""
    import torch

    from flodl import ElCheConfig, Trainer
    from flodl.demo import demo_task

    task = demo_task(samples=samples, seed=seed)
    losses: list[float] = []
    builder = (
        Trainer.builder(task.model_factory, task.optim_factory, task.train_step)
        .dataset(task.train)
        .batch_size(BATCH_SIZE)
        .num_epochs(epochs)
        .seed(seed)
        .progress(False)
        .metrics_fn(lambda m: losses.append(m.avg_loss))
    )
    if mode == "solo":
        torch.set_num_threads(1)  # a rank's share of this 2-core machine
    else:
        builder = builder.elche(ElCheConfig.preset(mode)).local_ranks(ranks)
    t0 = time.perf_counter()
    state = builder.run().join()  # a rank process trains here and exits
    wall = time.perf_counter() - t0
    model = task.model_factory("cpu")
    state.load_into(model)
    return {
        "mode": mode,
        "ranks": ranks,
        "seed": seed,
        "accuracy": task.eval_fn(model, task.held_out),
        "final_loss": losses[-1] if losses else None,
        "wall_s": wall,
        "trivial_accuracy": task.trivial_accuracy,
    }


def spawn_one(
    mode: str, ranks: int, seed: int, epochs: int, samples: int, timeout: float
) -> dict[str, Any]:
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--one",
        mode,
        str(ranks),
        str(seed),
        "--epochs",
        str(epochs),
        "--samples",
        str(samples),
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLODL_")}
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, check=False, env=env
    )
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_TAG):
            result: dict[str, Any] = json.loads(line[len(RESULT_TAG) :])
            return result
    raise RuntimeError(
        f"{mode} x{ranks} seed {seed} failed (exit {proc.returncode}):\n"
        f"{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1 (default 3)")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--samples", type=int, default=32_000, help="training windows")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--ranks", default="2,3", help="comma-separated rank counts")
    parser.add_argument("--timeout", type=float, default=300.0, help="per run, seconds")
    parser.add_argument("--json", default=str(RESULTS_DIR / "convergence.json"))
    parser.add_argument("--one", nargs=3, metavar=("MODE", "RANKS", "SEED"), help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.one:
        mode, ranks, seed = args.one[0], int(args.one[1]), int(args.one[2])
        result = run_one(mode, ranks, seed, args.epochs, args.samples)
        print(RESULT_TAG + json.dumps(result), flush=True)
        return 0

    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        parser.error(f"--modes: unknown {unknown}; expected some of {', '.join(MODES)}")
    rank_counts = [int(r) for r in args.ranks.split(",") if r.strip()]
    if any(r < 2 for r in rank_counts):
        parser.error("--ranks: every rank count must be >= 2")
    if args.seeds < 1 or args.epochs < 1:
        parser.error("--seeds and --epochs must be >= 1")
    configs = [("solo", 1)] + [(m, r) for r in rank_counts for m in modes]
    runs: list[dict[str, Any]] = []
    started = time.perf_counter()
    for seed in range(args.seeds):
        for mode, ranks in configs:
            r = spawn_one(mode, ranks, seed, args.epochs, args.samples, args.timeout)
            runs.append(r)
            print(
                f"  seed {seed} {mode:>12} x{ranks}: accuracy {100 * r['accuracy']:.2f} %, "
                f"{r['wall_s']:.1f} s",
                flush=True,
            )
    total_s = time.perf_counter() - started

    def accuracies(mode: str, ranks: int) -> list[float]:
        return [r["accuracy"] for r in runs if r["mode"] == mode and r["ranks"] == ranks]

    solo = accuracies("solo", 1)
    solo_mean = statistics.fmean(solo)
    rows: list[list[object]] = []
    summary: list[dict[str, Any]] = []
    for mode, ranks in configs:
        acc = accuracies(mode, ranks)
        mean = statistics.fmean(acc)
        sd = statistics.stdev(acc) if len(acc) > 1 else 0.0
        diff_pp = 100.0 * (mean - solo_mean)
        rel_loss = (solo_mean - mean) / solo_mean if solo_mean > 0 else 0.0
        met = None if mode == "solo" else (diff_pp >= -TARGET_PP or rel_loss <= TARGET_REL)
        walls = [r["wall_s"] for r in runs if r["mode"] == mode and r["ranks"] == ranks]
        rows.append(
            [
                mode,
                ranks,
                f"{100 * mean:.2f} ± {100 * sd:.2f}",
                "-" if mode == "solo" else f"{diff_pp:+.2f}",
                "-" if mode == "solo" else f"{100 * rel_loss:+.2f} %",
                statistics.fmean(walls),
                "-" if met is None else ("met" if met else "NOT met"),
            ]
        )
        summary.append(
            {
                "mode": mode,
                "ranks": ranks,
                "accuracy_mean": mean,
                "accuracy_sd": sd,
                "accuracies": acc,
                "diff_pp": None if mode == "solo" else diff_pp,
                "relative_loss": None if mode == "solo" else rel_loss,
                "mean_wall_s": statistics.fmean(walls),
                "target_met": met,
            }
        )
    trivial = runs[0]["trivial_accuracy"]
    print_table(
        f"Held-out next-character accuracy, {args.seeds} seeds, {args.epochs} epoch(s) of "
        f"{args.samples:,} windows, batch {BATCH_SIZE} per rank step (always-the-commonest "
        f"character: {100 * trivial:.1f} %; nccl_* on Gloo). Target: within {TARGET_PP} pp of "
        f"solo or ≤ {100 * TARGET_REL:.0f} % relative loss. Total {total_s:.0f} s.",
        ["mode", "ranks", "accuracy % (mean ± sd)", "vs solo pp", "rel. loss", "wall s", "target"],
        rows,
    )
    path = write_json(
        args.json,
        {
            "benchmark": "convergence",
            "machine": machine_info(),
            "load_average": os.getloadavg(),
            "settings": {
                "seeds": args.seeds,
                "epochs": args.epochs,
                "samples": args.samples,
                "batch_size": BATCH_SIZE,
                "modes": modes,
                "ranks": rank_counts,
            },
            "trivial_accuracy": trivial,
            "total_s": total_s,
            "summary": summary,
            "runs": runs,
        },
    )
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
