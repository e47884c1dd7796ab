"""Seeded simulations of the real coordinator; invariants are checked after every step."""

from __future__ import annotations

import itertools
import math
import random
import re
from typing import Any

import pytest

from flodl.config import MODES, MaxFailure
from flodl.coord.guards import TREND_THRESHOLD_DEFAULT, TREND_THRESHOLD_EASGD
from flodl.sim import Failure, SimCluster, SimTrace

SMALL = {"dataset_len": 3200, "batch_size": 32, "epochs": 2}


def _run(mode: str, speeds: list[float], **kw: object) -> SimTrace:
    args = {**SMALL, **kw}
    return SimCluster(len(speeds), mode, speeds, **args).run()  # type: ignore[arg-type]


def _assert_exact_coverage(tr: SimTrace, epochs: int) -> None:
    assert len(tr.epochs) == epochs, tr.reason
    assert tr.coverage_ok == [True] * epochs
    assert [m.epoch for m in tr.epochs] == list(range(epochs))


@pytest.mark.parametrize("mode", MODES)
def test_every_mode_completes_with_exact_coverage(mode: str) -> None:
    tr = _run(mode, [10.0, 10.0, 30.0], seed=3)
    assert tr.ok, tr.reason
    _assert_exact_coverage(tr, 2)
    # every batch of every epoch was trained by someone: 2 epochs × 100 batches × 32 samples
    assert sum(tr.samples) >= 2 * 100 * 32


def test_same_seed_same_trace_different_seed_different_trace() -> None:
    a = _run("cpu_cadence", [10.0, 12.0, 30.0], seed=7)
    b = _run("cpu_cadence", [10.0, 12.0, 30.0], seed=7)
    c = _run("cpu_cadence", [10.0, 12.0, 30.0], seed=8)
    assert a.digest == b.digest
    assert a.summary() == b.summary()
    assert a.digest != c.digest


@pytest.mark.parametrize("mode", ["nccl_cadence", "cpu_cadence"])
def test_cadence_counts_converge_to_speed_ratio_and_idle_stays_low(mode: str) -> None:
    tr = _run(mode, [10.0, 10.0, 30.0], dataset_len=64_000, epochs=2, seed=1)
    assert tr.ok
    counts = tr.batch_counts[-1]
    slow = counts[2]
    for fast in counts[:2]:
        assert abs(fast / slow - 3.0) <= 0.3, counts  # within 10 % of 3:3:1
    assert max(tr.idle_fraction) < 0.10, tr.idle_fraction


def test_sync_mode_leaves_fast_ranks_idle_where_cadence_does_not() -> None:
    sync = _run("nccl_sync", [10.0, 30.0], dataset_len=16_000, seed=2)
    cadence = _run("nccl_cadence", [10.0, 30.0], dataset_len=16_000, seed=2)
    assert sync.idle_fraction[0] > 0.5
    assert cadence.idle_fraction[0] < 0.15
    assert cadence.wall_s < 0.75 * sync.wall_s


KILL_SCENARIOS = [(MODES[i % 5], i) for i in range(200)]


@pytest.mark.parametrize(("mode", "seed"), KILL_SCENARIOS)
def test_rank_killed_at_random_moment_loses_no_sample(mode: str, seed: int) -> None:
    rng = random.Random(seed)
    speeds = [10.0, rng.uniform(10.0, 20.0), rng.uniform(20.0, 40.0)]
    victim = rng.randrange(3)
    at = rng.uniform(0.0, 3.0)
    tr = _run(mode, speeds, seed=seed, failures=[Failure(victim, at, "kill")])
    if tr.deaths:
        assert [d[1] for d in tr.deaths] == [victim]
    if mode.startswith("nccl") and tr.deaths:
        # two survivors of three keep going on the collective
        assert tr.ok, tr.reason
    assert tr.ok, tr.reason
    _assert_exact_coverage(tr, 2)


@pytest.mark.parametrize("mode", MODES)
def test_hung_rank_is_evicted_after_heartbeat_timeout_and_its_work_redone(mode: str) -> None:
    tr = _run(mode, [10.0, 10.0, 20.0], seed=5, failures=[Failure(1, 0.5, "hang")])
    assert tr.ok, tr.reason
    assert len(tr.deaths) == 1
    t_dead, rank, reason = tr.deaths[0]
    assert rank == 1
    assert "heartbeat timeout" in reason
    # silent since its last heartbeat (≤ 1 s before the hang) ⇒ declared within [29, 31] s after
    assert 29.0 <= t_dead - 0.5 <= 31.0
    _assert_exact_coverage(tr, 2)


