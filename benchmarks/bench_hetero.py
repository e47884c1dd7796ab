"""bench_hetero: ranks of unequal speed on realistic steps; every flodl mode against DDP, local SGD,
torchft LocalSGD and DiLoCo, and the balance bound, in the same sitting.

Workloads (the demo task, :func:`flodl.demo.demo_task`: next-character prediction over the
standard library's source):

* ``realistic``: a 2.2 M-parameter :class:`~flodl.demo.CharMLP` (32 characters of context,
  embedding 32, two hidden layers of 1,024) whose step takes ~25 ms on one core;
* ``micro``: the 0.1 M-parameter default model (~1 ms steps): a communication-bound row, where
  DDP's all-reduce per step dominates; it says little about a real model.

Rigs: ``x1`` (2 equal ranks), ``x2`` / ``x3`` (2 ranks, rank 1 slowed ×2 / ×3), ``mixed4`` (4
ranks slowed ×1, ×1, ×2, ×3), ``micro-x3`` (``x3`` on the micro workload).

Every system trains one epoch of the same samples with the same model, per-rank batch, Adam
(lr 3e-3), one torch thread per rank and the same slowdown: after each step's forward a slowed
rank sleeps ``(factor − 1) ×`` the step's own CPU time on its training thread (``time.thread_time``
over the forward and everything the thread ran since the previous forward: backward, optimizer
step, batch fetch; :class:`flodl.demo.lockstep.TimedStep` with ``measure="thread_cpu"``), so time
blocked in a collective or waiting for a core is never multiplied. Systems:

* flodl ``nccl_sync``, ``nccl_cadence`` (Gloo collectives on CPU), ``cpu_sync``,
  ``cpu_cadence``, ``cpu_async``: ``Trainer.builder(...).local_ranks(N)`` in a subprocess;
* ``ddp``: ``torch.nn.parallel.DistributedDataParallel`` on Gloo, an equal split per epoch;
* ``local_sgd``: ``torch``'s ``PeriodicModelAverager`` (parameters averaged every ``H`` steps,
  equal split);
* ``torchft`` / ``diloco``: ``torchft.local_sgd.LocalSGD`` / ``DiLoCo`` (outer Nesterov SGD, lr
  0.7, momentum 0.9), one replica group per rank, one lighthouse;
* ``bound``: the balance bound (``_bound.py``): every rank trains at once without communicating;
  ``samples / Σ throughput`` is the span of perfect balance with free averaging.

``H`` (the local-SGD baselines' period) is flodl ``cpu_cadence``'s mean window (steps per rank per
averaging) in round 0 of the rig, so every averaging system averages about as often.

Per run: the training span (first forward on any rank → last forward on any rank), the total
(launch → every process done, start-up included), held-out cross entropy and accuracy of the
final model, syncs, steps and idle ``1 − busy / span`` per rank (busy = CPU time + slowdown
sleep). Rounds run the systems in alternating order (forward, then reversed); the summary is the
median over rounds of each figure and of each per-round ratio (DDP's span / this span; bound span
/ this span = fraction of the bound). For flodl ``cpu_cadence`` at ``x3`` the record log's window
records give where the time went (the breakdown table). How fast the machine ran each run is
shown per round: the ranks' mean compute per step (``TimedStep``'s CPU time, sleeps left out)
against the same round's bound, and the cores other processes used during the run
(``_common.CpuMeter``); a round whose steps cost more ran on a slower machine, which explains
its span whatever the system's schedule.

Targets (issue 16; benchmark, never a test): at ``x3`` and ``mixed4`` the cadence modes reach ≥ 0.9
of the bound in the median (≥ 0.85 in every round), ≥ 2.5× DDP's span, ≥ 2.4× torchft
LocalSGD's, held-out loss within 1 % of DDP's; at ``x1`` no flodl mode slower than DDP.

    python benchmarks/bench_hetero.py [--quick] [--rigs x1,x2,x3,mixed4,micro-x3] [--rounds 3]
    python benchmarks/bench_hetero.py --markdown [JSON]   # the docs/benchmarks.md section
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _common import (
    REPO_ROOT,
    RESULTS_DIR,
    CpuMeter,
    add_markdown_option,
    ensure_repo_on_path,
    machine_info,
    markdown_table,
    print_table,
    run_line,
    uptime,
    write_json,
)

ensure_repo_on_path()

from _ddp import TimedStep, read_step_record  # noqa: E402

from flodl.demo.lockstep import run_lockstep  # noqa: E402
from flodl.demo.task import STEP_PER_FORWARD  # noqa: E402

FLODL_MODES = ("nccl_sync", "nccl_cadence", "cpu_sync", "cpu_cadence", "cpu_async")
CADENCE_MODES = ("nccl_cadence", "cpu_cadence")
BASELINES = ("ddp", "local_sgd", "torchft", "diloco")
SYSTEMS = (*FLODL_MODES, *BASELINES, "bound")
WORKLOADS: dict[str, dict[str, int]] = {
    "realistic": {"context": 32, "embed": 32, "hidden": 1024},
    "micro": {},
}
SAMPLES = {"realistic": 24_000, "micro": 96_000}
QUICK_SAMPLES = {"realistic": 8_000, "micro": 32_000}
MEASURE = "thread_cpu"
THREADS = 1
DEFAULT_SYNC_EVERY = 16
"""The local-SGD baselines' period when no cpu_cadence run gave a window."""

