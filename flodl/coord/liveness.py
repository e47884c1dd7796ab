"""Liveness: who is alive, who is stale, who exited cleanly, when the run is unrecoverable.

Pure module (time is an argument). Rules (docs/design.md §2 "Liveness"):

* every frame from a rank refreshes its ``last_seen_at``; a rank silent for
  ``heartbeat_timeout_s`` is stale and gets declared dead;
* a launcher-reported child exit, or a lost connection, is the fast path (no waiting);
* ``exiting`` is a latch: a rank that finished cleanly is never counted as a death and is
  excluded from staleness scans;
* after a death, :func:`unrecoverable_reason` decides whether the survivors may go on.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Final

from flodl.config import MaxFailure
from flodl.errors import LocalProtocolError
from flodl.wire.frames import SaveReason

__all__ = ["RankState", "Liveness", "unrecoverable_reason"]


class RankState(enum.Enum):
    JOINING = "joining"
    ALIVE = "alive"
    EXITED = "exited"
    DEAD = "dead"


# Python 3.11's EnumType defines ``__getattr__``, which sends every attribute read on an enum
# class (``RankState.ALIVE``) down the slow slot path: about 100 ns, where a module global
# costs 15. The per-frame and per-rank paths read the member through these (docs/design.md
# §2, "Coordinator cost").
_ALIVE: Final = RankState.ALIVE
_DEAD: Final = RankState.DEAD


@dataclass(slots=True)
class _Rank:
    state: RankState = RankState.JOINING
    last_seen_at: float = 0.0
    reason: str = ""


class Liveness:
    """Per-rank liveness ledger.

    Args:
        world_size: number of ranks.
        heartbeat_timeout_s: silence (seconds, monotonic) after which a rank is stale.
    """

    def __init__(self, world_size: int, heartbeat_timeout_s: float) -> None:
        self.world_size = world_size
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self._ranks = [_Rank() for _ in range(world_size)]
        self._alive_count = 0
        self._joined_count = 0
        # A lower bound of the earliest stale instant. seen() only moves instants later, so a
        # cached minimum stays a valid (early) deadline: refreshing it on every frame would make
        # each frame O(world size). stale() rescans and refreshes it.
        self._deadline_at: float | None = None
        # The live ranks, ascending, rebuilt on the next alive() after a transition: a
        # finalize asks for them several times, and a scan is O(world size) each.
        self._alive: list[int] | None = None

    # queries ---------------------------------------------------------------------------------
    def state(self, rank: int) -> RankState:
        return self._ranks[rank].state

    def is_alive(self, rank: int) -> bool:
        return self._ranks[rank].state is _ALIVE

    def alive(self) -> list[int]:
        """Ranks that joined and have neither died nor exited, ascending (a fresh list)."""
        if self._alive is None:
            self._alive = [r for r, s in enumerate(self._ranks) if s.state is _ALIVE]
        return self._alive.copy()

    def alive_mask(self) -> list[bool]:
        return [s.state is _ALIVE for s in self._ranks]

    def dead(self) -> list[int]:
        return [r for r, s in enumerate(self._ranks) if s.state is _DEAD]

    def alive_count(self) -> int:
        return self._alive_count

    def joined_count(self) -> int:
        return self._joined_count

    def last_seen_at(self, rank: int) -> float:
        return self._ranks[rank].last_seen_at

    def reason(self, rank: int) -> str:
        return self._ranks[rank].reason

    # transitions -----------------------------------------------------------------------------
    def join(self, rank: int, now: float) -> None:
        r = self._ranks[rank]
        if r.state is RankState.JOINING:
            self._joined_count += 1
        if r.state is not RankState.ALIVE:
            self._alive_count += 1
            self._alive = None
        r.state = RankState.ALIVE
        r.last_seen_at = now
        at = now + self.heartbeat_timeout_s
        if self._alive_count == 1:
            self._deadline_at = at
        elif self._deadline_at is not None:
            self._deadline_at = min(self._deadline_at, at)

    def rejoin(self, rank: int, now: float) -> None:
        """A rank joined the running run: a dead rank's new incarnation (dead → alive: its old
        connection is closed, so nothing of the old incarnation can refresh it), or a rank
        that missed the formation (joining → alive)."""
        r = self._ranks[rank]
        if r.state not in (RankState.DEAD, RankState.JOINING):
            raise LocalProtocolError(f"rejoin: rank {rank} is {r.state.value}")
        r.reason = ""
        self.join(rank, now)

    def touch(self, rank: int, now: float) -> bool:
        """A frame from ``rank`` arrived at ``now``: True if ``rank`` is in range and alive (its
        last-seen instant refreshed), False otherwise (nothing changes). One call where a frame
        would otherwise make three (range, state, seen): it runs for every frame."""
        if not 0 <= rank < self.world_size:
            return False
        r = self._ranks[rank]
        if r.state is not _ALIVE:
            return False
        if now > r.last_seen_at:  # (max() of two costs 8× this on 3.11)
            r.last_seen_at = now
        return True

    def seen(self, rank: int, now: float) -> None:
        """Any frame from ``rank`` arrived at ``now``."""
        r = self._ranks[rank]
        if r.state is _ALIVE and now > r.last_seen_at:
            r.last_seen_at = now

    def mark_exited(self, rank: int) -> bool:
        """Latch a clean exit; returns False if the rank was not alive (already dead/exited)."""
        r = self._ranks[rank]
        if r.state is not RankState.ALIVE:
            return False
        r.state = RankState.EXITED
        self._alive_count -= 1
        self._alive = None
        self._drop_deadline_if_earliest(r)
        return True

    def _drop_deadline_if_earliest(self, r: _Rank) -> None:
        """A rank left: the cached deadline is rescanned only when it was that rank's. Any
        other stays exact (a minimum over the others), and dropping it at every exit would make
        a run's W exits O(W²) scans."""
        at = r.last_seen_at + self.heartbeat_timeout_s
        if self._deadline_at is not None and at <= self._deadline_at:
            self._deadline_at = None

    def declare_dead(self, rank: int, reason: str) -> bool:
        """Returns True on the alive → dead transition (once); False if already out."""
        r = self._ranks[rank]
        if r.state in (RankState.DEAD, RankState.EXITED):
            return False
        if r.state is RankState.ALIVE:
            self._alive_count -= 1
            self._alive = None
            self._drop_deadline_if_earliest(r)
        r.state = RankState.DEAD
        r.reason = reason
        return True

    def stale(self, now: float) -> list[int]:
        """Alive ranks silent for at least the heartbeat timeout, ascending."""
        # Same expression as next_deadline(): `now - timeout` could round differently and make
        # a tick at exactly the deadline find nobody stale, re-arming the same instant forever.
        timeout = self.heartbeat_timeout_s
        if self._deadline_at is not None and now < self._deadline_at:
            return []
        stale: list[int] = []
        earliest: float | None = None
        for r, s in enumerate(self._ranks):
            if s.state is not _ALIVE:
                continue
            at = s.last_seen_at + timeout
            if now >= at:
                stale.append(r)
            if earliest is None or at < earliest:
                earliest = at
        self._deadline_at = earliest
        return stale

    def next_deadline(self) -> float | None:
        """When the earliest alive rank may go stale; None if none is alive.

        Never late: frames only move instants later, so a cached value is an early bound (a
        tick then rescans). Exact after a :meth:`stale` scan, and after the rank that set it
        dies or exits (the next call rescans); another rank's exit keeps it (O(1), not a scan)."""
        if self._alive_count == 0:
            return None
        if self._deadline_at is None:
            seen = [s.last_seen_at for s in self._ranks if s.state is _ALIVE]
            self._deadline_at = min(seen) + self.heartbeat_timeout_s
        return self._deadline_at


def unrecoverable_reason(
    *,
    world_size: int,
    dead: int,
    alive: int,
    needs_two: bool,
    max_failure: MaxFailure | None,
) -> tuple[SaveReason, str] | None:
    """Whether the survivors must stop (docs/design.md §2), with a human-readable reason.

    Order: ``max_failure`` breach, then the backend floors: with ``needs_two`` (a collective
    backend needs two survivors to have anything to average with) a lone survivor stops; the
    CPU backend stops with no rank left.
    """
    if max_failure is not None:
        limit = max_failure.limit_for(world_size)
        if dead >= limit:
            return (
                "max_failure_exceeded",
                f"{dead} of {world_size} ranks dead, max_failure allows fewer than {limit}",
            )
    if alive == 0:
        return ("all_ranks_lost", f"all {world_size} ranks lost")
    if needs_two and alive < 2 and world_size >= 2:
        return ("single_survivor", f"only {alive} rank left of {world_size} (collective needs 2)")
    return None
