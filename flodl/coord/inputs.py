"""Non-wire inputs of the coordinator machine: facts the shells observe.

Pure module. Decoded wire frames are inputs too (one vocabulary, as h11); these are the rest.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

__all__ = ["PeerLost", "ChildExited", "ReduceDone", "Input"]


@dataclass(frozen=True, slots=True)
class PeerLost:
    """The control connection of ``rank`` ended (EOF, reset, bad frame or slow reader)."""

    kind: ClassVar[str] = "peer_lost"
    rank: int
    reason: str


@dataclass(frozen=True, slots=True)
class ChildExited:
    """The launcher's supervisor saw the process of ``rank`` exit (the fast death path)."""

    kind: ClassVar[str] = "child_exited"
    rank: int
    exit_code: int


@dataclass(frozen=True, slots=True)
class ReduceDone:
    """The CPU reduce server finished round ``cycle``; ``contributors`` are the ranks whose
    upload is folded into the consensus (sorted). A rank that dies after this still had its
    work averaged in, so its window is committed, not redone."""

    kind: ClassVar[str] = "reduce_done"
    cycle: int
    contributors: tuple[int, ...]
    weight_total: float


Input = PeerLost | ChildExited | ReduceDone
