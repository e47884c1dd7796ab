"""Callback roles: which rank runs ``epoch_fn``, eval and ``checkpoint_fn``.

Pure module. Rules (docs/design.md §2, §6 "Callbacks"):

* ``Fastest`` (default): before the first calibration every role is the lowest live rank; at
  the first calibration the live rank with the lowest smoothed ms/batch is elected (ties → lowest
  rank) and the election is **sticky**: it changes only when the role rank dies.
* ``Rank(n)``: pinned. While ``n`` does not hold the consensus (it died, or has not joined a
  run that started at its minimum world size), every role it held goes to a survivor by the
  ``Fastest`` rule (:func:`elect_fastest` over the ranks that hold the consensus); when ``n``
  (a new incarnation, or a late joiner) receives the consensus, every role goes back to it.
  Deviation: the original moved only the checkpoint role, so ``epoch_fn`` and eval silently
  stopped for the rest of the run.
* A failed checkpoint is retried on the next live rank that has not tried this version yet
  (lowest index first, as the original's code does); exhausted ⇒ give up, with a reason.
* Callback costs are tracked per (kind, rank) with an EWMA (α = 0.3, first sample raw).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

__all__ = ["CallbackKind", "EWMA_ALPHA", "Roles", "elect_fastest", "CheckpointRetry"]

CallbackKind = Literal["epoch_fn", "eval", "checkpoint"]
EWMA_ALPHA = 0.3


def elect_fastest(alive: Sequence[int], smoothed_ms: Sequence[float]) -> tuple[int, str]:
    """The live rank with the lowest positive smoothed ms/batch (ties → lowest rank), or the
    lowest live rank when none is calibrated. ``alive`` must not be empty."""
    timed = [(smoothed_ms[r], r) for r in alive if smoothed_ms[r] > 0.0]
    if not timed:
        return min(alive), f"no rank calibrated yet: lowest live rank {min(alive)}"
    ms, rank = min(timed)
    return rank, f"fastest live rank {rank} ({ms:.3f} ms/batch)"


@dataclass(slots=True)
class Roles:
    """The three role fields and the cost EWMAs.

    Args:
        policy: ``"fastest"`` or a pinned global rank.
    """

    policy: Literal["fastest"] | int
    epoch_callback_role: int = 0
    eval_role: int = 0
    checkpoint_role: int = 0
    elected: bool = False
    dirty: bool = True
    costs_ms: dict[tuple[CallbackKind, int], float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.policy, int):
            self.epoch_callback_role = self.eval_role = self.checkpoint_role = self.policy

    def _set_all(self, rank: int) -> None:
        if (self.epoch_callback_role, self.eval_role, self.checkpoint_role) != (rank,) * 3:
            self.dirty = True
        self.epoch_callback_role = self.eval_role = self.checkpoint_role = rank

    def on_first_calibration(self, alive: Sequence[int], smoothed_ms: Sequence[float]) -> str:
        """Elect once (Fastest); returns the reason ("" when nothing changed)."""
        if self.elected or isinstance(self.policy, int) or not alive:
            self.elected = True
            return ""
        rank, why = elect_fastest(alive, smoothed_ms)
        self.elected = True
        self._set_all(rank)
        return f"callback roles elected: {why}"

    def on_death(self, dead: int, alive: Sequence[int], smoothed_ms: Sequence[float]) -> str:
        """Fail roles over from ``dead`` to a rank of ``alive`` (the ranks holding the
        consensus); returns the reason ("" when no role moved)."""
        return self._vacate(dead, "died", alive, smoothed_ms)

    def on_absent(self, rank: int, alive: Sequence[int], smoothed_ms: Sequence[float]) -> str:
        """``rank`` did not join the run's formation (a minimum world size): its roles go to
        a rank of ``alive`` until it holds the consensus; returns the reason ("" when none)."""
        return self._vacate(rank, "has not joined", alive, smoothed_ms)

    def on_consensus(self, rank: int) -> str:
        """``rank`` (a rejoined incarnation or a late joiner) now holds the consensus: a pinned
        rank takes every role back; returns the reason ("" when nothing changed)."""
        if self.policy != rank or self._held() == (rank,) * 3:
            return ""
        self._set_all(rank)
        return f"pinned rank {rank} holds the consensus again: callback roles back on it"

    def _held(self) -> tuple[int, int, int]:
        return (self.epoch_callback_role, self.eval_role, self.checkpoint_role)

    def _vacate(
        self, gone: int, verb: str, alive: Sequence[int], smoothed_ms: Sequence[float]
    ) -> str:
        if not alive or gone not in self._held():
            return ""
        heir, why = elect_fastest(alive, smoothed_ms)
        if isinstance(self.policy, int):  # the roles still held by live ranks stay put
            self.epoch_callback_role, self.eval_role, self.checkpoint_role = (
                heir if role == gone else role for role in self._held()
            )
            self.dirty = True
            return (
                f"pinned rank {gone} {verb}: callback roles moved to {why} until it holds the "
                "consensus again"
            )
        self._set_all(heir)
        return f"role rank {gone} {verb}; re-elected {why}"

    def observe_cost(self, kind: CallbackKind, rank: int, elapsed_ms: float) -> float:
        """Feed a callback's wall time into its EWMA; returns the new estimate."""
        key = (kind, rank)
        prev = self.costs_ms.get(key)
        value = elapsed_ms if prev is None else EWMA_ALPHA * elapsed_ms + (1 - EWMA_ALPHA) * prev
        self.costs_ms[key] = value
        return value

    def cost(self, kind: CallbackKind, rank: int) -> float:
        return self.costs_ms.get((kind, rank), 0.0)


@dataclass(slots=True)
class CheckpointRetry:
    """Failover state of one checkpoint version."""

    version: int
    tried: set[int] = field(default_factory=set)
    target: int | None = None

    def first(self, rank: int) -> int:
        self.tried.add(rank)
        self.target = rank
        return rank

    def next_target(self, alive: Sequence[int]) -> int | None:
        """The lowest live rank that has not tried this version; None when exhausted."""
        for r in sorted(alive):
            if r not in self.tried:
                self.tried.add(r)
                self.target = r
                return r
        self.target = None
        return None
