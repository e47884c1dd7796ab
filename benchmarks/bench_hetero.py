"""bench_hetero: 2 ranks, one slowed; flodl's modes vs DDP and torchft LocalSGD, same run.

Every system trains the demo task (:func:`flodl.demo.demo_task`: a character-level MLP over
the standard library's source) for the same fixed number of epochs, with the same model,
data, per-rank batch size, one torch thread per rank, and rank 1 slowed ``factor``× by the
same method (:meth:`flodl.demo.Slowdown.forward`, wrapped by :class:`_ddp.TimedStep`):

* flodl ``cpu_cadence``, ``nccl_cadence`` (Gloo collectives on CPU) and ``nccl_sync``:
  ``Trainer.builder(...).local_ranks(2)`` in a subprocess of this script;
* ``ddp``: ``torch.nn.parallel.DistributedDataParallel`` on Gloo over 127.0.0.1, two
  spawned processes, a ``DistributedSampler``-style equal split;
* ``torchft``: ``torchft.local_sgd.LocalSGD`` (two replica groups, one lighthouse) with a
  fixed ``sync_every`` = flodl ``cpu_cadence``'s mean window (steps per rank per averaging)
  at the same factor.

Reported per run: the training span (first forward on any rank → last forward on any rank;
the ratios use it), the end-to-end time (launch → every process done, process start-up
included), the held-out next-character accuracy of the final model, the averaging count and
per-rank idle fraction ``1 − busy / span`` with busy = estimated step compute + slowdown sleep
(the same estimator in every system; see ``_ddp.py``).

For flodl runs also the coordinator's own busy fraction of each rank in the last epoch,
``per_rank_share_complete_ms / epoch_ms`` of its :class:`~flodl.wire.frames.EpochMetrics`
(the figure tests/integration/test_training.py used to bound): the fast rank of a cadence mode
trains most of the epoch's wall time instead of waiting at averaging barriers.

Targets (at the largest factor, ×3 by default): flodl cadence ≥ 1.5× faster than DDP with the
accuracy within the parity bound of DDP's (``bench_convergence``'s: at most 0.5 points below,
or at most 2 % relative loss; better counts as within); ≥ 1.2× faster than torchft LocalSGD;
the fast rank busy ≥ 0.6 of the epoch by the coordinator's count.

    python benchmarks/bench_hetero.py [--quick] [--factors 2,3] [--epochs N] [--systems ...]
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
from pathlib import Path
from typing import Any

from _common import (
    REPO_ROOT,
    RESULTS_DIR,
    ensure_repo_on_path,
    machine_info,
    print_table,
    write_json,
)

ensure_repo_on_path()

from _ddp import SLOW_RANK, TimedStep, read_step_record, run_ddp  # noqa: E402

FLODL_MODES = ("cpu_cadence", "nccl_cadence", "nccl_sync")
SYSTEMS = (*FLODL_MODES, "ddp", "torchft")
CADENCE_MODES = ("cpu_cadence", "nccl_cadence")
TARGET_VS_DDP = 1.5
TARGET_VS_TORCHFT = 1.2
TARGET_FAST_BUSY = 0.6
PARITY_PP = 0.5  # bench_convergence's bound, applied against DDP in the same run
PARITY_REL = 0.02
WORLD = 2


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
    task = demo_task(samples=spec["samples"], seed=spec["seed"])
    spf = float(spec["step_per_forward"])
    rank = os.environ.get("FLODL_RANK")
    # ranks time their steps; the launcher never calls train_step
    record = out / f"rank{rank}.steps" if rank is not None else None
    slowdown = Slowdown.for_rank({SLOW_RANK: spec["factor"]}, step_per_forward=spf)
    step = TimedStep(task.train_step, slowdown, spf, record)
    epochs: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    handle = (
        Trainer.builder(task.model_factory, task.optim_factory, step)
        .dataset(task.train)
        .batch_size(spec["batch_size"])
        .num_epochs(spec["epochs"])
        .elche(ElCheConfig.preset(spec["mode"]))
        .local_ranks(WORLD)
        .seed(spec["seed"])
        .progress(False)
        .metrics_fn(lambda m: epochs.append(m.model_dump()))
        .run()
    )
    state = handle.join()
    total_s = time.perf_counter() - t0
    model = task.model_factory("cpu")
    state.load_into(model)
    torch.set_num_threads(1)
    result = {"metric": task.eval_fn(model, task.held_out), "total_s": total_s, "epochs": epochs}
    (out / "result.json").write_text(json.dumps(result))


def run_flodl(cfg: dict[str, Any], out_dir: Path, timeout_s: float) -> dict[str, Any]:
    out_dir.mkdir(parents=True, exist_ok=True)
    spec = out_dir / "spec.json"
    spec.write_text(json.dumps({**cfg, "out_dir": str(out_dir)}))
    log = out_dir / "job.log"
    with log.open("wb") as sink:
        proc = subprocess.run(
            [sys.executable, str(Path(__file__).resolve()), "--flodl-job", str(spec)],
            cwd=REPO_ROOT,
            stdout=sink,
            stderr=subprocess.STDOUT,
            timeout=timeout_s,
            check=False,
        )
    if proc.returncode != 0 or not (out_dir / "result.json").exists():
        tail = log.read_text(errors="replace")[-1500:]
        raise RuntimeError(f"flodl {cfg['mode']} exited {proc.returncode}: {tail}")
    result: dict[str, Any] = json.loads((out_dir / "result.json").read_text())
    ranks = []
    for r in range(WORLD):
        rec = read_step_record(out_dir / f"rank{r}.steps")
        if rec is None:
            raise RuntimeError(f"flodl {cfg['mode']}: rank {r} left no step record")
        ranks.append(rec)
    result["ranks"] = ranks
    last = result["epochs"][-1] if result["epochs"] else {}
    result["syncs"] = int(last.get("syncs", 0))
    epoch_ms = float(last.get("epoch_ms", 0.0))
    complete = last.get("per_rank_share_complete_ms") or []
    result["coord_busy"] = [c / epoch_ms for c in complete] if epoch_ms > 0 else None
    return result


# ---------------------------------------------------------------------------------------------
# one run → one row
# ---------------------------------------------------------------------------------------------


def summarize(system: str, factor: float, raw: dict[str, Any]) -> dict[str, Any]:
    """Span, idle fractions and counts of one run (raw per-rank TimedStep summaries)."""
    ranks = raw["ranks"]
    t0 = min(r["t0"] for r in ranks)
    t1 = max(r["t1"] for r in ranks)
    span = t1 - t0
    return {
        "system": system,
        "factor": factor,
        "ok": True,
        "span_s": span,
        "total_s": raw["total_s"],
        "metric": raw["metric"],
        "syncs": raw.get("syncs"),
        "steps": [r["steps"] for r in ranks],
        "busy_s": [r["busy_s"] for r in ranks],
        "idle": [max(0.0, 1.0 - r["busy_s"] / span) if span > 0 else None for r in ranks],
        "coord_busy": raw.get("coord_busy"),
        "sync_every": raw.get("sync_every"),
    }


def best_runs(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (factor, system), the run with the shortest span (noise only ever adds time), in
    first-seen order; a system that never succeeded keeps its first failure."""
    best: dict[tuple[float, str], dict[str, Any]] = {}
    for run in runs:
        key = (run["factor"], run["system"])
        have = best.get(key)
        if have is None or (
            run.get("ok") and (not have.get("ok") or run["span_s"] < have["span_s"])
        ):
            best[key] = run
    for (factor, system), row in best.items():
        row["repeats_ok"] = sum(
            1 for r in runs if r["factor"] == factor and r["system"] == system and r.get("ok")
        )
    return list(best.values())


