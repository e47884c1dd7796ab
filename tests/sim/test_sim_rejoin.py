"""A rank declared dead comes back as a new incarnation: the production coordinator and rank
protocol on the simulator's clock, invariants checked after every step (docs/design.md §2,
"Rejoin")."""

from __future__ import annotations

import random

import pytest

from flodl.config import MODES
from flodl.sim import Failure, SimCluster

BS = 32


def sim(mode: str, speeds: list[float], failures: list[Failure], **kw: object) -> SimCluster:
    args: dict[str, object] = {"dataset_len": 25_600, "batch_size": BS, "epochs": 3, "seed": 4}
    args.update(kw)
    return SimCluster(len(speeds), mode, speeds, failures=failures, **args)  # type: ignore[arg-type]


@pytest.mark.parametrize("mode", MODES)
def test_a_killed_rank_that_rejoins_trains_again_and_no_sample_is_lost(mode: str) -> None:
    s = sim(
        mode,
        [10.0, 10.0, 20.0],
        [Failure(2, 1.0, "kill"), Failure(2, 4.0, "rejoin")],
    )
    tr = s.run()
    assert tr.ok, tr.reason
    assert tr.coverage_ok == [True, True, True]
    assert [r for _, r, _ in tr.deaths] == [2]
    assert [(r, k) for _, r, k in tr.rejoins] == [(2, 1)]
    assert s.coord.membership.incarnations == [0, 0, 1]
    assert not s.coord.membership.awaiting
    # the new incarnation trained (its samples continue the old one's count)
    assert s.ranks[2].proto.step > 0
    # every batch of every epoch trained at least once; the dead rank's uncommitted work was
    # redone, so a few batches more than three epochs
    assert sum(tr.samples) >= 3 * 800 * BS


@pytest.mark.parametrize("mode", ["cpu_cadence", "cpu_async", "nccl_cadence"])
def test_a_rejoined_rank_is_recalibrated_to_a_count_proportional_to_its_speed(mode: str) -> None:
    # rank 2 was the slow one (30 ms a batch); it comes back on a machine 3x faster
    s = SimCluster(
        3, mode, [10.0, 10.0, 30.0], dataset_len=64_000, batch_size=BS, epochs=2, seed=1,
        failures=[Failure(2, 2.0, "kill"), Failure(2, 5.0, "rejoin", ms_per_batch=10.0)],
    )  # fmt: skip
    tr = s.run()
    assert tr.ok, tr.reason
    assert tr.coverage_ok == [True, True]
    before = next(c for c in tr.batch_counts if c[2] > 0 and c[0] >= 2 * c[2])
    assert before[0] / before[2] >= 2.5, before  # 3:1 while it was slow
    counts = tr.batch_counts[-1]
    assert abs(counts[2] / counts[0] - 1.0) <= 0.1, counts  # as fast as the others now


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("seed", range(6))
def test_random_kill_and_rejoin_schedules_keep_exact_coverage(mode: str, seed: int) -> None:
    rng = random.Random(seed)
    failures: list[Failure] = []
    t = 0.3
    for _ in range(rng.randint(1, 3)):
        rank = rng.randrange(3)
        t += rng.uniform(0.2, 1.5)
        failures.append(Failure(rank, t, "kill"))
        t += rng.uniform(1.2, 3.0)
        failures.append(Failure(rank, t, "rejoin"))
    tr = sim(mode, [10.0, 14.0, 25.0], failures, seed=seed).run()
    assert tr.ok, tr.reason
    assert tr.coverage_ok == [True, True, True]
    assert len(tr.rejoins) == len(tr.deaths)


@pytest.mark.parametrize("mode", MODES)
def test_a_pinned_callback_rank_lends_epoch_fn_while_dead_and_takes_it_back(mode: str) -> None:
    # EpochCallbackPolicy.Rank(2); rank 1 is the fastest survivor, rank 0 the lowest. Rank 2
    # is away 10 s, long enough for an epoch to end without it in every mode.
    s = sim(
        mode,
        [20.0, 5.0, 10.0],
        [Failure(2, 3.0, "kill"), Failure(2, 13.0, "rejoin")],
        epochs=6, epoch_fn_ms=1.0, epoch_callback_policy=2,
    )  # fmt: skip
    tr = s.run()
    assert tr.ok, tr.reason
    [(died, _, _)] = tr.deaths
    moved = [(t, d) for t, c, d in tr.alerts if c == "callback_roles_moved"]
    assert len(moved) == 2 and moved[0][1].startswith("pinned rank 2 died")
    back_at, back = moved[1]
    assert back == "pinned rank 2 holds the consensus again: callback roles back on it"
    assert [e for _, e, _ in tr.epoch_fns] == list(range(6))  # one per epoch, none lost
    before = [r for t, _, r in tr.epoch_fns if t < died]
    during = [r for t, _, r in tr.epoch_fns if died < t < back_at]
    after = [r for t, _, r in tr.epoch_fns if t > back_at]
    assert set(before) <= {2}  # the pinned rank while it lives
    assert during and len(set(during)) == 1 and 2 not in during  # one survivor holds them
    if "sync" not in mode:  # (in simulated Sync runs only rank 0 has a speed reading)
        assert set(during) == {1}  # the fastest survivor, not the lowest (rank 0)
    assert after and set(after) == {2}  # back on the pinned rank once it has the consensus
