"""bench_elastic: a killed rank comes back (respawn + rejoin); time until its work counts again.

flodl, per mode (``cpu_sync``, ``cpu_cadence``, ``cpu_async``, ``nccl_sync``, ``nccl_cadence``;
the ``nccl_*`` modes run on Gloo here): a 3-rank Trainer job on the demo task (as
``bench_recovery``) runs in a subprocess of this script with ``.respawn(1)``,
``record_log(dir)`` and ``reports_per_epoch(1000)``, so about every batch leaves a root ``node``
record (``syncs``: completed reduces, ``throughput``, wall-clock ``ts`` in ms) and one ``node``
record per rank of the same report (``steps`` since the report before). Once training is
warm (``--warm-syncs`` reduces and ``--before-s`` seconds of reports), rank 1's process
(found with ``ps`` by a tag argument and its ``FLODL_RANK``) gets ``SIGKILL``; the launcher
respawns it (its stderr line "respawning it" is time-stamped here: the new process's start),
the new process says hello, enters the next averaging cycle at weight 0 and then gets work.
Measured from the record log:

* ``t_fold``: the rejoined rank's hello (the ``rank_rejoined`` record's ``ts`` −
  ``consensus_s``) → the first completed reduce after the first report (after that record)
  whose ``root/rank1`` report has ``steps > 0`` (the first averaging cycle that folds its
  work). Target: < 2 s + one averaging window, the window being the median interval between
  completed reduces (a report whose ``syncs`` rose) in the ``--before-s`` seconds before the
  kill;
* throughput (the root report's ``throughput``: each rank's samples per second of its busy
  time, compute + data, summed over ranks) averaged over the reports of the ``--before-s``
  seconds before the kill and of the ``--after-s`` seconds after the first folded cycle, and
  their ratio (≈ 1 for a healthy rejoin); and the same ratio of wall-clock throughput (the
  reports' ``steps`` × batch size over the elapsed time), which also counts averaging waits;
* ``down_s`` (death → hello) and ``consensus_s`` (hello → the cycle that gave it the consensus)
  from the record; and from the new process's start: → flodl imported, → demo task built (the
  respawned rank stamps these), → hello, → consensus, → first fold.

The sync modes hand out work as whole-epoch partitions: a rank that rejoins mid-epoch holds
the consensus after one cycle, and the running epoch is then re-split (the others give back
the untrained end of their queues, docs/design.md §2 "Rejoin"), so it trains that epoch's
rest with them; ``consensus→next epoch`` (the time to the next epoch boundary) is reported
for comparison: before the re-split, that was when such a rank got work.

torchft 0.2.0 (same run, same task, data, batch size, 1 thread per process, no slowdown): 3
replica groups of one process each run ``LocalSGD(sync_every=10)`` with one lighthouse
(``min_replicas=2``) and ``min_replica_size=2``, as in ``bench_recovery`` (both lighthouses:
the ``torchft_lighthouse`` binary's defaults and the Python ``LighthouseServer()``'s). Once
each has committed 3 syncs, replica 1 is SIGKILLed and, as soon as it is reaped, a new process
for replica 1 (same replica id, same config) is started; measured from that start: its
Manager is up (``start``), its first committed sync (the quorum in which it heals: it fetches
the state from a live peer; torchft's counterpart of flodl's consensus), and its next committed
sync (the first that averages its own local steps: flodl's fold).

    python benchmarks/bench_elastic.py [--quick] [--modes M,...] [--systems flodl,torchft]
        [--trials N] [--lighthouses cli,py]
    python benchmarks/bench_elastic.py --markdown [JSON]   # the docs section, from the JSON
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import itertools
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

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
    span_text,
    stats_cell,
    wait_for,
    write_json,
)

_T_MODULE = time.time()  # a rank process: how long the interpreter took to get here
ensure_repo_on_path()

MODES = ("cpu_sync", "cpu_cadence", "cpu_async", "nccl_sync", "nccl_cadence")
WORLD = 3
VICTIM = 1
TARGET_FOLD_S = 2.0  # plus one averaging window
TORCHFT_SYNC_EVERY = 10  # flodl's initial ElChe anchor
TORCHFT_VARIANTS = {
    "cli": "torchft (torchft_lighthouse, join 60 s)",
    "py": "torchft (LighthouseServer(), join 0.1 s)",
}
RESPAWN_LINE = "respawning it"
"""What flodl's launcher prints to stderr as it starts the new process of a failed rank."""
PAIR_TOLERANCE_MS = 5.0
"""A root report and a rank's report of the same report are written within this of each other
(reports come about every batch, a few ms apart)."""


# ---------------------------------------------------------------------------------------------
# flodl job (its launcher re-executes this script once per rank, and once more per respawn)
# ---------------------------------------------------------------------------------------------


def flodl_job(spec_path: str) -> None:
    """The body of ``--flodl-job SPEC``; a rank process also stamps its start-up phases (wall
    ms) into ``phases/rank<R>.<restart>.json`` next to the spec."""
    stamps = {"module": _T_MODULE * 1000.0, "job": time.time() * 1000.0}
    from flodl import ElCheConfig, Trainer
    from flodl.demo import demo_task

    stamps["imports"] = time.time() * 1000.0
    spec = json.loads(Path(spec_path).read_text())
    task = demo_task(samples=spec["samples"], seed=0)
    stamps["task"] = time.time() * 1000.0
    rank = os.environ.get("FLODL_RANK")
    if rank is not None:
        phases = Path(spec_path).parent / "phases"
        phases.mkdir(exist_ok=True)
        restart = os.environ.get("FLODL_RESTART_COUNT", "0")
        (phases / f"rank{rank}.{restart}.json").write_text(json.dumps(stamps))
    handle = (
        Trainer.builder(task.model_factory, task.optim_factory, task.train_step)
        .dataset(task.train)
        .device("cpu")  # on the CPU, like the baselines it is compared with
        .batch_size(spec["batch_size"])
        .num_epochs(spec["epochs"])
        .elche(ElCheConfig.preset(spec["mode"]))
        .local_ranks(WORLD)
        .respawn(1)
        .record_log(spec["records"])
        .reports_per_epoch(1000)
        .progress(False)
        .run()
    )
    handle.join()


