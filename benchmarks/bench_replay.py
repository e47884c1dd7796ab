"""bench_replay: how well does ``flodl sim --from-records`` predict the real run it replays?

For every mode and rig, a real training job runs (the demo task, real rank processes through
``Trainer.builder(...).local_ranks(N)``, one rank slowed with :func:`flodl.demo.slowdown.slowed`,
an eval every epoch, ``record_log(dir)`` into a temporary folder). Its record log is then read
back with :func:`flodl.monitor.records.read_tree` and replayed through the production
coordinator in the simulator (:func:`flodl.sim.replay.recorded_run`, :func:`~flodl.sim.replay.
replay`, seed 0), and :func:`~flodl.sim.replay.compare` gives the replay's error at the last
epoch: the recorded training span (``epoch`` records' ``t_s``, from training start) against the
predicted one, the sync counts, and the largest batch-share error in percentage points.

Rigs: ``2r`` is 2 ranks with rank 1 slowed ×3; ``3r`` is 3 ranks at ×1, ×1, ×2 (rank 2
slowed). ``--rounds N`` repeats the whole set (rounds in the outer loop, so machine drift
spreads over every configuration). Target: |time error| ≤ 15 % for every run of every mode.
Besides the headline figures each run keeps what the replay read (median ms per batch per
rank, averaging cost, callback ms per epoch) and the per-epoch recorded and predicted times,
to tell where a miss comes from.

    python benchmarks/bench_replay.py [--quick] [--modes ...] [--rigs 2r,3r] [--rounds N]
        [--samples 64000] [--epochs 2] [--json PATH] [--keep-records DIR]
    python benchmarks/bench_replay.py --markdown [PATH]   # the docs section, from the JSON
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from _common import (
    RESULTS_DIR,
    add_markdown_option,
    ensure_repo_on_path,
    machine_info,
    print_table,
    run_in_group,
    run_line,
    uptime,
    write_json,
)

ensure_repo_on_path()

from flodl.config import MODES  # noqa: E402 - after the path fix

TARGET = 0.15
"""|time error| bound for every run of every mode."""
BATCH_SIZE = 128
RIGS: dict[str, tuple[int, dict[int, float]]] = {
    "2r": (2, {1: 3.0}),
    "3r": (3, {2: 2.0}),
}
"""Rig name → (world size, rank → slowdown factor)."""
DEFAULT_JSON = RESULTS_DIR / "bench_replay.json"
COMMAND = "python benchmarks/bench_replay.py"


def rig_label(rig: str) -> str:
    world, slow = RIGS[rig]
    return "×" + ", ×".join(f"{slow.get(r, 1.0):g}" for r in range(world))


# ---------------------------------------------------------------------------------------------
# the training job (its launcher re-executes this script once per rank)
# ---------------------------------------------------------------------------------------------


def job(mode: str, rig: str, samples: int, epochs: int, records: str) -> None:
    """The body of ``--job``: launcher and ranks alike run this."""
    from flodl import ElCheConfig, Trainer
    from flodl.demo.slowdown import slowed
    from flodl.demo.task import demo_task

    world, slow = RIGS[rig]
    task = demo_task(samples=samples, seed=0)
    step = slowed(task.train_step, slow, step_per_forward=task.step_per_forward)
    (
        Trainer.builder(task.model_factory, task.optim_factory, step)
        .dataset(task.train)
        .device("cpu")  # on the CPU, like the baselines it is compared with
        .batch_size(BATCH_SIZE)
        .num_epochs(epochs)
        .seed(0)
        .elche(ElCheConfig.preset(mode))
        .local_ranks(world)
        .eval_dataset(task.held_out)
        .eval_fn(task.eval_fn)
        .progress(False)
        .record_log(records)
        .run()
        .join()
    )


def spawn_job(
    mode: str, rig: str, args: argparse.Namespace, records: Path
) -> tuple[float, str | None]:
    """Run one job in its own process group; returns (wall s, error or None). The group is
    killed on a timeout, so no rank outlives it."""
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--job",
        mode,
        rig,
        str(records),
        "--samples",
        str(args.samples),
        "--epochs",
        str(args.epochs),
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLODL_")}
    t0 = time.perf_counter()
    code, out, _ = run_in_group(
        cmd, args.timeout, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env
    )
    wall = time.perf_counter() - t0
    if code is None:
        return wall, f"timed out after {args.timeout:.0f} s"
    if code != 0:
        tail = out.decode(errors="replace").strip().splitlines()[-5:]
        return wall, f"exit {code}: " + " | ".join(tail)[-400:]
    return wall, None


# ---------------------------------------------------------------------------------------------
# the replay and its error
# ---------------------------------------------------------------------------------------------


def replay_records(records: Path) -> dict[str, Any]:
    """Replay one record log; the :func:`compare` figures plus what the replay read."""
    from flodl.monitor.records import read_tree
    from flodl.sim.replay import compare, recorded_run, replay

    tree = read_tree(records)
    run = recorded_run(tree)
    t0 = time.perf_counter()
    trace = replay(run)
    sim_s = time.perf_counter() - t0
    err = compare(run, trace)
    windows = [r["data"] for r in tree.get("root", ()) if r.get("kind") == "window"]
    return {
        **err,
        "replay_ok": trace.ok,
        "replay_reason": trace.reason,
        "replay_cpu_s": round(sim_s, 3),
        "recorded_epoch_s": [round(t, 3) for t in run.epoch_t_s],
        "predicted_epoch_s": [round(t, 3) for t in trace.epoch_at[: len(run.epoch_t_s)]],
        "median_ms_per_batch": [round(run.median_ms(r), 3) for r in range(run.world_size)],
        "averaging_ms": round(run.averaging_ms, 3),
        "callback_ms_per_epoch": round(run.callback_ms_per_epoch, 3),
        "windows": len(windows),
        "first_window_s": windows[0].get("t_s") if windows else None,
        "window_span_s": round(sum(float(w.get("span_ms", 0.0)) for w in windows) / 1000, 3),
    }


def one_run(mode: str, rig: str, rnd: int, args: argparse.Namespace) -> dict[str, Any]:
    world, _ = RIGS[rig]
    row: dict[str, Any] = {"mode": mode, "rig": rig, "world": world, "round": rnd}
    work = Path(tempfile.mkdtemp(prefix="flodl-bench-replay-"))
    try:
        records = work / "records"
        wall, error = spawn_job(mode, rig, args, records)
        row["job_wall_s"] = round(wall, 2)
        if error is None:
            try:
                row |= replay_records(records)
            except Exception as exc:  # noqa: BLE001 - a refused log or failed replay: a row saying so
                error = f"replay: {type(exc).__name__}: {exc}"[:400]
        row["ok"] = error is None
        if error is not None:
            row["error"] = error
        if args.keep_records is not None:
            dest = Path(args.keep_records) / f"{mode}-{rig}-{rnd}"
            if records.exists():
                shutil.rmtree(dest, ignore_errors=True)
                shutil.copytree(records, dest)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return row


# ---------------------------------------------------------------------------------------------
# summary, table, markdown
# ---------------------------------------------------------------------------------------------


def summarize(runs: list[dict[str, Any]], modes: list[str]) -> dict[str, Any]:
    """Per mode: the worst |time error| over its runs and whether every one is within the
    target (``None`` when a run failed and the others are within, or none ran); overall:
    the median and max |time error| over every successful run, met when every mode is."""
    per_mode = []
    for mode in modes:
        mine = [r for r in runs if r["mode"] == mode]
        good = [r for r in mine if r.get("ok") and r.get("time_error") is not None]
        worst = max(good, key=lambda r: abs(r["time_error"]), default=None)
        within = all(abs(r["time_error"]) <= TARGET for r in good)
        met: bool | None
        if not within:
            met = False
        elif not good or len(good) < len(mine):
            met = None
        else:
            met = True
        per_mode.append(
            {
                "mode": mode,
                "runs": len(mine),
                "ok": len(good),
                "worst_time_error": None if worst is None else worst["time_error"],
                "worst_rig": None if worst is None else worst["rig"],
                "max_abs_time_error": None if worst is None else abs(worst["time_error"]),
                "max_share_error_pp": max((r["share_error_pp"] for r in good), default=None),
                "met": met,
            }
        )
    errors = [abs(r["time_error"]) for r in runs if r.get("ok") and r.get("time_error") is not None]
    verdicts = [m["met"] for m in per_mode]
    overall: bool | None = (
        False if False in verdicts else (True if verdicts and all(verdicts) else None)
    )
    return {
        "modes": per_mode,
        "median_abs_time_error": statistics.median(errors) if errors else None,
        "max_abs_time_error": max(errors) if errors else None,
        "met": overall,
    }


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:+.1f} %"


def _verdict(met: bool | None) -> str:
    return {True: "met", False: "NOT met", None: "-"}[met]


def table_rows(runs: list[dict[str, Any]]) -> list[list[str]]:
    rows = []
    for r in runs:
        label = f"{r['rig']} ({rig_label(r['rig'])})"
        if not r.get("ok"):
            rows.append([r["mode"], label, str(r["round"]), "-", "-", "-", "-", "-", "-", "-"])
            continue
        rows.append(
            [
                r["mode"],
                label,
                str(r["round"]),
                f"{r['recorded_s']:.2f}",
                f"{r['predicted_s']:.2f}",
                _pct(r["time_error"]),
                f"{r['recorded_syncs']}/{r['predicted_syncs']}",
                f"{r['share_error_pp']:.1f}",
                " / ".join(f"{ms:.1f}" for ms in r["median_ms_per_batch"]),
                f"{r['averaging_ms']:.1f}, {r['callback_ms_per_epoch']:.0f}",
            ]
        )
    return rows


HEADERS = [
    "mode",
    "rig",
    "round",
    "recorded s",
    "predicted s",
    "time error",
    "syncs rec/pred",
    "share err pp",
    "ms/batch per rank",
    "avg ms, cb ms/ep",
]


def print_report(data: dict[str, Any]) -> None:
    s = data["settings"]
    print_table(
        f"Replay error on real runs: demo task, {s['samples']:,} windows × {s['epochs']} "
        f"epoch(s), batch {BATCH_SIZE}, {s['rounds']} round(s); training span at the last "
        f"epoch, recorded vs predicted (flodl sim --from-records, seed 0). "
        f"Total {data['total_s']:.0f} s.",
        HEADERS,
        table_rows(data["runs"]),
    )
    summary = data["summary"]
    print(f"\nper mode, worst |time error| over its runs (target ≤ {100 * TARGET:.0f} %):")
    for m in summary["modes"]:
        print(
            f"  {m['mode']:<13} {_pct(m['worst_time_error']):>9} ({m['worst_rig'] or '-'}, "
            f"{m['ok']}/{m['runs']} runs)  {_verdict(m['met'])}"
        )
    med, mx = summary["median_abs_time_error"], summary["max_abs_time_error"]
    print(
        f"median |time error| {'-' if med is None else f'{100 * med:.1f} %'}, max "
        f"{'-' if mx is None else f'{100 * mx:.1f} %'}: target {_verdict(summary['met'])}"
    )
    for r in data["runs"]:
        if not r.get("ok"):
            print(f"  {r['mode']} {r['rig']} round {r['round']} failed: {r.get('error')}")


def markdown(data: dict[str, Any]) -> str:
    """The docs/benchmarks.md section for one JSON result (every figure from it)."""
    s = data["settings"]
    summary = data["summary"]
    lines = [
        f"### Replay error on real runs (`{data['command']}`)",
        "",
        (run_line(data, f"{data['total_s']:.0f} s")),
        "",
        (
            f"Each row is one real job: the demo task, {s['samples']:,} windows × {s['epochs']} "
            f"epoch(s), batch {BATCH_SIZE}, an eval every epoch, local rank processes at the rig's "
            "slowdowns, `record_log(dir)`. Its log is replayed by `flodl.sim.replay` (seed 0): "
            "training span at the last epoch, recorded vs predicted; syncs recorded / predicted; "
            "the largest batch-share error; and what the replay read (median ms per batch of each "
            "rank, the averaging cost, the callbacks per epoch)."
        ),
        "",
        "| " + " | ".join(HEADERS) + " |",
        "|" + "---|" * len(HEADERS),
    ]
    lines += ["| " + " | ".join(row) + " |" for row in table_rows(data["runs"])]
    lines += ["", f"Worst |time error| per mode over its runs (target ≤ {100 * TARGET:.0f} %):", ""]
    lines += ["| mode | worst time error | rig | runs ok | max share error pp | target |"]
    lines += ["|---|---|---|---|---|---|"]
    for m in summary["modes"]:
        share = m["max_share_error_pp"]
        lines.append(
            f"| {m['mode']} | {_pct(m['worst_time_error'])} | {m['worst_rig'] or '-'} | "
            f"{m['ok']}/{m['runs']} | {'-' if share is None else f'{share:.1f}'} | "
            f"{'**met**' if m['met'] else ('**not met**' if m['met'] is False else '-')} |"
        )
    med, mx = summary["median_abs_time_error"], summary["max_abs_time_error"]
    verdict = {True: "**met**", False: "**not met**", None: "not established"}[summary["met"]]
    lines += [
        "",
        (
            f"Median |time error| {'-' if med is None else f'{100 * med:.1f} %'}, max "
            f"{'-' if mx is None else f'{100 * mx:.1f} %'}. Target (|time error| ≤ "
            f"{100 * TARGET:.0f} % for every mode's runs): {verdict}."
        ),
    ]
    failed = [r for r in data["runs"] if not r.get("ok")]
    for r in failed:
        lines.append(f"- {r['mode']} {r['rig']} round {r['round']} failed: {r.get('error')}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# entry
# ---------------------------------------------------------------------------------------------


def _csv(text: str, allowed: Any, what: str, p: argparse.ArgumentParser) -> list[str]:
    items = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in items if x not in allowed]
    if bad or not items:
        p.error(f"--{what}: unknown {bad}; expected some of {', '.join(allowed)}")
    return [x for x in allowed if x in items]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="suite smoke size: 2r only, smaller")
    p.add_argument("--modes", default=",".join(MODES), help="subset of: %(default)s")
    p.add_argument("--rigs", default=None, help="subset of 2r,3r (default both; quick 2r)")
    p.add_argument("--rounds", type=int, default=1, help="repeats of the whole set")
    p.add_argument("--samples", type=int, default=None, help="windows (default 64000; quick 24000)")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--timeout", type=float, default=240.0, help="per job, seconds")
    p.add_argument("--json", type=Path, default=DEFAULT_JSON)
    p.add_argument("--keep-records", default=None, metavar="DIR", help="copy each log here")
    add_markdown_option(p, DEFAULT_JSON)
    p.add_argument("--job", nargs=3, metavar=("MODE", "RIG", "DIR"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.mode_list = _csv(args.modes, list(MODES), "modes", p)
    args.rig_list = _csv(args.rigs or ("2r" if args.quick else "2r,3r"), list(RIGS), "rigs", p)
    if args.samples is None:
        args.samples = 24_000 if args.quick else 64_000
    if args.rounds < 1 or args.epochs < 1 or args.samples < BATCH_SIZE * 3:
        p.error(f"--rounds and --epochs must be >= 1, --samples >= {BATCH_SIZE * 3}")
    return args


def main(argv: list[str] | None = None) -> int:
    raw = sys.argv[1:] if argv is None else argv
    args = parse_args(raw)
    if args.job:
        mode, rig, records = args.job
        job(mode, rig, args.samples, args.epochs, records)
        return 0
    if args.markdown is not None:
        print(markdown(json.loads(Path(args.markdown).read_text())))
        return 0
    uptime_before = uptime()
    date = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    print(f"{date}; {uptime_before}", flush=True)
    runs: list[dict[str, Any]] = []
    started = time.perf_counter()
    for rnd in range(args.rounds):
        for rig in args.rig_list:
            for mode in args.mode_list:
                row = one_run(mode, rig, rnd, args)
                runs.append(row)
                if row["ok"]:
                    print(
                        f"  round {rnd} {rig} {mode:>12}: recorded {row['recorded_s']:.2f} s, "
                        f"predicted {row['predicted_s']:.2f} s ({_pct(row['time_error'])}), "
                        f"syncs {row['recorded_syncs']}/{row['predicted_syncs']}, "
                        f"job {row['job_wall_s']:.0f} s",
                        flush=True,
                    )
                else:
                    print(f"  round {rnd} {rig} {mode:>12}: FAILED {row['error']}", flush=True)
    total_s = time.perf_counter() - started
    shown = [a for a in raw if not a.startswith("--json") and a != str(args.json)]
    data = {
        "benchmark": "replay",
        "command": " ".join([COMMAND, *shown]),
        "date": date,
        "uptime_before": uptime_before,
        "uptime_after": uptime(),
        "machine": machine_info(),
        "settings": {
            "modes": args.mode_list,
            "rigs": {r: rig_label(r) for r in args.rig_list},
            "rounds": args.rounds,
            "samples": args.samples,
            "epochs": args.epochs,
            "batch_size": BATCH_SIZE,
        },
        "target_time_error": TARGET,
        "total_s": total_s,
        "runs": runs,
        "summary": summarize(runs, args.mode_list),
    }
    print_report(data)
    path = write_json(args.json, data)
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
