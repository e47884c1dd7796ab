"""Run every benchmark at a small size and print one table of headline ratios vs targets.

    python -m benchmarks [--quick] [--only NAME,...] [--skip NAME,...]

Each ``benchmarks/bench_*.py`` runs in its own subprocess (``python benchmarks/<name>.py``,
with the suite's size arguments and ``--json benchmarks/results/suite/<name>.json``: a folder of
its own, so that a smoke-size run never replaces the result file of a script's own full run,
from which docs/benchmarks.md renders that script's section), one after the
other, under a per-script time limit that keeps the whole suite under 21.5 minutes
(``--quick``: a smoke run of a few minutes). The summary reads each script's JSON; a script
that is missing, fails, times out or writes JSON of an unexpected shape gets a row that says
so. A script the suite does not know runs with no arguments and gets a row with its exit
status only. Exit status: 0 when every script ran (targets missed or not), 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # the scripts' helpers, imported bare as the scripts do

from _common import machine_info, run_in_group, section_head, uptime  # noqa: E402

REPO = HERE.parent
RESULTS = HERE / "results"
SUITE_RESULTS = RESULTS / "suite"
"""Where the suite's runs write their JSON and logs (a script's own run writes to RESULTS)."""
SUITE_LIMIT_S = 21.5 * 60

Headline = dict[str, Any]
"""One summary row: ``metric`` (what), ``value`` (str), ``target`` (str), ``met`` (bool|None)."""


def _row(metric: str, value: str, target: str = "", met: bool | None = None) -> Headline:
    return {"metric": metric, "value": value, "target": target, "met": met}


# ---------------------------------------------------------------------------------------------
# headline extractors: JSON → rows (any KeyError/TypeError → "unexpected JSON" row)
# ---------------------------------------------------------------------------------------------


def _wire(d: dict[str, Any]) -> list[Headline]:
    codec = d["codec"]
    out = [
        _row(
            f"codec {k} round trip vs bare msgpack",
            f"{codec['frames'][k]['ratio']:.2f}×",
            f"≥ {codec['target_ratio']}×",
            codec["frames"][k]["ratio"] >= codec["target_ratio"],
        )
        for k in ("heartbeat", "batch")
    ]
    loop = d["loopback"]["loops"]["uvloop"]
    out.append(_row("loopback frames/s vs raw msgpack (uvloop)", f"{loop['ratio']:.2f}×"))
    return out


def _tensor_wire(d: dict[str, Any]) -> list[Headline]:
    ratio = d["rows"]["f32"]["decode_vs_memcpy"]
    target = d["target_decode_vs_memcpy"]
    return [
        _row(
            f"f32 decode vs memcpy ({d['mib']} MiB)",
            f"{ratio:.2f}×",
            f"≥ {target}×",
            d["target_met"],
        )
    ]


def _coord(d: dict[str, Any]) -> list[Headline]:
    # the interpreted core's rows (the suite measures the sources; a --compiled file has both)
    rows = [r for r in d["rows"] if r.get("core", "interpreted") == "interpreted"]
    big = max(rows, key=lambda r: r["world"])
    small = min(rows, key=lambda r: r["world"])
    per_rank = big["cycle_us_per_rank"] / small["cycle_us_per_rank"]
    return [
        _row(
            f"{big['world']}-rank cycle overhead",
            f"{big['cycle_us'] / 1000:.1f} ms",
            "< 50 ms",
            big["cycle_us"] < 50_000,
        ),
        _row(
            f"µs per rank, {big['world']} vs {small['world']} ranks",
            f"{per_rank:.2f}×",
            "linear (flat per rank)",
        ),
    ]


def _reform(d: dict[str, Any]) -> list[Headline]:
    big = max(d["rows"], key=lambda r: r["world"])
    total = big["machine_ms"] + big["encode_ms"]
    return [
        _row(
            f"re-form after a death at {big['world']:,} ranks: coordinator + encoding",
            f"{total:.1f} ms ({1e3 * big['encode_ms'] / big['members']:.1f} µs per member "
            f"encoded, {big['bytes'] / 2**20:.2f} MiB sent)",
        )
    ]


def _reduce(d: dict[str, Any]) -> list[Headline]:
    out = []
    for r in d["rows"]:
        if r["mib"] == 64 and r["target_ratio"] is not None:
            out.append(
                _row(
                    f"CPU round vs Gloo, world {r['world']}, 64 MiB {r['wire']} {r['lane']}",
                    f"{r['ratio_vs_gloo']:.2f}×",
                    f"≤ {r['target_ratio']}×",
                    r["target_met"],
                )
            )
    if not out:
        raise KeyError("no 64 MiB row with a target")
    lag = d.get("loop_lag")
    if lag is not None:
        out.append(
            _row(
                f"event-loop lag p99 during a {lag['mib']} MiB round",
                f"{lag['lag_p99_ms']:.1f} ms",
                f"< {lag['target_p99_ms']:g} ms",
                lag["target_met"],
            )
        )
    return out


def _convergence(d: dict[str, Any]) -> list[Headline]:
    rows = [s for s in d["summary"] if s["mode"] != "solo"]
    met = sum(1 for s in rows if s["target_met"])
    worst = min(rows, key=lambda s: s["diff_pp"])
    return [
        _row(
            "modes × ranks within 0.5 pp / 2 % of solo",
            f"{met}/{len(rows)}",
            "all",
            met == len(rows),
        ),
        _row(
            f"worst: {worst['mode']} ×{worst['ranks']} vs solo",
            f"{worst['diff_pp']:+.2f} pp",
            "≥ −0.5 pp or ≤ 2 % rel.",
            worst["target_met"],
        ),
    ]


def _overhead(d: dict[str, Any]) -> list[Headline]:
    one, two = d["single"], d["two_ranks"]
    return [
        _row(
            "one device: flodl / plain torch loop",
            f"{one['ratio']:.2f}×",
            f"≤ {one['target']}×",
            one["met"],
        ),
        _row(
            "2 equal ranks nccl_sync: flodl / DDP (training)",
            f"{two['ratio_train']:.2f}×",
            f"≤ {two['target']}×",
            two["met"],
        ),
    ]


def _hetero(d: dict[str, Any]) -> list[Headline]:
    out = []
    for t in d["targets"]:
        v = t["value"]
        if v is None:
            shown = "n/a"
        elif isinstance(v, list):
            shown = f"{v[0]:.2f} (worst {v[1]:.2f})"
        elif "loss" in t["check"]:
            shown = f"{100 * v:+.2f} %"
        else:
            shown = f"{v:.2f}×"
        out.append(_row(f"{t['rig']} {t['system']}: {t['check']}", shown, t["target"], t["met"]))
    if not out:
        raise KeyError("no targets (no cadence mode ran?)")
    return out


def _demo(d: dict[str, Any]) -> list[Headline]:
    v = d["verdict"]
    speedups = [r["result"]["speedup"] for r in d["runs"] if "result" in r]
    shown = " / ".join("n/a" if x is None else f"{x:.2f}×" for x in speedups)
    return [
        _row(
            "flodl demo: the whole command (slowest run)",
            f"{v['max_wall_s']:.1f} s",
            f"< {v['target_s']:.0f} s",
            v["met"],
        ),
        _row(
            "flodl demo: flodl vs lock-step DDP (training span)",
            shown or "n/a (no run finished)",
        ),
    ]


def _startup(d: dict[str, Any]) -> list[Headline]:
    by = {r["system"]: r for r in d["rows"]}
    failed = [s for s in ("flodl", "torchrun_ddp") if not by.get(s, {}).get("ok")]
    metric = "launch → last rank's first step: flodl vs torchrun + DDP"
    if failed:
        return [_row(metric, f"n/a: {', '.join(failed)} failed")]
    flodl = by["flodl"]
    value = f"{flodl['first_step_vs_torchrun']:.2f}× ({flodl['first_step_s']:.2f} s)"
    return [_row(metric, value)]


def _gpu(d: dict[str, Any]) -> list[Headline]:
    if not d["runs"]:
        return [_row("the GPU path", f"nothing measured: {d['gpus']} GPU(s) visible")]
    ok = [r for r in d["runs"].values() if "error" not in r]
    failed = len(d["runs"]) - len(ok)
    value = f"{len(ok)} runs on {d.get('gpu_name', 'a GPU')}" + (
        f", {failed} failed" if failed else ""
    )
    return [_row("the GPU path", value)]


def _recovery(d: dict[str, Any]) -> list[Headline]:
    out = []
    for r in d["rows"]:
        det, res = r["t_detect_s"], r["t_resume_s"]
        if r["system"] == "flodl" and r["path"] == "kill":
            value = (
                "n/a"
                if det["max"] is None
                else f"detect {1000 * det['max']:.0f} ms, resume "
                + ("-" if res["max"] is None else f"{1000 * res['max']:.0f} ms")
            )
            out.append(_row("flodl SIGKILL (worst trial)", value, "< 200 ms, < 2 s", r.get("met")))
        elif r["system"] == "flodl" and r["path"] == "stop":
            over = r.get("detect_minus_timeout_s", {}).get("max")
            after = r.get("resume_after_detect_s", {}).get("max")
            value = (
                "n/a"
                if over is None
                else f"detect−timeout {1000 * over:.0f} ms, resume−detect "
                + ("-" if after is None else f"{1000 * after:.0f} ms")
            )
            out.append(
                _row("flodl SIGSTOP (heartbeat, worst trial)", value, "< 1 s, < 2 s", r.get("met"))
            )
        else:
            label = f"torchft SIGKILL ({r.get('variant') or '?'} lighthouse, median)"
            value = (
                "n/a"
                if det["median"] is None
                else f"detect {1000 * det['median']:.0f} ms, resume "
                + ("-" if res["median"] is None else f"{1000 * res['median']:.0f} ms")
            )
            row = _row(label, value, "reference")
            if r.get("errors"):
                row["note"] = r["errors"][0][:120]
            out.append(row)
    return out


def _elastic(d: dict[str, Any]) -> list[Headline]:
    out = []
    flodl = [r for r in d["rows"] if r["system"] == "flodl"]
    for r in flodl:
        fold, target = r["t_fold_s"], r["target_s"]
        ratio = r["throughput_ratio"]
        value = (
            "n/a"
            if fold["max"] is None
            else f"t_fold {fold['max']:.2f} s (worst), throughput after/before "
            + ("-" if ratio["median"] is None else f"{ratio['median']:.2f}× (median)")
        )
        goal = "< 2 s + window" + ("" if target["min"] is None else f" ({target['min']:.2f} s)")
        row = _row(f"flodl {r['mode']} rejoin after a respawn", value, goal, r.get("met"))
        if r.get("errors"):
            row["note"] = r["errors"][0][:120]
        out.append(row)
    for r in d["rows"]:
        if r["system"] != "torchft":
            continue
        healed = r["start_to_consensus_s"]["median"]
        ours = [f["start_to_consensus_s"]["median"] for f in flodl]
        ours = [v for v in ours if v is not None]
        value = "n/a" if healed is None else f"torchft {healed:.2f} s"
        if ours:
            value += f", flodl {min(ours):.2f}–{max(ours):.2f} s"
        row = _row(
            f"restart → has the state, torchft ({r['variant']} lighthouse) vs flodl",
            value,
            "reference",
        )
        if r.get("errors"):
            row["note"] = r["errors"][0][:120]
        out.append(row)
    if not out:
        raise KeyError("no rows")
    return out


def _replay(d: dict[str, Any]) -> list[Headline]:
    target = f"|error| ≤ {100 * d['target_time_error']:.0f} %"
    out = []
    for m in d["summary"]["modes"]:
        worst = m["worst_time_error"]
        value = "n/a" if worst is None else f"{100 * worst:+.1f} % ({m['ok']}/{m['runs']} runs)"
        out.append(
            _row(f"flodl sim replay of a real {m['mode']} run: time error", value, target, m["met"])
        )
    if not out:
        raise KeyError("no modes")
    return out


@dataclass
class Spec:
    """How the suite runs one script."""

    args: list[str]
    quick_args: list[str]
    limit_s: float
    headline: Callable[[dict[str, Any]], list[Headline]]
    json_flag: bool = True


# Per-script limits (seconds) sum to 21.5 min; measured here (2 shared cores, load ≈ 3) the
# default sizes take ≈ 5 min in all and --quick ≈ 3 min. Sizes are the scripts' own
# quick/small options.
SPECS: dict[str, Spec] = {
    "bench_demo": Spec(["--repeat", "1"], ["--repeat", "1"], 150, _demo),
    "bench_wire": Spec(["--quick"], ["--quick"], 45, _wire),
    "bench_tensor_wire": Spec(["--mib", "32"], ["--mib", "8"], 45, _tensor_wire),
    "bench_coord": Spec(["--quick"], ["--quick"], 45, _coord),
    "bench_reform": Spec(["--repeat", "1"], ["--sizes", "64,512", "--repeat", "1"], 30, _reform),
    "bench_reduce": Spec(["--quick"], ["--quick", "--reps", "1"], 120, _reduce),
    "bench_convergence": Spec(
        ["--seeds", "1", "--epochs", "1", "--samples", "12000", "--ranks", "2"],
        ["--seeds", "1", "--epochs", "1", "--samples", "6000", "--ranks", "2"],
        120,
        _convergence,
    ),
    "bench_overhead": Spec(
        ["--repeat", "1", "--single-repeat", "2", "--samples", "16000"],
        ["--repeat", "1", "--single-repeat", "1", "--samples", "8000"],
        105,
        _overhead,
    ),
    "bench_hetero": Spec(
        [
            "--rigs",
            "x3",
            "--rounds",
            "1",
            "--samples",
            "8000",
            "--systems",
            "nccl_cadence,cpu_cadence,ddp,torchft,bound",
        ],
        [
            "--quick",
            "--rigs",
            "x3",
            "--samples",
            "4000",
            "--systems",
            "cpu_cadence,ddp,torchft,bound",
        ],
        150,
        _hetero,
    ),
    "bench_recovery": Spec(["--trials", "1"], ["--quick", "--paths", "kill"], 150, _recovery),
    "bench_elastic": Spec(
        ["--modes", "cpu_cadence", "--trials", "1", "--lighthouses", "py"],
        ["--quick", "--modes", "cpu_cadence", "--lighthouses", "py"],
        120,
        _elastic,
    ),
    "bench_replay": Spec(
        ["--rigs", "2r", "--samples", "24000"],
        ["--quick", "--modes", "cpu_cadence,cpu_async"],
        150,
        _replay,
    ),
    "bench_gpu": Spec([], [], 30, _gpu),
    "bench_startup": Spec(["--repeat", "1"], ["--repeat", "1"], 30, _startup),
}


def discover() -> list[str]:
    """Every known script in suite order (a missing one gets a "missing" row), then any other
    ``bench_*.py`` by name."""
    present = sorted(p.stem for p in HERE.glob("bench_*.py"))
    return list(SPECS) + [n for n in present if n not in SPECS]


def run_script(name: str, quick: bool, deadline: float) -> dict[str, Any]:
    """Run one script; returns status, seconds and its headline rows."""
    spec = SPECS.get(name)
    path = HERE / f"{name}.py"
    out_json = SUITE_RESULTS / f"{name}.json"
    argv = [sys.executable, str(path)]
    limit = 600.0
    if spec is not None:
        argv += spec.quick_args if quick else spec.args
        if spec.json_flag:
            argv += ["--json", str(out_json)]
        limit = spec.limit_s
    limit = max(10.0, min(limit, deadline - time.perf_counter()))
    if not path.exists():
        return {"name": name, "status": "missing", "seconds": 0.0, "rows": []}
    if out_json.exists() and spec is not None:
        out_json.unlink()  # never summarize a stale file
    log = SUITE_RESULTS / f"{name}.log"
    SUITE_RESULTS.mkdir(parents=True, exist_ok=True)
    print(f"\n=== {name}: {' '.join(argv[2:])} (limit {limit:.0f} s)", flush=True)
    t0 = time.perf_counter()
    with log.open("wb") as sink:
        # a group of its own: a script's children (a flodl demo and its ranks, say) are
        # killed with it at its limit and never compete with the next script
        code, _, _ = run_in_group(argv, limit, cwd=REPO, stdout=sink, stderr=subprocess.STDOUT)
    status = f"timeout {limit:.0f} s" if code is None else "ok" if code == 0 else f"exit {code}"
    seconds = time.perf_counter() - t0
    print(f"    {status} in {seconds:.0f} s (output: {log.relative_to(REPO)})", flush=True)
    result: dict[str, Any] = {"name": name, "status": status, "seconds": seconds, "rows": []}
    if status != "ok":
        tail = log.read_text(errors="replace").strip().splitlines()[-3:]
        result["note"] = " / ".join(tail)[-200:]
        return result
    if spec is None:
        result["note"] = "no headline extractor in benchmarks/__main__.py"
        return result
    try:
        data = json.loads(out_json.read_text())
        result["rows"] = spec.headline(data)
    except (OSError, ValueError, KeyError, TypeError, IndexError) as exc:
        result["status"] = "bad JSON"
        result["note"] = f"{type(exc).__name__}: {exc}"[:200]
    return result


def print_summary(results: list[dict[str, Any]], total_s: float) -> None:
    lines: list[list[str]] = []
    for r in results:
        if not r["rows"]:
            lines.append([r["name"], r["status"], r.get("note", ""), "", "", f"{r['seconds']:.0f}"])
            continue
        for i, h in enumerate(r["rows"]):
            verdict = {True: "met", False: "NOT met", None: "-"}[h["met"]]
            metric = h["metric"] + (f" [{h['note'][:80]}]" if h.get("note") else "")
            lines.append(
                [
                    r["name"] if i == 0 else "",
                    metric,
                    h["value"],
                    h["target"],
                    verdict,
                    f"{r['seconds']:.0f}" if i == 0 else "",
                ]
            )
    headers = ["script", "headline", "value", "target", "", "s"]
    widths = [max(len(h), *(len(row[i]) for row in lines)) for i, h in enumerate(headers)]
    print(f"\nbenchmark summary (total {total_s:.0f} s; details in benchmarks/results/)")
    print("  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip())
    print("  ".join("-" * w for w in widths))
    for row in lines:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())


def markdown(data: dict[str, Any]) -> str:
    """The docs/benchmarks.md section for a summary file (every figure from it)."""
    lines = [
        *section_head("All of it", data, f"{data['total_s']:.0f} s in all"),
        "",
        (
            "Every script at the suite's small size (`python -m benchmarks --list` prints the "
            "arguments), one after the other, each headline read from the script's JSON. These "
            "sizes are smoke sizes: the sections above and below, from each script's own "
            "default run, are the measurements."
        ),
        "",
        "| script | headline | value | target | verdict | s |",
        "|---|---|---|---|---|---|",
    ]

    def cell(text: str) -> str:
        return " ".join(str(text).split()).replace("|", "\\|")

    for r in data["scripts"]:
        seconds = f"{r['seconds']:.0f}"
        if not r["rows"]:
            lines.append(
                f"| {r['name']} | {cell(r['status'])} | {cell(r.get('note', ''))} | | | {seconds} |"
            )
            continue
        for i, h in enumerate(r["rows"]):
            verdict = {True: "**met**", False: "**not met**", None: "–"}[h["met"]]
            lines.append(
                f"| {r['name'] if i == 0 else ''} | {cell(h['metric'])} | {cell(h['value'])} "
                f"| {cell(h['target']) or '–'} | {verdict} | {seconds if i == 0 else ''} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="smoke sizes (a few minutes)")
    p.add_argument("--only", default="", help="comma-separated script names (bench_x)")
    p.add_argument("--skip", default="", help="comma-separated script names to leave out")
    p.add_argument("--list", action="store_true", help="print the plan and exit")
    p.add_argument(
        "--markdown",
        nargs="?",
        const=str(RESULTS / "summary.json"),
        default=None,
        metavar="JSON",
        help="print the docs section for a summary file and exit (default: %(const)s)",
    )
    args = p.parse_args(argv)
    if args.markdown is not None:
        try:
            data = json.loads(Path(args.markdown).read_text())
            print(markdown(data))
        except (OSError, ValueError) as exc:
            print(f"python -m benchmarks: error: {args.markdown}: {exc}", file=sys.stderr)
            return 2
        except KeyError as exc:
            print(
                f"python -m benchmarks: error: {args.markdown} has no {exc} (a summary from an "
                "older python -m benchmarks?): run the suite again",
                file=sys.stderr,
            )
            return 2
        return 0
    names = discover()
    only = {n.strip() for n in args.only.split(",") if n.strip()}
    skip = {n.strip() for n in args.skip.split(",") if n.strip()}
    if only:
        names = [n for n in names if n in only] + sorted(only - set(names))
    names = [n for n in names if n not in skip]
    if args.list:
        for n in names:
            spec = SPECS.get(n)
            size = (
                "(no arguments)"
                if spec is None
                else " ".join(spec.quick_args if args.quick else spec.args)
            )
            print(f"{n} {size}")
        return 0
    given = argv if argv is not None else sys.argv[1:]
    command = shlex.join(["python", "-m", "benchmarks", *given])
    date = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    before = uptime()
    print(f"{command}: {before}")
    t0 = time.perf_counter()
    deadline = t0 + SUITE_LIMIT_S
    results = [run_script(n, args.quick, deadline) for n in names]
    total = time.perf_counter() - t0
    print_summary(results, total)
    write = RESULTS / "summary.json"
    header = {
        "benchmark": "suite",
        "command": command,
        "date": date,
        "uptime_before": before,
        "uptime_after": uptime(),
        "machine": machine_info(),
    }
    write.write_text(
        json.dumps(header | {"quick": args.quick, "total_s": total, "scripts": results}, indent=2)
    )
    return 0 if all(r["status"] == "ok" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
