"""Replay a run's record log through the real coordinator, then ask it what-ifs
(``flodl sim --from-records DIR``; docs/design.md §3, "Replay").

Pure module: it takes the records (``read_tree``'s output, or a simulated run's
``SimTrace.records``) and returns figures; the command reads the files.

What a record log tells (:func:`recorded_run`):

* the job (``job`` record at ``root``, written when training starts): mode, world size, data,
  batch size, epochs, the ElChe knobs, the checkpoint cadence;
* each rank's speed over time: every ``window`` record's busy ms per batch (compute and data
  wait) of each live rank, a step function of the time since training started;
* the averaging cost: the median ``averaging_ms`` of the windows (``span − the longest busy``);
* the callbacks: every ``callback`` record (eval, checkpoint, epoch_fn on a role rank), charged
  to the simulator's epoch-boundary callback as their total per epoch;
* the faults: ``rank_lost`` records, and ``rank_rejoined`` ones (at their admission:
  ``consensus_s`` before the record);
* what happened: each ``epoch`` record's time since training started and sync count, and each
  rank's trained batches (the ``window`` records' steps).

The replay (:func:`replay`) runs :class:`~flodl.sim.cluster.SimCluster` — the production
coordinator and rank protocol — with that job, those speeds, that averaging cost, those
callbacks and faults, and :func:`compare` reports its error against the recorded run at the
last epoch the log holds (a running job's log is compared as far as it goes). The what-ifs
(:class:`WhatIf`) change one thing each: another mode, a rank added at a given speed, a rank
dropped, a rank failure rate per hour (goodput: the simulated cost of one failure, against a
whole-job restart from the last checkpoint), another overhead target or anchor bound.
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from flodl.config import MODES, ElCheConfig
from flodl.coord.contribution import MOVE_TO_ASYNC
from flodl.errors import ConfigError
from flodl.sim.cluster import SimCluster
from flodl.sim.trace import Failure, SimTrace
from flodl.timeouts import HEARTBEAT_INTERVAL_S

__all__ = [
    "DEFAULT_RESTART_S",
    "RecordedRun",
    "WhatIf",
    "recorded_run",
    "replay",
    "compare",
    "failure_goodput",
    "what_ifs",
    "format_replay",
]

DEFAULT_RESTART_S = 30.0
"""A failed rank's (or job's) time to come back: process start, imports, the rejoin."""


@dataclass(frozen=True, slots=True)
class RecordedRun:
    """What a record log says about a run (see the module docstring)."""

    mode: str
    world_size: int
    dataset_len: int
    batch_size: int
    epochs: int
    elche: dict[str, Any]
    checkpoint_every: int | None
    speeds: tuple[tuple[tuple[float, float], ...], ...]
    """Per rank: ``(t_s, ms per batch)`` of each window it trained in, in time order."""
    averaging_ms: float
    callback_ms_per_epoch: float
    faults: tuple[Failure, ...]
    epoch_t_s: tuple[float, ...]
    """Time since training started at which each recorded epoch closed (epochs 0, 1, …)."""
    epoch_syncs: tuple[int, ...]
    batches: tuple[int, ...]
    """Each rank's trained batches over the recorded windows."""
    advice: tuple[dict[str, Any], ...] = ()
    """The last ``contribution`` record's per-rank figures."""
    unknown_speed: tuple[int, ...] = ()
    """Ranks that trained in no recorded window (dead or joined before the first one closed):
    replayed at the median speed of the others."""

    @property
    def shares(self) -> list[float]:
        total = sum(self.batches)
        return [b / total if total else 0.0 for b in self.batches]

    def median_ms(self, rank: int) -> float:
        return statistics.median(ms for _, ms in self.speeds[rank])


