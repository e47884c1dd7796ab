"""Does data-parallel training with flodl reach the accuracy of one rank training alone?

    python benchmarks/bench_convergence.py [--seeds 3] [--epochs 2] [--samples 32000]
        [--modes nccl_sync,nccl_cadence,cpu_sync,cpu_cadence,cpu_async] [--ranks 2,3]
    python benchmarks/bench_convergence.py --markdown [JSON]   # the docs section, from the JSON

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
        .device("cpu")  # on the CPU, like the baselines it is compared with
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


def configs_of(modes: list[str], rank_counts: list[int]) -> list[tuple[str, int]]:
    """The (mode, ranks) a run trains: solo first, then every mode at each rank count."""
    return [("solo", 1)] + [(m, r) for r in rank_counts for m in modes]


def summarize(runs: list[dict[str, Any]], configs: list[tuple[str, int]]) -> list[dict[str, Any]]:
    """Per (mode, ranks) of ``configs`` (solo first): the accuracy's mean and sd over seeds, the
    difference to solo in pp, the relative loss and whether it meets the target (None: solo)."""

    def mine(mode: str, ranks: int) -> list[dict[str, Any]]:
        return [r for r in runs if r["mode"] == mode and r["ranks"] == ranks]

    solo_mean = statistics.fmean(r["accuracy"] for r in mine("solo", 1))
    summary: list[dict[str, Any]] = []
    for mode, ranks in configs:
        acc = [r["accuracy"] for r in mine(mode, ranks)]
        mean = statistics.fmean(acc)
        diff_pp = 100.0 * (mean - solo_mean)
        rel_loss = (solo_mean - mean) / solo_mean if solo_mean > 0 else 0.0
        solo = mode == "solo"
        summary.append(
            {
                "mode": mode,
                "ranks": ranks,
                "accuracy_mean": mean,
                "accuracy_sd": statistics.stdev(acc) if len(acc) > 1 else 0.0,
                "accuracies": acc,
                "diff_pp": None if solo else diff_pp,
                "relative_loss": None if solo else rel_loss,
                "mean_wall_s": statistics.fmean(r["wall_s"] for r in mine(mode, ranks)),
                "target_met": None if solo else (diff_pp >= -TARGET_PP or rel_loss <= TARGET_REL),
            }
        )
    return summary


def report(
    settings: dict[str, Any], runs: list[dict[str, Any]], total_s: float, header: dict[str, Any]
) -> dict[str, Any]:
    """The result file: ``header`` (:meth:`RunStamp.header`), the load average now, the
    ``settings``, the targets, the trivial accuracy, the summary of ``runs`` and the runs."""
    configs = configs_of(settings["modes"], settings["ranks"])
    return {
        **header,
        "load_average": os.getloadavg(),
        "settings": settings,
        "targets": {"pp": TARGET_PP, "relative_loss": TARGET_REL},
        "trivial_accuracy": runs[0]["trivial_accuracy"],
        "total_s": total_s,
        "summary": summarize(runs, configs),
        "runs": runs,
    }


def _signed(x: float, fmt: str, unit: str = "") -> str:
    """``x`` formatted with ``fmt`` (a signed spec), with a typographic minus, then ``unit``."""
    return format(x, fmt).replace("-", "−") + unit


def markdown(data: dict[str, Any]) -> str:
    """The docs/benchmarks.md section for a result file (every figure from it)."""
    s, t = data["settings"], data["targets"]
    steps = s["epochs"] * (s["samples"] // s["batch_size"])
    per_rank = ", ".join(f"{steps // w:,} at {w} ranks" for w in s["ranks"])
    seeds = "seed 0" if s["seeds"] == 1 else f"seeds 0–{s['seeds'] - 1}"
    lines = [
        *section_head("Convergence parity", data, f"{data['took_s']:.0f} s"),
        "",
        (
            f"The demo task trained solo (one process, one thread) and with each mode at "
            f"{' and '.join(str(w) for w in s['ranks'])} equal-speed local CPU ranks: the same "
            f"{s['epochs']} epoch(s) of {s['samples']:,} windows, batch {s['batch_size']} per rank "
            f"step, {seeds}. Held-out next-character accuracy, mean ± sd over the "
            f"{s['seeds']} seed(s); always predicting the commonest character scores "
            f"{100 * data['trivial_accuracy']:.1f} %. Solo takes about {steps:,} optimizer "
            f"steps; split evenly, a rank takes about {per_rank}. Target: within {t['pp']:g} pp "
            f"of solo, or at most {100 * t['relative_loss']:g} % relative loss (better than solo "
            "counts)."
        ),
        "",
    ]
    rows = []
    for m in data["summary"]:
        acc = f"{100 * m['accuracy_mean']:.2f} ± {100 * m['accuracy_sd']:.2f}"
        if m["diff_pp"] is None:
            rows.append([m["mode"], str(m["ranks"]), acc, "–", "–", "–"])
            continue
        verdict = met_text(m["target_met"])
        if m["target_met"] and m["diff_pp"] < -t["pp"]:
            verdict += " (relative loss)"
        rows.append(
            [
                m["mode"],
                str(m["ranks"]),
                acc,
                _signed(m["diff_pp"], "+.2f"),
                _signed(100 * m["relative_loss"], "+.1f", " %"),
                verdict,
            ]
        )
    within = f"within {t['pp']:g} pp / {100 * t['relative_loss']:g} %"
    lines += markdown_table(
        ["mode", "ranks", "accuracy %", "vs solo pp", "relative loss", within], rows
    )
    graded = [m for m in data["summary"] if m["diff_pp"] is not None]
    met = [m for m in graded if m["target_met"]]
    worst = min(graded, key=lambda m: m["diff_pp"])
    lines += [
        "",
        (
            f"{len(met)} of {len(graded)} (mode, ranks) within the bound: the target is "
            f"{met_text(len(met) == len(graded))} at this size. Furthest from solo: "
            f"{worst['mode']} at {worst['ranks']} ranks, {_signed(worst['diff_pp'], '+.2f')} pp."
        ),
    ]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The options, plus ``mode_list`` and ``rank_list`` when they select a run to measure."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1 (default 3)")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--samples", type=int, default=32_000, help="training windows")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--ranks", default="2,3", help="comma-separated rank counts")
    parser.add_argument("--timeout", type=float, default=300.0, help="per run, seconds")
    parser.add_argument("--json", default=str(RESULTS_DIR / "convergence.json"))
    add_markdown_option(parser, RESULTS_DIR / "convergence.json")
    parser.add_argument("--one", nargs=3, metavar=("MODE", "RANKS", "SEED"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one or args.markdown is not None:
        return args
    args.mode_list = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in args.mode_list if m not in MODES]
    if unknown:
        parser.error(f"--modes: unknown {unknown}; expected some of {', '.join(MODES)}")
    args.rank_list = [int(r) for r in args.ranks.split(",") if r.strip()]
    if any(r < 2 for r in args.rank_list):
        parser.error("--ranks: every rank count must be >= 2")
    if args.seeds < 1 or args.epochs < 1:
        parser.error("--seeds and --epochs must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    raw = sys.argv[1:] if argv is None else argv
    args = parse_args(raw)
    if args.one:
        mode, ranks, seed = args.one[0], int(args.one[1]), int(args.one[2])
        result = run_one(mode, ranks, seed, args.epochs, args.samples)
        print(RESULT_TAG + json.dumps(result), flush=True)
        return 0
    if args.markdown is not None:
        print(markdown(json.loads(Path(args.markdown).read_text())))
        return 0

    stamp = RunStamp("bench_convergence", raw)
    configs = configs_of(args.mode_list, args.rank_list)
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
    settings = {
        "seeds": args.seeds,
        "epochs": args.epochs,
        "samples": args.samples,
        "batch_size": BATCH_SIZE,
        "modes": args.mode_list,
        "ranks": args.rank_list,
    }
    data = report(settings, runs, total_s, stamp.header("convergence", "torch"))
    print_table(
        f"Held-out next-character accuracy, {args.seeds} seeds, {args.epochs} epoch(s) of "
        f"{args.samples:,} windows, batch {BATCH_SIZE} per rank step (always-the-commonest "
        f"character: {100 * data['trivial_accuracy']:.1f} %; nccl_* on Gloo). Target: within "
        f"{TARGET_PP} pp of solo or ≤ {100 * TARGET_REL:.0f} % relative loss. Total "
        f"{total_s:.0f} s.",
        ["mode", "ranks", "accuracy % (mean ± sd)", "vs solo pp", "rel. loss", "wall s", "target"],
        [
            [
                m["mode"],
                m["ranks"],
                f"{100 * m['accuracy_mean']:.2f} ± {100 * m['accuracy_sd']:.2f}",
                "-" if m["diff_pp"] is None else f"{m['diff_pp']:+.2f}",
                "-" if m["relative_loss"] is None else f"{100 * m['relative_loss']:+.2f} %",
                m["mean_wall_s"],
                "-" if m["target_met"] is None else ("met" if m["target_met"] else "NOT met"),
            ]
            for m in data["summary"]
        ],
    )
    path = write_json(args.json, data)
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