# ---------------------------------------------------------------------------------------------
# pure helpers over a record tree ({path: [records]}, as flodl.monitor.records.read_tree gives)
# ---------------------------------------------------------------------------------------------


def _nodes(tree: dict[str, list[dict[str, Any]]], path: str) -> list[dict[str, Any]]:
    return [
        r
        for r in tree.get(path, [])
        if r.get("kind") == "node" and isinstance(r.get("data"), dict) and "ts" in r
    ]


def root_reports(tree: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """The root ``node`` records of completed reduces (those that carry ``syncs``)."""
    return [r for r in _nodes(tree, "root") if "syncs" in r["data"]]


def paired_reports(
    tree: dict[str, list[dict[str, Any]]], rank: int
) -> list[tuple[dict[str, Any], dict[str, Any] | None]]:
    """Each root report with ``root/rank<rank>``'s report of the same reduce (None if absent).

    A report writes the root record and one record per rank, in that order and in the same
    millisecond or so: pair them by order when the two lists have the same length and agree in
    time, else each root record with the rank record nearest in time (within
    :data:`PAIR_TOLERANCE_MS`)."""
    roots = root_reports(tree)
    ranks = _nodes(tree, f"root/rank{rank}")
    if len(ranks) == len(roots) and all(
        abs(float(a["ts"]) - float(b["ts"])) <= PAIR_TOLERANCE_MS
        for a, b in zip(roots, ranks, strict=True)
    ):
        return list(zip(roots, ranks, strict=True))
    out: list[tuple[dict[str, Any], dict[str, Any] | None]] = []
    for root in roots:
        ts = float(root["ts"])
        near = min(ranks, key=lambda r: abs(float(r["ts"]) - ts), default=None)
        if near is not None and abs(float(near["ts"]) - ts) > PAIR_TOLERANCE_MS:
            near = None
        out.append((root, near))
    return out


def rejoined_record(
    tree: dict[str, list[dict[str, Any]]], rank: int, after_ms: float = 0.0
) -> dict[str, Any] | None:
    """The first ``rank_rejoined`` record of ``root/rank<rank>`` at or after ``after_ms``."""
    for r in tree.get(f"root/rank{rank}", []):
        if (
            r.get("kind") == "rank_rejoined"
            and isinstance(r.get("data"), dict)
            and float(r["ts"]) >= after_ms
        ):
            return r
    return None


def first_fold(
    tree: dict[str, list[dict[str, Any]]], rank: int, after_ms: float
) -> dict[str, Any] | None:
    """The first averaging cycle that folds ``rank``'s work after ``after_ms``: the first root
    report whose ``syncs`` exceeds that of the first report (at or after ``after_ms``) in which
    ``rank``'s report has steps > 0. Reports follow the batches (``reports_per_epoch``), so the
    report that first shows its steps comes before the cycle that averages them."""
    trained: int | None = None
    for root, mine in paired_reports(tree, rank):
        if float(root["ts"]) < after_ms:
            continue
        syncs = int(root["data"]["syncs"])
        if trained is None:
            if mine is not None and float(mine["data"].get("steps") or 0) > 0:
                trained = syncs
        elif syncs > trained:
            return root
    return None


def cycle_reports(reports: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The root reports that open a new averaging cycle (``syncs`` above the report before):
    one per completed reduce, at the first batch report after it."""
    out, last = [], None
    for r in reports:
        syncs = int(r["data"]["syncs"])
        if last is not None and syncs > last:
            out.append(r)
        last = syncs
    return out


def averaging_window_s(reports: Sequence[dict[str, Any]], lo_ms: float, hi_ms: float) -> float:
    """Median interval (s) between consecutive completed reduces (:func:`cycle_reports`) with
    ``lo_ms <= ts < hi_ms`` (NaN with fewer than two)."""
    ts = [float(r["ts"]) for r in cycle_reports(reports) if lo_ms <= float(r["ts"]) < hi_ms]
    gaps = [(b - a) / 1000.0 for a, b in itertools.pairwise(ts)]
    return statistics.median(gaps) if gaps else float("nan")


def mean_throughput(
    reports: Sequence[dict[str, Any]], lo_ms: float, hi_ms: float
) -> tuple[float | None, int]:
    """Mean ``throughput`` (samples/s of the run) of the root reports with ``lo_ms < ts <=
    hi_ms``, and how many there were."""
    got = [
        float(r["data"]["throughput"])
        for r in reports
        if lo_ms < float(r["ts"]) <= hi_ms and r["data"].get("throughput") is not None
    ]
    return (statistics.fmean(got) if got else None), len(got)


def wall_throughput(
    reports: Sequence[dict[str, Any]], lo_ms: float, hi_ms: float, batch_size: int
) -> float | None:
    """Samples/s of wall-clock time over the root reports with ``lo_ms < ts <= hi_ms``: their
    ``steps`` (summed over ranks, done since the report before) × ``batch_size``, over the time
    from the report before the first of them to the last of them (None: too few reports).

    The reports' own ``throughput`` is per rank over its busy time (compute + data), summed;
    this one also counts the time ranks spend waiting for averaging."""
    idx = [i for i, r in enumerate(reports) if lo_ms < float(r["ts"]) <= hi_ms]
    if not idx or idx[0] == 0:
        return None
    span_ms = float(reports[idx[-1]]["ts"]) - float(reports[idx[0] - 1]["ts"])
    steps = sum(float(reports[i]["data"].get("steps") or 0) for i in idx)
    return 1000.0 * steps * batch_size / span_ms if span_ms > 0 else None


def _finite_or_none(v: float) -> float | None:
    return v if math.isfinite(v) else None


def _syncs_at(reports: Sequence[dict[str, Any]], ms: float) -> int:
    """The run's ``syncs`` counter as of ``ms`` (0 before the first reduce)."""
    return max((int(r["data"]["syncs"]) for r in reports if float(r["ts"]) <= ms), default=0)


def startup_phases(stamps: dict[str, float], t_start_ms: float) -> dict[str, float]:
    """A respawned rank's start-up phases (its wall-ms stamps) in s from its process's start."""
    names = {"module": "start_to_script_s", "imports": "start_to_imports_s"}
    names["task"] = "start_to_task_s"
    return {names[k]: (float(v) - t_start_ms) / 1000.0 for k, v in stamps.items() if k in names}


def analyse_flodl(
    tree: dict[str, list[dict[str, Any]]],
    *,
    victim: int,
    t_kill_ms: float,
    t_respawn_ms: float | None,
    before_s: float,
    after_s: float,
    batch_size: int = 0,
) -> dict[str, Any]:
    """Every figure of one flodl trial from its record tree (ms wall-clock times in, s out;
    ``batch_size`` > 0 adds the wall-clock throughputs).

    Raises:
        ValueError: no ``rank_rejoined`` record after the kill, or no folded cycle after it.
    """
    reports = root_reports(tree)
    rec = rejoined_record(tree, victim, after_ms=t_kill_ms)
    if rec is None:
        raise ValueError(f"no rank_rejoined record for rank {victim} after the kill")
    data = rec["data"]
    consensus_ms = float(rec["ts"])
    hello_ms = consensus_ms - 1000.0 * float(data["consensus_s"])
    fold = first_fold(tree, victim, after_ms=consensus_ms)
    if fold is None:
        raise ValueError(f"no averaging cycle folded rank {victim}'s work after its rejoin")
    fold_ms = float(fold["ts"])
    window = averaging_window_s(reports, t_kill_ms - 1000.0 * before_s, t_kill_ms)
    before, n_before = mean_throughput(reports, t_kill_ms - 1000.0 * before_s, t_kill_ms)
    after, n_after = mean_throughput(reports, fold_ms, fold_ms + 1000.0 * after_s)
    t_fold = (fold_ms - hello_ms) / 1000.0
    if math.isnan(window):  # under two reduces in the before-window: all of those before the kill
        window = averaging_window_s(reports, float("-inf"), t_kill_ms)
    target = None if math.isnan(window) else TARGET_FOLD_S + window
    down, _ = mean_throughput(reports, t_kill_ms, hello_ms)
    epochs = [
        r
        for r in tree.get("root", [])
        if r.get("kind") == "epoch" and isinstance(r.get("data"), dict)
    ]
    boundary = next((float(r["ts"]) for r in epochs if float(r["ts"]) >= consensus_ms), None)
    last_epoch = [r for r in epochs if float(r["ts"]) <= t_kill_ms][-1:] or epochs[:1]
    out: dict[str, Any] = {
        "incarnation": data.get("incarnation"),
        "down_s": data.get("down_s"),
        "consensus_s": data.get("consensus_s"),
        "world_size_after": data.get("world_size"),
        "t_fold_s": t_fold,
        "window_s": None if target is None else window,
        "target_s": target,
        "met": None if target is None else t_fold < target,
        "window_down_s": _finite_or_none(averaging_window_s(reports, t_kill_ms, hello_ms)),
        "kill_to_hello_s": (hello_ms - t_kill_ms) / 1000.0,
        "kill_to_fold_s": (fold_ms - t_kill_ms) / 1000.0,
        "throughput_before": before,
        "throughput_after": after,
        "reports_before": n_before,
        "reports_after": n_after,
        "throughput_ratio": None if not before or after is None else after / before,
        "throughput_while_down": down,
        "syncs_while_down": _syncs_at(reports, hello_ms) - _syncs_at(reports, t_kill_ms),
        "syncs_at_fold": fold["data"].get("syncs"),
        # the next epoch boundary (where whole-epoch partitions gave work before the re-split)
        "consensus_to_next_epoch_s": (
            None if boundary is None else (boundary - consensus_ms) / 1000.0
        ),
        "epoch_s": (
            float(last_epoch[0]["data"]["epoch_ms"]) / 1000.0
            if last_epoch and "epoch_ms" in last_epoch[0]["data"]
            else None
        ),
    }
    if batch_size > 0:
        wall_before = wall_throughput(reports, t_kill_ms - 1000.0 * before_s, t_kill_ms, batch_size)
        wall_after = wall_throughput(reports, fold_ms, fold_ms + 1000.0 * after_s, batch_size)
        out |= {
            "wall_throughput_before": wall_before,
            "wall_throughput_after": wall_after,
            "wall_throughput_ratio": (
                None if not wall_before or wall_after is None else wall_after / wall_before
            ),
        }
    if t_respawn_ms is not None:
        out |= {
            "kill_to_start_s": (t_respawn_ms - t_kill_ms) / 1000.0,
            "start_to_hello_s": (hello_ms - t_respawn_ms) / 1000.0,
            "start_to_consensus_s": (consensus_ms - t_respawn_ms) / 1000.0,
            "start_to_fold_s": (fold_ms - t_respawn_ms) / 1000.0,
        }
    return out


def analyse_torchft(events: Sequence[dict[str, Any]], t_start_ms: float) -> dict[str, Any]:
    """A restarted torchft replica's milestones from its event log (the lines it wrote after
    ``t_start_ms``, the new process's start), in s from that start (None: not reached).

    ``heal``: the first quorum in which it recovers a peer's state; ``healed_commit``: the first
    committed sync at or after it; ``own_commit``: the next committed sync (the first that
    averages its own local steps)."""
    mine = sorted((e for e in events if float(e.get("ts", 0)) > t_start_ms), key=lambda e: e["ts"])

    def since(e: dict[str, Any] | None) -> float | None:
        return None if e is None else (float(e["ts"]) - t_start_ms) / 1000.0

    ready = next((e for e in mine if e.get("event") == "start"), None)
    heal = next((e for e in mine if e.get("event") == "quorum" and e.get("healing")), None)
    commits = [e for e in mine if e.get("event") == "commit" and e.get("committed")]
    healed = None
    own = None
    if heal is not None:
        later = [e for e in commits if e["ts"] >= heal["ts"]]
        healed = later[0] if later else None
        own = later[1] if len(later) > 1 else None
    first_quorum = next((e for e in mine if e.get("event") == "quorum"), None)
    return {
        "start_to_ready_s": since(ready),
        "start_to_first_quorum_s": since(first_quorum),
        "start_to_heal_s": since(heal),
        "start_to_consensus_s": since(healed),
        "start_to_fold_s": since(own),
        "failed_commits": sum(
            1 for e in mine if e.get("event") == "commit" and not e.get("committed")
        ),
    }


# ---------------------------------------------------------------------------------------------
# flodl trial
# ---------------------------------------------------------------------------------------------


def _tree(records: Path) -> dict[str, list[dict[str, Any]]]:
    from flodl.monitor.records import read_tree

    try:
        return read_tree(records)
    except Exception:  # noqa: BLE001 - no root.log yet
        return {}


class _Follow:
    """The records of one JSONL file as it grows, read incrementally (polling must not load
    the machine it measures; a file that shrank, i.e. rotated, is read again from its start)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.rest = b""
        self.records: list[dict[str, Any]] = []

    def poll(self) -> list[dict[str, Any]]:
        try:
            size = self.path.stat().st_size
        except OSError:
            return self.records
        if size < self.offset:
            self.offset, self.rest, self.records = 0, b"", []
        if size > self.offset:
            with self.path.open("rb") as f:
                f.seek(self.offset)
                chunk = f.read(size - self.offset)
            self.offset += len(chunk)
            *lines, self.rest = (self.rest + chunk).split(b"\n")
            for line in lines:
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                if isinstance(rec, dict) and "ts" in rec:
                    self.records.append(rec)
        return self.records


class _Output:
    """Copies the job's merged stdout/stderr to a file, time-stamping the launcher's respawn
    line (the new process's start) as it passes."""

    def __init__(self, stream: IO[bytes], log: Path) -> None:
        self.stream = stream
        self.log = log
        self.respawned_ms: float | None = None
        self.thread = threading.Thread(target=self._pump, daemon=True)
        self.thread.start()

    def _pump(self) -> None:
        with self.log.open("wb") as sink:
            for line in iter(self.stream.readline, b""):
                if self.respawned_ms is None and RESPAWN_LINE.encode() in line:
                    self.respawned_ms = time.time() * 1000.0
                sink.write(line)
                sink.flush()

    def tail(self, n: int = 800) -> str:
        return self.log.read_text(errors="replace")[-n:] if self.log.exists() else ""


def flodl_trial(mode: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    trial = work / f"flodl-{mode}-{uuid.uuid4().hex[:6]}"
    records = trial / "records"
    records.mkdir(parents=True)
    tag = f"bench-elastic-{uuid.uuid4().hex}"
    spec = trial / "spec.json"
    spec.write_text(
        json.dumps(
            {
                "mode": mode,
                "samples": args.samples,
                "batch_size": args.batch_size,
                "epochs": 1000,  # ended by this script once measured
                "records": str(records),
            }
        )
    )
    env = dict(os.environ)
    env.pop("FLODL_NET_TIMEOUT_SCALE", None)
    env.pop("FLODL_RESPAWN", None)  # the job's .respawn(1) decides
    proc = subprocess.Popen(
        [sys.executable, str(Path(__file__).resolve()), "--flodl-job", str(spec), "--tag", tag],
        cwd=REPO_ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its own process group: cleaned up as one below
    )
    assert proc.stdout is not None
    output = _Output(proc.stdout, trial / "job.log")
    result: dict[str, Any] = {"system": "flodl", "mode": mode}
    victim: int | None = None
    try:
        follow = {
            "root": _Follow(records / "root.log"),
            f"root/rank{VICTIM}": _Follow(records / "root" / f"rank{VICTIM}.log"),
        }

        def tree() -> dict[str, list[dict[str, Any]]]:
            return {path: f.poll() for path, f in follow.items()}

        def warm() -> float | None:
            reports = root_reports(tree())
            if not reports or int(reports[-1]["data"]["syncs"]) < args.warm_syncs:
                return None
            # the first second of reports is start-up; the before-window follows it
            span = (float(reports[-1]["ts"]) - float(reports[0]["ts"])) / 1000.0
            return span if span >= args.before_s + 1.0 else None

        if not wait_for(warm, args.start_timeout):
            raise RuntimeError(
                f"no {args.warm_syncs} reduces and {args.before_s + 1:.0f} s of reports within "
                f"{args.start_timeout:.0f} s"
            )
        victim = rank_pid(tag, VICTIM)
        if victim is None:
            raise RuntimeError(f"rank {VICTIM}'s process not found")
        t_kill = time.time() * 1000.0
        os.kill(victim, signal.SIGKILL)

        def rejoined() -> Any:
            return rejoined_record(tree(), VICTIM, after_ms=t_kill)

        if not wait_for(rejoined, args.rejoin_timeout):
            raise RuntimeError(
                f"rank {VICTIM} did not rejoin (no rank_rejoined record) within "
                f"{args.rejoin_timeout:.0f} s of the kill"
            )

        def folded() -> dict[str, Any] | None:
            now = tree()
            rec = rejoined_record(now, VICTIM, after_ms=t_kill)
            return None if rec is None else first_fold(now, VICTIM, float(rec["ts"]))

        fold = wait_for(folded, 30.0)
        if fold is None:
            raise RuntimeError("no averaging cycle folded the rejoined rank's work within 30 s")
        fold_ms = float(fold["ts"])
        # the after-window: --after-s seconds of reports past the fold (or what came by then)
        wait_for(
            lambda: any(
                float(r["ts"]) >= fold_ms + 1000.0 * args.after_s for r in root_reports(tree())
            ),
            args.after_s + 15.0,
        )
        result |= {
            "ok": True,
            **analyse_flodl(
                _tree(records),
                victim=VICTIM,
                t_kill_ms=t_kill,
                t_respawn_ms=output.respawned_ms,
                before_s=args.before_s,
                after_s=args.after_s,
                batch_size=args.batch_size,
            ),
        }
        if output.respawned_ms is None:
            result["note"] = "the launcher's respawn line was not seen"
        else:
            with contextlib.suppress(OSError, ValueError):
                stamps = json.loads((trial / "phases" / f"rank{VICTIM}.1.json").read_text())
                result |= startup_phases(stamps, output.respawned_ms)
    except Exception as exc:  # noqa: BLE001 - a failed trial is reported, not raised
        result |= {"ok": False, "error": f"{type(exc).__name__}: {exc} | {output.tail()}"[:1500]}
    finally:
        if victim is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(victim, signal.SIGKILL)
        result["orphans"] = _stop_job(proc, tag)
        output.thread.join(timeout=10)
    return result


def _stop_job(proc: subprocess.Popen[bytes], tag: str) -> int:
    """Stop the launcher (it stops its ranks on SIGTERM), then kill its process group and any
    process left with the tag; returns how many were still there to kill at the end."""
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    left = wait_for(lambda: not processes_with(tag), 5.0)
    stragglers = [] if left else processes_with(tag)
    for pid in stragglers:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return len(stragglers)


# ---------------------------------------------------------------------------------------------
# torchft trial
# ---------------------------------------------------------------------------------------------


def torchft_trial(args: argparse.Namespace, work: Path, cli: bool) -> dict[str, Any]:
    from _torchft import Lighthouse, spawn_replica, spawn_replicas

    out = work / f"torchft-{uuid.uuid4().hex[:6]}"
    cfg = {
        "world": WORLD,
        "samples": args.samples,
        "seed": 0,
        "epochs": 0,
        "forever": True,
        "batch_size": args.batch_size,
        "factor": 1.0,  # no slowdown, as flodl's ranks
        "step_per_forward": 3.0,
        "sync_every": TORCHFT_SYNC_EVERY,
        "min_replica_size": WORLD - 1,
    }
    result: dict[str, Any] = {"system": "torchft", "variant": "cli" if cli else "py"}
    restarted: Any = None
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
            old = ctx.processes[VICTIM]
            os.kill(old.pid, signal.SIGKILL)
            old.join(timeout=10)
            t_start = time.time() * 1000.0
            restarted = spawn_replica(VICTIM, cfg, lh.address, out)
            log = out / f"replica{VICTIM}.log"

            def done() -> bool:
                got = analyse_torchft(read_records(log), t_start)
                return got["start_to_fold_s"] is not None

            wait_for(done, args.torchft_cap, poll_s=0.1)
            got = analyse_torchft(read_records(log), t_start)
            result |= {"ok": got["start_to_consensus_s"] is not None, **got}
            if got["start_to_first_quorum_s"] is not None:
                until = t_start + 1000.0 * got["start_to_first_quorum_s"]
                result["syncs_while_down"] = sum(
                    1
                    for e in read_records(out / "replica0.log")
                    if e.get("event") == "commit"
                    and e.get("committed")
                    and t_kill < e["ts"] < until
                )
            result["kill_to_start_s"] = (t_start - t_kill) / 1000.0
            if not result["ok"]:
                result["error"] = (
                    f"the restarted replica did not heal and commit within "
                    f"{args.torchft_cap:.0f} s of its start"
                )
        except Exception as exc:  # noqa: BLE001 - a failed trial is reported, not raised
            result |= {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:1500]}
        finally:
            procs = [*ctx.processes, *([restarted] if restarted is not None else [])]
            for p in procs:
                if p.is_alive():
                    p.kill()
            for p in procs:
                p.join(timeout=10)
            result["orphans"] = sum(1 for p in procs if p.is_alive())
    return result


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="one trial per mode, shorter windows")
    p.add_argument("--trials", type=int, default=None, help="per mode (default 2; quick 1)")
    p.add_argument("--modes", default=",".join(MODES), help="flodl modes: %(default)s")
    p.add_argument("--systems", default="flodl,torchft", help="subset of: %(default)s")
    p.add_argument(
        "--lighthouses", default="cli,py", help="torchft lighthouses (binary, Python): %(default)s"
    )
    p.add_argument("--samples", type=int, default=48_000)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--warm-syncs", type=int, default=5, help="reduces done before the kill")
    p.add_argument(
        "--before-s", type=float, default=None, help="throughput window before the kill (3; 2)"
    )
    p.add_argument(
        "--after-s", type=float, default=None, help="throughput window after the fold (4; 2.5)"
    )
    p.add_argument("--start-timeout", type=float, default=90.0)
    p.add_argument("--rejoin-timeout", type=float, default=60.0)
    p.add_argument(
        "--torchft-cap", type=float, default=90.0, help="give up on torchft's rejoin after"
    )
    p.add_argument("--json", type=Path, default=RESULTS_DIR / "bench_elastic.json")
    add_markdown_option(p, RESULTS_DIR / "bench_elastic.json")
    p.add_argument("--keep", action="store_true", help="keep the record logs (prints where)")
    p.add_argument("--flodl-job", help=argparse.SUPPRESS)
    p.add_argument("--tag", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.trials is None:
        args.trials = 1 if args.quick else 2
    if args.trials < 1:
        p.error("--trials must be >= 1")
    if args.before_s is None:
        args.before_s = 2.0 if args.quick else 3.0
    if args.after_s is None:
        args.after_s = 2.5 if args.quick else 4.0
    args.system_list = [s.strip() for s in args.systems.split(",") if s.strip()]
    args.mode_list = [s.strip() for s in args.modes.split(",") if s.strip()]
    if set(args.system_list) - {"flodl", "torchft"}:
        p.error("--systems: a subset of flodl,torchft")
    if set(args.mode_list) - set(MODES):
        p.error(f"--modes: a subset of {','.join(MODES)}")
    args.lighthouse_list = [s.strip() for s in args.lighthouses.split(",") if s.strip()]
    if set(args.lighthouse_list) - set(TORCHFT_VARIANTS):
        p.error("--lighthouses: a subset of cli,py")
    return args


FLODL_FIELDS = (
    "down_s",
    "consensus_s",
    "t_fold_s",
    "consensus_to_next_epoch_s",
    "epoch_s",
    "window_s",
    "target_s",
    "throughput_before",
    "throughput_after",
    "throughput_ratio",
    "wall_throughput_before",
    "wall_throughput_after",
    "wall_throughput_ratio",
    "throughput_while_down",
    "syncs_while_down",
    "start_to_script_s",
    "start_to_imports_s",
    "start_to_task_s",
    "start_to_hello_s",
    "start_to_consensus_s",
    "start_to_fold_s",
    "kill_to_hello_s",
    "kill_to_fold_s",
)
TORCHFT_FIELDS = (
    "start_to_ready_s",
    "start_to_first_quorum_s",
    "start_to_heal_s",
    "start_to_consensus_s",
    "start_to_fold_s",
    "syncs_while_down",
)


def _dispatch(mode: str) -> str:
    """How the mode hands out work: a rejoined rank of a whole-epoch-partition mode (the
    sync modes) gets a share of the running partitions (a re-split); a chunk mode's its
    next chunk."""
    from flodl import ElCheConfig

    return "chunks" if ElCheConfig.preset(mode).traits.progressive else "epoch partitions"


def summarize(trials: Sequence[dict[str, Any]], mode_list: Sequence[str]) -> list[dict[str, Any]]:
    """One row per flodl mode and per torchft lighthouse that ran: stats over its good trials;
    a flodl row's ``met`` holds when every good trial met its own target."""
    rows: list[dict[str, Any]] = []
    groups: list[tuple[str, str]] = [("flodl", m) for m in mode_list]
    groups += [("torchft", v) for v in TORCHFT_VARIANTS]
    for system, which in groups:
        key = "mode" if system == "flodl" else "variant"
        ts = [t for t in trials if t["system"] == system and t.get(key) == which]
        if not ts:
            continue
        good = [t for t in ts if t.get("ok")]
        fields = FLODL_FIELDS if system == "flodl" else TORCHFT_FIELDS
        row: dict[str, Any] = {
            "system": system,
            key: which,
            "trials": len(ts),
            "ok": len(good),
            **{f: median_stats([t.get(f) for t in good]) for f in fields},
            "orphans": sum(int(t.get("orphans") or 0) for t in ts),
            "errors": [t["error"] for t in ts if not t.get("ok") and "error" in t],
        }
        if system == "flodl":
            row["dispatch"] = _dispatch(which)
            row["target"] = f"t_fold < {TARGET_FOLD_S:g} s + one averaging window"
            row["met"] = bool(good) and all(t["met"] for t in good)
        rows.append(row)
    return rows


def report(
    args: argparse.Namespace,
    trials: list[dict[str, Any]],
    reason: str | None,
    header: dict[str, Any],
) -> dict[str, Any]:
    """The result file: ``header`` (:meth:`RunStamp.header`), the settings, why torchft could not
    run (``reason``), the summary rows of ``trials`` and every trial."""
    return {
        **header,
        "quick": args.quick,
        "config": {
            "world": WORLD,
            "victim": VICTIM,
            "modes": args.mode_list,
            "trials": args.trials,
            "warm_syncs": args.warm_syncs,
            "before_s": args.before_s,
            "after_s": args.after_s,
            "samples": args.samples,
            "batch_size": args.batch_size,
            "threads_per_process": 1,
            "slowdown": 1.0,
            "torchft_sync_every": TORCHFT_SYNC_EVERY,
            "torchft_lighthouses": args.lighthouse_list,
            "target_fold_s": TARGET_FOLD_S,
        },
        "torchft": {"available": reason is None, "reason": reason},
        "rows": summarize(trials, args.mode_list if "flodl" in args.system_list else []),
        "trials": trials,
    }


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

    stamp = RunStamp("bench_elastic", raw)
    reason = unavailable() if "torchft" in args.system_list else "not selected"
    print(
        f"bench_elastic: {WORLD} ranks, rank {VICTIM} SIGKILLed after {args.warm_syncs} reduces "
        f"and respawned; {args.trials} trial(s) per mode; windows {args.before_s:g} s before "
        f"the kill, {args.after_s:g} s after the fold"
    )
    work = Path(tempfile.mkdtemp(prefix="bench_elastic-"))
    trials: list[dict[str, Any]] = []
    try:
        if "flodl" in args.system_list:
            for mode in args.mode_list:
                run = functools.partial(flodl_trial, mode, args, work)
                repeat_trials(f"flodl {mode}", args.trials, run, _brief, trials)
        if "torchft" in args.system_list:
            for variant in args.lighthouse_list:
                if reason is not None:
                    trials.append(
                        {"system": "torchft", "variant": variant, "ok": False, "error": reason}
                    )
                    print(f"  torchft ({variant}): cannot run here: {reason}")
                    continue
                run = functools.partial(torchft_trial, args, work, cli=variant == "cli")
                label = f"torchft ({variant})"
                repeat_trials(label, max(1, min(args.trials, 2)), run, _brief, trials)
    finally:
        if args.keep:
            print(f"  record logs kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)

    data = report(args, trials, reason, stamp.header("bench_elastic", "torch", "torchft"))
    print_tables(data["rows"])
    print(f"bench_elastic took {data['took_s']:.0f} s")
    path = write_json(args.json, data)
    print(f"wrote {path}")
    return 0


FLODL_HEADERS = (
    "mode",
    "ok",
    "down s",
    "consensus s",
    "t_fold s",
    "window s",
    "target s",
    "",
    "dispatch",
    "epoch s",
    "consensus→next epoch s",
    "thr before",
    "thr after",
    "after/before",
    "wall after/before",
    "note",
)
RESTART_HEADERS = (
    "system",
    "ok",
    "flodl imported",
    "task built",
    "up",
    "1st quorum",
    "has the state",
    "own work folded",
    "survivor syncs",
    "note",
)


def _note(r: dict[str, Any]) -> str:
    """A summary row's note: its first failure (one line) and the orphans killed, if any."""
    note = f"failed: {' '.join(r['errors'][0].split())[:90]}" if r["errors"] else ""
    if r["orphans"]:
        note = (note + "; " if note else "") + f"{r['orphans']} orphan(s) killed"
    return note


def flodl_table(
    rows: Sequence[dict[str, Any]], verdict: Callable[[bool | None], str]
) -> list[list[str]]:
    """The cells of the flodl rejoin table (:data:`FLODL_HEADERS`), one row per flodl mode;
    ``verdict`` words a row's ``met``."""
    return [
        [
            r["mode"],
            f"{r['ok']}/{r['trials']}",
            stats_cell(r["down_s"]),
            stats_cell(r["consensus_s"]),
            stats_cell(r["t_fold_s"]),
            stats_cell(r["window_s"]),
            stats_cell(r["target_s"]),
            verdict(r["met"] if r["ok"] else None),
            r["dispatch"],
            stats_cell(r["epoch_s"]),
            stats_cell(r["consensus_to_next_epoch_s"]),
            stats_cell(r["throughput_before"], ".0f"),
            stats_cell(r["throughput_after"], ".0f"),
            stats_cell(r["throughput_ratio"]),
            stats_cell(r["wall_throughput_ratio"]),
            _note(r),
        ]
        for r in rows
        if r["system"] == "flodl"
    ]


def restart_table(rows: Sequence[dict[str, Any]]) -> list[list[str]]:
    """The cells of the restart → rejoin table (:data:`RESTART_HEADERS`), one row per flodl
    mode and torchft lighthouse."""
    table = []
    for r in rows:
        if r["system"] == "flodl":
            cells = [
                f"flodl {r['mode']}",
                stats_cell(r["start_to_imports_s"]),
                stats_cell(r["start_to_task_s"]),
                stats_cell(r["start_to_hello_s"]),
                "-",
            ]
        else:
            cells = [
                TORCHFT_VARIANTS[r["variant"]],
                "-",
                "-",
                stats_cell(r["start_to_ready_s"]),
                stats_cell(r["start_to_first_quorum_s"]),
            ]
        table.append(
            [
                cells[0],
                f"{r['ok']}/{r['trials']}",
                *cells[1:],
                stats_cell(r["start_to_consensus_s"]),
                stats_cell(r["start_to_fold_s"]),
                stats_cell(r["syncs_while_down"], ".0f"),
                _note(r),
            ]
        )
    return table


def print_tables(rows: Sequence[dict[str, Any]]) -> None:
    """Print the summary rows as the two terminal tables."""
    table = flodl_table(rows, lambda met: "-" if met is None else ("met" if met else "NOT met"))
    if table:
        print_table(
            "flodl rejoin (s; samples/s): median (min–max) over trials; t_fold = hello → first "
            "cycle folding its steps, target = 2 s + window (median reduce interval before the "
            "kill); thr = the reports' throughput (samples/s of busy time, summed over ranks), "
            "wall = their steps × batch / elapsed time",
            FLODL_HEADERS,
            table,
        )
    print_table(
        "restart → rejoin, s from the new process's start: median (min–max) over trials\n"
        "  flodl: up = its hello; has the state = the cycle that gave it the consensus; own work "
        "= the first cycle that folds its steps\n"
        "  torchft: up = its Manager is built; has the state = its first committed sync (healed "
        "from a peer); own work = the next one\n"
        "  survivor syncs = reduces the others completed between the kill and the victim's "
        "hello (flodl) / first quorum (torchft)",
        RESTART_HEADERS,
        restart_table(rows),
    )


def _medians(rows: Sequence[dict[str, Any]], field: str) -> list[float | None]:
    """Each row's median of ``field`` (None where no trial had it)."""
    return [r[field]["median"] for r in rows]


def _gaps(rows: Sequence[dict[str, Any]], a: str, b: str) -> list[float | None]:
    """Per row, the median of ``b`` minus the median of ``a`` (None where either is missing)."""
    return [
        None if x is None or y is None else y - x
        for x, y in zip(_medians(rows, a), _medians(rows, b), strict=True)
    ]


def _fold_bullet(
    flodl: Sequence[dict[str, Any]], trials: Sequence[dict[str, Any]], target_fold_s: float
) -> str:
    """The bullet that states the t_fold target's verdict over the modes (``target_fold_s``
    plus a window) and each mode's worst trial against that trial's own target."""
    worst = []
    for r in flodl:
        good = [
            t for t in trials if t["system"] == "flodl" and t["mode"] == r["mode"] and t.get("ok")
        ]
        t = max(good, key=lambda t: t["t_fold_s"], default=None)
        if t is not None:
            target = "no target" if t["target_s"] is None else f"target {t['target_s']:.2f} s"
            worst.append(f"{r['mode']} {t['t_fold_s']:.2f} s ({target})")
    met = [r for r in flodl if r["met"]]
    missed = [r["mode"] for r in flodl if not r["met"]]
    return (
        f"- **t_fold < {target_fold_s:g} s + one window**: {met_text(len(met) == len(flodl))}: "
        f"{len(met)} of {len(flodl)} modes had every finished trial within its own target"
        + (f" (not: {', '.join(missed)})" if missed else "")
        + f". Worst trial per mode: {'; '.join(worst) or 'none finished'}."
    )


def markdown(data: dict[str, Any]) -> str:
    """The docs/benchmarks.md section for a result file (every figure from it)."""
    cfg = data["config"]
    rows = data["rows"]
    flodl = [r for r in rows if r["system"] == "flodl"]
    torchft = [r for r in rows if r["system"] == "torchft"]
    setup = (
        f"Per mode, {cfg['world']} ranks train the demo task ({cfg['samples']:,} windows, batch "
        f"{cfg['batch_size']}, {cfg['threads_per_process']} thread per rank, slowdown "
        f"{cfg['slowdown']:g}) with `.respawn(1)`. Rank {cfg['victim']} is SIGKILLed after "
        f"{cfg['warm_syncs']} reduces and {cfg['before_s'] + 1:g} s of reports; the launcher "
        "restarts it, and the new process says hello and rejoins. "
        f"Each mode ran {cfg['trials']} trial(s). `t_fold` runs from the rejoined rank's hello to "
        f"the first reduce completed after its first trained batch (the first root report "
        f"whose `syncs` exceeds that of the first report where `root/rank{cfg['victim']}` has "
        f"`steps > 0`); the target is `t_fold` < {cfg['target_fold_s']:g} s + one averaging "
        "window (the median interval between completed reduces in the "
        f"{cfg['before_s']:g} s before the kill). `thr` is "
        "the root reports' `throughput` (each rank's samples per second of busy time, summed), "
        "`wall` their `steps` × batch over the elapsed time, both averaged over the reports in "
        f"the {cfg['before_s']:g} s before the kill and the {cfg['after_s']:g} s after the first "
        "folded cycle. Restart times are from the launcher's `respawning it` line."
    )
    if torchft:
        setup += (
            f" torchft: `LocalSGD(sync_every={cfg['torchft_sync_every']})`, "
            f"`min_replica_size={cfg['world'] - 1}`, one lighthouse at its defaults; replica "
            f"{cfg['victim']} is SIGKILLed and a new process for it started once the old one is "
            "reaped. Up: its Manager is built; has the state: its first committed sync, in the "
            "quorum where it heals from a peer; own work: the next committed sync."
        )
    lines = [
        *section_head("Rejoin after a respawn", data, f"{data['took_s']:.0f} s"),
        "",
        setup,
        "",
    ]
    if flodl:
        headers = [h or "verdict" for h in FLODL_HEADERS]
        lines += [
            "flodl rejoin, s and samples/s, median (min–max) over trials:",
            "",
            *markdown_table(headers, flodl_table(rows, met_text)),
            "",
        ]
    lines += [
        (
            "Restart → rejoin, s from the new process's start, median (min–max) over trials "
            "(survivor syncs: reduces the others completed between the kill and the victim's "
            "hello for flodl, its first quorum for torchft):"
        ),
        "",
        *markdown_table(RESTART_HEADERS, restart_table(rows)),
    ]
    bullets = []
    if flodl:
        good = [t for t in data["trials"] if t["system"] == "flodl" and t.get("ok")]
        ratios = [t.get(k) for t in good for k in ("throughput_ratio", "wall_throughput_ratio")]
        partitions = [r for r in flodl if r["dispatch"] == "epoch partitions"]
        bullets += [
            _fold_bullet(flodl, data["trials"], cfg["target_fold_s"]),
            (
                "- **Throughput after / before:** medians "
                f"{span_text(_medians(flodl, 'throughput_ratio'))} (`thr`) and "
                f"{span_text(_medians(flodl, 'wall_throughput_ratio'))} (`wall`) over the modes; "
                f"single trials {span_text(ratios)}."
            ),
            (
                "- **flodl's restart, medians per mode:** flodl imported at "
                f"{span_text(_medians(flodl, 'start_to_imports_s'))} s, the task built "
                f"{span_text(_gaps(flodl, 'start_to_imports_s', 'start_to_task_s'))} s later, "
                f"the hello {span_text(_gaps(flodl, 'start_to_task_s', 'start_to_hello_s'))} s "
                f"after that, the consensus {span_text(_medians(flodl, 'consensus_s'))} s after "
                "the hello. Survivor reduces while it was down: "
                f"{span_text(_medians(flodl, 'syncs_while_down'), '.0f')}."
            ),
        ]
        if partitions:
            bullets.append(
                "- Epoch-partition modes "
                f"({', '.join(r['mode'] for r in partitions)}): consensus → next epoch boundary "
                f"{span_text(_medians(partitions, 'consensus_to_next_epoch_s'))} s (median per "
                "mode), against a `t_fold` of "
                f"{span_text(_medians(partitions, 't_fold_s'))} s."
            )
    for r in torchft:
        label = TORCHFT_VARIANTS[r["variant"]]
        healed = r["start_to_consensus_s"]["median"]
        if healed is None:
            continue
        mine = [v for v in _medians(flodl, "start_to_consensus_s") if v is not None]
        before = sum(1 for v in mine if v < healed)
        bullets.append(
            f"- **Restart → has the state:** {label} {healed:.2f} s, flodl "
            f"{span_text(mine)} s (median per mode); flodl had it first in {before} of "
            f"{len(mine)} modes. Restart → own work folded: {label} "
            f"{stats_cell(r['start_to_fold_s'])} s, flodl "
            f"{span_text(_medians(flodl, 'start_to_fold_s'))} s. Survivor commits while it was "
            f"down: {stats_cell(r['syncs_while_down'], '.0f')}."
        )
    failed = [r for r in rows if r["errors"]]
    bullets += [
        f"- {r.get('mode') or TORCHFT_VARIANTS[r['variant']]}: {len(r['errors'])} of "
        f"{r['trials']} trial(s) failed; the first: {' '.join(r['errors'][0].split())[:200]}"
        for r in failed
    ]
    return "\n".join(lines + (["", *bullets] if bullets else []))


def _brief(r: dict[str, Any]) -> str:
    if not r.get("ok"):
        return f"FAILED: {r.get('error', '')[:300]}"
    if r["system"] == "torchft":
        return (
            f"start → ready {_s(r['start_to_ready_s'])}, → healed commit "
            f"{_s(r['start_to_consensus_s'])}, → own-work commit {_s(r['start_to_fold_s'])}"
        )
    return (
        f"down {_s(r['down_s'])}, consensus {_s(r['consensus_s'])}, t_fold {_s(r['t_fold_s'])} "
        f"(target {_s(r['target_s'])}: {'met' if r['met'] else 'NOT met'}), throughput "
        f"after/before {_s(r['throughput_ratio'], '')}, start → fold {_s(r.get('start_to_fold_s'))}"
    )


def _s(v: float | None, unit: str = " s") -> str:
    return "-" if v is None else f"{v:.2f}{unit}"


if __name__ == "__main__":
    sys.exit(main())
