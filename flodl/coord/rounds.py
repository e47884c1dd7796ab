"""The round book: which uploads each CPU averaging round waits for, and when it is complete.

Pure module (docs/design.md §2b). The reduce server (:mod:`flodl.service.reduce`, under its lock)
and the simulator (:mod:`flodl.sim.cluster`) keep the same book, so the simulator's invariants
cover the production bookkeeping:

* ``open(cycle, ranks)`` expects an upload from every rank listed that has not left; uploads
  that arrived early for ``cycle`` count, early uploads from ranks it does not expect are
  refused, and so are uploads to an earlier round that was never opened;
* an upload is refused (with the reason) when it is a second one to the round, goes to a round
  that does not expect the rank, or to a round that is no longer open;
* ``leave(rank)`` — the rank was declared dead, or exited — removes it from every open round
  (its upload, if any, is not folded in), which may complete rounds;
* a round is **complete** when every expected rank that is still in the run uploaded; its
  contributor set is frozen then: a rank that leaves after that was still folded in.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from flodl.errors import LocalProtocolError

__all__ = ["RoundBook", "Opened"]


@dataclass(slots=True)
class _Round:
    expected: set[int] | None = None  # None until opened
    uploaded: set[int] = field(default_factory=set)


@dataclass(frozen=True, slots=True)
class Opened:
    """What opening a round changed.

    Attributes:
        refused: ``(rank, reason)`` of early uploads this opening refuses (their connections
            are closed).
        complete: the contributors, sorted, when the round is already complete.
    """

    refused: tuple[tuple[int, str], ...] = ()
    complete: tuple[int, ...] | None = None


class RoundBook:
    """The open rounds of one run.

    Args:
        world_size: ranks of the run (an expected rank outside it is our own bug).
    """

    def __init__(self, world_size: int) -> None:
        if world_size < 1:
            raise LocalProtocolError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.opened = -1
        """The latest round opened."""
        self.gone: set[int] = set()
        """Ranks that left the run (dead or exited)."""
        self._rounds: dict[int, _Round] = {}

    # ------------------------------------------------------------------ queries
    def problem(self, rank: int, cycle: int) -> str | None:
        """Why an upload of ``rank`` to ``cycle`` would be refused, or None."""
        if rank in self.gone:
            return f"rank {rank} left the run"
        rnd = self._rounds.get(cycle)
        if rnd is not None and rank in rnd.uploaded:
            return f"second upload to round {cycle}"
        if rnd is not None and rnd.expected is not None:
            if rank not in rnd.expected:
                return f"round {cycle} does not expect rank {rank}"
            return None
        if cycle <= self.opened:
            return f"round {cycle} is not open (latest opened: {self.opened})"
        return None  # a round not opened yet: the upload waits for open()

    def waiting_for(self, cycle: int) -> tuple[int, ...] | None:
        """The expected ranks whose upload to open round ``cycle`` has not arrived, sorted;
        ``None`` when ``cycle`` is not open (not opened yet, or complete)."""
        rnd = self._rounds.get(cycle)
        if rnd is None or rnd.expected is None:
            return None
        return tuple(sorted(rnd.expected - rnd.uploaded))

    def uploads(self, cycle: int) -> tuple[int, ...]:
        """The ranks whose upload to ``cycle`` arrived and awaits completion, sorted."""
        rnd = self._rounds.get(cycle)
        return () if rnd is None else tuple(sorted(rnd.uploaded))

    def pending(self) -> list[int]:
        """Rounds not complete yet (opened or not), ascending."""
        return sorted(self._rounds)

    # ------------------------------------------------------------------ transitions
    def open(self, cycle: int, ranks: Iterable[int]) -> Opened:
        """Expect uploads for ``cycle`` from ``ranks`` (ranks that left are dropped).

        Raises:
            LocalProtocolError: ``cycle`` is not above every round opened so far, or a rank is
                outside the world.
        """
        expected = {int(r) for r in ranks}
        if any(not 0 <= r < self.world_size for r in expected):
            raise LocalProtocolError(f"round {cycle}: ranks {sorted(expected)} outside the world")
        if cycle <= self.opened:
            raise LocalProtocolError(f"round {cycle} opened after round {self.opened}")
        self.opened = cycle
        refused: list[tuple[int, str]] = []
        for number in [n for n, r in self._rounds.items() if r.expected is None and n < cycle]:
            for rank in sorted(self._rounds.pop(number).uploaded):
                refused.append((rank, f"uploaded to round {number}, which was never opened"))
        rnd = self._rounds.setdefault(cycle, _Round())
        rnd.expected = expected - self.gone
        for rank in sorted(r for r in rnd.uploaded if r not in rnd.expected):
            rnd.uploaded.discard(rank)
            refused.append((rank, f"uploaded to round {cycle}, which does not expect it"))
        return Opened(tuple(refused), self._complete(cycle))

    def upload(self, rank: int, cycle: int) -> tuple[int, ...] | None:
        """Record an upload; the contributors when it completes the round.

        Raises:
            LocalProtocolError: the upload is refused (check :meth:`problem` first).
        """
        problem = self.problem(rank, cycle)
        if problem is not None:
            raise LocalProtocolError(problem)
        self._rounds.setdefault(cycle, _Round()).uploaded.add(rank)
        return self._complete(cycle)

    def leave(self, rank: int) -> list[tuple[int, tuple[int, ...]]]:
        """``rank`` left the run: no round waits for it any more. Returns the rounds this
        completes, ``(cycle, contributors)``, ascending."""
        if rank in self.gone:
            return []
        self.gone.add(rank)
        for rnd in self._rounds.values():
            rnd.uploaded.discard(rank)
            if rnd.expected is not None:
                rnd.expected.discard(rank)
        done = []
        for cycle in sorted(self._rounds):
            contributors = self._complete(cycle)
            if contributors is not None:
                done.append((cycle, contributors))
        return done

    def rejoin(self, rank: int) -> None:
        """A rank that left came back (a new incarnation): rounds opened from now on may
        expect it; rounds already open do not (they were opened without it)."""
        if not 0 <= rank < self.world_size:
            raise LocalProtocolError(f"rejoin: rank {rank} outside the world")
        self.gone.discard(rank)

    def _complete(self, cycle: int) -> tuple[int, ...] | None:
        rnd = self._rounds.get(cycle)
        if rnd is None or rnd.expected is None or not rnd.expected <= rnd.uploaded:
            return None
        del self._rounds[cycle]
        return tuple(sorted(rnd.uploaded))
