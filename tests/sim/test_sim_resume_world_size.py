"""A run saved at one world size resumes at another: the production coordinator and rank
protocol on the simulator's clock, invariants checked after every step (docs/design.md §6,
"Resume at another world size")."""

from __future__ import annotations

import pytest

from flodl.config import MODES
from flodl.coord.elche_state import ElCheState
from flodl.coord.resume import ResumeState
from flodl.sim import SimCluster

BS = 32
N = 12_800  # 400 batches an epoch
SAVED_SPEEDS = [10.0, 10.0, 30.0]
"""What the 3-rank run that saved had measured (ms per batch)."""
UNCOVERED = ((0, 64 * BS), (160 * BS, 96 * BS), (300 * BS, 100 * BS))
"""The interrupted epoch's uncovered ranges, (offset, size) in samples: 260 batches."""


def saved_at_three(epoch: int = 1) -> ResumeState:
    return ResumeState(
        epoch=epoch,
        global_step=400,
        sync_round=40,
        elche=ElCheState(8, 2, list(SAVED_SPEEDS), "stable", 12, trend_history=[0.01]),
        uncovered=UNCOVERED,
        world_size_at_save=3,
    )


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("mode", MODES)
def test_a_three_rank_save_resumes_at_another_world_size_training_each_uncovered_batch_once(
    mode: str, world: int
) -> None:
    speeds = [10.0, 10.0, 30.0, 5.0][:world]
    sim = SimCluster(
        world, mode, speeds, dataset_len=N, batch_size=BS, epochs=2, seed=5,
        resume=saved_at_three(),
    )  # fmt: skip
    tr = sim.run()
    assert tr.ok, tr.reason
    assert [m.epoch for m in tr.epochs] == [1]  # epoch 0 was closed by the run that saved
    assert tr.coverage_ok == [True]
    # the interrupted epoch trains its uncovered samples, all of them, each once
    assert sum(tr.samples) == sum(n for _, n in UNCOVERED)
    assert all(n > 0 for n in tr.samples), tr.samples  # every rank of the new world trained
    state = sim.coord.elche.to_state()
    assert len(state.smoothed_ms_per_batch) == world
    assert state.calibration_count > 12  # ElChe went on from what it knew


@pytest.mark.parametrize("mode", ["cpu_cadence", "nccl_cadence", "cpu_async"])
def test_a_rank_new_at_the_resume_is_measured_and_given_a_count_proportional_to_its_speed(
    mode: str,
) -> None:
    # rank 3 did not exist at the save and is 6x faster than the anchor (rank 2)
    sim = SimCluster(
        4, mode, [10.0, 10.0, 30.0, 5.0], dataset_len=64_000, batch_size=BS, epochs=2, seed=2,
        resume=ResumeState(epoch=1, elche=saved_at_three().elche, world_size_at_save=3),
    )  # fmt: skip
    tr = sim.run()
    assert tr.ok, tr.reason
    assert tr.coverage_ok == [True]
    counts = tr.batch_counts[-1]
    assert abs(counts[3] / counts[2] - 6.0) <= 0.6, counts  # within 10 % of its speed ratio
    assert abs(counts[0] / counts[2] - 3.0) <= 0.3, counts