def _job(tree: Mapping[str, Sequence[Mapping[str, Any]]]) -> tuple[float, dict[str, Any], int]:
    jobs = [r for r in tree.get("root", ()) if r.get("kind") == "job"]
    if not jobs:
        raise ConfigError(
            "the record log has no 'job' record: it was written before training started, or "
            "by a flodl older than the replay (records of flodl ≥ protocol 5 carry the job)"
        )
    if len(jobs) > 1:
        raise ConfigError(
            f"the record log holds {len(jobs)} training segments (a restarted or resumed run); "
            "replay one segment's log"
        )
    rec = jobs[0]
    data = rec.get("data")
    if not isinstance(data, dict) or not isinstance(data.get("job"), dict):
        raise ConfigError("the 'job' record has no job")
    ws = data.get("world_size")
    if not isinstance(ws, int) or ws < 1:
        raise ConfigError(f"the 'job' record's world_size {ws!r} is not a positive integer")
    return float(rec.get("ts", 0.0)), data["job"], ws


def _num(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ConfigError(f"{what}: {value!r} is not a finite number")
    return float(value)


def recorded_run(tree: Mapping[str, Sequence[Mapping[str, Any]]]) -> RecordedRun:
    """Read a run's record tree (node path → records, oldest first).

    Raises:
        ConfigError: the log lacks what a replay needs (no job, no finished window or epoch),
            naming what is missing; or a record's figures are not numbers.
    """
    t0_ms, job, world = _job(tree)
    try:
        elche = ElCheConfig.model_validate(job.get("elche", {}))
        splits = int(job.get("epoch_splits", 1))
        dataset_len = int(job["dataset_len"]) * int(job.get("augment", 1)) // splits
        batch_size = int(job["batch_size"])
        epochs = int(job["num_epochs"]) * splits
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"the 'job' record is not a flodl job: {exc}") from None
    if job.get("resume_from"):
        raise ConfigError(
            "the run resumed from a bundle: the replay starts a job from epoch 0 and cannot "
            "compare with a resumed segment"
        )
    root = tree.get("root", ())
    speeds: list[list[tuple[float, float]]] = [[] for _ in range(world)]
    batches = [0] * world
    averaging: list[float] = []
    for rec in root:
        if rec.get("kind") != "window":
            continue
        d = rec["data"]
        t = _num(d.get("t_s"), "window t_s")
        averaging.append(_num(d.get("averaging_ms", 0.0), "window averaging_ms"))
        ranks, steps, per = d.get("ranks", []), d.get("steps", []), d.get("ms_per_batch", [])
        for r, n, ms in zip(ranks, steps, per, strict=False):
            if not isinstance(r, int) or not 0 <= r < world:
                raise ConfigError(f"a window record names rank {r!r} of a world of {world}")
            batches[r] += int(_num(n, "window steps"))
            if ms is not None and n:
                speeds[r].append((t, _num(ms, "window ms_per_batch")))
    if not averaging:
        raise ConfigError("the record log has no 'window' record: no averaging cycle finished")
    known = [ms for series in speeds for _, ms in series]
    if not known:
        raise ConfigError("no rank trained in a recorded window: the speeds are unknown")
    unknown = tuple(r for r, series in enumerate(speeds) if not series)
    for r in unknown:  # died (or joined) before any window closed: the others' median
        speeds[r].append((0.0, statistics.median(known)))
    epoch_recs = [r["data"] for r in root if r.get("kind") == "epoch"]
    if not epoch_recs:
        raise ConfigError("the record log has no 'epoch' record: no epoch finished yet")
    if [int(e["epoch"]) for e in epoch_recs] != list(range(len(epoch_recs))):
        raise ConfigError("the epoch records are not epochs 0, 1, … in order")
    callback_ms = 0.0
    faults: list[Failure] = []
    for path, recs in tree.items():
        for rec in recs:
            kind, d = rec.get("kind"), rec.get("data", {})
            at = max(0.0, (float(rec.get("ts", t0_ms)) - t0_ms) / 1000.0)
            if kind == "callback" and path != "root":
                callback_ms += _num(d.get("elapsed_ms"), "callback elapsed_ms")
            elif kind == "rank_lost":
                faults.append(Failure(int(d["rank"]), at, "kill"))
            elif kind == "rank_rejoined":
                admitted = max(0.0, at - _num(d.get("consensus_s", 0.0), "consensus_s"))
                faults.append(Failure(int(d["rank"]), admitted, "rejoin"))
    contribution = [r["data"] for r in root if r.get("kind") == "contribution"]
    every = job.get("checkpoint_every")
    return RecordedRun(
        mode=elche.mode,
        world_size=world,
        dataset_len=dataset_len,
        batch_size=batch_size,
        epochs=epochs,
        elche=elche.model_dump(mode="json", exclude={"mode"}, exclude_defaults=True),
        checkpoint_every=int(every) if isinstance(every, int) else None,
        speeds=tuple(tuple(s) for s in speeds),
        averaging_ms=statistics.median(averaging),
        callback_ms_per_epoch=callback_ms / max(1, len(epoch_recs)),
        faults=tuple(sorted(faults, key=lambda f: (f.at_s, f.rank))),
        epoch_t_s=tuple(_num(e.get("t_s"), "epoch t_s") for e in epoch_recs),
        epoch_syncs=tuple(int(e.get("syncs", 0)) for e in epoch_recs),
        batches=tuple(batches),
        advice=tuple(contribution[-1].get("ranks", [])) if contribution else (),
        unknown_speed=unknown,
    )


