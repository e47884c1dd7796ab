"""The run phases of the coordinator and which inputs each accepts (docs/design.md §2).

Pure module, h11-style: the allowed inputs are a table, not ``if`` chains, and the machine
changes phase in one place (:meth:`~flodl.coord.machine.Coordinator._enter`), always with a
reason (``Coordinator.phase_log``).

``FORMING`` (handshakes until every rank joined, or the formation deadline) → ``TRAINING``
(dispatch, cycles, epochs) → ``FINAL_EVAL`` (optional: the last eval after the last epoch) →
``SHUTDOWN`` (waiting for every rank to exit) → ``DONE``. An unrecoverable state jumps to
``SHUTDOWN`` through ShutdownWithSave; a failed formation jumps to ``DONE``.

An input a phase does not accept is, from a live rank, a protocol violation (the rank trained
before the cohort formed, say): the rank is evicted with that reason. Nothing is accepted once
the run is ``DONE`` except a ``hello``, which is refused with a reason the joiner prints.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from types import MappingProxyType

__all__ = ["RunPhase", "ACCEPTS", "accepts"]


class RunPhase(enum.Enum):
    FORMING = "forming"
    TRAINING = "training"
    FINAL_EVAL = "final_eval"
    SHUTDOWN = "shutdown"
    DONE = "done"


_DEATHS = frozenset({"peer_lost", "child_exited", "rank_exited"})
"""A rank's process or connection ended: accepted whenever a rank can be alive."""
_ALWAYS = _DEATHS | {"hello", "heartbeat", "resource_sample"}
_TRAINING = _ALWAYS | {
    "batch",
    "snapshot_ready",
    "sync_ack",
    "reduce_done",
    "metrics",
    "lr_update",
    "intent",
    "eval_result",
    "checkpoint_result",
    "bundle_saved",
    "epoch_fn_elapsed",
    "session_failed",
    "partition_revoked",
    "exiting",
}

ACCEPTS: Mapping[RunPhase, frozenset[str]] = MappingProxyType(
    {
        RunPhase.FORMING: frozenset(_ALWAYS),
        RunPhase.TRAINING: frozenset(_TRAINING),
        RunPhase.FINAL_EVAL: frozenset(_TRAINING),
        # ranks finish the step they are in: its frames still arrive and are accounted
        RunPhase.SHUTDOWN: frozenset(_TRAINING),
        RunPhase.DONE: frozenset({"hello"}),
    }
)
"""Input kinds (frame ``kind`` or :mod:`flodl.coord.inputs` ``kind``) each phase accepts."""


def accepts(phase: RunPhase, kind: str) -> bool:
    """Whether ``phase`` accepts an input of ``kind``."""
    return kind in ACCEPTS[phase]
