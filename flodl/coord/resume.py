"""What a checkpoint meta seeds into a new coordinator (docs/design.md §6, "Resume").

Pure module. :mod:`flodl.checkpoint` reads and validates the meta file and builds a
:class:`ResumeState`; the coordinator machine starts from it.
"""

from __future__ import annotations

from dataclasses import dataclass

from flodl.coord.elche_state import ElCheState
from flodl.wire.frames import BUNDLE_TAG_PATTERN

__all__ = ["META_SCHEMA_VERSION", "TAG_PATTERN", "bundle_tag", "ResumeState"]

META_SCHEMA_VERSION = 3
"""The meta's ``schema_version`` (the original's field names, plus the coverage block)."""

TAG_PATTERN = BUNDLE_TAG_PATTERN


def bundle_tag(global_step: int, version: int, salt: int) -> str:
    """The tag of a save (``salt``: 24 random bits, so saves of two runs on one stem differ)."""
    return f"b{global_step}-{version}-{salt & 0xFFFFFF:06x}"


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
        world_size_at_save: the world size of the run that saved (it may differ from the
            resumed run's: docs/design.md §6, "Resume at another world size"); ``None`` when
            unknown.
    """

    epoch: int
    global_step: int = 0
    sync_round: int = 0
    elche: ElCheState | None = None
    uncovered: tuple[tuple[int, int], ...] | None = None
    world_size_at_save: int | None = None

    def record(self, world_size: int) -> dict[str, object]:
        """The ``resumed`` record of a run of ``world_size`` ranks started from this state."""
        return {
            "epoch": self.epoch,
            "global_step": self.global_step,
            "world_size_at_save": self.world_size_at_save,
            "world_size": world_size,
            "uncovered_samples": (
                None if self.uncovered is None else sum(n for _, n in self.uncovered)
            ),
        }
