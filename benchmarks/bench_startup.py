"""bench_startup: launch → first training step, flodl ``local_ranks(N)`` against torchrun + DDP.

Both systems train the realistic model of ``bench_hetero`` (``demo_task(context=32, embed=32,
hidden=1024)``, 2.2 M parameters) with N CPU ranks of one torch thread on this host; every
process of both writes time marks (``time.perf_counter``: ``CLOCK_MONOTONIC``, one clock for
every process of the machine) to its own file:

* ``start``: the first line of this script ran (the interpreter is up);
* ``torch``: ``import torch`` returned;
* ``ready``: the system's own set-up is done (flodl: ``import flodl`` and the task; DDP: the task,
  ``init_process_group`` and ``DistributedDataParallel(model)``, whose constructor broadcasts the
  parameters from rank 0);
* ``first_step``: the rank's first ``train_step`` began (for flodl: after the rank connected,
  the run formed and the initial parameter sync ended).

The parent takes ``t0`` just before it starts the launcher (``python this.py --flodl-job`` or
``python -m torch.distributed.run --nproc-per-node N this.py --ddp-job``) and ``t_exit`` when it
has exited. Reported per system, median over repeats (alternating order): time to the last rank's
first step, its parts (rank interpreter start, torch import, set-up, the rest until the first
step), and the whole run (a few steps each) until exit.

    python benchmarks/bench_startup.py [--ranks 2] [--repeat 3] [--steps 4]
"""

from __future__ import annotations

import time as _time

_T_START = _time.perf_counter()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

from _common import (  # noqa: E402
    REPO_ROOT,
    RESULTS_DIR,
    add_markdown_option,
    ensure_repo_on_path,
    machine_info,
    print_table,
    run_line,
    uptime,
    write_json,
)

ensure_repo_on_path()

TASK = {"context": 32, "embed": 32, "hidden": 1024}
SYSTEMS = ("flodl", "torchrun_ddp")
PHASES = ("start", "torch", "ready", "first_step")


def _mark(out: Path, who: str, name: str, t: float | None = None) -> None:
    with (out / f"marks-{who}.jsonl").open("a") as f:
        f.write(json.dumps({"mark": name, "t": _time.perf_counter() if t is None else t}) + "\n")


def flodl_job(spec: dict[str, Any]) -> None:
    out = Path(spec["out"])
    rank = os.environ.get("FLODL_RANK")
    who = f"rank{rank}" if rank is not None else "launcher"
    _mark(out, who, "start", _T_START)
    import torch

    _mark(out, who, "torch")
    from flodl import ElCheConfig, Trainer
    from flodl.demo import demo_task

    task = demo_task(samples=spec["samples"], seed=0, **TASK)
    _mark(out, who, "ready")
    seen = {"first": False}

    def step(model: Any, batch: Any) -> Any:
        if not seen["first"]:
            seen["first"] = True
            torch.set_num_threads(1)
            _mark(out, who, "first_step")
        return task.train_step(model, batch)

    handle = (
        Trainer.builder(task.model_factory, task.optim_factory, step)
        .dataset(task.train)
        .device("cpu")  # on the CPU, like the baselines it is compared with
        .batch_size(spec["batch_size"])
        .num_epochs(1)
        .elche(ElCheConfig.preset("cpu_cadence"))
        .local_ranks(int(spec["ranks"]))
        .seed(0)
        .progress(False)
        .run()
    )
    handle.join()


