"""Contribution and advice (docs/design.md §7): induced idle, the running totals, the advice
rules, and the records the simulated coordinator writes with them."""

from __future__ import annotations

import pytest

from flodl.coord.contribution import NOTABLE_COST, Contribution, advise, induced_idle
from flodl.coord.metrics import WindowStats
from flodl.sim import SimCluster


def test_the_last_finisher_is_charged_the_wait_of_the_others() -> None:
    # rank 0 done at 1, rank 1 at 3: rank 0 waits 2, caused by rank 1
    assert induced_idle([1.0, 3.0], [2.0, 0.0]) == [0.0, 2.0]
    # two early finishers wait 2 each for rank 2
    assert induced_idle([1.0, 1.0, 3.0], [2.0, 2.0, 0.0]) == [0.0, 0.0, 4.0]


def test_an_interval_is_split_among_the_ranks_still_busy() -> None:
    # rank 0 done at 1 waits for ranks 1 (2) and 2 (4): 1 ms shared by both, then 2 ms by 2;
    # rank 1 waits 2 ms for rank 2
    got = induced_idle([1.0, 2.0, 4.0], [3.0, 2.0, 0.0])
    assert got == pytest.approx([0.0, 0.5, 0.5 + 2.0 * 2.0])
    assert sum(got) == pytest.approx(3.0 + 2.0)


def test_a_rank_that_did_not_wait_charges_nothing() -> None:
    # cpu_async: unequal windows but nobody waited
    assert induced_idle([1.0, 3.0], [0.0, 0.0]) == [0.0, 0.0]
    # half the explained wait was real: half is charged
    assert induced_idle([1.0, 3.0], [1.0, 0.0]) == [0.0, 1.0]


def test_order_of_ranks_does_not_matter() -> None:
    assert induced_idle([3.0, 1.0], [0.0, 2.0]) == [2.0, 0.0]
    assert induced_idle([5.0], [0.0]) == [0.0]
    assert induced_idle([], []) == []


@pytest.mark.parametrize(
    ("sample", "cost", "barrier", "advice"),
    [
        (0.10, 0.20, True, "evict"),
        (0.10, 0.20, False, "evict"),
        (0.25, 0.10, True, "cpu_async"),
        (0.25, 0.10, False, "keep"),  # already without a barrier
        (0.25, NOTABLE_COST / 2, True, "keep"),  # waits too small to matter
        (0.40, 0.05, True, "keep"),  # under a quarter of what it brings
    ],
)
def test_advice_rules(sample: float, cost: float, barrier: bool, advice: str) -> None:
    got, reason = advise(sample, cost, live=2, barrier=barrier)
    assert got == advice
    assert f"{100 * sample:.1f} % of the samples" in reason


def test_the_only_live_rank_is_kept() -> None:
    assert advise(1.0, 0.9, live=1, barrier=True) == ("keep", "the only live rank")


def _window(steps: int, ms: float) -> WindowStats:
    w = WindowStats()
    for _ in range(steps):
        w.add(ms, 0.0, 1.0, 32)
    return w


def test_totals_give_shares_and_the_window_record() -> None:
    c = Contribution(2, barrier=True)
    c.start(0.0)
    # a 100 ms window: rank 0 busy 30 ms, rank 1 busy 90 ms, sync 10 ms
    data = c.on_cycle(0.1, 10.0, [_window(3, 10.0), _window(3, 30.0)], [0, 1])
    assert data["span_ms"] == pytest.approx(100.0)
    assert data["idle_ms"] == pytest.approx([60.0, 0.0])
    assert data["induced_ms"] == pytest.approx([0.0, 60.0])
    assert data["ms_per_batch"] == pytest.approx([10.0, 30.0])
    assert data["steps"] == [3, 3]
    figures = c.figures([0, 1])
    assert [f["sample_share"] for f in figures] == [0.5, 0.5]
    # rank 1: 60 ms induced + 5 ms averaging over 200 ms of cluster time
    assert figures[1]["cost_share"] == pytest.approx(65 / 200)
    assert figures[1]["advice"] == "cpu_async"
    assert figures[0]["advice"] == "keep"
    assert c.figures([0])[1]["advice"] == "gone"


@pytest.mark.parametrize(
    ("mode", "samples", "slow_advice"),
    [
        ("cpu_sync", 20_000, "evict"),
        ("nccl_sync", 20_000, "evict"),
        # the slow rank's first window (the anchor's 10 batches at 60 ms) is most of a short run
        ("cpu_cadence", 4_000, "evict"),
        ("cpu_cadence", 200_000, "keep"),
        ("nccl_cadence", 200_000, "keep"),
        ("cpu_async", 200_000, "keep"),
    ],
)
def test_the_simulated_advice_agrees_with_the_run_without_the_rank(
    mode: str, samples: int, slow_advice: str
) -> None:
    """A 6× slower third rank: equal batch counts (Sync) make the fast ranks wait for it,
    ElChe's proportional counts and the barrier-free async mode do not once calibrated. The
    advice is checked against the counterfactual: the same run without the slow rank is faster
    exactly when the advice is to evict it."""
    kw = {"dataset_len": samples, "batch_size": 32, "seed": 1, "check_invariants": False}
    trace = SimCluster(3, mode, [10.0, 10.0, 60.0], **kw).run()  # type: ignore[arg-type]
    without = SimCluster(2, mode, [10.0, 10.0], **kw).run()  # type: ignore[arg-type]
    assert trace.ok and without.ok
    slow = trace.contribution[2]
    assert slow["advice"] == slow_advice, slow
    assert [f["advice"] for f in trace.contribution[:2]] == ["keep", "keep"]
    assert (without.wall_s < trace.wall_s) == (slow_advice == "evict")
    assert sum(f["samples"] for f in trace.contribution) == samples
