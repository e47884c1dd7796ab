"""bench_recovery: one of 3 ranks dies; time to declare it dead and to the next reduce.

flodl: a 3-rank ``cpu_cadence`` Trainer job (the demo task) runs in a subprocess of this
script with ``record_log(dir)`` and ``reports_per_epoch(1000)``, so every completed reduce
leaves a root ``node`` record carrying the ``syncs`` counter and a wall-clock ``ts`` (ms).
Once training is under way (``--warm-syncs`` reduces done), rank 1's process (found with
``ps`` by a tag argument and its ``FLODL_RANK``) gets

* ``SIGKILL`` (child-exit path): ``t_detect`` = ``rank_lost`` record at ``root/rank1`` − kill
  time (target < 0.2 s); ``t_resume`` = first root report with a higher ``syncs`` after the
  ``rank_lost`` record − kill time (target < 2 s);
* ``SIGSTOP`` (heartbeat path) under ``FLODL_NET_TIMEOUT_SCALE`` (0.1: a 3 s heartbeat
  timeout): ``t_detect − timeout`` (target < 1 s) and ``t_resume − t_detect`` (< 2 s).

torchft (same run, its default timeouts: lighthouse heartbeat timeout 5 s, quorum tick
100 ms, Manager timeouts 60 s): 3 replica groups of one process each run
``LocalSGD(sync_every=10)`` on the same task with one lighthouse (``min_replicas=2``) and
``min_replica_size=2``; replica 1 is SIGKILLed. Two lighthouses, since torchft ships two sets
of defaults: the ``torchft_lighthouse`` binary (deployments; ``join_timeout_ms`` 60 000) and
the in-process ``LighthouseServer(...)`` Python binding (torchft's tests; ``join_timeout_ms``
100). ``t_detect`` = the first quorum a survivor gets without the victim (the lighthouse's
decision, as the survivor learns it) − kill time; ``t_resume`` = the moment every survivor has
committed a sync after that − kill time.

    python benchmarks/bench_recovery.py [--quick] [--trials N] [--systems flodl,torchft]
    python benchmarks/bench_recovery.py --markdown [JSON]   # the docs section, from the JSON
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from _common import (
    REPO_ROOT,
    RESULTS_DIR,
    RunStamp,
    add_markdown_option,
    ensure_repo_on_path,
    markdown_table,
    median_stats,
    met_text,
    print_table,
    processes_with,
    rank_pid,
    read_records,
    repeat_trials,
    section_head,
    stats_cell,
    wait_for,
    write_json,
)

ensure_repo_on_path()

WORLD = 3
VICTIM = 1
MODE = "cpu_cadence"
TARGET_DETECT_KILL_S = 0.2
TARGET_DETECT_STOP_OVER_S = 1.0
TARGET_RESUME_S = 2.0
HEARTBEAT_TIMEOUT_S = 30.0  # flodl's default, scaled by FLODL_NET_TIMEOUT_SCALE
TORCHFT_SYNC_EVERY = 10  # flodl's initial ElChe anchor
SIGNALS = {"kill": "SIGKILL", "stop": "SIGSTOP"}
"""What each flodl path sends to the victim."""
TORCHFT_VARIANTS = {
    "cli": "torchft (torchft_lighthouse, join 60 s)",
    "py": "torchft (LighthouseServer(), join 0.1 s)",
}


# ---------------------------------------------------------------------------------------------
# flodl job (its launcher re-executes this script once per rank)
# ---------------------------------------------------------------------------------------------


def flodl_job(spec_path: str) -> None:
    from flodl import ElCheConfig, Trainer
    from flodl.demo import demo_task

    spec = json.loads(Path(spec_path).read_text())
    task = demo_task(samples=spec["samples"], seed=0)
    handle = (
        Trainer.builder(task.model_factory, task.optim_factory, task.train_step)
        .dataset(task.train)
        .device("cpu")  # on the CPU, like the baselines it is compared with
        .batch_size(spec["batch_size"])
        .num_epochs(spec["epochs"])
        .elche(ElCheConfig.preset(MODE))
        .local_ranks(WORLD)
        .record_log(spec["records"])
        .reports_per_epoch(1000)
        .progress(False)
        .run()
    )
    handle.join()


def _root_syncs(records: Path) -> list[tuple[float, int]]:
    """(ts ms, syncs) of every root node report."""
    return [
        (float(r["ts"]), int(r["data"]["syncs"]))
        for r in read_records(records / "root.log")
        if r.get("kind") == "node" and isinstance(r.get("data"), dict) and "syncs" in r["data"]
    ]


def _rank_lost_ts(records: Path, rank: int) -> float | None:
    for r in read_records(records / "root" / f"rank{rank}.log"):
        data = r.get("data")
        if r.get("kind") == "event" and isinstance(data, dict) and data.get("class") == "rank_lost":
            return float(r["ts"])
    return None


def _ms_cell(s: dict[str, Any]) -> str:
    """A seconds :func:`median_stats` result as a cell in whole milliseconds."""
    return stats_cell(s, ".0f", 1000.0)


def flodl_trial(path: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """One flodl trial; ``path`` is ``kill`` (SIGKILL) or ``stop`` (SIGSTOP)."""
    trial = work / f"flodl-{path}-{uuid.uuid4().hex[:6]}"
    records = trial / "records"
    records.mkdir(parents=True)
    tag = f"bench-recovery-{uuid.uuid4().hex}"
    spec = trial / "spec.json"
    spec.write_text(
        json.dumps(
            {
                "samples": args.samples,
                "batch_size": args.batch_size,
                "epochs": 1000,  # ended by this script once measured
                "records": str(records),
            }
        )
    )
    env = dict(os.environ)
    env.pop("FLODL_NET_TIMEOUT_SCALE", None)  # the kill path runs with the defaults
    timeout_s = HEARTBEAT_TIMEOUT_S
    if path == "stop":
        env["FLODL_NET_TIMEOUT_SCALE"] = str(args.scale)
        timeout_s = HEARTBEAT_TIMEOUT_S * args.scale
    log = (trial / "job.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, str(Path(__file__).resolve()), "--flodl-job", str(spec), "--tag", tag],
        cwd=REPO_ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    result: dict[str, Any] = {"system": "flodl", "path": path, "timeout_s": timeout_s}
    victim: int | None = None
    try:
        warm = wait_for(
            lambda: any(s >= args.warm_syncs for _, s in _root_syncs(records)), args.start_timeout
        )
        if not warm:
            raise RuntimeError(f"no {args.warm_syncs} reduces within {args.start_timeout:.0f} s")
        victim = rank_pid(tag, VICTIM)
        if victim is None:
            raise RuntimeError(f"rank {VICTIM}'s process not found")
        sig = signal.SIGKILL if path == "kill" else signal.SIGSTOP
        t_kill = time.time() * 1000.0
        os.kill(victim, sig)
        lost = wait_for(lambda: _rank_lost_ts(records, VICTIM), timeout_s + 30.0)
        if lost is None:
            raise RuntimeError("no rank_lost record within the heartbeat timeout + 30 s")
        if path == "stop":
            os.kill(victim, signal.SIGKILL)  # let the launcher end cleanly later

        def resumed() -> float | None:
            rows = _root_syncs(records)
            before = max((s for ts, s in rows if ts <= lost), default=-1)
            after = [ts for ts, s in rows if ts > lost and s > before]
            return min(after) if after else None

        resume = wait_for(resumed, 30.0)
        result |= {
            "ok": True,
            "t_detect_s": (lost - t_kill) / 1000.0,
            "t_resume_s": None if resume is None else (resume - t_kill) / 1000.0,
        }
    except Exception as exc:  # noqa: BLE001 - a failed trial is reported, not raised
        log.flush()
        tail = (trial / "job.log").read_text(errors="replace")[-800:]
        result |= {"ok": False, "error": f"{type(exc).__name__}: {exc} | {tail}"[:1500]}
    finally:
        if victim is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(victim, signal.SIGKILL)
        proc.terminate()  # the launcher stops its ranks on SIGTERM
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        for pid in processes_with(tag):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    return result


# ---------------------------------------------------------------------------------------------
# torchft
# ---------------------------------------------------------------------------------------------


def torchft_trial(args: argparse.Namespace, work: Path, cli: bool) -> dict[str, Any]:
    from _torchft import Lighthouse, spawn_replicas

    out = work / f"torchft-{uuid.uuid4().hex[:6]}"
    cfg = {
        "world": WORLD,
        "samples": args.samples,
        "seed": 0,
        "epochs": 0,
        "forever": True,
        "batch_size": args.batch_size,
        "factor": 1.0,
        "step_per_forward": 3.0,
        "sync_every": TORCHFT_SYNC_EVERY,
        "min_replica_size": WORLD - 1,
    }
    result: dict[str, Any] = {
        "system": "torchft",
        "path": "kill",
        "variant": "cli" if cli else "py",
        "timeout_s": 5.0,
    }
    with Lighthouse(min_replicas=WORLD - 1, cli=cli) as lh:
        ctx = spawn_replicas(cfg, lh.address, out)
        try:

            def warm() -> bool:
                return all(
                    sum(1 for e in read_records(out / f"replica{r}.log") if e.get("committed")) >= 3
                    for r in range(WORLD)
                )

            if not wait_for(warm, args.start_timeout):
                raise RuntimeError(f"torchft: no 3 commits within {args.start_timeout:.0f} s")
            t_kill = time.time() * 1000.0
            os.kill(ctx.processes[VICTIM].pid, signal.SIGKILL)
            survivors = [r for r in range(WORLD) if r != VICTIM]

            def detected() -> float | None:
                firsts = []
                for r in survivors:
                    qs = [
                        e["ts"]
                        for e in read_records(out / f"replica{r}.log")
                        if e.get("event") == "quorum"
                        and e["ts"] > t_kill
                        and f"replica_{VICTIM}" not in e.get("members", [])
                    ]
                    if qs:
                        firsts.append(min(qs))
                return min(firsts) if firsts else None

            detect = wait_for(detected, args.torchft_cap, poll_s=0.05)

            def resumed() -> float | None:
                if detect is None:
                    return None
                firsts = []
                for r in survivors:
                    cs = [
                        e["ts"]
                        for e in read_records(out / f"replica{r}.log")
                        if e.get("event") == "commit" and e["ts"] >= detect and e.get("committed")
                    ]
                    if not cs:
                        return None
                    firsts.append(min(cs))
                return float(max(firsts))  # the reduce is complete once every survivor committed it

            resume = wait_for(resumed, 30.0, poll_s=0.05) if detect is not None else None
            result |= {
                "ok": detect is not None,
                "t_detect_s": None if detect is None else (detect - t_kill) / 1000.0,
                "t_resume_s": None if resume is None else (resume - t_kill) / 1000.0,
            }
            if detect is None:
                result["error"] = f"no quorum without the victim within {args.torchft_cap:.0f} s"
        except Exception as exc:  # noqa: BLE001 - a failed trial is reported, not raised
            result |= {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:1500]}
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            for p in ctx.processes:
                p.join(timeout=10)
    return result


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="one trial per path")
    p.add_argument("--trials", type=int, default=None, help="per path (default 3; quick 1)")
    p.add_argument("--systems", default="flodl,torchft", help="subset of: %(default)s")
    p.add_argument("--paths", default="kill,stop", help="flodl paths: %(default)s")
    p.add_argument(
        "--scale", type=float, default=0.1, help="FLODL_NET_TIMEOUT_SCALE for the SIGSTOP path"
    )
    p.add_argument("--samples", type=int, default=48_000)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--warm-syncs", type=int, default=5, help="reduces done before the kill")
    p.add_argument("--start-timeout", type=float, default=90.0)
    p.add_argument(
        "--torchft-cap", type=float, default=90.0, help="give up on torchft's detection after"
    )
    p.add_argument("--json", type=Path, default=RESULTS_DIR / "bench_recovery.json")
    add_markdown_option(p, RESULTS_DIR / "bench_recovery.json")
    p.add_argument("--flodl-job", help=argparse.SUPPRESS)
    p.add_argument("--tag", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.trials is None:
        args.trials = 1 if args.quick else 3
    if args.trials < 1:
        p.error("--trials must be >= 1")
    args.system_list = [s.strip() for s in args.systems.split(",") if s.strip()]
    args.path_list = [s.strip() for s in args.paths.split(",") if s.strip()]
    if set(args.system_list) - {"flodl", "torchft"} or set(args.path_list) - {"kill", "stop"}:
        p.error("--systems: flodl,torchft; --paths: kill,stop")
    return args


def summarize(
    trials: list[dict[str, Any]], system_list: list[str], path_list: list[str]
) -> list[dict[str, Any]]:
    """One row per flodl path and torchft lighthouse selected: the detect and resume stats over
    its good trials and, for flodl, its target and whether every good trial met it."""
    rows: list[dict[str, Any]] = []
    groups: list[tuple[str, str, str | None]] = [
        ("flodl", p, None) for p in path_list if "flodl" in system_list
    ]
    if "torchft" in system_list:
        groups += [("torchft", "kill", v) for v in TORCHFT_VARIANTS]
    for system, path, variant in groups:
        ts = [
            t
            for t in trials
            if t["system"] == system and t["path"] == path and t.get("variant") == variant
        ]
        good = [t for t in ts if t.get("ok")]
        timeout_s = ts[0].get("timeout_s") if ts else None
        detect = median_stats([t["t_detect_s"] for t in good])
        resume = median_stats([t["t_resume_s"] for t in good])
        row: dict[str, Any] = {
            "system": system,
            "path": path,
            "variant": variant,
            "trials": len(ts),
            "ok": len(good),
            "timeout_s": timeout_s,
            "t_detect_s": detect,
            "t_resume_s": resume,
            "errors": [t["error"] for t in ts if not t.get("ok")],
        }
        if system == "flodl" and detect["median"] is not None:
            worst_detect = detect["max"]
            if path == "kill":
                row["target"] = f"detect < {TARGET_DETECT_KILL_S} s, resume < {TARGET_RESUME_S} s"
                row["met"] = (
                    worst_detect < TARGET_DETECT_KILL_S
                    and resume["n"] == len(good)
                    and resume["max"] < TARGET_RESUME_S
                )
            else:
                over = [t["t_detect_s"] - t["timeout_s"] for t in good]
                after = [
                    t["t_resume_s"] - t["t_detect_s"] for t in good if t["t_resume_s"] is not None
                ]
                row["detect_minus_timeout_s"] = median_stats(list(over))
                row["resume_after_detect_s"] = median_stats(list(after))
                row["target"] = (
                    f"detect − timeout < {TARGET_DETECT_STOP_OVER_S} s, "
                    f"resume − detect < {TARGET_RESUME_S} s"
                )
                row["met"] = (
                    max(over) < TARGET_DETECT_STOP_OVER_S
                    and len(after) == len(good)
                    and max(after) < TARGET_RESUME_S
                )
        rows.append(row)
    return rows


def report(
    args: argparse.Namespace,
    trials: list[dict[str, Any]],
    reason: str | None,
    header: dict[str, Any],
) -> dict[str, Any]:
    """The result file: ``header`` (:meth:`RunStamp.header`), the settings, the targets, why
    torchft could not run (``reason``), the summary rows and every trial."""
    return {
        **header,
        "quick": args.quick,
        "config": {
            "world": WORLD,
            "victim": VICTIM,
            "mode": MODE,
            "trials": args.trials,
            "scale": args.scale,
            "heartbeat_timeout_s": HEARTBEAT_TIMEOUT_S,
            "warm_syncs": args.warm_syncs,
            "samples": args.samples,
            "batch_size": args.batch_size,
            "torchft_sync_every": TORCHFT_SYNC_EVERY,
        },
        "targets": {
            "detect_kill_s": TARGET_DETECT_KILL_S,
            "detect_stop_over_s": TARGET_DETECT_STOP_OVER_S,
            "resume_s": TARGET_RESUME_S,
        },
        "torchft": {"available": reason is None, "reason": reason},
        "rows": summarize(trials, args.system_list, args.path_list),
        "trials": trials,
    }


def print_rows(rows: list[dict[str, Any]]) -> None:
    """Print the summary rows as the terminal table."""
    table = []
    for r in rows:
        extra = ""
        if r["path"] == "stop" and "detect_minus_timeout_s" in r:
            extra = (
                f"detect−timeout {_ms_cell(r['detect_minus_timeout_s'])} ms, "
                f"resume−detect {_ms_cell(r['resume_after_detect_s'])} ms"
            )
        if r["errors"]:
            extra = (extra + "; " if extra else "") + f"failed: {r['errors'][0][:90]}"
        verdict = "-" if "met" not in r else ("met" if r["met"] else "NOT met")
        table.append(
            [
                _label(r),
                SIGNALS[r["path"]] + (" (heartbeat)" if r["path"] == "stop" else ""),
                f"{r['ok']}/{r['trials']}",
                "-" if r["timeout_s"] is None else f"{r['timeout_s']:g}",
                _ms_cell(r["t_detect_s"]),
                _ms_cell(r["t_resume_s"]),
                r.get("target", ""),
                verdict,
                extra,
            ]
        )
    print_table(
        "recovery: ms from the signal, median (min–max) over trials",
        ["system", "path", "ok", "timeout s", "detect ms", "resume ms", "target", "", "note"],
        table,
    )


def _label(r: dict[str, Any]) -> str:
    """A row's system: ``flodl``, or the torchft lighthouse's label."""
    return str(r["system"]) if r["variant"] is None else TORCHFT_VARIANTS[r["variant"]]


def _path_label(r: dict[str, Any]) -> str:
    """A row's path as the docs table names it (the signal; SIGSTOP with its timeout)."""
    if r["path"] == "kill":
        return "SIGKILL (child-exit report)" if r["system"] == "flodl" else "SIGKILL"
    timeout = "?" if r["timeout_s"] is None else f"{r['timeout_s']:g}"
    return f"SIGSTOP, heartbeat timeout {timeout} s"


