"""Coordinator machine cost per averaging cycle at 8 … 4096 simulated ranks.

Drives the real pure coordinator with :class:`flodl.sim.SimCluster` (cpu_cadence, equal speeds
with jitter) and times every ``handle``/``tick`` call with ``perf_counter``. Reports, per world
size:

* ``cycle µs``: coordinator CPU per averaging cycle for everything except per-batch frames
  (acks/heartbeats, the trigger, finalize with ElChe/guard feedback, dispatch, and the slice
  reports: a ``batch`` frame that finishes a slice carries its ``metrics`` and counts here for
  its cost beyond a plain ``batch`` frame's mean), and
  ``of which GC µs``: the part spent in Python's cyclic garbage collector, whose passes scan
  the whole heap (the simulated ranks' objects too),
* ``batch µs``: cost of one plain ``batch`` frame (the per-step timing report), so a cycle of anchor
  ``a`` costs ``cycle + a × W × batch``,
* ``total ms/cycle`` at the measured anchor, and simulated ranks×seconds per wall second,
* ``closing ms``: the last cycle, whose finalize also closes the epoch and ends the run
  (coverage check, epoch-boundary callbacks, shutdown): a cost per epoch, kept out of the
  per-cycle figures; ``one-off ms``: formation, the first dispatch and the exits.

The heap policy is ``flodl coord``'s (:class:`flodl.service.heap.HeapFreeze`): one collection
and ``gc.freeze()`` after the input that starts training (in ``one-off ms``) and a young
generation threshold of :data:`~flodl.service.heap.YOUNG_THRESHOLD` while it trains,
``gc.unfreeze()`` and the threshold restored after the run. A coordinator of thousands of
ranks is a ``flodl coord``; a launcher-hosted one (in the user's interpreter) leaves the
collector alone and pays its full passes in the cycle.

Target: the 4096-rank cycle costs < 50 ms of coordinator CPU, growing no faster than linearly.

Every world size runs ``REPEATS`` times, interleaved; a row is the run with the median cycle.

``--baseline REV`` also measures git revision ``REV`` of this repository (unpacked with ``git
archive``; its compiled core built too with ``--compiled``), every (tree, core) child alternated
with this tree's, and reports this tree's cycle against it: the way to show what a change did
on a machine whose speed drifts by more than the change between two sittings.

``--compiled`` measures the compiled core too (docs/design.md §2, "Compiled core"): it builds
the wheel a user would (``HATCH_BUILD_HOOK_ENABLE_CUSTOM=1 pip wheel .``), installs it in a
scratch directory, and measures both builds in child processes, alternated (one run of every
world size per child), so each row names its core.

    python benchmarks/bench_coord.py [--quick] [--repeat N] [--compiled] [--baseline REV]
                                     [--json PATH]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from _common import (
    REPO_ROOT,
    RESULTS_DIR,
    CoordinatorView,
    add_markdown_option,
    build_compiled_core,
    ensure_repo_on_path,
    machine_info,
    print_table,
    section_head,
    uptime,
    write_json,
)

CORE_PATH_ENV = "FLODL_BENCH_CORE_PATH"
"""Set in a child process: the directory holding the flodl build it measures."""

if os.environ.get(CORE_PATH_ENV):
    sys.path.insert(0, os.environ[CORE_PATH_ENV])
else:
    ensure_repo_on_path()

from flodl import coord as coord_pkg  # noqa: E402
from flodl.service.heap import HeapFreeze  # noqa: E402
from flodl.sim import SimCluster  # noqa: E402
from flodl.wire.frames import Batch  # noqa: E402


def measure(world: int, cycles: int) -> dict[str, Any]:
    anchor = 10
    sim = SimCluster(
        world,
        "cpu_cadence",
        [10.0] * world,
        dataset_len=world * anchor * cycles,
        batch_size=1,
        epochs=1,
        seed=1,
        check_invariants=False,
    )
    coord = sim.coord
    spent: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    handle, tick = coord.handle, coord.tick
    collector = {"total": 0.0, "started": 0.0}

    def on_gc(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            collector["started"] = time.perf_counter()
        else:
            collector["total"] += time.perf_counter() - collector["started"]

    # what was spent and called so far, at each finalized cycle
    marks: list[tuple[dict[str, float], dict[str, int]]] = []

    def mark() -> None:
        while len(marks) < coord.sync_rounds:
            marks.append((dict(spent), dict(calls)))

    heap = HeapFreeze()  # the standalone coordinator's policy, applied where it applies it

    def timed_handle(event: Any, now: float) -> Any:
        g0, t0 = collector["total"], time.perf_counter()
        out = handle(event, now)
        if heap.pending:  # (the server checks after every input, as here)
            heap.on_phase(coord.phase)
        # a batch that finished a slice carries its metrics (one frame where there were two)
        key = (
            "other"
            if not isinstance(event, Batch)
            else ("batch" if event.metrics is None else "slice")
        )
        spent[key] += time.perf_counter() - t0
        spent[f"{key}_gc"] += collector["total"] - g0
        calls[key] += 1
        mark()
        return out

    def timed_tick(now: float) -> Any:
        g0, t0 = collector["total"], time.perf_counter()
        out = tick(now)
        spent["other"] += time.perf_counter() - t0
        spent["other_gc"] += collector["total"] - g0
        calls["tick"] += 1
        mark()
        return out

    sim.coord = CoordinatorView(coord, handle=timed_handle, tick=timed_tick)  # type: ignore[assignment]
    gc.collect()  # what earlier world sizes left is not this one's to collect
    gc.callbacks.append(on_gc)
    wall0 = time.perf_counter()
    try:
        trace = sim.run()
        frozen = gc.get_freeze_count()
        young = gc.get_threshold()[0]  # (the policy's, while the run trained)
    finally:
        gc.callbacks.remove(on_gc)
        heap.release()
    wall = time.perf_counter() - wall0
    # Steady state: from the first finalized cycle to the one before the last. Formation and
    # the first dispatch come before it; the last cycle's finalize also closes the epoch and
    # ends the run (coverage check, epoch callbacks, the shutdown), a cost per epoch or per
    # run that is reported on its own (``closing_ms``), not spread over the cycles.
    if len(marks) < 3:
        raise SystemExit(f"bench_coord: {len(marks)} cycles at {world} ranks, need 3 or more")
    steady = len(marks) - 2
    # A plain batch frame's mean cost; a batch that carries a slice's metrics counts in the
    # cycle for what it costs beyond that (the metrics frame it replaces did, whole).
    plain = spent["batch"] / max(1, calls["batch"])
    plain_gc = spent["batch_gc"] / max(1, calls["batch"])

    def cyc(at: tuple[dict[str, float], dict[str, int]], gc_part: bool = False) -> float:
        s, n = at
        suffix, per = ("_gc", plain_gc) if gc_part else ("", plain)
        return s.get("other" + suffix, 0.0) + s.get("slice" + suffix, 0.0) - n.get("slice", 0) * per

    def total(at: tuple[dict[str, float], dict[str, int]]) -> float:
        s = at[0]
        return s.get("other", 0.0) + s.get("batch", 0.0) + s.get("slice", 0.0)

    end = (dict(spent), dict(calls))
    batch_us = 1e6 * plain
    cycle_us = 1e6 * (cyc(marks[-2]) - cyc(marks[0])) / steady
    cycle_gc_us = 1e6 * (cyc(marks[-2], True) - cyc(marks[0], True)) / steady
    total_ms = 1e3 * (total(marks[-2]) - total(marks[0])) / steady
    closing_ms = 1e3 * (cyc(marks[-1]) - cyc(marks[-2]))
    one_off_ms = 1e3 * (cyc(end) - (cyc(marks[-1]) - cyc(marks[0])))
    return {
        "world": world,
        "core": "compiled" if coord_pkg.compiled() else "interpreted",
        "cycles": trace.cycles,
        "ok": trace.ok,
        "cycle_us": cycle_us,
        "cycle_us_per_rank": cycle_us / world,
        "cycle_gc_us": cycle_gc_us,
        "batch_us": batch_us,
        "total_ms_per_cycle": total_ms,
        "anchor": trace.anchors[-1],
        "one_off_ms": one_off_ms,
        "closing_ms": closing_ms,
        "sim_rank_seconds_per_wall_s": world * trace.wall_s / wall,
        "wall_s": wall,
        "frozen_objects": frozen,
        "young_threshold": young,
    }


CYCLES = 24
"""Cycles per world size: the steady window (all but the first and the last) must span enough
cycles that the garbage collector's full passes, a few per run at 4096 ranks, land in it in
proportion rather than by chance (8 cycles moved the 4096-rank figure by ±15 % when a change
only shifted where a pass fell)."""

REPEATS = 3
"""Runs per world size, interleaved (every size once, then again): a row is the run with the
median cycle. Where the collector's full passes land moves a 4,096-rank figure by ±15 % from
run to run (a pass costs tens of ms there, and it is charged to whichever input triggered it),
and the machine's speed drifts within a sitting."""


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run with the median cycle cost, carrying every run's cycle cost (ascending) and
    the median of their plain batch costs (a figure of its own, whichever run it came from)."""
    ordered = sorted(runs, key=lambda r: r["cycle_us"])
    return ordered[(len(ordered) - 1) // 2] | {
        "cycle_us_runs": [r["cycle_us"] for r in ordered],
        "batch_us_median": statistics.median(r["batch_us"] for r in runs),
        "repeats": len(ordered),
    }


TARGET_MS = 50.0
LINEAR_BOUND = 1.5
"""Linear growth: µs per rank per cycle at 4096 ranks at most this many times the 64-rank one."""


def verdicts(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The targets from the rows: the 4096-rank cycle under TARGET_MS, growth linear. The
    top-level verdicts are the interpreted core's (the rows of a run without ``--compiled``);
    ``by_core`` has every core measured."""
    out: dict[str, Any] = {"target_ms": TARGET_MS, "linear_bound": LINEAR_BOUND}
    by_core: dict[str, dict[str, Any]] = {}
    for core in _cores(rows):
        by = {r["world"]: r for r in rows if _core(r) == core}
        big, mid = by.get(4096), by.get(64)
        v: dict[str, Any] = {}
        if big is not None:
            v |= {"cycle_ms_4096": big["cycle_us"] / 1000.0}
            v["met_cycle"] = v["cycle_ms_4096"] < TARGET_MS
        if big is not None and mid is not None:
            growth = big["cycle_us_per_rank"] / mid["cycle_us_per_rank"]
            v |= {"per_rank_growth_64_to_4096": growth, "met_linear": growth <= LINEAR_BOUND}
        by_core[core] = v
    out |= by_core.get("interpreted", {})
    out["by_core"] = by_core
    return out


