"""The step watchdog's thread (docs/design.md §2b, "A hung training step"): it ends the process
when the clock says the running step hung, with the training thread's stack, and never once
it is stopped. The process exit is a callable the tests pass; the clock's time is a fake."""

from __future__ import annotations

import logging
import threading

import pytest

from flodl.rank.step_clock import HungStep, StepClock
from flodl.rank.watchdog import HUNG_STEP_EXIT_CODE, POLL_S, StepWatchdog

WAIT_S = 30.0
FLOOR = 0.04  # the poll period is a quarter of it: 10 ms


class FakeTime:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def training_thread_waits_in_the_step(release: threading.Event) -> None:
    release.wait(WAIT_S)


def test_a_hung_step_ends_the_process_with_the_training_threads_stack(
    caplog: pytest.LogCaptureFixture,
) -> None:
    assert POLL_S == 1.0 and HUNG_STEP_EXIT_CODE == 4
    caplog.set_level(logging.CRITICAL, logger="flodl.rank.watchdog")
    now, clock = FakeTime(), StepClock(FLOOR, 1.0)
    reports: list[tuple[HungStep, str]] = []
    exited: list[int] = []
    fired = threading.Event()
    release = threading.Event()
    built = threading.Event()
    box: list[StepWatchdog] = []

    def on_exit(code: int) -> None:
        exited.append(code)
        fired.set()

    def trainer() -> None:  # the watchdog is built on the training thread, as the rank loop does
        box.append(
            StepWatchdog(clock, FLOOR, lambda h, s: reports.append((h, s)), exit=on_exit, now=now)
        )
        built.set()
        clock.started(now())
        training_thread_waits_in_the_step(release)

    t = threading.Thread(target=trainer)
    t.start()
    try:
        assert built.wait(WAIT_S)
        box[0].start()
        now.t = 1.5  # over the ceiling (1 s: no step finished yet)
        assert fired.wait(WAIT_S)
    finally:
        release.set()
        t.join(WAIT_S)
    assert exited == [HUNG_STEP_EXIT_CODE]
    [(hung, stack)] = reports
    assert hung.step == 1 and hung.limit_s == 1.0 and hung.elapsed_s == pytest.approx(1.5)
    assert "training_thread_waits_in_the_step" in stack  # the training thread's, not its own
    assert "training step 1 hung" in caplog.text and "training_thread_waits_in_the_step" in (
        caplog.text
    )


def test_a_failing_on_hung_still_ends_the_process() -> None:
    now, clock = FakeTime(), StepClock(FLOOR, 1.0)
    exited: list[int] = []
    fired = threading.Event()

    def on_hung(h: HungStep, s: str) -> None:
        raise OSError("the death record's directory is gone")

    def on_exit(code: int) -> None:
        exited.append(code)
        fired.set()

    dog = StepWatchdog(clock, FLOOR, on_hung, exit=on_exit, now=now)
    clock.started(0.0)
    now.t = 2.0
    dog.start()
    assert fired.wait(WAIT_S)
    assert exited == [HUNG_STEP_EXIT_CODE]


def test_a_stopped_watchdog_never_fires_and_its_thread_ends() -> None:
    now, clock = FakeTime(), StepClock(FLOOR, 1.0)
    exited: list[int] = []
    dog = StepWatchdog(clock, FLOOR, lambda h, s: None, exit=exited.append, now=now)
    dog.start()
    dog.stop()
    assert not dog._thread.is_alive()
    clock.started(0.0)
    now.t = 100.0
    assert exited == []


def test_a_step_that_ended_between_the_two_looks_is_not_reported() -> None:
    now, clock = FakeTime(), StepClock(FLOOR, 1.0)
    switch = {"at": 0, "looks": 0}

    def time_source() -> float:
        switch["looks"] += 1
        if switch["looks"] == switch["at"]:  # the step ends and the next starts, right then
            clock.ended(5.0)
            clock.started(5.0)
        return now.t

    dog = StepWatchdog(clock, FLOOR, lambda h, s: None, exit=lambda code: None, now=time_source)
    clock.started(0.0)
    now.t = 5.0
    switch["at"] = 2  # between the first look (over the limit) and the second
    assert dog._look() is None
    clock.started(0.0)
    switch["at"] = 0
    hung = dog._look()  # (two looks at one step over its limit)
    assert hung is not None and hung.started_at == 0.0 and hung.step == 3
    dog._stop.set()
    assert dog._look() is None  # (stopped: the run ended while it looked)
