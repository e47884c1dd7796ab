"""Effects: what the coordinator machine asks its shell to do, as plain data.

Pure module. The shell executes effects in list order; every decision that evicts, shuts down
or re-elects carries a human-readable ``reason``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from flodl.wire.frames import CoordFrame, EpochMetrics, SaveReason

__all__ = [
    "Send",
    "Reply",
    "RefusePeer",
    "Close",
    "RankDead",
    "RankLeft",
    "RankRejoined",
    "OpenReduce",
    "WriteMeta",
    "BundleRequested",
    "Record",
    "Alert",
    "EpochDone",
    "EvalDone",
    "RunOver",
    "Effect",
]


@dataclass(slots=True)
class Send:
    """Send ``frame`` to ``rank`` (best-effort: a failed send is reported back as PeerLost).

    Immutable like every effect, but not declared frozen: a cycle makes two or more per live
    rank, and a frozen dataclass's constructor costs 2.4× a plain one's (docs/design.md §2,
    "Coordinator cost")."""

    rank: int
    frame: CoordFrame


@dataclass(frozen=True, slots=True)
class Reply:
    """Send ``frame`` on the connection that delivered the current input (handshake replies).
    An ``Accept`` binds that connection to ``Accept.rank``."""

    frame: CoordFrame


@dataclass(frozen=True, slots=True)
class RefusePeer:
    """Close the connection that delivered the current input, after any :class:`Reply`."""

    reason: str


@dataclass(frozen=True, slots=True)
class Close:
    """Close the control connection of ``rank``."""

    rank: int
    reason: str


@dataclass(frozen=True, slots=True)
class RankDead:
    """``rank`` is declared dead: stop waiting for it anywhere (reduce server, supervisor)."""

    rank: int
    reason: str


@dataclass(frozen=True, slots=True)
class RankRejoined:
    """A dead ``rank`` came back as incarnation ``incarnation``: the reduce server takes its
    data connection again (executed before the ``accept`` goes out, so the rank's data hello
    never races it)."""

    rank: int
    incarnation: int


@dataclass(frozen=True, slots=True)
class RankLeft:
    """``rank`` finished cleanly during the shutdown: no averaging round waits for it any more
    (a peer blocked in a CPU round it will never upload to is released)."""

    rank: int


@dataclass(frozen=True, slots=True)
class OpenReduce:
    """CPU backend: expect uploads for round ``cycle`` from ``ranks``."""

    cycle: int
    ranks: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class WriteMeta:
    """Write the checkpoint meta (atomically): the model file of bundle ``version`` is on disk,
    so this meta commits the bundle. ``meta`` is JSON-ready; ``reason`` says why it was saved."""

    meta: dict[str, Any]
    reason: SaveReason | str
    version: int | None = None


@dataclass(frozen=True, slots=True)
class BundleRequested:
    """Bundle ``version`` was requested from the ranks, its files tagged ``tag``: the shell
    snapshots the state it owns for that bundle (the CPU outer optimizer's), to write with the
    matching :class:`WriteMeta`, and spares its files while it is being written."""

    version: int
    tag: str | None = None


@dataclass(frozen=True, slots=True)
class Record:
    """A node record for the record log / dashboard (``path`` like ``root/host/rank0``)."""

    path: str
    kind: str
    data: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Alert:
    """An alert event (``rank_lost``, ``drift``, ``control_drop``, ``reduce_stall``…)."""

    cls: str
    path: str
    detail: str
    severity: str = "warning"


@dataclass(frozen=True, slots=True)
class EpochDone:
    """An epoch was aggregated: deliver to ``metrics_fn`` and the handle's queue."""

    metrics: EpochMetrics


@dataclass(frozen=True, slots=True)
class EvalDone:
    """An eval finished on a rank: deliver to ``eval_result_fn`` on the host."""

    epoch: int
    metric: float


@dataclass(frozen=True, slots=True)
class RunOver:
    """The run ended; ``ok`` is False after a ShutdownWithSave or a formation failure;
    ``detail`` says why a ShutdownWithSave stopped it."""

    ok: bool
    reason: str
    save_reason: SaveReason | None = None
    detail: str = ""


Effect = (
    Send
    | Reply
    | RefusePeer
    | Close
    | RankDead
    | RankLeft
    | RankRejoined
    | OpenReduce
    | WriteMeta
    | BundleRequested
    | Record
    | Alert
    | EpochDone
    | EvalDone
    | RunOver
)
