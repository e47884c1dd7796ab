"""What ``Trainer.run()`` returns on every tier: a handle to join the run and stream its
per-epoch metrics. In tiers 1-3 it comes back at once, the run still going; on a rank started
by another launcher (tier 4) ``run()`` returns it only once the rank is done, finished (its
``join()`` returns the state, or raises ``TrainingStopped``, at once)."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

from flodl import checkpoint
from flodl.errors import CheckpointError, TrainingStopped
from flodl.rank.snapshot import TrainedState
from flodl.wire.frames import EpochMetrics

__all__ = ["TrainerHandle", "training_stopped"]


class TrainerHandle:
    """What ``run()`` returns: ``join()`` the final state, stream :class:`EpochMetrics`
    (already finished on a tier-4 rank, whose ``run()`` trained in the calling thread)."""

    def __init__(self, world_size: int, *, is_primary: bool = True) -> None:
        self.world_size = world_size
        self.is_primary = is_primary
        self.dashboard_url: str | None = None
        """The live dashboard's address while the run lasts (``dashboard(port)``)."""
        self._metrics: queue.SimpleQueue[EpochMetrics | None] = queue.SimpleQueue()
        self._done = threading.Event()
        self._state: TrainedState | None = None
        self._error: BaseException | None = None
        self._joiner: Callable[[], None] | None = None

    # producer side
    def _push(self, m: EpochMetrics) -> None:
        self._metrics.put(m)

    def _finish(self, state: TrainedState | None, error: BaseException | None) -> None:
        self._state, self._error = state, error
        self._metrics.put(None)
        self._done.set()

    # consumer side
    def join(self, timeout: float | None = None) -> TrainedState:
        """Wait for the run; returns the final consensus state (CPU tensors).

        Raises:
            TrainingStopped: the coordinator stopped the run before its end (a
                ShutdownWithSave); the error names the reason and the bundle to resume from,
                and carries the survivors' last state.
            FlodlError: the run failed (the message says why).
            TimeoutError: not finished within ``timeout`` seconds.
        """
        if self._joiner is not None:
            self._joiner()
        if not self._done.wait(timeout):
            raise TimeoutError(f"the run did not finish within {timeout} s")
        if self._error is not None:
            raise self._error
        assert self._state is not None
        return self._state

    def next_metrics(self, timeout: float | None = None) -> EpochMetrics | None:
        """The next epoch's metrics, blocking; ``None`` once the run is over (or timeout)."""
        if self._done.is_set() and self._metrics.empty():
            return None
        try:
            return self._metrics.get(timeout=timeout)
        except queue.Empty:
            return None

    def poll_metrics(self) -> list[EpochMetrics]:
        """Every epoch's metrics that arrived since the last call, without blocking."""
        out: list[EpochMetrics] = []
        while True:
            try:
                m = self._metrics.get_nowait()
            except queue.Empty:
                return out
            if m is None:
                self._metrics.put(None)
                return out
            out.append(m)


def training_stopped(
    save_reason: str,
    detail: str,
    stem: str | None,
    state: TrainedState | None,
    resume: Callable[[str], str] = lambda stem: f".resume_from({stem!r})",
) -> TrainingStopped:
    """The error ``join()`` raises after a ShutdownWithSave, with the resume point read from the
    bundle on disk (the stop's own bundle, or the previous one when it could not be saved);
    ``resume(stem)`` words the call that resumes (the Trainer's by default)."""
    head = f"training stopped ({save_reason})" + (f": {detail}" if detail else "")
    meta = None
    if stem is not None:
        try:
            meta = checkpoint.read_meta(stem)
        except CheckpointError:
            meta = None
    if meta is None:
        tail = (
            "no bundle was saved to resume from"
            if stem is not None
            else "no bundle to resume from (set save_path to save one at a stop)"
        )
        return TrainingStopped(
            f"{head}; {tail}", save_reason=save_reason, detail=detail, state=state
        )
    assert stem is not None  # a meta was read from it
    uncovered = sum(
        size
        for entry in (meta.coverage.per_epoch if meta.coverage is not None else [])
        if entry.epoch == meta.epoch
        for _, size in entry.uncovered_ranges
    )
    return TrainingStopped(
        f"{head}; resume from its bundle with {resume(stem)} (epoch {meta.epoch}, "
        f"{uncovered} samples of it still to train)",
        save_reason=save_reason,
        detail=detail,
        bundle=stem,
        resume_epoch=meta.epoch,
        uncovered_samples=uncovered,
        state=state,
    )
