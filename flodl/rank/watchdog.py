"""The rank's step watchdog: a thread that ends the rank when its training step hangs.

The rule is :class:`~flodl.rank.step_clock.StepClock`'s (pure); this is its shell
(docs/design.md §2b, "A hung training step"). The training thread marks each step's start and
end on the clock; a daemon thread looks at it every :data:`POLL_S` (or a quarter of the floor,
if less). When a step is over its limit, the thread logs the training thread's stack at
CRITICAL, hands the report to ``on_hung`` (the rank loop writes its death record there) and
ends the process with ``os._exit(HUNG_STEP_EXIT_CODE)``: the training thread cannot be
interrupted, and a process that exits closes its connections, so the coordinator (or the
launcher that started it) declares the rank dead at once and the run goes on without it — its
uncommitted batches return to the others, and a launcher with a respawn budget starts it again.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Final

from flodl.rank.step_clock import HungStep, StepClock

__all__ = ["HUNG_STEP_EXIT_CODE", "POLL_S", "StepWatchdog"]

logger = logging.getLogger(__name__)

HUNG_STEP_EXIT_CODE: Final = 4
"""The exit status of a rank whose training step hung (3 is the bridge's hard exit)."""
POLL_S: Final = 1.0
"""How often the watchdog looks at the clock (at most: a quarter of the floor if less)."""


class StepWatchdog:
    """Watch ``clock`` from a daemon thread; end the process when its step hangs.

    Args:
        clock: the rank's step clock (the training thread marks it; this thread reads it).
        floor_s: the clock's floor (the poll period is at most a quarter of it).
        on_hung: called with the report and the training thread's formatted stack before the
            exit (a failure in it is logged; the exit happens anyway).
        exit: ends the process (``os._exit``; a test passes its own).
        now: the clock's time source (``time.perf_counter``, as the rank loop's marks).
    """

    def __init__(
        self,
        clock: StepClock,
        floor_s: float,
        on_hung: Callable[[HungStep, str], None],
        *,
        exit: Callable[[int], object] = os._exit,
        now: Callable[[], float] = time.perf_counter,
    ) -> None:
        self._clock = clock
        self._poll_s = min(POLL_S, floor_s / 4.0)
        self._on_hung = on_hung
        self._exit = exit
        self._now = now
        self._trainer = threading.get_ident()  # (built on the training thread)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="flodl-step-watchdog", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop watching (the run ended); returns once the thread is gone, unless called from
        it."""
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self._poll_s):
            hung = self._look()
            if hung is not None:
                self._fire(hung)
                return

    def _look(self) -> HungStep | None:
        """The running step if it is over its limit, seen so twice: a step that ended between
        the looks (and the next one, started) is not the one that was (the training thread
        marks the clock without a lock)."""
        clock, now = self._clock, self._now
        hung = clock.overdue(now())
        if hung is None:
            return None
        again = clock.overdue(now())
        if again is None or again.started_at != hung.started_at or self._stop.is_set():
            return None
        return again

    def _fire(self, hung: HungStep) -> None:
        frame = sys._current_frames().get(self._trainer)
        stack = "".join(traceback.format_stack(frame)) if frame is not None else "(no stack)\n"
        logger.critical(
            "%s; the rank leaves the run (exit %d) so the others go on. Its training thread "
            "was at:\n%s",
            hung.describe(),
            HUNG_STEP_EXIT_CODE,
            stack.rstrip("\n"),
        )
        try:
            self._on_hung(hung, stack)
        except Exception:
            logger.exception("step watchdog: on_hung failed")
        finally:
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except Exception:  # (a closed stream: nothing left to flush)
                    logger.debug("flush before the exit failed", exc_info=True)
            self._exit(HUNG_STEP_EXIT_CODE)