def _target_cell(r: dict[str, Any], targets: dict[str, float]) -> str:
    """A row's target cell: the bounds in ms and the row's verdict (flodl), or ``reference``."""
    if r["system"] != "flodl":
        return "reference"
    resume_ms = f"{1000 * targets['resume_s']:g} ms"
    if r["path"] == "kill":
        goal = f"detect < {1000 * targets['detect_kill_s']:g} ms, resume < {resume_ms}"
        return f"{goal}: {met_text(r.get('met'))}"
    goal = f"detect − timeout < {1000 * targets['detect_stop_over_s']:g} ms, resume − detect < "
    cell = f"{goal}{resume_ms}: {met_text(r.get('met'))}"
    if "detect_minus_timeout_s" in r:
        cell += (
            f" (detect − timeout {_ms_cell(r['detect_minus_timeout_s'])} ms; resume − detect "
            f"{_ms_cell(r['resume_after_detect_s'])} ms)"
        )
    return cell


def markdown(data: dict[str, Any]) -> str:
    """The docs/benchmarks.md section for a result file (every figure from it)."""
    cfg = data["config"]
    rows = data["rows"]
    timeouts = {r["path"]: r["timeout_s"] for r in rows if r["system"] == "flodl"}
    ft_timeout = next((r["timeout_s"] for r in rows if r["system"] == "torchft"), None)
    setup = (
        f"{cfg['world']} ranks train the demo task ({cfg['samples']:,} windows, batch "
        f"{cfg['batch_size']}, `{cfg['mode']}`); once {cfg['warm_syncs']} reduces are done, rank "
        f"{cfg['victim']}'s process gets the signal. flodl's SIGKILL path runs with the default "
        f"timeouts (heartbeat {cfg['heartbeat_timeout_s']:g} s), its SIGSTOP path under "
        f"`FLODL_NET_TIMEOUT_SCALE={cfg['scale']:g}`"
        + (f" (heartbeat timeout {timeouts['stop']:g} s)" if timeouts.get("stop") else "")
        + ". detect: the `rank_lost` record; resume: the next completed reduce."
    )
    if any(r["system"] == "torchft" for r in rows):
        setup += (
            f" torchft: {cfg['world']} replica groups of one process run "
            f"`LocalSGD(sync_every={cfg['torchft_sync_every']})` with "
            f"`min_replica_size={cfg['world'] - 1}` and one lighthouse at its defaults"
            + (f" (heartbeat timeout {ft_timeout:g} s)" if ft_timeout else "")
            + f"; replica {cfg['victim']} is SIGKILLed. detect: the first quorum a survivor gets "
            "without it; resume: every survivor has committed a sync after that."
        )
    counts = ", ".join(f"{_label(r)} {SIGNALS[r['path']]} {r['ok']}/{r['trials']}" for r in rows)
    setup += (
        " Times are ms from the signal: median (min–max) over the trials that finished "
        f"(finished/run: {counts})."
    )
    lines = [
        *section_head("Recovery", data, f"{data['took_s']:.0f} s"),
        "",
        setup,
        "",
        *markdown_table(
            ["system", "path", "detect", "resume (next completed reduce)", "target"],
            (
                [
                    _label(r),
                    _path_label(r),
                    _ms_cell(r["t_detect_s"]),
                    _ms_cell(r["t_resume_s"]),
                    _target_cell(r, data["targets"]),
                ]
                for r in rows
            ),
        ),
    ]
    notes = []
    for r in rows:
        over = r.get("detect_minus_timeout_s", {}).get("median")
        if over is not None:
            when = "before" if over < 0 else "after"
            notes.append(
                f"- SIGSTOP: detection came {abs(1000 * over):.0f} ms {when} the nominal "
                f"{r['timeout_s']:g} s heartbeat timeout (median over {r['ok']} trial(s))."
            )
        if r["errors"]:
            error = " ".join(r["errors"][0].split())[:200]
            notes.append(
                f"- {_label(r)} {SIGNALS[r['path']]}: {len(r['errors'])} of {r['trials']} trial(s) "
                f"failed; the first: {error}"
            )
    return "\n".join(lines + (["", *notes] if notes else []))


