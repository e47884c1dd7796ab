"""Ranks that join a running run (``min_world_size`` below the world size): the production
coordinator and rank protocol on the simulator's clock, invariants checked after every step
(docs/design.md §2, "Late joins")."""

from __future__ import annotations

import pytest

from flodl.config import MODES
from flodl.sim import Failure, SimCluster

BS = 32


@pytest.mark.parametrize("mode", MODES)
def test_a_third_rank_joining_mid_epoch_gets_a_share_and_no_sample_is_lost(mode: str) -> None:
    s = SimCluster(
        3, mode, [10.0, 10.0, 10.0], dataset_len=25_600, batch_size=BS, epochs=3, seed=2,
        min_world_size=2, join_at=[0.0, 0.0, 1.5],
    )  # fmt: skip
    tr = s.run()
    assert tr.ok, tr.reason
    assert tr.coverage_ok == [True, True, True]
    assert tr.deaths == [] and [(r, k) for _, r, k in tr.rejoins] == [(2, 1)]
    assert "2 of 3 ranks joined (the minimum world size)" in s.coord.phase_log[1][1]
    # the late rank trained; the first two trained before it came, so they trained more
    assert 0 < tr.samples[2] < min(tr.samples[:2])
    # every batch of every epoch exactly once (no death, so no redone work)
    assert sum(tr.samples) == 3 * 800 * BS
    last = tr.epochs[-1].per_rank_samples
    assert all(n > 0 for n in last), last  # the last epoch is shared by the three
    # it came during epoch 0 and trained a share of it: chunks from the pool, or, with
    # whole-epoch partitions (Sync), what the others gave back of theirs
    first = tr.epochs[0].per_rank_samples
    assert first[2] >= 0.4 * min(first[:2]), first


@pytest.mark.parametrize("mode", ["cpu_cadence", "nccl_cadence", "cpu_async"])
def test_a_late_rank_is_calibrated_to_a_count_proportional_to_its_speed(mode: str) -> None:
    s = SimCluster(
        3, mode, [10.0, 10.0, 5.0], dataset_len=64_000, batch_size=BS, epochs=2, seed=1,
        min_world_size=2, join_at=[0.0, 0.0, 3.0],
    )  # fmt: skip
    tr = s.run()
    assert tr.ok, tr.reason
    assert tr.coverage_ok == [True, True]
    counts = tr.batch_counts[-1]
    assert abs(counts[2] / counts[0] - 2.0) <= 0.2, counts  # twice as fast: twice the count


@pytest.mark.parametrize("mode", ["cpu_cadence", "nccl_sync"])
def test_a_run_at_its_minimum_world_size_completes_when_the_others_never_come(mode: str) -> None:
    s = SimCluster(
        4, mode, [10.0, 10.0, 10.0, 10.0], dataset_len=6400, batch_size=BS, epochs=2, seed=3,
        min_world_size=2, join_at=[0.0, 0.0, 1e6, 1e6],
    )  # fmt: skip
    tr = s.run()
    assert tr.ok, tr.reason
    assert tr.coverage_ok == [True, True]
    assert tr.samples[2:] == [0, 0] and sum(tr.samples) == 2 * 200 * BS


@pytest.mark.parametrize("mode", MODES)
def test_a_rank_killed_before_it_joins_never_says_hello_and_its_respawn_joins(mode: str) -> None:
    # Its process dies before its hello (the launcher's exit report of a rank that never joined
    # is no death); the launcher's respawn is the one that joins, once.
    s = SimCluster(
        3, mode, [10.0, 10.0, 10.0], dataset_len=25_600, batch_size=BS, epochs=3, seed=2,
        min_world_size=2, join_at=[0.0, 0.0, 1.5],
        failures=[Failure(2, 1.0, "kill"), Failure(2, 2.5, "rejoin")],
    )  # fmt: skip
    tr = s.run()
    assert tr.ok, tr.reason
    assert tr.coverage_ok == [True, True, True]
    assert tr.deaths == [] and tr.rejoin_refusals == []
    [(at, rank, _)] = tr.rejoins
    assert rank == 2 and 2.5 <= at < 2.51
    assert tr.samples[2] > 0
    assert sum(tr.samples) == 3 * 800 * BS  # no death, so nothing redone
