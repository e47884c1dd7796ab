"""What a checkpoint meta seeds into a new coordinator (docs/design.md §6, "Resume").

Pure module. :mod:`flodl.checkpoint` reads and validates the meta file and builds a
:class:`ResumeState`; the coordinator machine starts from it.
"""

from __future__ import annotations

from dataclasses import dataclass

from flodl.coord.elche_state import ElCheState

__all__ = ["META_SCHEMA_VERSION", "ResumeState"]

META_SCHEMA_VERSION = 3
"""The meta's ``schema_version`` (the original's field names, plus the coverage block)."""


@dataclass(frozen=True, slots=True)
class ResumeState:
    """The state a resumed run starts from.

    Attributes:
        epoch: the interrupted (first unfinished) epoch.
        global_step: the optimizer-step clock the LR schedules continue from.
        sync_round: averaging cycles completed so far.
        elche: ElChe's state (speeds, anchor, phase) and the guard's history.
        uncovered: uncovered ranges of the interrupted ``epoch`` as the meta stores them:
            ``(offset, size)`` in samples, multiples of the batch size; ``None``: the whole
            epoch is still to train.
    """

    epoch: int
    global_step: int = 0
    sync_round: int = 0
    elche: ElCheState | None = None
    uncovered: tuple[tuple[int, int], ...] | None = None