@pytest.mark.parametrize("seed", range(6))
def test_with_a_short_timeout_a_rank_that_only_heartbeats_is_not_taken_for_dead(seed: int) -> None:
    """A 1 s liveness timeout, two ranks of five hung: the others wait in the CPU round for
    them, sending nothing but heartbeats until the hung ranks are declared dead. At the
    original's 1 s cadence a heartbeat a little late read as a death (a healthy rank declared
    dead, or failing its round on the data-plane timeout) in five of these six seeds; at a
    third of the timeout (docs/design.md §2b, "Heartbeat cadence") only the hung ranks go."""
    tr = _run(
        "cpu_cadence",
        [22.9, 31.5, 29.9, 26.1, 39.0],
        dataset_len=6400,
        epochs=1,
        seed=seed,
        heartbeat_timeout_s=1.0,
        failures=[Failure(1, 0.542, "hang"), Failure(2, 1.234, "hang")],
    )
    assert tr.ok, tr.reason
    assert sorted(rank for _, rank, _ in tr.deaths) == [1, 2], tr.deaths
    assert tr.rank_failures == []
    _assert_exact_coverage(tr, 1)


@pytest.mark.parametrize("mode", MODES)
def test_max_failure_breach_broadcasts_exactly_one_shutdown_with_save(mode: str) -> None:
    tr = _run(
        mode,
        [10.0, 10.0, 10.0],
        seed=9,
        failures=[Failure(0, 0.3)],
        max_failure=MaxFailure(absolute=1),
    )
    assert not tr.ok
    assert tr.save_reason == "max_failure_exceeded"
    assert tr.shutdowns_with_save == 2  # one frame to each survivor, once


STOP_SCENARIOS = [(MODES[i % 5], i) for i in range(60)]


@pytest.mark.parametrize(("mode", "seed"), STOP_SCENARIOS)
def test_a_stop_with_save_strands_no_rank_in_an_averaging_round(mode: str, seed: int) -> None:
    """A ShutdownWithSave reaches ranks at different moments: one exits before the round it
    would have uploaded to, another is already blocked in it. The blocked one must be released
    and exit cleanly, never die of the data-plane timeout (the simulator's invariants fail on a
    rank that fails without a fault)."""
    rng = random.Random(seed)
    speeds = [10.0, rng.uniform(10.0, 30.0), rng.uniform(10.0, 30.0), rng.uniform(10.0, 30.0)]
    failures = [Failure(rng.randrange(4), rng.uniform(0.05, 1.5))]
    tr = _run(
        mode, speeds, seed=seed, failures=failures, max_failure=MaxFailure(absolute=1), epochs=4
    )
    assert tr.save_reason == "max_failure_exceeded", tr.reason
    assert tr.rank_failures == []
    assert [d[1] for d in tr.deaths] == [failures[0].rank]


def test_collective_lone_survivor_stops_with_single_survivor() -> None:
    tr = _run("nccl_cadence", [10.0, 10.0], seed=4, failures=[Failure(1, 0.2)])
    assert not tr.ok
    assert tr.save_reason == "single_survivor"
    assert tr.shutdowns_with_save == 1


def test_cpu_run_survives_down_to_one_rank() -> None:
    tr = _run(
        "cpu_cadence", [10.0, 10.0, 10.0], seed=4, failures=[Failure(1, 0.2), Failure(2, 0.4)]
    )
    assert tr.ok, tr.reason
    _assert_exact_coverage(tr, 2)


def test_all_ranks_lost_ends_the_run() -> None:
    tr = _run("cpu_cadence", [10.0, 10.0], seed=4, failures=[Failure(0, 0.2), Failure(1, 0.2)])
    assert not tr.ok
    assert tr.save_reason == "all_ranks_lost"