def ddp_job(spec: dict[str, Any]) -> None:
    out = Path(spec["out"])
    rank = int(os.environ["RANK"])
    who = f"rank{rank}"
    _mark(out, who, "start", _T_START)
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    _mark(out, who, "torch")
    from flodl.demo import demo_task

    torch.set_num_threads(1)
    task = demo_task(samples=spec["samples"], seed=0, **TASK)
    dist.init_process_group("gloo")
    model = DistributedDataParallel(task.model_factory("cpu"))
    optim = task.optim_factory(model.parameters())
    _mark(out, who, "ready")
    world = dist.get_world_size()
    per_rank = spec["samples"] // world
    bs = int(spec["batch_size"])
    for i, start in enumerate(range(rank * per_rank, (rank + 1) * per_rank - bs + 1, bs)):
        if i == 0:
            _mark(out, who, "first_step")
        batch = task.train.get_batch(list(range(start, start + bs)))
        optim.zero_grad(set_to_none=True)
        task.train_step(model, batch).backward()  # type: ignore[no-untyped-call]
        optim.step()
    dist.destroy_process_group()


def read_marks(out: Path, who: str) -> dict[str, float]:
    marks: dict[str, float] = {}
    path = out / f"marks-{who}.jsonl"
    if not path.exists():
        return marks
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        marks.setdefault(rec["mark"], rec["t"])
    return marks


def run_once(system: str, args: argparse.Namespace, work: Path, rep: int) -> dict[str, Any]:
    out = work / f"{system}-{rep}"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    spec = {
        "out": str(out),
        "ranks": args.ranks,
        "samples": args.ranks * args.batch_size * args.steps,
        "batch_size": args.batch_size,
    }
    here = str(Path(__file__).resolve())
    if system == "flodl":
        cmd = [sys.executable, here, "--flodl-job", json.dumps(spec)]
    else:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={args.ranks}",
            here,
            "--ddp-job",
            json.dumps(spec),
        ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    t0 = _time.perf_counter()
    proc = subprocess.run(
        cmd, cwd=REPO_ROOT, env=env, capture_output=True, timeout=args.timeout, check=False
    )
    t_exit = _time.perf_counter()
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr).decode(errors="replace")[-800:]
        return {"system": system, "ok": False, "error": f"exit {proc.returncode}: {tail}"}
    ranks = [read_marks(out, f"rank{r}") for r in range(args.ranks)]
    if any(set(PHASES) - set(m) for m in ranks):
        return {"system": system, "ok": False, "error": f"missing marks: {ranks}"}
    last = max(ranks, key=lambda m: m["first_step"])
    row: dict[str, Any] = {
        "system": system,
        "ok": True,
        "first_step_s": last["first_step"] - t0,
        "first_step_first_rank_s": min(m["first_step"] for m in ranks) - t0,
        "rank_start_s": last["start"] - t0,
        "torch_import_s": last["torch"] - last["start"],
        "setup_s": last["ready"] - last["torch"],
        "to_first_step_s": last["first_step"] - last["ready"],
        "exit_s": t_exit - t0,
    }
    launcher = read_marks(out, "launcher")
    if launcher:
        row["launcher_ready_s"] = launcher.get("ready", t0) - t0
    return row


COLUMNS = (
    ("first_step_s", "launch → last rank's first step s"),
    ("first_step_first_rank_s", "→ first rank's s"),
    ("rank_start_s", "rank interpreter up s"),
    ("torch_import_s", "import torch s"),
    ("setup_s", "set-up s"),
    ("to_first_step_s", "set-up → first step s"),
    ("exit_s", "launch → exit s"),
)


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for system in SYSTEMS:
        ok = [r for r in runs if r["system"] == system and r.get("ok")]
        if not ok:
            bad = [r for r in runs if r["system"] == system]
            if bad:
                rows.append({"system": system, "ok": False, "error": bad[0].get("error", "")})
            continue
        row: dict[str, Any] = {"system": system, "ok": True, "repeats": len(ok)}
        for key, _ in COLUMNS:
            row[key] = statistics.median(r[key] for r in ok)
        rows.append(row)
    base = next((r for r in rows if r["system"] == "torchrun_ddp" and r.get("ok")), None)
    for r in rows:
        if r.get("ok") and base is not None:
            r["first_step_vs_torchrun"] = r["first_step_s"] / base["first_step_s"]
    return rows


