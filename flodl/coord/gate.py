"""The count gate, kept incrementally: O(1) per batch instead of O(world size).

Pure module (docs/design.md §2, "Count gate"). A reduce may start when every live rank is
*satisfied* (hit its count, or quiesced: it holds no untrained work) and at least one live rank
*moved* (stepped) this window. :class:`CountGate` keeps both flags per rank and the two counts
over live ranks; the coordinator's dispatch decides each rank's flags
(:meth:`~flodl.coord.dispatch.Dispatch.refresh`) and the simulator checks the result against
:func:`~flodl.coord.cycle.should_average` recomputed from scratch after every step.
"""

from __future__ import annotations

from flodl.errors import LocalProtocolError

__all__ = ["CountGate"]


class CountGate:
    """Per-rank "satisfied" and "moved" flags and their counts over live ranks.

    Args:
        world_size: number of ranks.
    """

    __slots__ = ("_moved", "_moved_count", "_sat", "_unsat")

    def __init__(self, world_size: int) -> None:
        self._sat = [False] * world_size
        self._moved = [False] * world_size
        self._unsat = 0
        self._moved_count = 0

    def reset(self, alive_count: int) -> None:
        """Every flag cleared; every live rank counts as unsatisfied until it is set."""
        n = len(self._sat)
        self._sat = [False] * n
        self._moved = [False] * n
        self._unsat = alive_count
        self._moved_count = 0

    def load(self, alive_count: int, sat: list[bool], moved: list[bool]) -> None:
        """Every rank's flags at once (a rank not alive has both False): :meth:`reset`, then
        :meth:`set` for each live rank, without a call per rank. The lists are taken over."""
        if len(sat) != len(self._sat) or len(moved) != len(self._moved):
            raise LocalProtocolError(
                f"CountGate.load: {len(sat)}/{len(moved)} flags for {len(self._sat)} ranks"
            )
        self._sat, self._moved = sat, moved
        self._unsat = alive_count - sat.count(True)
        self._moved_count = moved.count(True)

    def set(self, rank: int, *, live: bool, sat: bool, moved: bool) -> None:
        """``rank``'s flags (a dead rank's are cleared and it leaves the counts untouched:
        :meth:`forget` took it out)."""
        if not live:
            sat = moved = False
        else:
            # (bools count as 0 and 1: int() of each would cost more than the rest of it)
            self._unsat += self._sat[rank] - sat
            self._moved_count += moved - self._moved[rank]
        self._sat[rank], self._moved[rank] = sat, moved

    def forget(self, rank: int) -> None:
        """A rank that just died or exited leaves the live counts."""
        if not self._sat[rank]:
            self._unsat -= 1
        if self._moved[rank]:
            self._moved_count -= 1
        self._sat[rank] = self._moved[rank] = False

    @property
    def unsatisfied(self) -> int:
        """Live ranks not satisfied yet."""
        return self._unsat

    def ready(self) -> bool:
        """Every live rank satisfied and at least one moved: :meth:`open` but for its live
        count, which the caller need not fetch while this is False (on every batch)."""
        return self._unsat == 0 and self._moved_count > 0

    def open(self, alive_count: int) -> bool:
        """Every live rank satisfied, at least one moved, at least one alive."""
        return alive_count > 0 and self.ready()
