"""When a rank's training step has hung: the rule, on a clock the caller passes in.

Pure module (docs/design.md §2b, "A hung training step"). A rank's liveness is its bridge
thread's heartbeat, so a training thread stuck in a step (user code, a data loader, a driver
call that never returns) while the bridge runs is not a death to the coordinator: the other
ranks wait for it until the run's progress watchdog ends the run (``reduce_stall``). The rank
itself is the one process that can tell a hung step from a rank that waits for others: a step
is the span from the fetch of its batch to its report (:meth:`StepClock.started` /
:meth:`StepClock.ended`), which holds no wait on another rank, no averaging and no callback.

A step is hung once it has run longer than its limit::

    limit = clamp(STEP_HANG_FACTOR × the longest step the rank finished, floor, ceiling)

and the ceiling alone until the rank finished one (its first step can compile, autotune and
grow the allocator). The floor and the ceiling come from the run's one knob
(:class:`~flodl.timeouts.Timeouts`: ``2 · hb`` and the stall ceiling less ``hb``), so a hung
rank leaves the run before the progress watchdog would end it, and never sooner than twice the
time the coordinator gives a silent rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Final

__all__ = ["STEP_HANG_FACTOR", "HungStep", "StepClock"]

STEP_HANG_FACTOR: Final = 20.0
"""A step is hung past this many times the longest step the rank finished (within the floor
and the ceiling)."""


@dataclass(frozen=True, slots=True)
class HungStep:
    """A step over its limit: its number (the rank's 1-based step count), when it started, how
    long it has run, the limit it broke, the longest finished step (0.0 before the first) and
    what set the limit (``"floor"``, ``"ceiling"`` or ``"factor"``)."""

    step: int
    started_at: float
    elapsed_s: float
    limit_s: float
    longest_s: float
    basis: str

    def describe(self) -> str:
        """One sentence for logs and the death record."""
        longest = f"its longest step took {self.longest_s:.3g} s"
        basis = {
            "floor": f"the floor, 2 x the heartbeat timeout; {longest}",
            "ceiling": (
                f"the ceiling, the stall ceiling less the heartbeat timeout; {longest}"
                if self.longest_s > 0.0
                else "the ceiling: no step finished yet"
            ),
            "factor": f"{STEP_HANG_FACTOR:g} x its longest step, {self.longest_s:.3g} s",
        }[self.basis]
        return (
            f"training step {self.step} hung: it has run {self.elapsed_s:.1f} s, over its limit "
            f"of {self.limit_s:.1f} s ({basis})"
        )


class StepClock:
    """The steps of one rank: the one running, the longest finished, the limit.

    Args:
        floor_s: the least limit a step gets (``Timeouts.step_hang_floor_s``).
        ceiling_s: the most, and the limit before any step finished
            (``Timeouts.step_hang_ceiling_s``).

    Raises:
        ValueError: a floor or ceiling that is not positive and finite, or a floor above the
            ceiling.
    """

    __slots__ = ("_ceiling", "_floor", "_longest", "_started_at", "_step")

    def __init__(self, floor_s: float, ceiling_s: float) -> None:
        if not (0.0 < floor_s <= ceiling_s and math.isfinite(ceiling_s)):
            raise ValueError(
                f"step hang limits need 0 < floor <= ceiling, finite: got floor {floor_s!r}, "
                f"ceiling {ceiling_s!r}"
            )
        self._floor = float(floor_s)
        self._ceiling = float(ceiling_s)
        self._longest = 0.0
        self._started_at: float | None = None
        self._step = 0

    @property
    def running(self) -> bool:
        """A step started and has not ended."""
        return self._started_at is not None

    @property
    def step(self) -> int:
        """The number of the step running, or of the last one that ran (0 before any)."""
        return self._step

    @property
    def longest_s(self) -> float:
        """The longest step the rank finished (0.0 before the first)."""
        return self._longest

    def limit_s(self) -> float:
        """How long the next (or running) step may run before it counts as hung."""
        return self._limit()[0]

    def _limit(self) -> tuple[float, str]:
        """The limit and what set it."""
        if self._longest <= 0.0:
            return self._ceiling, "ceiling"
        scaled = STEP_HANG_FACTOR * self._longest
        if scaled >= self._ceiling:
            return self._ceiling, "ceiling"
        if scaled <= self._floor:
            return self._floor, "floor"
        return scaled, "factor"

    def started(self, now: float) -> None:
        """A step began (its batch is being fetched). A step left running is dropped: its end
        was not seen, so its length is not known."""
        self._step += 1
        self._started_at = now

    def ended(self, now: float) -> None:
        """The running step ended (it is being reported); its length joins the record. Nothing
        if none runs."""
        started = self._started_at
        if started is None:
            return
        self._started_at = None
        self._longest = max(self._longest, now - started)

    def overdue(self, now: float) -> HungStep | None:
        """The running step, if it has run past its limit; else None."""
        started = self._started_at
        if started is None:
            return None
        elapsed = now - started
        limit, basis = self._limit()
        if elapsed <= limit:
            return None
        return HungStep(self._step, started, elapsed, limit, self._longest, basis)
