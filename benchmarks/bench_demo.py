"""``flodl demo``, the README's first command, as a user runs it: the whole command's wall time
and the summary it prints, a few times in a row.

    python benchmarks/bench_demo.py [--repeat 3] [--json PATH]
    python benchmarks/bench_demo.py --markdown [JSON]   # the docs section, from the JSON

Each run is ``python -m flodl demo --out <tmp> --json <tmp>/demo.json`` with the command's
defaults (cpu_cadence, 2 local CPU ranks, rank 1 slowed ×3, 3 epochs) in a subprocess; the wall
time is the whole command's (solo baseline, lock-step DDP, flodl's run, start-up and shutdown
included), the figures are the demo's own ``--json`` (the summary table it printed). Target: the
command finishes in under 3 minutes on this machine in every run. The demo's own comparison
(flodl against lock-step DDP on the same ranks) is a ratio within each run.
"""

from __future__ import annotations

import argparse
import json
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
    RunStamp,
    add_markdown_option,
    markdown_table,
    met_text,
    print_table,
    run_in_group,
    section_head,
    write_json,
)

TARGET_S = 180.0
"""The whole ``flodl demo`` command, seconds, in every run."""
RUN_LIMIT_S = 2 * TARGET_S
"""A run still going after this is killed (and fails the target)."""


def run_once(work: Path, index: int) -> dict[str, Any]:
    """One ``flodl demo`` in a subprocess: its exit status, wall time and ``--json`` figures."""
    out = work / f"run{index}"
    figures = work / f"run{index}.json"
    cmd = [sys.executable, "-m", "flodl", "demo", "--out", str(out), "--json", str(figures)]
    t0 = time.perf_counter()
    # a group of its own: a run past the limit is killed with its ranks
    code, _, err = run_in_group(
        cmd,
        RUN_LIMIT_S,
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    if code is None:
        err += f"\nkilled after {RUN_LIMIT_S:.0f} s"
    wall = time.perf_counter() - t0
    row: dict[str, Any] = {"run": index, "rc": code, "wall_s": wall}
    if code != 0 or not figures.exists():
        row["error"] = (err.strip().splitlines() or ["(no output)"])[-1][-300:]
        return row
    figures_of: dict[str, Any] = json.loads(figures.read_text())
    return row | figures_of


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f} %"


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def verdict(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Under TARGET_S in every run (a failed run fails it)."""
    walls = [r["wall_s"] for r in runs]
    ok = all(r["rc"] == 0 and "result" in r for r in runs)
    return {
        "target_s": TARGET_S,
        "max_wall_s": max(walls) if walls else None,
        "met": bool(runs) and ok and max(walls) < TARGET_S,
    }


def table_rows(runs: list[dict[str, Any]]) -> list[list[str]]:
    rows = []
    for r in runs:
        res = r.get("result")
        if res is None:
            rows.append([str(r["run"]), f"{r['wall_s']:.1f}", f"failed: {r.get('error', '')}"])
            continue
        shares = " · ".join(f"{100 * s:.0f} %" for s in res["batch_share"])
        rows.append(
            [
                str(r["run"]),
                f"{r['wall_s']:.1f}",
                _s(res["solo_train_s"]),
                _s(res["lockstep_train_s"]),
                _s(res["train_s"]),
                f"{res['speedup']:.2f}×" if res.get("speedup") is not None else "-",
                " / ".join(
                    _pct(res[k]) for k in ("solo_accuracy", "lockstep_accuracy", "accuracy")
                ),
                shares,
                f"{res['lockstep_syncs']} / {res['syncs']}",
                str(res["anchor"]),
            ]
        )
    return rows


HEADERS = [
    "run",
    "command s",
    "solo train s",
    "lock-step DDP train s",
    "flodl train s",
    "flodl vs lock-step",
    "accuracy solo / DDP / flodl",
    "flodl batch share",
    "syncs DDP / flodl",
    "anchor",
]


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The successful run with the median command time (the lower middle of an even count)."""
    good = sorted((r for r in runs if "result" in r), key=lambda r: r["wall_s"])
    return good[(len(good) - 1) // 2] if good else None


def markdown(data: dict[str, Any]) -> str:
    """The docs/benchmarks.md section for a result file (every figure from it)."""
    runs, v = data["runs"], data["verdict"]
    lines = section_head("`flodl demo`, the README's first command", data)
    lines += [
        "",
        (
            "The command with its defaults (cpu_cadence, 2 local CPU ranks, rank 1 slowed ×3 "
            "by `flodl.demo.Slowdown`, 3 epochs of the demo task: a 158k-parameter character "
            "MLP on the first MiB of the interpreter's standard-library source, Adam, batch "
            "128), run as a subprocess; `command s` is the whole command (solo baseline, "
            "lock-step DDP on the same ranks, flodl's run, start-up and shutdown), the other "
            "figures are the demo's own `--json` (its summary table). `flodl vs lock-step` is "
            "lock-step DDP's training span over flodl's, in the same run."
        ),
        "",
        *markdown_table(HEADERS, table_rows(runs)),
        "",
    ]
    mid = median_run(runs)
    if mid is not None:
        table = []
        for line in mid["summary"].splitlines():
            if line.startswith("  records"):
                break  # the file lines name the run's temporary directory
            table.append(line.rstrip())
        while table and not table[-1]:
            table.pop()
        head = f"The summary the median run (run {mid['run']}, {mid['wall_s']:.1f} s) printed"
        lines += [
            head + ", without the lines naming its files:",
            "",
            "```",
            *table,
            "```",
            "",
        ]
    walls = [r["wall_s"] for r in runs]
    lines.append(
        f"- The whole command under {v['target_s']:.0f} s in every run: "
        + (
            f"{min(walls):.1f}–{max(walls):.1f} s over {len(walls)} run(s), "
            if walls
            else "no run, "
        )
        + f"{met_text(v['met'])}."
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3, help="runs of the command (default 3)")
    parser.add_argument("--json", default=str(RESULTS_DIR / "bench_demo.json"))
    add_markdown_option(parser, RESULTS_DIR / "bench_demo.json")
    given = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(given)
    if args.markdown is not None:
        print(markdown(json.loads(Path(args.markdown).read_text())))
        return 0
    if args.repeat < 1:
        parser.error(f"--repeat {args.repeat}: expected at least 1")
    stamp = RunStamp("bench_demo", given)
    runs = []
    with tempfile.TemporaryDirectory(prefix="bench-demo-") as tmp:
        for i in range(args.repeat):
            row = run_once(Path(tmp), i)
            state = "ok" if "result" in row else f"failed ({row.get('error', '')})"
            print(f"  run {i}: {row['wall_s']:.1f} s, {state}", flush=True)
            runs.append(row)
    v = verdict(runs)
    print_table("flodl demo (the README's first command)", HEADERS, table_rows(runs))
    walls = [r["wall_s"] for r in runs]
    print(
        f"whole command: median {statistics.median(walls):.1f} s, max {max(walls):.1f} s "
        f"(target < {TARGET_S:.0f} s in every run): {'met' if v['met'] else 'NOT met'}"
    )
    write_json(args.json, stamp.header("bench_demo", "torch") | {"runs": runs, "verdict": v})
    return 0 if all("result" in r for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
