"""Random fault mixes on the production coordinator and rank protocol (docs/design.md §8, "A
seventh"): every mode, 2–8 ranks of random speeds, kills, hangs, rejoins of killed ranks,
late joiners, callbacks, anchor caps, failure budgets, divergence and LR feeds, network delays
and jitter, liveness timeouts of 1 or 3 s; the simulator checks the invariants after every
step. A run either completes with exact coverage and no rank failing on its own, or stops for
a reason the rules call for: a collective mode left with one rank (``single_survivor``), no
rank left that holds the consensus (``all_ranks_lost``), or the failure budget spent
(``max_failure_exceeded``). Seeded: every case replays exactly (``scenario(seed)``)."""

from __future__ import annotations

import random
from typing import Any

import pytest

from flodl.config import MODES, MaxFailure
from flodl.sim import Failure, SimCluster


def scenario(seed: int) -> tuple[str, list[float], dict[str, Any]]:
    """The seed's mode, speeds and SimCluster arguments."""
    rng = random.Random(seed)
    mode = MODES[seed % len(MODES)]
    world = rng.randint(2, 8)
    speeds = [rng.uniform(5.0, 40.0) for _ in range(world)]
    failures: list[Failure] = []
    dead: dict[int, float] = {}  # killed, not yet rejoined: rank → when
    hung: set[int] = set()
    t = rng.uniform(0.05, 0.5)
    for _ in range(rng.randint(0, 4)):
        t += rng.uniform(0.05, 1.5)
        r = rng.randrange(world)
        if r in hung:
            continue  # (the simulator rejoins killed ranks only)
        if r in dead:
            t = max(t, dead.pop(r) + rng.uniform(1.2, 2.5))  # a heartbeat after the kill, at least
            failures.append(Failure(r, t, "rejoin", ms_per_batch=rng.choice([None, 20.0])))
        elif len(dead) + len(hung) < world - 1:
            if rng.random() < 2 / 3:
                failures.append(Failure(r, t, "kill"))
                dead[r] = t
            else:
                failures.append(Failure(r, t, "hang"))
                hung.add(r)
    kw: dict[str, Any] = {
        "dataset_len": rng.choice([3200, 6400]),
        "batch_size": 32,
        "epochs": rng.randint(1, 3),
        "seed": seed,
        "heartbeat_timeout_s": rng.choice([1.0, 3.0]),
        "failures": failures,
    }
    if rng.random() < 0.3:
        kw["epoch_fn_ms"] = rng.uniform(1.0, 300.0)
    if rng.random() < 0.3:
        late = rng.randint(1, world - 1)
        kw["min_world_size"] = world - late
        kw["join_at"] = [0.0] * (world - late) + [rng.uniform(0.1, 4.0) for _ in range(late)]
    if rng.random() < 0.2:
        kw["max_failure"] = MaxFailure(absolute=rng.randint(1, 3))
    if rng.random() < 0.25:
        amplitude = rng.choice([0.01, 0.5, 5.0])  # (a guard that stays quiet, and one that acts)
        kw["divergence"] = lambda rank, step: amplitude * ((rank * 7 + step) % 5) / 5.0
    if rng.random() < 0.2:
        kw["lr"] = lambda rank, step: 0.1 / (1.0 + step / 50.0)
    if rng.random() < 0.3:
        kw["elche"] = {"max_anchor": rng.choice([2, 5, 20])}
    if rng.random() < 0.3:
        kw["net_delay_ms"] = rng.choice([2.0, 20.0, 80.0])
    if rng.random() < 0.3:
        kw["jitter"] = rng.choice([0.2, 0.5])
    if rng.random() < 0.3:
        kw["reduce_ms"] = rng.choice([1.0, 50.0, 300.0])
    if rng.random() < 0.2:
        kw["epoch_callback_policy"] = rng.randrange(world)
    if rng.random() < 0.2:
        kw["reports_per_epoch"] = rng.randint(1, 4)
    return mode, speeds, kw


@pytest.mark.parametrize("seed", range(120))
def test_a_random_fault_mix_keeps_the_rules(seed: int) -> None:
    mode, speeds, kw = scenario(seed)
    tr = SimCluster(len(speeds), mode, speeds, **kw).run()
    assert tr.rank_failures == [], tr.rank_failures  # no rank failed without a fault
    assert all(tr.coverage_ok), tr.coverage_ok  # every epoch that closed, exactly
    if tr.ok:
        assert len(tr.coverage_ok) == kw["epochs"], tr.reason
        return
    faulted = {f.rank for f in kw["failures"] if f.kind != "rejoin"}
    assert tr.deaths and {r for _, r, _ in tr.deaths} <= faulted, (tr.reason, tr.deaths)
    if "single_survivor" in tr.reason:
        assert mode.startswith("nccl"), tr.reason  # a collective needs two
    elif "max_failure_exceeded" in tr.reason:
        budget = kw.get("max_failure")
        assert budget is not None and len(tr.deaths) >= budget.absolute, (tr.reason, tr.deaths)
    else:
        assert "all_ranks_lost" in tr.reason, tr.reason
