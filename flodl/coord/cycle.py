"""Averaging cycles: the count gate, the Idle/Pending cycle, collective sessions, throttles.

Pure module. Rules (docs/design.md §2):

* **Count gate** (:func:`should_average`): a reduce fires when every *live* rank hit its count
  (Sync: ≥ 1 step since the last reduce; Cadence/Async: ``batch_counts[r]``) or is quiesced
  (holds no work), and at least one rank moved. Never a wall-clock trigger.
* **Cycle** (:class:`Cycle`): Idle → Pending at the trigger; Pending → finalize when every live
  expected rank acked (dead ranks count as acked) and, on the CPU backend, the reduce server
  reported the round done. The machine flips back to Idle even if finalizing fails, so a round
  is never folded twice. No deadline for slow cycles — only the hard stall ceiling
  ``max(10 × heartbeat timeout, 300 s)``.
* **Sessions** (:class:`Sessions`): the collective group is re-formed after every death with a
  new session id and survivors renumbered by ascending global rank.
* **Throttle** (:func:`ranks_to_throttle`): CPU only, with ``max_batch_diff = M`` a rank more
  than M steps ahead of the slowest gets one ``throttle``.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final

from flodl.coord.metrics import WindowStats

__all__ = [
    "should_average",
    "CyclePhase",
    "Cycle",
    "RankWindow",
    "Sessions",
    "ranks_to_throttle",
]


def should_average(
    *,
    one_step: bool,
    alive: Sequence[int],
    window_steps: Sequence[int],
    counts: Sequence[int],
    quiesced: Sequence[bool],
    chunked: bool = False,
) -> bool:
    """The count gate. ``one_step``: a fixed one-step window (Sync) instead of the counts;
    ``window_steps[r]`` are the steps since the last reduce trigger;
    ``quiesced[r]`` means the rank holds no untrained work. With ``chunked`` (progressive
    Cadence: one chunk is one window, and a final-window slot may exceed the count) a rank hit
    its window exactly when its chunk is done, i.e. when it is quiesced."""
    if not alive:
        return False
    moved = False
    for r in alive:
        steps = window_steps[r]
        moved = moved or steps > 0
        if chunked:
            hit = False
        elif one_step:
            hit = steps >= 1
        else:
            hit = steps >= counts[r]
        if not (hit or quiesced[r]):
            return False
    return moved


class CyclePhase(enum.Enum):
    IDLE = "idle"
    PENDING = "pending"


_PENDING: Final = CyclePhase.PENDING
"""(Read per frame: a module global, not the enum class's attribute, which costs 7× more on
Python 3.11; see :mod:`flodl.coord.liveness`.)"""


@dataclass(slots=True)
class Cycle:
    """One averaging cycle at a time (both backends).

    Attributes:
        number: id of the current or last cycle (increasing; 0 is the initial broadcast).
        expected: live ranks that must ack the pending cycle.
        waiting: the expected ranks that have not acked yet.
        acked: ranks that acked it (and their step snapshot).
    """

    needs_reduce_done: bool
    number: int = 0
    phase: CyclePhase = CyclePhase.IDLE
    pending_since_at: float = 0.0
    expected: set[int] = field(default_factory=set)
    acked: dict[int, int] = field(default_factory=dict)
    waiting: set[int] = field(default_factory=set)
    reduce_done: bool = False
    contributors: tuple[int, ...] | None = None
    weight_total: float | None = None

    def begin(self, ranks: Sequence[int], now: float) -> int:
        """Idle → Pending; returns the new cycle number."""
        assert self.phase is CyclePhase.IDLE, "a cycle is already pending"
        self.number += 1
        self.phase = CyclePhase.PENDING
        self.pending_since_at = now
        self.expected = set(ranks)
        self.waiting = set(ranks)
        self.acked = {}
        self.reduce_done = False
        self.contributors = None
        self.weight_total = None
        return self.number

    @property
    def pending(self) -> bool:
        return self.phase is _PENDING

    def ack(self, rank: int, step: int) -> bool:
        """Record an ack; False when it is not expected (stale cycle or unknown rank)."""
        if not self.pending or rank not in self.expected:
            return False
        self.acked[rank] = step
        self.waiting.discard(rank)
        return True

    def drop(self, rank: int) -> None:
        """A dead rank counts as acked: never wait for it."""
        self.expected.discard(rank)
        self.waiting.discard(rank)

    def mark_reduce_done(self, contributors: tuple[int, ...], weight_total: float) -> None:
        self.reduce_done = True
        self.contributors = contributors
        self.weight_total = weight_total

    def ready(self) -> bool:
        """Every live expected rank acked (and the CPU round is done)."""
        if not self.pending:
            return False
        if self.needs_reduce_done and not self.reduce_done and self.expected:
            return False
        return not self.waiting  # O(1): ready is asked after every ack

    def finish(self) -> None:
        """Pending → Idle (always, even when finalizing failed)."""
        self.phase = CyclePhase.IDLE

    def stall_deadline(self, ceiling_s: float) -> float | None:
        return self.pending_since_at + ceiling_s if self.pending else None


@dataclass(slots=True)
class RankWindow:
    """One rank's side of the averaging cycles.

    Attributes:
        step: the rank's latest step counter.
        window: accumulators of the window in progress (reset when the rank acks a cycle).
        closed_window: the window the rank closed with its ack, until the cycle finalizes.
        spare: the window closed a cycle before, reset and reused by the next ack (one
            allocation fewer per rank per cycle; nothing holds a closed window past its
            finalize).
        snapshot: the rank's done count per open epoch when it entered the pending cycle
            (``snapshot_ready``, overwritten by its ``sync_ack``; where ranks wait for the
            update, taken at the ack or at the rank's death inside the cycle); what finalize
            commits.
        snapshot_cycle: the cycle the snapshot belongs to.
        ack_session: the collective session the rank's ack was made under.
    """

    step: int = 0
    window: WindowStats = field(default_factory=WindowStats)
    closed_window: WindowStats | None = None
    spare: WindowStats | None = None
    snapshot: dict[int, int] | None = None
    snapshot_cycle: int = -1
    ack_session: int = 0


@dataclass(slots=True)
class Sessions:
    """Collective group membership: session 0 is the full world; each death opens a new one."""

    session: int = 0
    members: tuple[int, ...] = ()

    def reform(self, survivors: Sequence[int]) -> tuple[int, tuple[int, ...]]:
        """Open a new session among ``survivors``; returns (session, members ascending)."""
        self.session += 1
        self.members = tuple(sorted(survivors))
        return self.session, self.members

    def store_prefix(self, run_id: str) -> str:
        return f"{run_id}/s{self.session}"


def ranks_to_throttle(
    *,
    alive: Sequence[int],
    window_steps: Sequence[int],
    max_batch_diff: int | None,
    already: set[int],
) -> list[int]:
    """Ranks more than ``max_batch_diff`` steps ahead of the slowest live rank that were not
    throttled yet this window (CPU backend only; the collective paces itself)."""
    if max_batch_diff is None or len(alive) < 2:
        return []
    low = min(window_steps[r] for r in alive)
    return [r for r in alive if r not in already and window_steps[r] > low + max_batch_diff]