@dataclass(frozen=True, slots=True)
class WhatIf:
    """One change to the recorded run (the default changes nothing: the replay itself)."""

    name: str = "replay"
    mode: str | None = None
    add_ms: tuple[float, ...] = ()
    """Ranks added at these constant ms per batch."""
    drop: tuple[int, ...] = ()
    """Ranks (of the recorded run) left out, with their faults."""
    elche: dict[str, Any] = field(default_factory=dict)
    """ElChe overrides (``overhead_target``, ``max_anchor``)."""
    faults: tuple[Failure, ...] | None = None
    """Faults instead of the recorded ones (ranks of the recorded numbering)."""


class _Schedule:
    """``speed_at`` for the simulator: each rank's recorded ms per batch as a step function
    of time (kept after the last window; before the first, the first)."""

    def __init__(self, series: Sequence[Sequence[tuple[float, float]] | float]) -> None:
        self._t: list[list[float]] = []
        self._ms: list[list[float]] = []
        for s in series:
            pts = [(0.0, float(s))] if isinstance(s, int | float) else list(s)
            self._t.append([t for t, _ in pts])
            self._ms.append([ms for _, ms in pts])

    def __call__(self, rank: int, t: float) -> float:
        times = self._t[rank]
        # the window recorded at t_s covers the time before it: the first one at or after t
        i = min(bisect.bisect_left(times, t), len(times) - 1)
        return self._ms[rank][i]


def replay(run: RecordedRun, what: WhatIf = WhatIf(), *, seed: int = 0) -> SimTrace:
    """Simulate the recorded run with ``what`` changed (the production coordinator).

    Raises:
        ConfigError: the change leaves no rank, names a rank the run does not have, or makes
            an invalid job (the message says which).
    """
    keep = [r for r in range(run.world_size) if r not in set(what.drop)]
    bad = [r for r in what.drop if not 0 <= r < run.world_size]
    if bad:
        raise ConfigError(f"drop rank {bad[0]}: the run has ranks 0..{run.world_size - 1}")
    series: list[Sequence[tuple[float, float]] | float] = [run.speeds[r] for r in keep]
    series.extend(what.add_ms)
    if not series:
        raise ConfigError("the what-if leaves no rank")
    index = {old: new for new, old in enumerate(keep)}
    faults = []
    for f in run.faults if what.faults is None else what.faults:
        if f.rank in index:
            faults.append(replace(f, rank=index[f.rank]))
    schedule = _Schedule(series)
    mode = what.mode or run.mode
    elche = {**run.elche, **what.elche}
    if not ElCheConfig.preset(mode).traits.elastic_blend:
        elche.pop("easgd_alpha", None)  # cpu_async's knobs do not apply to another mode
        elche.pop("max_overshoot", None)
    try:
        sim = SimCluster(
            len(series),
            mode,
            [schedule(r, 0.0) for r in range(len(series))],
            dataset_len=run.dataset_len,
            batch_size=run.batch_size,
            epochs=run.epochs,
            failures=faults,
            seed=seed,
            reduce_ms=run.averaging_ms,
            epoch_fn_ms=run.callback_ms_per_epoch,
            elche=elche,
            speed_at=schedule,
            check_invariants=False,
        )
    except (ValueError, ConfigError) as exc:
        raise ConfigError(f"what-if {what.name!r}: {exc}") from None
    return sim.run()


