"""Seeded simulations of the real coordinator; invariants are checked after every step."""

from __future__ import annotations

import random

import pytest

from flodl.config import MODES, MaxFailure
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
    base = SimCluster(3, "cpu_cadence", [10.0] * 3, dataset_len=32_000, epochs=4, seed=1).run()
    sim = SimCluster(
        3, "cpu_cadence", [10.0] * 3, dataset_len=32_000, epochs=4, seed=1, epoch_fn_ms=2000.0
    )
    tr = sim.run()
    assert tr.ok
    assert tr.coverage_ok == [True] * 4
    role = sim.coord.callbacks.roles.epoch_callback_role
    assert sim.coord.callbacks.roles.cost("epoch_fn", role) == 2000.0
    speeds = sim.coord.elche.smoothed_ms
    # 2 s callbacks never enter the role rank's ms/batch
    assert max(speeds) / min(speeds) < 1.05
    # 4 callbacks × 2 s = 8 s of callback time; run in the role rank's pre-shrunk final window,
    # most of it overlaps the others' compute
    assert tr.wall_s < base.wall_s + 0.5 * 8.0