TARGET_BOUND_MEDIAN = 0.9
TARGET_BOUND_EVERY = 0.85
TARGET_VS_DDP = 2.5
TARGET_VS_TORCHFT = 2.4
TARGET_LOSS_REL = 0.01
TARGET_RIGS = ("x3", "mixed4")


@dataclass(frozen=True)
class Rig:
    name: str
    world: int
    slow: dict[int, float]
    workload: str

    def label(self) -> str:
        factors = "/".join(f"×{self.slow.get(r, 1.0):g}" for r in range(self.world))
        return f"{self.name} ({self.world} ranks {factors}, {self.workload})"


RIGS = {
    "x1": Rig("x1", 2, {}, "realistic"),
    "x2": Rig("x2", 2, {1: 2.0}, "realistic"),
    "x3": Rig("x3", 2, {1: 3.0}, "realistic"),
    "mixed4": Rig("mixed4", 4, {2: 2.0, 3: 3.0}, "realistic"),
    "micro-x3": Rig("micro-x3", 2, {1: 3.0}, "micro"),
}


# ---------------------------------------------------------------------------------------------
# flodl, in a subprocess (its launcher re-executes this script once per rank)
# ---------------------------------------------------------------------------------------------


def flodl_job(spec_path: str) -> None:
    """The body of ``--flodl-job SPEC``: launcher and ranks alike run this."""
    import torch

    from flodl import ElCheConfig, Trainer
    from flodl.demo import Slowdown, demo_task

    spec = json.loads(Path(spec_path).read_text())
    out = Path(spec["out_dir"])
    task = demo_task(samples=spec["samples"], seed=spec["seed"], **spec["task"])
    spf = float(task.step_per_forward)
    rank = os.environ.get("FLODL_RANK")
    # ranks time their steps; the launcher never calls train_step
    record = out / f"rank{rank}.steps" if rank is not None else None
    slow = {int(r): float(f) for r, f in spec["slow"].items()}
    timed = TimedStep(
        task.train_step, Slowdown.for_rank(slow, step_per_forward=spf), spf, record, MEASURE
    )

    def step(model: Any, batch: Any) -> Any:
        if torch.get_num_threads() != THREADS:  # the same threads as every other system
            torch.set_num_threads(THREADS)
        return timed(model, batch)

    epochs: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    cpu0 = time.process_time()
    handle = (
        Trainer.builder(task.model_factory, task.optim_factory, step)
        .dataset(task.train)
        .device("cpu")  # on the CPU, like the baselines it is compared with
        .batch_size(spec["batch_size"])
        .num_epochs(1)
        .elche(ElCheConfig.preset(spec["mode"]))
        .local_ranks(int(spec["world"]))
        .seed(spec["seed"])
        .progress(False)
        .record_log(str(out / "records"))
        .metrics_fn(lambda m: epochs.append(m.model_dump()))
        .run()
    )
    state = handle.join()
    total_s = time.perf_counter() - t0
    # the launcher process's CPU over the run: the coordinator, the reduce server and the
    # launcher's threads, all competing with the ranks for the machine's cores
    launcher_cpu_s = time.process_time() - cpu0
    model = task.model_factory("cpu")
    state.load_into(model)
    torch.set_num_threads(THREADS)
    result = {
        "metric": task.eval_fn(model, task.held_out),
        "loss": task.loss_fn(model, task.held_out),
        "total_s": total_s,
        "launcher_cpu_s": launcher_cpu_s,
        "epochs": epochs,
    }
    (out / "result.json").write_text(json.dumps(result))