def _core(row: dict[str, Any]) -> str:
    return str(row.get("core", "interpreted"))  # (a result file from before the compiled core)


def _cores(rows: list[dict[str, Any]]) -> list[str]:
    return list(dict.fromkeys(_core(r) for r in rows))


def _bases(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Each core's µs per rank at its smallest world size (the rows come smallest first)."""
    bases: dict[str, float] = {}
    for r in rows:
        bases.setdefault(_core(r), r["cycle_us_per_rank"])
    return bases


def _frozen_text(rows: list[dict[str, Any]]) -> str:
    """How many objects the heap policy froze, at the largest world size measured."""
    top = max(rows, key=lambda r: r["world"])
    frozen = top.get("frozen_objects")
    if frozen is None:  # a result file from before the policy
        return "not applied in this run"
    return f"{frozen:,} objects at {top['world']:,} ranks"


def markdown(data: dict[str, Any]) -> str:
    """The docs/benchmarks.md section for a result file (every figure from it)."""
    v = data["verdicts"]
    cores = _cores(data["rows"])
    core_head = "core | " if cores != ["interpreted"] else ""
    lines = [
        *section_head("Coordinator cost per averaging cycle", data),
        "",
        (
            "The real pure coordinator driven by `flodl.sim` (cpu_cadence, equal speeds, anchor "
            "10), every `handle`/`tick` timed with `perf_counter`; steady state from the first "
            "finalized cycle to "
            "the one before the last (the last cycle also closes the epoch and ends the run: "
            "`closing ms`, a cost per epoch; formation, the first dispatch and the exits are "
            "`one-off ms`). `cycle µs` is everything except per-step `batch` frames "
            "(the ack frames — snapshot frames too where a mode sends them —, the "
            "trigger, finalize with ElChe/guard feedback, the next dispatch, and each slice's "
            "report: a `batch` frame that finishes a slice carries its `metrics` and counts "
            "here for what it costs beyond a plain `batch` frame); `batch µs` is the cost of one "
            "plain `batch` frame. Each world size ran "
            f"{data['rows'][0].get('repeats', 1)} time(s), interleaved with the others; a row is "
            "the run with the median `cycle µs`, and the last column shows every run's."
            + (
                " `core`: `interpreted` is the repository's sources, `compiled` the wheel built "
                "with the compiled-core hook on (`HATCH_BUILD_HOOK_ENABLE_CUSTOM=1 pip wheel .`, "
                'docs/design.md §2, "Compiled core"); each ran in child processes, the two '
                "alternated, one run of every world size per child."
                if core_head
                else ""
            )
        ),
        "",
        (
            "`of which GC µs` is the part of `cycle µs` spent in Python's cyclic garbage "
            "collector (`gc.callbacks`), whose passes scan the process heap, the simulated "
            "ranks' objects included. The heap policy is `flodl coord`'s "
            "(`flodl.service.heap.HeapFreeze`): one collection and `gc.freeze()` after the "
            "input that starts training (in `one-off ms`), so later passes skip what existed "
            f"then ({_frozen_text(data['rows'])}), and young passes every "
            f"{data['rows'][-1].get('young_threshold', 700):,} allocations instead of 700 "
            "while it trains; "
            "a coordinator hosted by a launcher, in the user's interpreter, leaves the "
            "collector alone."
        ),
        "",
        (
            f"| {core_head}ranks | cycles | cycle µs | of which GC µs | µs per rank "
            "| vs 8 ranks (per rank) | batch µs | total ms/cycle | closing ms | one-off ms "
            "| simulated rank·s per wall s | cycle µs, each run |"
        ),
        "|---" * (12 + bool(core_head)) + "|",
    ]
    bases = _bases(data["rows"])
    for r in data["rows"]:
        base = bases[_core(r)]
        cell = f"{_core(r)} | " if core_head else ""
        lines.append(
            f"| {cell}{r['world']:,} | {r['cycles']} | {r['cycle_us']:,.0f} "
            f"| {_gc_cell(r)} | {r['cycle_us_per_rank']:.1f} "
            f"| {r['cycle_us_per_rank'] / base:.2f}× | {r['batch_us']:.1f} "
            f"| {r['total_ms_per_cycle']:.1f} | {r['closing_ms']:.1f} | {r['one_off_ms']:.0f} "
            f"| {r['sim_rank_seconds_per_wall_s']:.0f} | {_runs_cell(r)} |"
        )
    lines.append("")
    for core, cv in v.get("by_core", {"interpreted": v}).items():
        which = f", {core} core" if core_head else ""
        if "met_linear" in cv:
            lines.append(
                f"- Linear growth{which} (µs per rank per cycle at 4096 ≤ "
                f"{v['linear_bound']}× the 64-rank figure): "
                f"{cv['per_rank_growth_64_to_4096']:.2f}×, "
                f"**{'met' if cv['met_linear'] else 'not met'}**."
            )
        if "met_cycle" in cv:
            lines.append(
                f"- 4096-rank cycle under {v['target_ms']:g} ms{which}: "
                f"{cv['cycle_ms_4096']:.1f} ms, **{'met' if cv['met_cycle'] else 'not met'}**."
            )
    baseline = data.get("baseline")
    if baseline is not None:
        lines += ["", *_baseline_lines(baseline)]
    return "\n".join(lines)


def _baseline_lines(base: dict[str, Any]) -> list[str]:
    """The comparison with ``--baseline``: this tree's median cycle against the baseline's."""
    lines = [
        (
            f"Against the baseline `{base['rev']}` (commit `{base['commit'][:10]}`), measured in "
            "the same run (`--baseline`): its sources, and its compiled core built the same way, "
            "each ran as a child of its own, every (tree, core) child alternated with this "
            "tree's, the same sizes, cycles and runs; each side's row is its median run."
        ),
        "",
        (
            "| core | ranks | cycle µs | baseline cycle µs | this / baseline | baseline, each run "
            "| batch µs | baseline batch µs | this / baseline |"
        ),
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for c in base["comparison"]:
        runs = " · ".join(f"{us:,.0f}" for us in c["baseline_cycle_us_runs"])
        batch = (  # (result files from before the batch columns have none)
            f"{c['batch_us']:.2f} | {c['baseline_batch_us']:.2f} | {c['batch_ratio']:.2f}×"
            if "batch_ratio" in c
            else "- | - | -"
        )
        lines.append(
            f"| {c['core']} | {c['world']:,} | {c['cycle_us']:,.0f} "
            f"| {c['baseline_cycle_us']:,.0f} | {c['ratio']:.2f}× | {runs} | {batch} |"
        )
    lines.append("")
    for core, cv in base["verdicts"].get("by_core", {}).items():
        if "cycle_ms_4096" in cv and "per_rank_growth_64_to_4096" in cv:
            lines.append(
                f"- The baseline's {core} core in this run: 4096-rank cycle "
                f"{cv['cycle_ms_4096']:.1f} ms, growth {cv['per_rank_growth_64_to_4096']:.2f}×."
            )
    return lines


def _runs_cell(row: dict[str, Any]) -> str:
    return " · ".join(f"{us:,.0f}" for us in row.get("cycle_us_runs", [row["cycle_us"]]))


def _gc_cell(row: dict[str, Any]) -> str:
    return "-" if row.get("cycle_gc_us") is None else f"{row['cycle_gc_us']:,.0f}"


SIZES = (8, 64, 512, 4096)


def child_sweep(core: str, site: Path | None, cycles: int, out: Path) -> list[dict[str, Any]]:
    """One run of every world size in a child process: the repository's sources, or the build
    installed at ``site``. Fails unless the child measured the core it was meant to."""
    env = {k: v for k, v in os.environ.items() if k != CORE_PATH_ENV}
    if site is not None:
        env[CORE_PATH_ENV] = str(site)
    cmd = [sys.executable, __file__, "--sweep", str(out), "--cycles", str(cycles)]
    subprocess.run(cmd, env=env, check=True)
    rows: list[dict[str, Any]] = json.loads(out.read_text())
    wrong = {r["core"] for r in rows} - {core}
    if wrong:
        raise SystemExit(f"bench_coord: the {core} child measured a {wrong.pop()} core")
    return rows


def baseline_tree(rev: str, dest: Path) -> str:
    """Revision ``rev`` of this repository unpacked at ``dest`` (``git archive``); its commit."""
    git = ["git", "-C", str(REPO_ROOT)]
    found = subprocess.run(
        [*git, "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}"],
        check=False,
        capture_output=True,
        text=True,
    )
    if found.returncode != 0:
        raise SystemExit(f"bench_coord: --baseline {rev!r} names no commit of {REPO_ROOT}")
    commit = found.stdout.strip()
    dest.mkdir(parents=True)
    archive = subprocess.run([*git, "archive", commit], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return commit


def comparison(rows: list[dict[str, Any]], base: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """This tree's median cycle against the baseline's, per core and world size, and its
    plain batch frame's median cost against the baseline's."""
    theirs = {(_core(r), r["world"]): r for r in base}
    out = []
    for r in rows:
        b = theirs.get((_core(r), r["world"]))
        if b is not None:
            out.append(
                {
                    "core": _core(r),
                    "world": r["world"],
                    "cycle_us": r["cycle_us"],
                    "baseline_cycle_us": b["cycle_us"],
                    "ratio": r["cycle_us"] / b["cycle_us"],
                    "baseline_cycle_us_runs": b.get("cycle_us_runs", [b["cycle_us"]]),
                    # a plain batch frame: the median over each side's runs
                    "batch_us": r["batch_us_median"],
                    "baseline_batch_us": b["batch_us_median"],
                    "batch_ratio": r["batch_us_median"] / b["batch_us_median"],
                }
            )
    return out


def measure_all(
    cores: list[str], baseline: str | None, repeats: int, cycles: int
) -> tuple[dict[tuple[str, str, int], list[dict[str, Any]]], str | None]:
    """Every (tree, core, world size) run; the baseline's commit. A run with the compiled core
    or a baseline measures in child processes, one sweep of every size per child, the
    (tree, core) pairs alternated from one repeat to the next."""
    trees = ["this", "baseline"] if baseline else ["this"]
    runs: dict[tuple[str, str, int], list[dict[str, Any]]] = {
        (t, c, w): [] for t in trees for c in cores for w in SIZES
    }
    if cores == ["interpreted"] and baseline is None:
        for _ in range(repeats):
            for w in SIZES:
                runs[("this", "interpreted", w)].append(measure(w, cycles))
        return runs, None
    scratch = Path(tempfile.mkdtemp(prefix="bench-coord-"))
    commit = None
    try:
        sites: dict[tuple[str, str], Path] = {}
        if baseline is not None:
            source = scratch / "baseline"
            commit = baseline_tree(baseline, source)
            sites[("baseline", "interpreted")] = source
        if "compiled" in cores:
            sites[("this", "compiled")] = build_compiled_core(scratch / "this-build")
            if baseline is not None:
                sites[("baseline", "compiled")] = build_compiled_core(
                    scratch / "baseline-build", source=scratch / "baseline"
                )
        pairs = [(t, c) for c in cores for t in trees]
        for i in range(repeats):
            for tree, core in pairs if i % 2 == 0 else pairs[::-1]:  # (alternated)
                out = scratch / f"{tree}-{core}-{i}.json"
                for r in child_sweep(core, sites.get((tree, core)), cycles, out):
                    runs[(tree, core, r["world"])].append(r)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return runs, commit


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer cycles, one run per size")
    parser.add_argument("--repeat", type=int, default=None, help=f"runs per size ({REPEATS})")
    parser.add_argument(
        "--compiled", action="store_true", help="build the compiled core and measure it too"
    )
    parser.add_argument(
        "--baseline",
        metavar="REV",
        help="also measure git revision REV's coordinator, alternated with this tree's (same "
        "sizes, cores and runs), and report this tree's cycle against it",
    )
    parser.add_argument("--json", default=str(RESULTS_DIR / "bench_coord.json"))
    parser.add_argument("--sweep", help=argparse.SUPPRESS)  # (a child: one run of every size)
    parser.add_argument("--cycles", type=int, default=CYCLES, help=argparse.SUPPRESS)
    add_markdown_option(parser, RESULTS_DIR / "bench_coord.json")
    args = parser.parse_args()
    if args.markdown is not None:
        print(markdown(json.loads(Path(args.markdown).read_text())))
        return
    if args.sweep is not None:
        Path(args.sweep).write_text(json.dumps([measure(w, args.cycles) for w in SIZES]))
        return
    before = uptime()
    date = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    cycles = 4 if args.quick else CYCLES
    repeats = args.repeat if args.repeat is not None else (1 if args.quick else REPEATS)
    cores = ["interpreted", "compiled"] if args.compiled else ["interpreted"]
    runs, commit = measure_all(cores, args.baseline, repeats, cycles)
    rows = [median_run(runs[("this", c, w)]) for c in cores for w in SIZES]
    bases = _bases(rows)
    print_table(
        "coordinator cost per averaging cycle (cpu_cadence, anchor 10, equal speeds)",
        [
            "core",
            "ranks",
            "cycles",
            "cycle µs",
            "of which GC µs",
            "µs/rank",
            "vs 8-rank µs/rank",
            "batch µs",
            "total ms/cycle",
            "closing ms",
            "one-off ms",
            "rank·s / wall s",
            "cycle µs, each run",
        ],
        [
            [
                r["core"],
                r["world"],
                r["cycles"],
                f"{r['cycle_us']:.0f}",
                _gc_cell(r),
                f"{r['cycle_us_per_rank']:.1f}",
                f"{r['cycle_us_per_rank'] / bases[r['core']]:.2f}×",
                f"{r['batch_us']:.1f}",
                f"{r['total_ms_per_cycle']:.1f}",
                f"{r['closing_ms']:.1f}",
                f"{r['one_off_ms']:.0f}",
                f"{r['sim_rank_seconds_per_wall_s']:.0f}",
                _runs_cell(r),
            ]
            for r in rows
        ],
    )
    v = verdicts(rows)
    for core, cv in v["by_core"].items():
        if "met_linear" in cv:
            state = "met" if cv["met_linear"] else "NOT met"
            print(
                f"{core}: µs per rank at 4096 = {cv['per_rank_growth_64_to_4096']:.2f}× the "
                f"64-rank figure (target ≤ {LINEAR_BOUND:g}×): {state}"
            )
        if "met_cycle" in cv:
            state = "met" if cv["met_cycle"] else "NOT met"
            print(
                f"{core}: 4096-rank cycle {cv['cycle_ms_4096']:.1f} ms "
                f"(target < {TARGET_MS:g} ms): {state}"
            )
    extra: dict[str, Any] = {}
    if args.baseline is not None:
        base_rows = [median_run(runs[("baseline", c, w)]) for c in cores for w in SIZES]
        compared = comparison(rows, base_rows)
        print_table(
            f"this tree against {args.baseline} ({(commit or '')[:10]}), alternated in one run",
            ["core", "ranks", "cycle µs", "baseline cycle µs", "this / baseline"],
            [
                [
                    c["core"],
                    c["world"],
                    f"{c['cycle_us']:.0f}",
                    f"{c['baseline_cycle_us']:.0f}",
                    f"{c['ratio']:.2f}×",
                ]
                for c in compared
            ],
        )
        extra["baseline"] = {
            "rev": args.baseline,
            "commit": commit,
            "rows": base_rows,
            "verdicts": verdicts(base_rows),
            "comparison": compared,
        }
    argv = " ".join(sys.argv[1:])
    write_json(
        args.json,
        {
            "benchmark": "bench_coord",
            "command": "python benchmarks/bench_coord.py" + (f" {argv}" if argv else ""),
            "date": date,
            "uptime_before": before,
            "uptime_after": uptime(),
            "machine": machine_info(),
            "rows": rows,
            "verdicts": v,
            **extra,
        },
    )


if __name__ == "__main__":
    main()