def _trace_batches(trace: SimTrace, upto: int) -> list[int]:
    out = [0] * len(trace.samples)
    for m in trace.epochs[: upto + 1]:
        for r, n in enumerate(m.per_rank_samples):
            out[r] += n
    return out


def compare(run: RecordedRun, trace: SimTrace) -> dict[str, Any]:
    """The replay's error against the recorded run, at the last epoch the log holds."""
    k = len(run.epoch_t_s) - 1
    if len(trace.epoch_at) <= k:
        raise ConfigError(f"the replay finished {len(trace.epoch_at)} epochs, the log {k + 1}")
    recorded_s, predicted_s = run.epoch_t_s[k], trace.epoch_at[k]
    samples = _trace_batches(trace, k)
    total = sum(samples)
    shares = [s / total if total else 0.0 for s in samples]
    return {
        "epochs_compared": k + 1,
        "recorded_s": round(recorded_s, 3),
        "predicted_s": round(predicted_s, 3),
        "time_error": round((predicted_s - recorded_s) / recorded_s, 4) if recorded_s else None,
        "recorded_syncs": run.epoch_syncs[k],
        "predicted_syncs": trace.epochs[k].syncs,
        "recorded_shares": [round(s, 4) for s in run.shares],
        "predicted_shares": [round(s, 4) for s in shares],
        "share_error_pp": round(
            100 * max(abs(a - b) for a, b in zip(run.shares, shares, strict=False)), 2
        ),
    }


def failure_goodput(
    run: RecordedRun,
    base: SimTrace,
    per_hour: float,
    *,
    restart_s: float = DEFAULT_RESTART_S,
    seed: int = 0,
) -> dict[str, Any]:
    """Goodput (useful fraction of the wall time) at ``per_hour`` rank failures per hour.

    The simulator measures what one failure costs flodl: the fastest rank killed halfway
    through the run and back ``restart_s`` later; nothing is trained twice, so the cost is the
    time the others trained without it, its rejoin and the re-split. At a rate ``λ`` the run
    meets ``λ·T`` failures over its wall time ``T = T₀ + λ·T·c``, so ``goodput = T₀ / T = 1 −
    λ·c``. The same failure taking the whole job down, as under lock-step training, costs the
    restart and the work since the last checkpoint (half the checkpoint interval on average;
    half the run without checkpoints).
    """
    if not (per_hour >= 0 and math.isfinite(per_hour)):
        raise ConfigError(f"--failures-per-hour {per_hour}: expected a finite number >= 0")
    if not (restart_s >= HEARTBEAT_INTERVAL_S and math.isfinite(restart_s)):
        raise ConfigError(f"--restart-s {restart_s}: expected at least {HEARTBEAT_INTERVAL_S} s")
    wall = base.epoch_at[-1] if base.epoch_at else base.wall_s
    fastest = min(range(run.world_size), key=run.median_ms)
    at = wall / 2
    one = [Failure(fastest, at, "kill"), Failure(fastest, at + restart_s, "rejoin")]
    hit = replay(run, WhatIf(name="one failure", faults=tuple(one)), seed=seed)
    cost = max(0.0, (hit.epoch_at[-1] if hit.epoch_at else hit.wall_s) - wall)
    epoch_s = wall / max(1, run.epochs)
    interval = run.checkpoint_every * epoch_s if run.checkpoint_every else wall
    job_cost = restart_s + interval / 2
    rate = per_hour / 3600.0
    return {
        "failures_per_hour": per_hour,
        "restart_s": restart_s,
        "flodl_failure_cost_s": round(cost, 3),
        "flodl_goodput": round(max(0.0, 1 - rate * cost), 4),
        "job_restart_cost_s": round(job_cost, 3),
        "job_restart_goodput": round(max(0.0, 1 - rate * job_cost), 4),
    }