def run_flodl(cfg: dict[str, Any], out_dir: Path, timeout_s: float) -> dict[str, Any]:
    out_dir.mkdir(parents=True, exist_ok=True)
    spec = out_dir / "spec.json"
    spec.write_text(json.dumps({**cfg, "out_dir": str(out_dir)}))
    log = out_dir / "job.log"
    t0 = time.perf_counter()
    with log.open("wb") as sink:
        proc = subprocess.run(
            [sys.executable, str(Path(__file__).resolve()), "--flodl-job", str(spec)],
            cwd=REPO_ROOT,
            stdout=sink,
            stderr=subprocess.STDOUT,
            timeout=timeout_s,
            check=False,
        )
    total_s = time.perf_counter() - t0
    if proc.returncode != 0 or not (out_dir / "result.json").exists():
        tail = log.read_text(errors="replace")[-1500:]
        raise RuntimeError(f"flodl {cfg['mode']} exited {proc.returncode}: {tail}")
    result: dict[str, Any] = json.loads((out_dir / "result.json").read_text())
    result["total_s"] = total_s  # the job process's own start-up included, as for the others
    result["ranks"] = rank_records(out_dir, "rank", int(cfg["world"]), f"flodl {cfg['mode']}")
    last = result["epochs"][-1] if result["epochs"] else {}
    result["syncs"] = int(last.get("syncs", 0))
    result["breakdown"] = breakdown(out_dir / "records" / "root.log")
    if result["breakdown"] is not None:
        result["breakdown"]["launcher_cpu_s"] = result.get("launcher_cpu_s")
    return result


def rank_records(out_dir: Path, prefix: str, world: int, what: str) -> list[dict[str, Any]]:
    ranks = []
    for r in range(world):
        rec = read_step_record(out_dir / f"{prefix}{r}.steps")
        if rec is None:
            raise RuntimeError(f"{what}: rank {r} left no step record")
        ranks.append(rec)
    return ranks


def breakdown(root_log: Path) -> dict[str, Any] | None:
    """Where a flodl run's time went, from the coordinator's ``window`` records (one per
    averaging cycle): cycles, the averaging cost, each rank's busy / idle / induced idle, and
    the steps per cycle early and late (calibration and the anchor's growth)."""
    try:
        lines = root_log.read_text().splitlines()
    except OSError:
        return None
    windows = []
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and rec.get("kind") == "window":
            windows.append(rec["data"])
    if not windows:
        return None
    world = max(len(w.get("steps") or []) for w in windows)

    def total(key: str, r: int) -> float:
        return sum(float((w.get(key) or [0.0] * world)[r] or 0.0) for w in windows) / 1000.0

    steps = [w.get("steps") or [] for w in windows]
    return {
        "cycles": len(windows),
        "span_s": sum(float(w.get("span_ms") or 0.0) for w in windows) / 1000.0,
        "sync_s": sum(float(w.get("sync_ms") or 0.0) for w in windows) / 1000.0,
        "averaging_s": sum(float(w.get("averaging_ms") or 0.0) for w in windows) / 1000.0,
        "busy_s": [total("busy_ms", r) for r in range(world)],
        "idle_s": [total("idle_ms", r) for r in range(world)],
        "induced_s": [total("induced_ms", r) for r in range(world)],
        "first_steps": steps[:3],
        "last_steps": steps[-3:],
    }


# ---------------------------------------------------------------------------------------------
# one run → one row
# ---------------------------------------------------------------------------------------------


def summarize(system: str, rig: Rig, raw: dict[str, Any]) -> dict[str, Any]:
    """Span, idle fractions and counts of one run (raw per-rank TimedStep summaries)."""
    ranks = raw["ranks"]
    t0 = min(r["t0"] for r in ranks)
    t1 = max(r["t1"] for r in ranks)
    span = t1 - t0
    return {
        "system": system,
        "rig": rig.name,
        "ok": True,
        "span_s": span,
        "total_s": raw["total_s"],
        "metric": raw["metric"],
        "loss": raw["loss"],
        "syncs": raw.get("syncs"),
        "steps": [r["steps"] for r in ranks],
        "idle": [max(0.0, 1.0 - r["busy_s"] / span) if span > 0 else None for r in ranks],
        "cpu_ms_per_step": [
            1000.0 * r["cpu_s"] / r["steps"] if r.get("cpu_s") is not None and r["steps"] else None
            for r in ranks
        ],
        "sync_every": raw.get("sync_every"),
        "breakdown": raw.get("breakdown"),
    }


def mean_window(row: dict[str, Any]) -> float | None:
    """Steps per rank per averaging, averaged over ranks (flodl's mean ElChe window)."""
    syncs = row.get("syncs") or 0
    if syncs <= 0:
        return None
    return statistics.fmean(row["steps"]) / syncs