def test_slow_epoch_fn_is_not_mistaken_for_slow_compute_and_runs_in_slack() -> None:
    """epoch_fn runs on the role rank when an epoch's final reduce is done (on the consensus),
    i.e. at the start of the next epoch's first window: that window's count of the role rank
    shrinks by the callback's cost, so the cohort does not wait for it at the barrier."""
    kw: dict[str, Any] = {"dataset_len": 32_000, "epochs": 6, "seed": 1}
    kw["elche"] = {"anchor": 100, "min_anchor": 100}  # 1 s windows: room for a 0.5 s callback
    base = SimCluster(3, "cpu_cadence", [10.0] * 3, **kw).run()
    sim = SimCluster(3, "cpu_cadence", [10.0] * 3, epoch_fn_ms=500.0, **kw)
    tr = sim.run()
    assert tr.ok
    assert tr.coverage_ok == [True] * 6
    role = sim.coord.callbacks.roles.epoch_callback_role
    assert sim.coord.callbacks.roles.cost("epoch_fn", role) == 500.0
    speeds = sim.coord.elche.smoothed_ms
    # 0.5 s callbacks never enter the role rank's ms/batch
    assert max(speeds) / min(speeds) < 1.05
    # the role rank's first window of an epoch is shrunk by the 0.5 s (50 batches)
    assert any(c[role] <= 51 and min(c[:role] + c[role + 1 :]) >= 99 for c in tr.batch_counts)
    # 6 callbacks × 0.5 s: the first (cost not known yet) and the last (after the last epoch)
    # stall the cohort; the others cost about a third (one rank's compute spread over three)
    assert tr.wall_s - base.wall_s < 0.75 * 6 * 0.5


# The guard → coordinator path and the LR path, with the ranks' real protocol: a rank's
# measured divergence rides its sync_ack and an LR change its lr_update, as in production.
JUDGED: dict[str, Any] = {"dataset_len": 32_000, "epochs": 2, "seed": 1, "reduce_ms": 20.0}


def _judged(mode: str, **kw: Any) -> SimTrace:
    tr = SimCluster(2, mode, [10.0, 10.0], **JUDGED, **kw).run()
    assert tr.ok, tr.reason
    assert tr.coverage_ok == [True, True]
    return tr


@pytest.mark.parametrize(
    ("mode", "threshold"),
    [
        ("nccl_cadence", TREND_THRESHOLD_DEFAULT),
        ("cpu_cadence", TREND_THRESHOLD_DEFAULT),
        ("cpu_async", TREND_THRESHOLD_EASGD),  # EASGD's own threshold, 0.3
    ],
)
def test_rising_divergence_stops_the_window_growing(mode: str, threshold: float) -> None:
    """The default guard (three strict rises above the threshold) suppresses growth that the
    20 ms reduce would otherwise buy: the anchor stays where it was when the rises began."""
    free = _judged(mode)
    rising = _judged(mode, divergence=lambda cycle, rank: 1.2 * threshold * 1.2**cycle)
    assert max(free.anchors) >= 38
    assert max(rising.anchors) <= 20
    assert not [a for a in rising.alerts if a[1] == "drift"]  # the trend guard never nudges


def test_an_exploding_divergence_nudges_the_anchor_down_with_a_drift_alert() -> None:
    """MSF: λ = ln(D_t / D_t−1) / k_max above 1e-2 for three reduces halves the anchor, and
    the coordinator says so; a flat divergence leaves the growth alone."""
    msf = {"convergence_guard": "msf"}
    flat = _judged("nccl_cadence", elche=msf, divergence=lambda cycle, rank: 1e-3)
    exploding = _judged("nccl_cadence", elche=msf, divergence=lambda cycle, rank: 1e-3 * 1.5**cycle)
    assert max(flat.anchors) >= 38 and not [a for a in flat.alerts if a[1] == "drift"]
    drift = [a for a in exploding.alerts if a[1] == "drift"]
    assert drift and drift[0][2] == "guard nudged the anchor down ×0.5"
    peak = exploding.anchors.index(max(exploding.anchors))
    assert exploding.anchors[peak + 1] == exploding.anchors[peak] // 2
    assert exploding.anchors[-1] < max(exploding.anchors)


