"""The hung-step rule (docs/design.md §2b, "A hung training step"), on a fake clock with the
production constants: a step is hung past ``STEP_HANG_FACTOR ×`` the longest step the rank
finished, clamped to the run's floor and ceiling, and past the ceiling before any finished."""

from __future__ import annotations

import pytest

from flodl.rank.step_clock import STEP_HANG_FACTOR, StepClock
from flodl.timeouts import Timeouts

T = Timeouts()  # hb 30 s: floor 60 s, ceiling 270 s
FLOOR, CEILING = T.step_hang_floor_s, T.step_hang_ceiling_s


def clock_after(*steps_s: float) -> tuple[StepClock, float]:
    """A clock that ran steps of these lengths back to back; the time after the last."""
    c = StepClock(FLOOR, CEILING)
    now = 1000.0
    for length in steps_s:
        c.started(now)
        now += length
        c.ended(now)
    return c, now


def test_the_factor_is_twenty() -> None:
    assert STEP_HANG_FACTOR == 20.0


def test_before_any_step_finished_the_limit_is_the_ceiling() -> None:
    c, now = clock_after()
    assert c.limit_s() == CEILING
    c.started(now)  # the first step: it may compile and autotune
    assert c.overdue(now + CEILING) is None
    hung = c.overdue(now + CEILING + 0.5)
    assert hung is not None
    assert (hung.step, hung.started_at, hung.limit_s, hung.longest_s, hung.basis) == (
        1,
        now,
        CEILING,
        0.0,
        "ceiling",
    )
    assert hung.elapsed_s == pytest.approx(CEILING + 0.5)
    assert "no step finished yet" in hung.describe()


def test_short_steps_get_the_floor() -> None:
    c, now = clock_after(0.03, 0.05, 0.04)
    assert c.longest_s == pytest.approx(0.05)
    assert c.limit_s() == FLOOR  # 20 x 0.05 s = 1 s, under the floor
    c.started(now)
    assert c.overdue(now + FLOOR) is None
    hung = c.overdue(now + FLOOR + 0.001)
    assert hung is not None and hung.step == 4 and hung.basis == "floor"
    assert "the floor, 2 x the heartbeat timeout; its longest step took 0.05 s" in (hung.describe())


def test_the_limit_is_twenty_times_the_longest_step_between_floor_and_ceiling() -> None:
    c, now = clock_after(4.0, 6.0, 5.0)
    assert c.limit_s() == pytest.approx(120.0)  # 20 x 6 s
    c.started(now)
    hung = c.overdue(now + 121.0)
    assert hung is not None and hung.basis == "factor"
    assert "over its limit of 120.0 s (20 x its longest step, 6 s)" in hung.describe()
    c, now = clock_after(1.0, 30.0)
    assert c.limit_s() == CEILING  # 20 x 30 s = 600 s, over the ceiling
    c.started(now)
    hung = c.overdue(now + CEILING + 1.0)
    assert (
        hung is not None
        and hung.basis == "ceiling"
        and "its longest step took 30 s" in (hung.describe())
    )


def test_a_long_first_step_raises_the_limit_for_the_run() -> None:
    # a compiled model's first step (60 s) keeps every later step's limit at the ceiling
    c, _ = clock_after(60.0, 0.02, 0.02)
    assert c.limit_s() == CEILING


def test_no_step_running_is_never_hung() -> None:
    c, now = clock_after(0.1)
    assert not c.running
    assert c.overdue(now + 10 * CEILING) is None  # (waiting for others, a callback, the reduce)
    c.ended(now + 5.0)  # an end without a start changes nothing
    assert c.longest_s == pytest.approx(0.1)


def test_a_step_that_ends_in_time_is_not_hung_and_joins_the_record() -> None:
    c, now = clock_after(0.1)
    c.started(now)
    assert c.running and c.step == 2
    c.ended(now + FLOOR - 1.0)
    assert not c.running and c.overdue(now + 10 * CEILING) is None
    assert c.longest_s == pytest.approx(FLOOR - 1.0)
    assert c.limit_s() == CEILING  # 20 x 59 s


def test_a_step_started_over_an_unfinished_one_is_timed_from_its_own_start() -> None:
    c, now = clock_after(0.1)
    c.started(now)
    c.started(now + 50.0)  # (the previous step's end was not seen: its length is unknown)
    assert c.longest_s == pytest.approx(0.1)
    assert c.overdue(now + 50.0 + FLOOR) is None
    hung = c.overdue(now + 50.0 + FLOOR + 1.0)
    assert hung is not None and hung.step == 3 and hung.started_at == now + 50.0


@pytest.mark.parametrize(
    ("floor", "ceiling"), [(0.0, 1.0), (2.0, 1.0), (-1.0, 5.0), (1.0, float("inf"))]
)
def test_bad_limits_are_refused(floor: float, ceiling: float) -> None:
    with pytest.raises(ValueError, match="step hang limits"):
        StepClock(floor, ceiling)