def run_one(
    system: str, rig: Rig, args: argparse.Namespace, work: Path, sync_every: int
) -> dict[str, Any]:
    samples = args.samples[rig.workload]
    cfg: dict[str, Any] = {
        "world": rig.world,
        "samples": samples,
        "seed": args.seed,
        "epochs": 1,
        "batch_size": args.batch_size,
        "slow": {str(r): f for r, f in rig.slow.items()},
        "task": WORKLOADS[rig.workload],
        "measure": MEASURE,
        "threads": THREADS,
    }
    out = work / f"{rig.name}-{system}"
    shutil.rmtree(out, ignore_errors=True)
    try:
        if system == "bound":
            from _bound import run_bound

            bound = run_bound(
                {
                    **cfg,
                    "step_per_forward": STEP_PER_FORWARD,
                    "warmup_s": args.bound_warmup,
                    "measure_s": args.bound_window,
                },
                out,
                args.timeout,
            )
            return {
                "system": system,
                "rig": rig.name,
                "ok": True,
                "span_s": bound["span_s"],
                "total_s": bound["total_s"],
                "throughput": bound["throughput"],
                "cpu_ms_per_step": bound["cpu_ms_per_step"],
            }
        if system in FLODL_MODES:
            raw = run_flodl({**cfg, "mode": system}, out, args.timeout)
        elif system in ("ddp", "local_sgd"):
            raw = run_lockstep(
                world=rig.world,
                samples=samples,
                seed=args.seed,
                epochs=1,
                batch_size=args.batch_size,
                slow=rig.slow,
                step_per_forward=STEP_PER_FORWARD,
                threads=THREADS,
                out_dir=out,
                timeout_s=args.timeout,
                task=WORKLOADS[rig.workload],
                measure=MEASURE,
                period=None if system == "ddp" else sync_every,
            )
            if system == "local_sgd":
                raw["sync_every"] = sync_every
        else:
            if args.torchft_reason is not None:
                return {
                    "system": system,
                    "rig": rig.name,
                    "ok": False,
                    "error": args.torchft_reason,
                }
            from _torchft import run_localsgd

            algorithm = "diloco" if system == "diloco" else "localsgd"
            raw = run_localsgd(
                {
                    **cfg,
                    "step_per_forward": STEP_PER_FORWARD,
                    "sync_every": sync_every,
                    "algorithm": algorithm,
                },
                out,
                args.timeout,
            )
            raw["syncs"] = raw["ranks"][0]["syncs"]
            raw["sync_every"] = sync_every
    except Exception as exc:  # noqa: BLE001 - a failed system is a row that says why
        return {
            "system": system,
            "rig": rig.name,
            "ok": False,
            "error": f"{type(exc).__name__}: {exc}"[:2000],
        }
    return summarize(system, rig, raw)


