"""The one exception tree of flodl.

Peer misbehaviour is a :class:`RemoteProtocolError` (the shell closes that peer and carries on);
our own API misuse is a :class:`LocalProtocolError` (a bug: it propagates, and is never blamed on
a peer: the coordinator service ends the run with an internal error instead of evicting a rank).
Timeouts are never exceptions inside the coordinator: they come back as effects carrying a
reason. Every error type of the package is defined here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from flodl.rank.snapshot import TrainedState

__all__ = [
    "FlodlError",
    "ProtocolError",
    "RemoteProtocolError",
    "FrameError",
    "LocalProtocolError",
    "CycleAborted",
    "CoordinatorLost",
    "CollectiveFailed",
    "ConfigError",
    "CheckpointError",
    "CoverageError",
    "InvariantViolation",
    "RunStopped",
    "TrainingStopped",
]


class FlodlError(Exception):
    """Base of every error flodl raises on purpose."""


class ProtocolError(FlodlError):
    """A protocol rule was broken. Abstract: raise a subclass.

    Attributes:
        rank: the offending rank when known, else ``None``.
    """

    def __init__(self, message: str, *, rank: int | None = None) -> None:
        if type(self) is ProtocolError:
            raise TypeError(
                "ProtocolError is abstract; raise RemoteProtocolError or LocalProtocolError"
            )
        super().__init__(message)
        self.rank = rank


class RemoteProtocolError(ProtocolError):
    """The peer broke the protocol: close that peer, leave the machine unchanged."""


class FrameError(RemoteProtocolError):
    """Bytes that are not a valid frame: truncated, oversize, bad tag, bad body or bad field."""


class LocalProtocolError(ProtocolError):
    """We misused the API (a bug on our side): propagate."""


class CycleAborted(FlodlError):
    """Raised on a rank's main thread when the coordinator aborts an averaging cycle."""


class CoordinatorLost(FlodlError):
    """The rank bridge lost its coordinator (EOF or liveness timeout)."""


class CollectiveFailed(FlodlError):
    """A torch.distributed collective failed (peer died or timed out): re-form, then redo."""


class ConfigError(FlodlError, ValueError):
    """An invalid configuration value; the message names the field."""


class CheckpointError(FlodlError):
    """A checkpoint file is missing, corrupt, from a newer schema or from another run/model (or
    could not be written); the message names the file and the problem."""


class CoverageError(FlodlError):
    """The work ledger broke exactly-once coverage (a batch held twice, or lost): a bug."""


class InvariantViolation(FlodlError):
    """A coordinator invariant broke during a simulation (the message names it and the seed)."""


class RunStopped(FlodlError):
    """Not a failure: the coordinator ended the run (``shutdown``, or ``shutdown_with_save``
    with its reason). Raised out of a rank's training loop to unwind it.

    Attributes:
        save_reason: the ShutdownWithSave reason, or ``None`` for a normal end.
    """

    def __init__(self, save_reason: str | None, detail: str = "") -> None:
        super().__init__(save_reason or "shutdown")
        self.save_reason = save_reason
        self.detail = detail


class TrainingStopped(FlodlError):
    """The coordinator stopped the run before its end (ShutdownWithSave: too many deaths, a
    lone collective survivor, every rank lost, a wedged cohort). ``join()`` raises it: the
    message names the reason and the call that resumes.

    Attributes:
        save_reason: why (``max_failure_exceeded``, ``single_survivor``, ``all_ranks_lost``,
            ``reduce_stall``).
        detail: the coordinator's words.
        bundle: the stem of the bundle to resume from, or ``None`` when none was saved.
        resume_epoch: the epoch a resume restarts at (``None`` without a bundle).
        uncovered_samples: samples of that epoch still to train.
        state: the survivors' last consensus (``TrainedState``), or ``None``.
    """

    def __init__(
        self,
        message: str,
        *,
        save_reason: str,
        detail: str = "",
        bundle: str | None = None,
        resume_epoch: int | None = None,
        uncovered_samples: int | None = None,
        state: TrainedState | None = None,
    ) -> None:
        super().__init__(message)
        self.save_reason = save_reason
        self.detail = detail
        self.bundle = bundle
        self.resume_epoch = resume_epoch
        self.uncovered_samples = uncovered_samples
        self.state = state