def test_an_lr_cliff_from_the_schedule_halves_the_anchor() -> None:
    """The ranks' scheduler drops the LR 10× at step 1000: the lr_update reaches the
    meta-controller, which halves the anchor once; the window then grows back."""
    steady = _judged("nccl_cadence", lr=lambda step, rank: 0.1)
    gentle = _judged("nccl_cadence", lr=lambda step, rank: 0.1 if step < 1000 else 0.08)
    cliff = _judged("nccl_cadence", lr=lambda step, rank: 0.1 if step < 1000 else 0.01)
    assert sorted(set(steady.anchors)) == steady.anchors  # grow-only without a cliff
    assert sorted(set(gentle.anchors)) == gentle.anchors  # a 20 % drop is not a cliff
    drops = [(a, b) for a, b in itertools.pairwise(cliff.anchors) if b < a]
    assert len(drops) == 1 and drops[0][0] > 20, drops  # once, from a grown window
    nudges = [a[2] for a in cliff.alerts if a[1] == "drift"]
    assert len(nudges) == 1, nudges
    found = re.fullmatch(
        r"LR meta-controller nudged the anchor down ×([0-9.]+) \(LR cliff 0\.1 → 0\.01\)", nudges[0]
    )
    assert found is not None, nudges
    # the cliff's base factor 0.5, moved by the loss trend (flodl/coord/meta.py)
    factor = float(found.group(1))
    assert 0.4 < factor < 0.6 and drops[0][1] == math.ceil(drops[0][0] * factor)
    assert not [a for a in steady.alerts + gentle.alerts if a[1] == "drift"]


@pytest.mark.parametrize("mode", MODES)
def test_reports_per_epoch_gives_every_epoch_that_many_reports_however_few_its_cycles(
    mode: str,
) -> None:
    # fast ranks on a small epoch: ElChe grows the cadence window past a quarter of an epoch
    s = SimCluster(2, mode, [1.0, 1.0], dataset_len=2048, batch_size=32, epochs=3, seed=1,
                   reports_per_epoch=4)  # fmt: skip
    tr = s.run()
    assert tr.ok, tr.reason
    per_epoch = [[p for _, e, p in tr.reports if e == epoch] for epoch in range(3)]
    assert per_epoch == [[0.25, 0.5, 0.75, 1.0]] * 3, per_epoch
    if mode in ("cpu_cadence", "nccl_cadence"):
        assert tr.cycles < 3 * 4  # fewer averaging rounds than reports: reports follow batches


CPU_MODES = [m for m in MODES if m.startswith("cpu_")]


@pytest.mark.parametrize("mode", CPU_MODES)
def test_a_cpu_reduce_slower_than_the_data_io_timeout_fails_each_rank_at_its_own_deadline(
    mode: str,
) -> None:
    # heartbeat timeout 10 s → data-plane timeout 40 s; the initial broadcast's round takes 41 s
    args: dict[str, Any] = {"seed": 5, "heartbeat_timeout_s": 10.0, "check_invariants": False}
    slow = _run(mode, [10.0, 10.0, 20.0], reduce_ms=41_000.0, **args)
    assert not slow.ok
    assert sorted(rank for _, rank, _ in slow.rank_failures) == [0, 1, 2]
    assert {why for _, _, why in slow.rank_failures} == {"reduce round 0 timed out (40 s)"}
    at = [t for t, _, _ in slow.rank_failures]
    # each rank began its round when its frames arrived (sub-ms network delays apart) and
    # fails 40 s later, at its own instant: one watch for all ranks, never batched or late
    assert at == sorted(at) and len(set(at)) == 3
    assert all(40.0 < t < 40.01 for t in at), at
    # a round just inside the timeout fails nobody
    fast = _run(mode, [10.0, 10.0, 20.0], reduce_ms=39_000.0, **args)
    assert fast.ok, fast.reason
    assert fast.rank_failures == []


def test_the_event_queue_holds_no_dead_reduce_timers() -> None:
    """A CPU reduce's timeout is one queued event for all ranks, not one per rank per cycle
    left in the queue until its 4 × heartbeat deadline (120 s of virtual time by default):
    those made the queue, and the garbage the collector traverses, grow with world × cycles."""
    sim = SimCluster(8, "cpu_cadence", [10.0] * 8, dataset_len=8 * 10 * 40, batch_size=1,
                     epochs=1, seed=1)  # fmt: skip
    tr = sim.run()
    assert tr.ok, tr.reason
    assert tr.cycles >= 30
    # (virtual time) the run ended before its first reduce's timeout was due, so a timer per
    # rank per cycle would all still be queued here: what the count below tells apart
    assert tr.wall_s < sim.timeouts.data_io_s
    assert sum(1 for event in sim._heap if event[2] == "reduce_timeout") <= 1