def mean_window(row: dict[str, Any]) -> float | None:
    """Steps per rank per averaging, averaged over ranks (flodl's mean ElChe window)."""
    syncs = row.get("syncs") or 0
    if syncs <= 0:
        return None
    return statistics.fmean(row["steps"]) / syncs


def run_one(
    system: str,
    factor: float,
    args: argparse.Namespace,
    spf: float,
    work: Path,
    window: float | None,
    torchft_reason: str | None,
) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "world": WORLD,
        "samples": args.samples,
        "seed": args.seed,
        "epochs": args.epochs,
        "batch_size": args.batch_size,
        "factor": factor,
        "step_per_forward": spf,
    }
    out = work / f"{system}-x{factor:g}"
    shutil.rmtree(out, ignore_errors=True)
    try:
        if system in FLODL_MODES:
            raw = run_flodl({**cfg, "mode": system}, out, args.timeout)
        elif system == "ddp":
            raw = run_ddp(cfg, out, args.timeout)
            raw["syncs"] = raw["ranks"][0]["steps"]  # one gradient all-reduce per step
        else:
            if torchft_reason is not None:
                return {"system": system, "factor": factor, "ok": False, "error": torchft_reason}
            from _torchft import run_localsgd

            sync_every = max(1, round(window)) if window else 10
            raw = run_localsgd({**cfg, "sync_every": sync_every}, out, args.timeout)
            raw["syncs"] = raw["ranks"][0]["syncs"]
            raw["sync_every"] = sync_every
    except Exception as exc:  # noqa: BLE001 - a failed system is a row that says why
        return {
            "system": system,
            "factor": factor,
            "ok": False,
            "error": f"{type(exc).__name__}: {exc}"[:2000],
        }
    return summarize(system, factor, raw)


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="smaller data and fewer epochs")
    p.add_argument("--factors", default="2,3", help="slowdowns of rank 1 (default: %(default)s)")
    p.add_argument("--epochs", type=int, default=None, help="fixed epochs (default 4; quick 2)")
    p.add_argument(
        "--samples", type=int, default=None, help="training windows (default 48000; quick 16000)"
    )
    p.add_argument("--batch-size", type=int, default=64, help="per rank (default: %(default)s)")
    p.add_argument(
        "--repeat", type=int, default=None, help="runs per system, best span kept (default 2)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--systems",
        default=",".join(SYSTEMS),
        help="comma-separated subset of: %(default)s",
    )
    p.add_argument("--timeout", type=float, default=300.0, help="per run, seconds")
    p.add_argument("--json", type=Path, default=RESULTS_DIR / "bench_hetero.json")
    p.add_argument("--keep", action="store_true", help="keep the per-run work directory")
    p.add_argument("--flodl-job", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.flodl_job is None:
        try:
            args.factor_list = [float(f) for f in args.factors.split(",") if f.strip()]
        except ValueError:
            p.error(f"--factors {args.factors!r}: expected numbers like 2,3")
        if not args.factor_list or any(f < 1 for f in args.factor_list):
            p.error("--factors: every factor must be >= 1")
        chosen = {s.strip() for s in args.systems.split(",") if s.strip()}
        unknown = sorted(chosen - set(SYSTEMS))
        if unknown:
            p.error(f"--systems: unknown {unknown}; choose from {', '.join(SYSTEMS)}")
        # fixed order: torchft's sync_every comes from a cadence run before it
        args.system_list = [s for s in SYSTEMS if s in chosen]
        if args.repeat is None:
            args.repeat = 1 if args.quick else 2
        if args.repeat < 1:
            p.error("--repeat must be >= 1")
        if args.epochs is None:
            args.epochs = 2 if args.quick else 4
        if args.samples is None:
            args.samples = 16_000 if args.quick else 48_000
        if args.epochs < 1 or args.samples < WORLD * args.batch_size:
            p.error("--epochs must be >= 1 and --samples at least one batch per rank")
    return args


def _fmt(value: float | None, spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def within_parity(metric: float, ref: float) -> bool:
    """``bench_convergence``'s bound: ≤ PARITY_PP points below ``ref`` or ≤ PARITY_REL relative
    loss (better than ``ref`` is within)."""
    return 100.0 * (metric - ref) >= -PARITY_PP or (ref - metric) / ref <= PARITY_REL


def targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's targets at the largest factor, one entry per cadence mode."""
    ok = [r for r in rows if r.get("ok")]
    if not ok:
        return []
    top = max(r["factor"] for r in rows)
    at = {r["system"]: r for r in rows if r["factor"] == top}
    out: list[dict[str, Any]] = []
    ddp, tft = at.get("ddp"), at.get("torchft")
    for mode in CADENCE_MODES:
        row = at.get(mode)
        if row is None:
            continue
        entry: dict[str, Any] = {"system": mode, "factor": top}
        if row.get("ok") and ddp is not None and ddp.get("ok"):
            speed = ddp["span_s"] / row["span_s"]
            delta = row["metric"] - ddp["metric"]
            entry |= {
                "vs_ddp": speed,
                "target_vs_ddp": TARGET_VS_DDP,
                "metric_delta_vs_ddp": delta,
                "within_parity": within_parity(row["metric"], ddp["metric"]),
                "met_vs_ddp": speed >= TARGET_VS_DDP
                and within_parity(row["metric"], ddp["metric"]),
            }
        else:
            entry["met_vs_ddp"] = None
            entry["why_vs_ddp"] = (row.get("error") or (ddp or {}).get("error") or "not run")[:300]
        if row.get("ok") and tft is not None and tft.get("ok"):
            speed = tft["span_s"] / row["span_s"]
            entry |= {
                "vs_torchft": speed,
                "target_vs_torchft": TARGET_VS_TORCHFT,
                "met_vs_torchft": speed >= TARGET_VS_TORCHFT,
            }
        else:
            entry["met_vs_torchft"] = None
            entry["why_vs_torchft"] = (
                (tft or {}).get("error") or row.get("error") or "torchft not run"
            )[:300]
        busy = row.get("coord_busy") if row.get("ok") else None
        if busy:
            fast = min(b for r, b in enumerate(busy) if r != SLOW_RANK)
            entry |= {
                "fast_busy": fast,
                "target_fast_busy": TARGET_FAST_BUSY,
                "met_fast_busy": fast >= TARGET_FAST_BUSY,
            }
        else:
            entry["met_fast_busy"] = None
        out.append(entry)
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.flodl_job is not None:
        flodl_job(args.flodl_job)
        return 0

    import torch
    from _torchft import torchft_version, unavailable

    from flodl.demo import demo_task, measure_step_per_forward

    torch.set_num_threads(1)
    task = demo_task(samples=args.samples, seed=args.seed)
    spf = measure_step_per_forward(task, batch_size=args.batch_size)
    torchft_reason = unavailable() if "torchft" in args.system_list else "not selected"
    print(
        f"bench_hetero: {WORLD} ranks, rank {SLOW_RANK} slowed ×{args.factors}; "
        f"{args.epochs} epochs × {args.samples:,} samples, batch {args.batch_size}/rank; "
        f"torch {torch.__version__}; step = {spf:.2f} forwards (measured here)"
    )
    print(f"task: {task.description}")
    if torchft_reason and "torchft" in args.system_list:
        print(f"torchft: cannot run here: {torchft_reason}")

    work = Path(tempfile.mkdtemp(prefix="bench_hetero-"))
    t_start = time.perf_counter()
    runs: list[dict[str, Any]] = []
    try:
        for factor in args.factor_list:
            window: float | None = None
            for rep in range(args.repeat):
                for system in args.system_list:
                    row = run_one(system, factor, args, spf, work, window, torchft_reason)
                    row["repeat"] = rep
                    if system in CADENCE_MODES and row.get("ok"):
                        row["mean_window"] = mean_window(row)
                        # torchft's sync_every: cpu_cadence's first window (else nccl_cadence's)
                        if window is None and (
                            system == "cpu_cadence" or "cpu_cadence" not in args.system_list
                        ):
                            window = row["mean_window"]
                    runs.append(row)
                    state = (
                        f"span {row['span_s']:.1f} s, acc {100 * row['metric']:.2f} %"
                        if row.get("ok")
                        else f"FAILED: {row['error'][:200]}"
                    )
                    print(f"  ×{factor:g} #{rep} {system:<13} {state}", flush=True)
        rows = best_runs(runs)
    finally:
        if args.keep:
            print(f"work directory kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)

    ref = {(r["factor"], r["system"]): r for r in rows}
    table = []
    for r in rows:
        if not r.get("ok"):
            table.append([f"×{r['factor']:g}", r["system"], *["-"] * 10, f"n/a: {r['error'][:70]}"])
            continue
        ddp = ref.get((r["factor"], "ddp"))
        tft = ref.get((r["factor"], "torchft"))
        vs_ddp = ddp["span_s"] / r["span_s"] if ddp and ddp.get("ok") else None
        vs_tft = tft["span_s"] / r["span_s"] if tft and tft.get("ok") else None
        d_acc = r["metric"] - ddp["metric"] if ddp and ddp.get("ok") else None
        r["vs_ddp"], r["vs_torchft"], r["metric_delta_vs_ddp"] = vs_ddp, vs_tft, d_acc
        note = f"sync_every {r['sync_every']}" if r.get("sync_every") else ""
        if r.get("mean_window"):
            note = f"mean window {r['mean_window']:.1f}"
        table.append(
            [
                f"×{r['factor']:g}",
                r["system"],
                f"{r['span_s']:.1f}",
                f"{r['total_s']:.1f}",
                _fmt(vs_ddp, ".2f", "×"),
                _fmt(vs_tft, ".2f", "×"),
                f"{100 * r['metric']:.2f}",
                _fmt(None if d_acc is None else 100 * d_acc, "+.2f"),
                r["syncs"],
                "/".join(str(s) for s in r["steps"]),
                " / ".join(_fmt(i, ".0%") for i in r["idle"]),
                " / ".join(_fmt(b, ".0%") for b in r.get("coord_busy") or [None]),
                note,
            ]
        )
    print_table(
        f"hetero: best span of {args.repeat} run(s); span = first → last forward (s); "
        f"total = launch → exit (s); "
        f"speed = other span / this span; acc = held-out next-char accuracy "
        f"(commonest char: {100 * task.trivial_accuracy:.1f} %); idle = 1 − busy / span; "
        f"coord busy = share_complete_ms / epoch_ms of the last epoch (flodl only)",
        [
            "slow",
            "system",
            "span s",
            "total s",
            "vs DDP",
            "vs torchft",
            "acc %",
            "Δ pp vs DDP",
            "syncs",
            "steps r0/r1",
            "idle r0 / r1",
            "coord busy r0 / r1",
            "note",
        ],
        table,
    )
    goals = targets(rows)
    for g in goals:
        if g.get("met_vs_ddp") is None:
            ddp_part = f"vs DDP: n/a ({g['why_vs_ddp'][:80]})"
        else:
            ddp_part = (
                f"vs DDP {g['vs_ddp']:.2f}× (target ≥ {TARGET_VS_DDP}×), "
                f"Δacc {100 * g['metric_delta_vs_ddp']:+.2f} pp "
                f"({'within' if g['within_parity'] else 'outside'} the parity bound): "
                f"{'met' if g['met_vs_ddp'] else 'NOT met'}"
            )
        if g.get("met_vs_torchft") is None:
            tft_part = f"vs torchft: n/a ({g['why_vs_torchft'][:120]})"
        else:
            tft_part = (
                f"vs torchft {g['vs_torchft']:.2f}× (target ≥ {TARGET_VS_TORCHFT}×): "
                f"{'met' if g['met_vs_torchft'] else 'NOT met'}"
            )
        if g.get("met_fast_busy") is None:
            busy_part = "fast rank busy: n/a"
        else:
            busy_part = (
                f"fast rank busy {g['fast_busy']:.2f} of the epoch (coordinator's count; "
                f"target ≥ {TARGET_FAST_BUSY}): {'met' if g['met_fast_busy'] else 'NOT met'}"
            )
        print(f"×{g['factor']:g} {g['system']}: {ddp_part}; {tft_part}; {busy_part}")
    print(f"bench_hetero took {time.perf_counter() - t_start:.0f} s")
    import flodl

    versions = {"torch": torch.__version__, "flodl": flodl.__version__}
    path = write_json(
        args.json,
        {
            "benchmark": "bench_hetero",
            "quick": args.quick,
            "machine": machine_info(),
            "versions": {**versions, "torchft": torchft_version()},
            "config": {
                "world": WORLD,
                "slow_rank": SLOW_RANK,
                "factors": args.factor_list,
                "epochs": args.epochs,
                "samples": args.samples,
                "batch_size": args.batch_size,
                "seed": args.seed,
                "repeat": args.repeat,
                "systems": args.system_list,
                "step_per_forward": spf,
                "parity": {"pp": PARITY_PP, "relative": PARITY_REL, "vs": "ddp"},
                "task": task.description,
                "trivial_accuracy": task.trivial_accuracy,
            },
            "torchft": {"available": torchft_reason is None, "reason": torchft_reason},
            "rows": rows,
            "runs": runs,
            "targets": goals,
        },
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
