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
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
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
    ensure_repo_on_path,
    machine_info,
    print_table,
    processes_with,
    rank_pid,
    write_json,
)

ensure_repo_on_path()

WORLD = 3
VICTIM = 1
TARGET_DETECT_KILL_S = 0.2
TARGET_DETECT_STOP_OVER_S = 1.0
TARGET_RESUME_S = 2.0
HEARTBEAT_TIMEOUT_S = 30.0  # flodl's default, scaled by FLODL_NET_TIMEOUT_SCALE
TORCHFT_SYNC_EVERY = 10  # flodl's initial ElChe anchor
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
        .batch_size(spec["batch_size"])
        .num_epochs(spec["epochs"])
        .elche(ElCheConfig.cpu_cadence())
        .local_ranks(WORLD)
        .record_log(spec["records"])
        .reports_per_epoch(1000)
        .progress(False)
        .run()
    )
    handle.join()


def _records(path: Path) -> list[dict[str, Any]]:
    """Every whole JSON record of one node file (a torn last line is skipped)."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return []
    out = []
    for line in text.splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and "ts" in rec:
            out.append(rec)
    return out


def _root_syncs(records: Path) -> list[tuple[float, int]]:
    """(ts ms, syncs) of every root node report."""
    return [
        (float(r["ts"]), int(r["data"]["syncs"]))
        for r in _records(records / "root.log")
        if r.get("kind") == "node" and isinstance(r.get("data"), dict) and "syncs" in r["data"]
    ]


def _rank_lost_ts(records: Path, rank: int) -> float | None:
    for r in _records(records / "root" / f"rank{rank}.log"):
        data = r.get("data")
        if r.get("kind") == "event" and isinstance(data, dict) and data.get("class") == "rank_lost":
            return float(r["ts"])
    return None


def _wait(pred: Any, timeout_s: float, poll_s: float = 0.02) -> Any:
    deadline = time.perf_counter() + timeout_s
    while time.perf_counter() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(poll_s)
    return None


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
        warm = _wait(
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
        lost = _wait(lambda: _rank_lost_ts(records, VICTIM), timeout_s + 30.0)
        if lost is None:
            raise RuntimeError("no rank_lost record within the heartbeat timeout + 30 s")
        if path == "stop":
            os.kill(victim, signal.SIGKILL)  # let the launcher end cleanly later

        def resumed() -> float | None:
            rows = _root_syncs(records)
            before = max((s for ts, s in rows if ts <= lost), default=-1)
            after = [ts for ts, s in rows if ts > lost and s > before]
            return min(after) if after else None

        resume = _wait(resumed, 30.0)
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
                    sum(1 for e in _records(out / f"replica{r}.log") if e.get("committed")) >= 3
                    for r in range(WORLD)
                )

            if not _wait(warm, args.start_timeout):
                raise RuntimeError(f"torchft: no 3 commits within {args.start_timeout:.0f} s")
            t_kill = time.time() * 1000.0
            os.kill(ctx.processes[VICTIM].pid, signal.SIGKILL)
            survivors = [r for r in range(WORLD) if r != VICTIM]

            def detected() -> float | None:
                firsts = []
                for r in survivors:
                    qs = [
                        e["ts"]
                        for e in _records(out / f"replica{r}.log")
                        if e.get("event") == "quorum"
                        and e["ts"] > t_kill
                        and f"replica_{VICTIM}" not in e.get("members", [])
                    ]
                    if qs:
                        firsts.append(min(qs))
                return min(firsts) if firsts else None

            detect = _wait(detected, args.torchft_cap, poll_s=0.05)

            def resumed() -> float | None:
                if detect is None:
                    return None
                firsts = []
                for r in survivors:
                    cs = [
                        e["ts"]
                        for e in _records(out / f"replica{r}.log")
                        if e.get("event") == "commit" and e["ts"] >= detect and e.get("committed")
                    ]
                    if not cs:
                        return None
                    firsts.append(min(cs))
                return float(max(firsts))  # the reduce is complete once every survivor committed it

            resume = _wait(resumed, 30.0, poll_s=0.05) if detect is not None else None
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


def _stats(values: list[float | None]) -> dict[str, Any]:
    got = [v for v in values if v is not None]
    if not got:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {"median": statistics.median(got), "min": min(got), "max": max(got), "n": len(got)}


def _cell(s: dict[str, Any]) -> str:
    if s["median"] is None:
        return "-"
    if s["n"] == 1:
        return f"{s['median'] * 1000:.0f}"
    return f"{s['median'] * 1000:.0f} ({s['min'] * 1000:.0f}–{s['max'] * 1000:.0f})"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.flodl_job is not None:
        flodl_job(args.flodl_job)
        return 0

    from _torchft import torchft_version, unavailable

    reason = unavailable() if "torchft" in args.system_list else "not selected"
    print(
        f"bench_recovery: {WORLD} ranks, rank {VICTIM} killed after {args.warm_syncs} reduces; "
        f"{args.trials} trial(s) per path"
    )
    work = Path(tempfile.mkdtemp(prefix="bench_recovery-"))
    trials: list[dict[str, Any]] = []
    t_start = time.perf_counter()
    try:
        if "flodl" in args.system_list:
            for path in args.path_list:
                for _ in range(args.trials):
                    r = flodl_trial(path, args, work)
                    trials.append(r)
                    print(f"  flodl {path}: {_brief(r)}", flush=True)
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
                for _ in range(max(1, min(args.trials, 2))):
                    r = torchft_trial(args, work, cli=ft_variant == "cli")
                    trials.append(r)
                    print(f"  torchft ({ft_variant}) kill: {_brief(r)}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    rows: list[dict[str, Any]] = []
    groups: list[tuple[str, str, str | None]] = [
        ("flodl", p, None) for p in args.path_list if "flodl" in args.system_list
    ]
    if "torchft" in args.system_list:
        groups += [("torchft", "kill", v) for v in TORCHFT_VARIANTS]
    for system, path, variant in groups:
        ts = [
            t
            for t in trials
            if t["system"] == system and t["path"] == path and t.get("variant") == variant
        ]
        good = [t for t in ts if t.get("ok")]
        timeout_s = ts[0].get("timeout_s") if ts else None
        detect = _stats([t["t_detect_s"] for t in good])
        resume = _stats([t["t_resume_s"] for t in good])
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
                row["met"] = worst_detect < TARGET_DETECT_KILL_S and (
                    resume["max"] is not None and resume["max"] < TARGET_RESUME_S
                )
            else:
                over = [t["t_detect_s"] - t["timeout_s"] for t in good]
                after = [
                    t["t_resume_s"] - t["t_detect_s"] for t in good if t["t_resume_s"] is not None
                ]
                row["detect_minus_timeout_s"] = _stats(list(over))
                row["resume_after_detect_s"] = _stats(list(after))
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

    table = []
    for r in rows:
        extra = ""
        if r["path"] == "stop" and "detect_minus_timeout_s" in r:
            extra = (
                f"detect−timeout {_cell(r['detect_minus_timeout_s'])} ms, "
                f"resume−detect {_cell(r['resume_after_detect_s'])} ms"
            )
        if r["errors"]:
            extra = (extra + "; " if extra else "") + f"failed: {r['errors'][0][:90]}"
        verdict = "-" if "met" not in r else ("met" if r["met"] else "NOT met")
        table.append(
            [
                r["system"] if r["variant"] is None else TORCHFT_VARIANTS[r["variant"]],
                {"kill": "SIGKILL", "stop": "SIGSTOP (heartbeat)"}[r["path"]],
                f"{r['ok']}/{r['trials']}",
                "-" if r["timeout_s"] is None else f"{r['timeout_s']:g}",
                _cell(r["t_detect_s"]),
                _cell(r["t_resume_s"]),
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
    print(f"bench_recovery took {time.perf_counter() - t_start:.0f} s")
    path = write_json(
        args.json,
        {
            "benchmark": "bench_recovery",
            "quick": args.quick,
            "machine": machine_info(),
            "versions": {"torchft": torchft_version()},
            "config": {
                "world": WORLD,
                "victim": VICTIM,
                "trials": args.trials,
                "scale": args.scale,
                "warm_syncs": args.warm_syncs,
                "samples": args.samples,
                "batch_size": args.batch_size,
                "torchft_sync_every": TORCHFT_SYNC_EVERY,
            },
            "torchft": {"available": reason is None, "reason": reason},
            "rows": rows,
            "trials": trials,
        },
    )
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