def what_ifs(
    run: RecordedRun, asked: Sequence[WhatIf], *, seed: int = 0
) -> list[tuple[WhatIf, SimTrace]]:
    """The replay first, then every asked what-if, then — unless some were asked — the
    defaults: every other mode, and each rank dropped (the advice, quantified)."""
    todo = [WhatIf(), *asked]
    if not asked:
        todo += [WhatIf(name=m, mode=m) for m in MODES if m != run.mode]
        if run.world_size > 1:
            todo += [WhatIf(name=f"drop rank {r}", drop=(r,)) for r in range(run.world_size)]
    return [(w, replay(run, w, seed=seed)) for w in todo]


def _barrier_free(what: WhatIf) -> bool:
    return what.mode is not None and ElCheConfig.preset(what.mode).traits.elastic_blend


def _span(trace: SimTrace) -> float:
    return trace.epoch_at[-1] if trace.epoch_at else trace.wall_s


def format_replay(
    run: RecordedRun,
    error: Mapping[str, Any],
    rows: Sequence[tuple[WhatIf, SimTrace]],
    goodput: Mapping[str, Any] | None = None,
) -> str:
    """The replay's report: the recorded rig, the replay's error, the what-ifs, the advice."""
    ms = [round(run.median_ms(r), 3) for r in range(run.world_size)]
    lines = [
        (
            f"recorded: {run.mode}, {run.world_size} ranks, median ms/batch {ms}, "
            f"{run.dataset_len} samples × {run.epochs} epoch(s), batch {run.batch_size}, "
            f"averaging {run.averaging_ms:.1f} ms, callbacks "
            f"{run.callback_ms_per_epoch:.0f} ms/epoch, "
            f"{sum(f.kind == 'kill' for f in run.faults)} rank failure(s)"
            + (
                f"; ranks {list(run.unknown_speed)} trained in no window (replayed at the "
                "others' median speed)"
                if run.unknown_speed
                else ""
            )
        ),
        f"replay error at epoch {error['epochs_compared']}: training "
        f"{error['predicted_s']:.2f} s vs {error['recorded_s']:.2f} s recorded "
        f"({100 * (error['time_error'] or 0):+.1f} %), syncs {error['predicted_syncs']} vs "
        f"{error['recorded_syncs']}, shares "
        + " · ".join(f"{100 * s:.0f}%" for s in error["predicted_shares"])
        + " vs "
        + " · ".join(f"{100 * s:.0f}%" for s in error["recorded_shares"])
        + f" (max {error['share_error_pp']:.1f} pp)",
        "",
        f"{'what-if':<24} {'training s':>10} {'vs replay':>9} {'syncs':>6}  shares",
    ]
    base = _span(rows[0][1]) if rows else 0.0
    for what, trace in rows:
        span = _span(trace)
        total = sum(trace.samples)
        shares = " · ".join(f"{100 * s / total:.0f}%" for s in trace.samples) if total else "-"
        ratio = f"{span / base:8.2f}×" if base else "-"
        lines.append(f"{what.name:<24} {span:10.2f} {ratio:>9} {trace.cycles:>6}  {shares}")
    if goodput is not None:
        g = goodput
        lines += [
            "",
            (
                f"at {g['failures_per_hour']:g} rank failure(s) per hour (back after "
                f"{g['restart_s']:g} s): flodl goodput {100 * g['flodl_goodput']:.1f} % "
                f"(a failure costs {g['flodl_failure_cost_s']:.1f} s); a whole-job restart "
                f"from the last checkpoint: {100 * g['job_restart_goodput']:.1f} % "
                f"({g['job_restart_cost_s']:.1f} s each)"
            ),
        ]
    if run.advice:
        drops = {w.drop[0]: _span(t) for w, t in rows if len(w.drop) == 1 and not w.add_ms}
        async_s = next((_span(t) for w, t in rows if _barrier_free(w) and w.name == w.mode), None)
        lines += ["", "advice (the last contribution record; the replay without the rank):"]
        for f in run.advice:
            r = int(f.get("rank", -1))
            without = drops.get(r)
            quant = ""
            if without and base:
                quant = f"; without it {without:.2f} s ({without / base:.2f}×)"
            if f.get("advice") == MOVE_TO_ASYNC and async_s and base:
                quant += f"; in cpu_async {async_s:.2f} s ({async_s / base:.2f}×)"
            lines.append(f"  rank {r}: {f.get('advice')} — {f.get('reason')}{quant}")
    return "\n".join(lines)