def main(argv: list[str] | None = None) -> int:
    raw = sys.argv[1:] if argv is None else argv
    args = parse_args(raw)
    if args.flodl_job is not None:
        flodl_job(args.flodl_job)
        return 0
    if args.markdown is not None:
        print(markdown(json.loads(Path(args.markdown).read_text())))
        return 0

    from _torchft import unavailable

    stamp = RunStamp("bench_recovery", raw)
    reason = unavailable() if "torchft" in args.system_list else "not selected"
    print(
        f"bench_recovery: {WORLD} ranks, rank {VICTIM} killed after {args.warm_syncs} reduces; "
        f"{args.trials} trial(s) per path"
    )
    work = Path(tempfile.mkdtemp(prefix="bench_recovery-"))
    trials: list[dict[str, Any]] = []
    try:
        if "flodl" in args.system_list:
            for path in args.path_list:
                run = functools.partial(flodl_trial, path, args, work)
                repeat_trials(f"flodl {path}", args.trials, run, _brief, trials)
        if "torchft" in args.system_list:
            for ft_variant in TORCHFT_VARIANTS:
                if reason is not None:
                    trials.append(
                        {
                            "system": "torchft",
                            "path": "kill",
                            "variant": ft_variant,
                            "ok": False,
                            "error": reason,
                        }
                    )
                    print(f"  torchft ({ft_variant}): cannot run here: {reason}")
                    continue
                run = functools.partial(torchft_trial, args, work, cli=ft_variant == "cli")
                label = f"torchft ({ft_variant}) kill"
                repeat_trials(label, max(1, min(args.trials, 2)), run, _brief, trials)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    data = report(args, trials, reason, stamp.header("bench_recovery", "torch", "torchft"))
    print_rows(data["rows"])
    print(f"bench_recovery took {data['took_s']:.0f} s")
    path = write_json(args.json, data)
    print(f"wrote {path}")
    return 0


def _brief(r: dict[str, Any]) -> str:
    if not r.get("ok"):
        return f"FAILED: {r.get('error', '')[:300]}"
    resume = r.get("t_resume_s")
    return (
        f"detect {r['t_detect_s'] * 1000:.0f} ms, resume "
        f"{'-' if resume is None else f'{resume * 1000:.0f} ms'}"
    )


if __name__ == "__main__":
    sys.exit(main())