def markdown(data: dict[str, Any]) -> str:
    """The docs/benchmarks.md section for a result file (every figure from it)."""
    detail = f"{data['ranks']} CPU ranks, median of {data['repeat']} runs each, alternating order"
    lines = [
        f"## Start-up: launch → first step (`{data['command']}`)",
        "",
        (
            f"{run_line(data, detail)} The realistic model of `bench_hetero` (2.2 M "
            "parameters). Times from the parent's launch; the parts are the last rank's to "
            "step: its interpreter up, `import torch`, the system's set-up (flodl: `import "
            "flodl` + the task; DDP: the task, `init_process_group` and the DDP constructor's "
            "broadcast), and the rest until its first `train_step` (flodl: connect, form, the "
            "initial parameter sync)."
        ),
        "",
        "| system | " + " | ".join(h for _, h in COLUMNS) + " | vs torchrun |",
        "|" + "---|" * (len(COLUMNS) + 2),
    ]
    for r in data["rows"]:
        if not r.get("ok"):
            lines.append(f"| {r['system']} | failed: {' '.join(r['error'].split())[:120]} |")
            continue
        cells = " | ".join(f"{r[k]:.2f}" for k, _ in COLUMNS)
        ratio = r.get("first_step_vs_torchrun")
        lines.append(f"| {r['system']} | {cells} | {'–' if ratio is None else f'{ratio:.2f}×'} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--steps", type=int, default=4, help="steps per rank (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--timeout", type=float, default=180.0)
    p.add_argument("--json", type=Path, default=RESULTS_DIR / "bench_startup.json")
    add_markdown_option(p, RESULTS_DIR / "bench_startup.json")
    p.add_argument("--flodl-job", help=argparse.SUPPRESS)
    p.add_argument("--ddp-job", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.flodl_job is not None:
        flodl_job(json.loads(args.flodl_job))
        return 0
    if args.ddp_job is not None:
        ddp_job(json.loads(args.ddp_job))
        return 0
    if args.markdown is not None:
        print(markdown(json.loads(Path(args.markdown).read_text())))
        return 0
    if args.ranks < 1 or args.repeat < 1 or args.steps < 1:
        p.error("--ranks, --repeat and --steps must be >= 1")
    before = uptime()
    date = _time.strftime("%Y-%m-%d %H:%M UTC", _time.gmtime())
    work = Path(tempfile.mkdtemp(prefix="bench_startup-"))
    runs = []
    try:
        for rep in range(args.repeat):
            order = SYSTEMS if rep % 2 == 0 else tuple(reversed(SYSTEMS))
            for system in order:
                row = run_once(system, args, work, rep)
                row["repeat"] = rep
                runs.append(row)
                state = (
                    f"first step {row['first_step_s']:.2f} s, exit {row['exit_s']:.2f} s"
                    if row.get("ok")
                    else f"FAILED: {row['error'][:300]}"
                )
                print(f"  #{rep} {system:<13} {state}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rows = summarize(runs)
    print_table(
        f"bench_startup: {args.ranks} ranks, median of {args.repeat}",
        ["system", *(h for _, h in COLUMNS), "vs torchrun"],
        [
            [
                r["system"],
                *(f"{r[k]:.2f}" for k, _ in COLUMNS),
                f"{r.get('first_step_vs_torchrun', 0):.2f}×",
            ]
            if r.get("ok")
            else [r["system"], "failed", *[""] * len(COLUMNS)]
            for r in rows
        ],
    )
    argv = " ".join(sys.argv[1:])
    path = write_json(
        args.json,
        {
            "benchmark": "bench_startup",
            "command": "python benchmarks/bench_startup.py" + (f" {argv}" if argv else ""),
            "date": date,
            "uptime_before": before,
            "uptime_after": uptime(),
            "machine": machine_info(),
            "ranks": args.ranks,
            "repeat": args.repeat,
            "rows": rows,
            "runs": runs,
        },
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
