"""How Cadence's progressive dispatch fills a window: the calibration fill and the final window.

The pure coordinator on a fake clock with the production constants (anchor 10), driven by the
fake ranks of ``test_machine`` with hand-chosen interleavings, so a fast rank finishes its chunk
while a slow one still trains (docs/design.md §5).
"""

from __future__ import annotations

from typing import Any

import pytest
from test_machine import BS, Cluster, joined, plan, sends

from flodl.coord.effects import Record, RunOver
from flodl.wire.frames import RequestParams, StartEpoch, SyncNow

CADENCE = ["cpu_cadence", "nccl_cadence"]


def triggered(effects: list[Any]) -> bool:
    """An averaging cycle started (CPU: params are requested; NCCL: sync_now); cycle 0, the
    initial broadcast, is none."""
    asked = sends(effects, RequestParams) + sends(effects, SyncNow)
    return any(frame.cycle > 0 for _, frame in asked)


def windows(c: Cluster) -> list[list[int]]:
    """Each finalized cycle's steps per rank, from the coordinator's ``window`` records."""
    return [e.data["steps"] for e in c.trace if isinstance(e, Record) and e.kind == "window"]


def play(c: Cluster, pace: list[int]) -> None:
    """Run to the end, rank ``r`` acting ``pace[r]`` times per round (a faster rank)."""
    for _ in range(50_000):
        moved = False
        for r, times in enumerate(pace):
            for _ in range(times):
                moved = c.act(r) or moved
        if not moved:
            break
    assert c.trace[-1] == RunOver(ok=True, reason="run complete", save_reason=None)


def act_until(c: Cluster, rank: int, done: Any) -> None:
    """Only ``rank`` acts (a frame or a batch at a time) until ``done()``."""
    while not done():
        assert c.act(rank), f"rank {rank} has nothing left to do"


@pytest.mark.parametrize("mode", CADENCE)
def test_a_fast_rank_fills_the_calibration_window_one_batch_at_a_time(mode: str) -> None:
    c = joined(mode, dataset_len=200 * BS)  # rank 0: batches [0, 10), rank 1: [10, 20)
    # rank 0 ends its chunk while rank 1 has not trained yet: it is handed one batch at a
    # time (it could not reach step 13 otherwise), not left idle until rank 1 is done
    act_until(c, 0, lambda: c.step[0] == 13)
    assert not triggered(c.trace)
    mark = len(c.trace)
    act_until(c, 1, lambda: c.step[1] == 10)
    # rank 1 ended its chunk while rank 0 holds its 4th extra batch: nobody is left on a
    # first chunk, so rank 1 gets none, and the window waits for rank 0's batch
    assert sends(c.trace[mark:], StartEpoch) == []
    assert not triggered(c.trace)
    act_until(c, 0, lambda: c.step[0] == 14)
    assert triggered(c.trace)
    assert [f.plan for r, f in sends(c.trace, StartEpoch) if r == 0] == [
        plan(0, 10 * BS),
        *(plan(b * BS, BS) for b in (20, 21, 22, 23)),
    ]
    play(c, [1, 1])
    assert windows(c)[0] == [14, 10]
    coverage = c.coord.coverage(0)
    assert coverage is not None and coverage.ok and coverage.committed == 200


@pytest.mark.parametrize("mode", CADENCE)
def test_a_measured_cohort_is_never_filled(mode: str) -> None:
    """Once ElChe measured the ranks their counts are proportional: a rank that ends its chunk
    early waits for the cycle (the fill is for the one window with equal counts)."""
    c = joined(mode, dataset_len=400 * BS)
    c.batch_ms = [10.0, 40.0]
    c.run(until=lambda: len(windows(c)) == 1)
    counts = c.coord.elche.batch_counts
    assert counts == [40, 10]
    c.run(until=lambda: c.step[0] > 30 and not c.work[0][0][1])  # rank 0 ends its 2nd chunk
    trained0 = c.step[0]
    c.run(until=lambda: c.step[1] >= 20 or c.step[0] > trained0)
    assert c.step[0] == trained0  # rank 0 trained nothing more while rank 1 finished


@pytest.mark.parametrize("mode", CADENCE)
def test_the_fill_leaves_the_pool_what_the_closing_windows_need(mode: str) -> None:
    """46 batches: after the two first chunks 26 are left, and the fill stops at Σ counts +
    world size = 22, the final-window band."""
    c = joined(mode, dataset_len=46 * BS)
    play(c, [8, 1])
    first = windows(c)[0]
    assert first == [14, 10]
    assert sum(sum(w) for w in windows(c)) == 46


@pytest.mark.parametrize("mode", ["cpu_sync", "nccl_sync"])
def test_sync_partitions_are_not_filled(mode: str) -> None:
    """Sync hands each rank its whole-epoch partition once (no window to fill)."""
    c = joined(mode, dataset_len=200 * BS)
    play(c, [4, 1])
    assert [(r, f.plan.partition_size) for r, f in sends(c.trace, StartEpoch)] == [
        (0, 100 * BS),
        (1, 100 * BS),
    ]


@pytest.mark.parametrize("mode", CADENCE)
def test_a_window_that_starts_before_the_final_band_gives_every_rank_its_count(mode: str) -> None:
    """The final-window decision is taken once per window, on the pool the window's first
    chunk found: the slow rank that asks after the fast one took its 40 batches still gets its
    10 (not a slot of a final plan computed from the 21 left), and the epoch ends on one
    proportional window."""
    c = joined(mode, dataset_len=400 * BS)
    c.batch_ms = [10.0, 40.0]
    play(c, [4, 1])
    steps = windows(c)
    assert steps[0][1] == 10 and steps[0][0] > 10  # the calibration fill
    assert steps[1:-1] == [[40, 10]] * (len(steps) - 2)
    rest = 400 - sum(sum(w) for w in steps[:-1])
    assert 0 < rest < 52 and steps[-1] == [rest - round(rest / 5), round(rest / 5)]
