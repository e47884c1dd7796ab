"""The standalone coordinator's heap policy: what a run keeps for its whole length is frozen.

Python's cyclic garbage collector runs a full pass whenever enough objects survived younger
passes, and a full pass visits every tracked object in the process. In a coordinator of
thousands of ranks most of the heap is what the run built once and keeps to its end (the
machine's per-rank state, the connections), so each full pass rescans it: tens of ms at 4,096
ranks, spent on the event loop and charged to whichever frame tripped the threshold.

:class:`HeapFreeze` collects once and ``gc.freeze()``-s the heap when the machine first trains
(formation is over: every rank's state and connection exists), so later passes scan only what
the run created since; it ``gc.unfreeze()``-s when the run ends, so that a later run in the
same process (``flodl coord`` restarts a stopped run) can free the first one's cycles. What
was frozen and later dropped inside a reference cycle (a dead rank's first connection) is
freed then, not before: bounded by what existed at the freeze, never growing with the run.

While frozen it also raises the youngest generation's threshold to :data:`YOUNG_THRESHOLD`
allocations (Python's default is 700; the older generations keep their ratios). A cycle
allocates a handful of objects per rank (window stats, snapshots, chunk plans, frames) that
live until the next one, so at the default a young pass runs every few hundred frames and
each finds most of what it scans still alive: at 4,096 simulated ranks the passes cost about
38 ms per averaging cycle, 3 ms at this threshold (docs/design.md §2, "Coordinator cost").
The garbage a pass would free waits longer: at most that many objects, a few MB.

It is a policy of the whole process, so only ``flodl coord`` applies it, never a coordinator
hosted by a launcher inside the user's interpreter (docs/design.md §2, "Coordinator cost").
"""

from __future__ import annotations

import gc
import logging

from flodl.coord.phases import RunPhase

__all__ = ["HeapFreeze", "YOUNG_THRESHOLD"]

logger = logging.getLogger(__name__)

YOUNG_THRESHOLD = 50_000
"""Allocations (less deallocations) of tracked objects between young collections while the
heap is frozen."""


class HeapFreeze:
    """Freeze the process's heap once the run trains; unfreeze it when the run ends. Once
    released it never freezes again: an input that still reaches a closed server (a reduce
    round's report, queued from another thread) must not freeze a heap nobody will release."""

    __slots__ = ("_thresholds", "frozen", "released")

    def __init__(self) -> None:
        self.frozen = False
        """Whether this run froze the heap and has not released it yet."""
        self.released = False
        """Whether the run is over (:meth:`release` was called, frozen or not)."""
        self._thresholds: tuple[int, int, int] | None = None
        """The collector's thresholds before the freeze, restored at the release."""

    @property
    def pending(self) -> bool:
        """Whether a training phase would still freeze the heap."""
        return not (self.frozen or self.released)

    def on_phase(self, phase: RunPhase) -> None:
        """The machine is in ``phase`` after an input: freeze the heap the first time it
        trains (one full collection first, so no garbage is kept frozen)."""
        if not self.pending or phase is not RunPhase.TRAINING:
            return
        gc.collect()
        gc.freeze()
        self._thresholds = gc.get_threshold()
        young, *older = self._thresholds
        gc.set_threshold(max(young, YOUNG_THRESHOLD), *older)
        self.frozen = True
        logger.info(
            "heap frozen for the run (%d objects): the collector's full passes skip it, "
            "young passes run every %d allocations",
            gc.get_freeze_count(),
            gc.get_threshold()[0],
        )

    def release(self) -> None:
        """The run is over: what it froze goes back to the collector (idempotent)."""
        self.released = True
        if not self.frozen:
            return
        gc.unfreeze()
        if self._thresholds is not None:
            gc.set_threshold(*self._thresholds)
            self._thresholds = None
        self.frozen = False
        logger.info("heap unfrozen: the run is over")