# ---------------------------------------------------------------------------------------------
# rounds → medians → targets
# ---------------------------------------------------------------------------------------------


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def aggregate(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (rig, system), in first-seen order: the medians over rounds of span, total, loss and
    accuracy, and of the per-round ratios against DDP, torchft and the bound (each ratio
    against the baseline of the same round)."""
    by_round: dict[tuple[str, int, str], dict[str, Any]] = {}
    order: list[tuple[str, str]] = []
    for run in runs:
        key = (run["rig"], run["system"])
        if key not in order:
            order.append(key)
        if run.get("ok"):
            by_round[(run["rig"], run.get("round", 0), run["system"])] = run
    out = []
    for rig, system in order:
        mine = [r for r in runs if r["rig"] == rig and r["system"] == system]
        ok = [r for r in mine if r.get("ok")]
        if not ok:
            out.append(
                {"rig": rig, "system": system, "ok": False, "error": mine[0].get("error", "")}
            )
            continue

        def ratios(base: str, ok: list[dict[str, Any]] = ok, rig: str = rig) -> list[float]:
            vals = []
            for r in ok:
                b = by_round.get((rig, r.get("round", 0), base))
                if b is not None and r["span_s"] > 0:
                    vals.append(b["span_s"] / r["span_s"])
            return vals

        losses = []
        for r in ok:
            d = by_round.get((rig, r.get("round", 0), "ddp"))
            if d is not None and r.get("loss") is not None and d.get("loss"):
                losses.append(r["loss"] / d["loss"] - 1.0)
        bound = ratios("bound") if system != "bound" else []
        row: dict[str, Any] = {
            "rig": rig,
            "system": system,
            "ok": True,
            "rounds": len(ok),
            "span_s": _median([r["span_s"] for r in ok]),
            "span_min_s": min(r["span_s"] for r in ok),
            "span_max_s": max(r["span_s"] for r in ok),
            "total_s": _median([r["total_s"] for r in ok]),
            "vs_ddp": _median(ratios("ddp")),
            "vs_torchft": _median(ratios("torchft")),
            "of_bound": _median(bound),
            "of_bound_min": min(bound) if bound else None,
            "of_bound_rounds": bound,
        }
        if system != "bound":
            row |= {
                "loss": _median([r["loss"] for r in ok if r.get("loss") is not None]),
                "metric": _median([r["metric"] for r in ok]),
                "loss_vs_ddp": _median(losses),
                "syncs": _median([float(r["syncs"]) for r in ok if r.get("syncs") is not None]),
                "steps": ok[0]["steps"],
                "idle": [
                    _median([r["idle"][i] for r in ok if r["idle"][i] is not None])
                    for i in range(len(ok[0]["idle"]))
                ],
                "sync_every": ok[0].get("sync_every"),
            }
        out.append(row)
    return out


def targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's targets, one entry per (rig, check); ``met`` None when a figure is missing."""
    at = {(r["rig"], r["system"]): r for r in rows}
    out: list[dict[str, Any]] = []

    def check(rig: str, system: str, what: str, value: Any, goal: str, met: bool | None) -> None:
        out.append(
            {
                "rig": rig,
                "system": system,
                "check": what,
                "value": value,
                "target": goal,
                "met": met,
            }
        )

    for rig in TARGET_RIGS:
        for mode in CADENCE_MODES:
            row = at.get((rig, mode))
            if row is None:
                continue
            ok = row.get("ok", False)
            frac, low = row.get("of_bound") if ok else None, row.get("of_bound_min") if ok else None
            check(
                rig,
                mode,
                "fraction of the balance bound (median; worst round)",
                None if frac is None else [frac, low],
                f"≥ {TARGET_BOUND_MEDIAN} (≥ {TARGET_BOUND_EVERY} every round)",
                None
                if frac is None or low is None
                else frac >= TARGET_BOUND_MEDIAN and low >= TARGET_BOUND_EVERY,
            )
            for key, goal_x, name in (
                ("vs_ddp", TARGET_VS_DDP, "DDP"),
                ("vs_torchft", TARGET_VS_TORCHFT, "torchft LocalSGD"),
            ):
                v = row.get(key) if ok else None
                check(
                    rig,
                    mode,
                    f"speed vs {name}",
                    v,
                    f"≥ {goal_x}×",
                    None if v is None else v >= goal_x,
                )
            rel = row.get("loss_vs_ddp") if ok else None
            check(
                rig,
                mode,
                "held-out loss vs DDP",
                rel,
                f"≤ +{100 * TARGET_LOSS_REL:g} %",
                None if rel is None else rel <= TARGET_LOSS_REL,
            )
    for mode in FLODL_MODES:
        row = at.get(("x1", mode))
        if row is None:
            continue
        v = row.get("vs_ddp") if row.get("ok") else None
        check("x1", mode, "speed vs DDP, equal ranks", v, "≥ 1×", None if v is None else v >= 1.0)
    return out


# ---------------------------------------------------------------------------------------------
# output
# ---------------------------------------------------------------------------------------------


def _fmt(value: float | None, spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


SUMMARY_HEADERS = [
    "rig",
    "system",
    "span s",
    "total s",
    "vs DDP",
    "vs torchft",
    "of bound",
    "loss",
    "Δloss vs DDP",
    "acc %",
    "syncs",
    "steps/rank",
    "idle/rank",
]


def summary_rows(rows: list[dict[str, Any]]) -> list[list[str]]:
    table = []
    for r in rows:
        if not r.get("ok"):
            why = " ".join(r["error"].split())[-90:]
            table.append([r["rig"], r["system"], *["-"] * 10, f"n/a: {why}"])
            continue
        bound = r["system"] == "bound"
        frac = r.get("of_bound")
        table.append(
            [
                r["rig"],
                r["system"],
                f"{r['span_s']:.1f} ({r['span_min_s']:.1f}–{r['span_max_s']:.1f})",
                f"{r['total_s']:.1f}",
                _fmt(r.get("vs_ddp"), ".2f", "×"),
                _fmt(r.get("vs_torchft"), ".2f", "×"),
                "1"
                if bound
                else ("-" if frac is None else f"{frac:.2f} (min {r['of_bound_min']:.2f})"),
                "-" if bound else _fmt(r.get("loss"), ".4f"),
                "-"
                if bound or r.get("loss_vs_ddp") is None
                else f"{100 * r['loss_vs_ddp']:+.2f} %",
                "-" if bound else f"{100 * r['metric']:.2f}",
                "-" if bound else _fmt(r.get("syncs"), ".0f"),
                "-" if bound else "/".join(str(s) for s in r["steps"]),
                "-" if bound else "/".join(_fmt(i, ".0%") for i in r["idle"]),
            ]
        )
    return table


def breakdown_rows(runs: list[dict[str, Any]]) -> list[list[str]]:
    table = []
    for r in runs:
        b = r.get("breakdown")
        if not r.get("ok") or not b or r["rig"] not in TARGET_RIGS:
            continue
        table.append(
            [
                r["rig"],
                r["system"],
                str(r.get("round", 0)),
                f"{r['span_s']:.1f}",
                str(b["cycles"]),
                f"{b['averaging_s']:.2f}",
                "-" if b.get("launcher_cpu_s") is None else f"{b['launcher_cpu_s']:.2f}",
                "/".join(f"{x:.1f}" for x in b["busy_s"]),
                "/".join(f"{x:.1f}" for x in b["idle_s"]),
                "/".join(f"{x:.1f}" for x in b["induced_s"]),
                " ".join("/".join(str(s) for s in w) for w in b["first_steps"]),
                " ".join("/".join(str(s) for s in w) for w in b["last_steps"]),
            ]
        )
    return table


def _mean_step_ms(run: dict[str, Any]) -> float | None:
    vals = [v for v in run.get("cpu_ms_per_step") or [] if v is not None]
    return statistics.fmean(vals) if vals else None


def step_cost_headers(runs: list[dict[str, Any]]) -> list[str]:
    rounds = sorted({r.get("round", 0) for r in runs})
    return ["rig", "system", *(f"round {n}" for n in rounds), "other load, cores"]


def step_cost_rows(runs: list[dict[str, Any]]) -> list[list[str]]:
    """Per target rig and system, per round: the ranks' mean compute per step (CPU ms, the
    slowdown's sleep left out), ``×`` that over the same round's bound, and ``→`` the run's
    fraction of the bound at the bound's step cost (fraction × that ratio); then the cores
    other processes kept busy during each round's run. Where a system's steps cost more than
    the bound's in its round, the machine ran them slower: its span and its fraction of the
    bound move with that, not with the system's schedule."""
    rounds = sorted({r.get("round", 0) for r in runs})
    by = {(r["rig"], r["system"], r.get("round", 0)): r for r in runs}
    order: list[tuple[str, str]] = []
    for r in runs:
        key = (r["rig"], r["system"])
        if r["rig"] in TARGET_RIGS and key not in order:
            order.append(key)
    table = []
    for rig, system in order:
        cells, other = [], []
        for n in rounds:
            run = by.get((rig, system, n))
            ms = _mean_step_ms(run) if run is not None and run.get("ok") else None
            b = by.get((rig, "bound", n))
            base = _mean_step_ms(b) if b is not None and b.get("ok") else None
            if run is None or ms is None:
                cells.append("-")
            elif system == "bound" or b is None or not base:
                cells.append(f"{ms:.1f} ms")
            else:
                at_bound_speed = b["span_s"] / run["span_s"] * ms / base
                cells.append(f"{ms:.1f} ms ×{ms / base:.2f} → {at_bound_speed:.2f}")
            load = (run or {}).get("load") or {}
            other.append("-" if load.get("other") is None else f"{load['other']:.2f}")
        if any(c != "-" for c in cells):
            table.append([rig, system, *cells, "/".join(other)])
    return table


LOADED_CORES = 0.1
"""Other processes' load (cores) above which a run is named as disturbed (any rig)."""


def loaded_runs(runs: list[dict[str, Any]]) -> str:
    """The runs, of every rig, during which other processes kept more than LOADED_CORES busy."""
    hit = [
        f"{r['rig']} round {r.get('round', 0)} {r['system']} ({r['load']['other']:.2f})"
        for r in runs
        if (r.get("load") or {}).get("other") is not None and r["load"]["other"] > LOADED_CORES
    ]
    what = ", ".join(hit) if hit else "none"
    return f"Runs (any rig) with other processes' load above {LOADED_CORES:g} cores: {what}."


BREAKDOWN_HEADERS = [
    "rig",
    "system",
    "round",
    "span s",
    "cycles",
    "averaging s",
    "launcher CPU s",
    "busy s/rank",
    "idle s/rank",
    "induced idle s/rank",
    "first windows",
    "last windows",
]


def markdown(data: dict[str, Any]) -> str:
    """The docs/benchmarks.md section for a result file (every figure from it)."""
    cfg = data["config"]
    detail = f"{cfg['rounds']} round(s), {data['took_s']:.0f} s"
    lines = [
        f"## Heterogeneous ranks on realistic steps (`{data['command']}`)",
        "",
        (
            f"{run_line(data, detail)} "
            f"Machine: {data['machine'].get('cpus', '?')} CPUs; torch {data['versions']['torch']}, "
            f"torchft {data['versions'].get('torchft') or 'absent'}."
        ),
        "",
        (
            f"Workload `realistic`: {cfg['tasks']['realistic']}; one epoch of "
            f"{cfg['samples']['realistic']:,} samples. `micro`: {cfg['tasks']['micro']}; one epoch "
            f"of {cfg['samples']['micro']:,} samples (communication-bound: DDP's all-reduce per "
            f"~1 ms step dominates; not what a real model sees). Per-rank batch "
            f"{cfg['batch_size']}, Adam lr 3e-3, {cfg['threads']} torch thread per rank for every "
            "system; a slowed rank sleeps (factor − 1) × its step's own thread CPU time. "
            "Medians over rounds (span: median (min–max)); every ratio is against the baseline of "
            "the same round. `of bound` = the balance bound's span / this span (the bound: every "
            "rank training at once with no communication; samples / Σ throughput). Local-SGD "
            "baselines average every `H` steps (H = cpu_cadence's mean window in round 0); "
            "`idle` = 1 − (CPU + slowdown sleep) / span."
        ),
        "",
    ]
    table = [
        [*row[: len(SUMMARY_HEADERS)], str(r.get("sync_every") or "–")]
        for row, r in zip(summary_rows(data["rows"]), data["rows"], strict=True)
    ]
    lines += markdown_table([*SUMMARY_HEADERS, "H"], table)
    failed = [r for r in data["runs"] if not r.get("ok")]
    if failed:
        lines += ["", "Runs that failed (left out of the medians above):", ""]
        lines += [
            f"- {r['rig']} round {r['round']} {r['system']}: {str(r.get('error', ''))[:300]}"
            for r in failed
        ]
    lines += ["", "Targets:", ""]
    for t in data["targets"]:
        v = t["value"]
        if isinstance(v, list):
            shown = f"{v[0]:.2f} (worst {v[1]:.2f})"
        elif v is None:
            shown = "n/a"
        elif "loss" in t["check"]:
            shown = f"{100 * v:+.2f} %"
        else:
            shown = f"{v:.2f}×"
        state = "n/a" if t["met"] is None else ("met" if t["met"] else "not met")
        lines.append(
            f"- {t['rig']} {t['system']}: {t['check']} {shown} (target {t['target']}): **{state}**"
        )
    rows = breakdown_rows(data["runs"])
    if rows:
        lines += [
            "",
            (
                "Where flodl's time went (coordinator `window` records summed over the run; "
                "idle = time a rank waited at averaging; induced = the idle it caused others; "
                "launcher CPU = the CPU time of the process that hosts the coordinator and the "
                "reduce server, over the run; "
                "windows = steps per rank in the first and last three cycles):"
            ),
            "",
            *markdown_table(BREAKDOWN_HEADERS, rows),
        ]
    rows = step_cost_rows(data["runs"])
    if rows:
        lines += [
            "",
            (
                "How fast the machine ran each run's steps, per round: the ranks' mean compute "
                "per step (CPU ms, the slowdown's sleep left out), `×` that over the same "
                "round's bound, `→` the run's fraction of the bound at the bound's step cost "
                "(its fraction × that ratio; the verdicts above use the raw fraction), and the "
                "cores other processes kept busy during each run (`/proc/stat` less the run's "
                "own processes). A run whose steps cost more than its round's bound ran on a "
                "slower machine: its span and raw fraction of the bound carry that, whatever "
                "its schedule."
            ),
            "",
            *markdown_table(step_cost_headers(data["runs"]), rows),
            "",
            loaded_runs(data["runs"]),
        ]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer samples, one round")
    p.add_argument("--rigs", default=",".join(RIGS), help="comma-separated (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=None, help="rounds (default 3; quick 1)")
    p.add_argument(
        "--samples",
        type=int,
        default=None,
        help="realistic samples per epoch (default 24000; quick 8000); micro gets 4× that",
    )
    p.add_argument("--batch-size", type=int, default=64, help="per rank (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--systems", default=",".join(SYSTEMS), help="subset of: %(default)s")
    p.add_argument("--bound-warmup", type=float, default=2.0, help="bound: seconds left out")
    p.add_argument("--bound-window", type=float, default=6.0, help="bound: seconds measured")
    p.add_argument("--timeout", type=float, default=300.0, help="per run, seconds")
    p.add_argument("--json", type=Path, default=RESULTS_DIR / "bench_hetero.json")
    p.add_argument("--keep", action="store_true", help="keep the per-run work directory")
    add_markdown_option(p, RESULTS_DIR / "bench_hetero.json")
    p.add_argument("--flodl-job", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.flodl_job is not None or args.markdown is not None:
        return args
    names = [n.strip() for n in args.rigs.split(",") if n.strip()]
    unknown = sorted(set(names) - set(RIGS))
    if unknown or not names:
        p.error(f"--rigs: unknown {unknown or 'none given'}; choose from {', '.join(RIGS)}")
    args.rig_list = [RIGS[n] for n in names]
    chosen = {s.strip() for s in args.systems.split(",") if s.strip()}
    bad = sorted(chosen - set(SYSTEMS))
    if bad or not chosen:
        p.error(f"--systems: unknown {bad or 'none given'}; choose from {', '.join(SYSTEMS)}")
    args.system_list = [s for s in SYSTEMS if s in chosen]
    if args.rounds is None:
        args.rounds = 1 if args.quick else 3
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    base = args.samples if args.samples is not None else (8_000 if args.quick else 24_000)
    if base < 4 * args.batch_size:
        p.error("--samples must give every rank at least one batch")
    args.samples = {"realistic": base, "micro": 4 * base}
    if args.bound_warmup < 0 or args.bound_window <= 0:
        p.error("--bound-warmup must be >= 0 and --bound-window > 0")
    return args


def round_order(systems: list[str], round_index: int) -> list[str]:
    """Round 0 in the given order (flodl first, so cpu_cadence's window sets H), odd rounds
    reversed, even rounds forward."""
    return list(systems) if round_index % 2 == 0 else list(reversed(systems))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.flodl_job is not None:
        flodl_job(args.flodl_job)
        return 0
    if args.markdown is not None:
        print(markdown(json.loads(Path(args.markdown).read_text())))
        return 0

    import torch
    from _torchft import torchft_version, unavailable

    from flodl.demo import demo_task

    wants_tft = {"torchft", "diloco"} & set(args.system_list)
    args.torchft_reason = unavailable() if wants_tft else None
    tasks = {
        w: demo_task(samples=args.samples[w], seed=args.seed, **WORKLOADS[w]).description
        for w in WORKLOADS
    }
    command = "python benchmarks/bench_hetero.py" + (
        " " + " ".join(sys.argv[1:]) if argv is None and sys.argv[1:] else ""
    )
    print(
        f"bench_hetero: {len(args.rig_list)} rig(s) × {args.rounds} round(s); "
        f"torch {torch.__version__}"
    )
    for w, d in tasks.items():
        print(f"  {w}: {d}")
    if args.torchft_reason:
        print(f"torchft: cannot run here: {args.torchft_reason}")
    before = uptime()
    date = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    work = Path(tempfile.mkdtemp(prefix="bench_hetero-"))
    t_start = time.perf_counter()
    runs: list[dict[str, Any]] = []
    try:
        for rig in args.rig_list:
            sync_every = DEFAULT_SYNC_EVERY
            for rnd in range(args.rounds):
                for system in round_order(args.system_list, rnd):
                    meter = CpuMeter()
                    row = run_one(system, rig, args, work, sync_every)
                    row["load"] = meter.stop()
                    row["round"] = rnd
                    if system in CADENCE_MODES and row.get("ok"):
                        row["mean_window"] = mean_window(row)
                        if rnd == 0 and system == "cpu_cadence" and row["mean_window"]:
                            sync_every = max(1, round(row["mean_window"]))
                    runs.append(row)
                    state = (
                        f"span {row['span_s']:.1f} s, total {row['total_s']:.1f} s"
                        + (f", loss {row['loss']:.4f}" if row.get("loss") is not None else "")
                        if row.get("ok")
                        else f"FAILED: {row['error'][:300]}"
                    )
                    print(f"  {rig.name} #{rnd} {system:<13} {state}", flush=True)
    finally:
        if args.keep:
            print(f"work directory kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    rows = aggregate(runs)
    print_table(
        "bench_hetero: medians over rounds; span = first → last forward (s); total = launch → "
        "exit (s); ratios = baseline span / this span, per round; of bound = bound span / span",
        SUMMARY_HEADERS,
        summary_rows(rows),
    )
    table = breakdown_rows(runs)
    if table:
        print_table("where flodl's time went (window records)", BREAKDOWN_HEADERS, table)
    table = step_cost_rows(runs)
    if table:
        print_table(
            "compute per step (× the round's bound's; → fraction of the bound at its step cost), "
            "and other processes' load",
            step_cost_headers(runs),
            table,
        )
        print(loaded_runs(runs))
    goals = targets(rows)
    for t in goals:
        state = "n/a" if t["met"] is None else ("met" if t["met"] else "NOT met")
        print(
            f"{t['rig']} {t['system']}: {t['check']} = {t['value']} (target {t['target']}): {state}"
        )
    took = time.perf_counter() - t_start
    print(f"bench_hetero took {took:.0f} s")
    import flodl

    path = write_json(
        args.json,
        {
            "benchmark": "bench_hetero",
            "command": command,
            "date": date,
            "uptime_before": before,
            "uptime_after": uptime(),
            "took_s": took,
            "quick": args.quick,
            "machine": machine_info(),
            "versions": {
                "torch": torch.__version__,
                "flodl": flodl.__version__,
                "torchft": torchft_version(),
            },
            "config": {
                "rigs": [
                    {"name": r.name, "world": r.world, "slow": r.slow, "workload": r.workload}
                    for r in args.rig_list
                ],
                "rounds": args.rounds,
                "samples": args.samples,
                "batch_size": args.batch_size,
                "threads": THREADS,
                "measure": MEASURE,
                "seed": args.seed,
                "systems": args.system_list,
                "tasks": tasks,
                "bound": {"warmup_s": args.bound_warmup, "window_s": args.bound_window},
            },
            "torchft": {"available": args.torchft_reason is None, "reason": args.torchft_reason},
            "rows": rows,
            "runs": runs,
            "targets": goals,
        },
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
