"""The rank's side of the protocol, sans-IO: coordinator frames in, the rank's next action out.

Pure module (docs/design.md §0, §2b): no torch, no socket, no clock. The rank runtime
(:mod:`flodl.rank.runtime`, real torch and sockets) and the simulator (:mod:`flodl.sim`, a
virtual clock) drive the same :class:`RankProtocol`, so the simulator's invariants cover how a
production rank reacts to every frame.

* :meth:`RankProtocol.receive` applies one frame and returns the work it asks for at once
  (:class:`RunEval`, :class:`RunCheckpoint`, :class:`SaveBundle`, :class:`RunEpochFn`,
  :class:`Reform`, :class:`PeerDead`, :class:`Stop`, and :class:`Answer`: frames to send now,
  e.g. the ``partition_revoked`` reply to a ``revoke_partition``);
* :meth:`RankProtocol.next_action` says what to do at a step boundary: :class:`Broadcast` (the
  initial state exchange), :class:`Reduce` (enter a cycle), :class:`Train` (the next batch of
  the oldest slice), :class:`Wait` (block for a frame) or :class:`Stop`;
* the executor reports back: :meth:`~RankProtocol.trained` (the ``batch`` frame, carrying
  ``metrics`` when a slice ends), :meth:`~RankProtocol.begin_reduce` /
  :meth:`~RankProtocol.end_reduce` (``snapshot_ready`` — not in the modes that wait for the
  update —, ``sync_ack``),
  :meth:`~RankProtocol.lr_set` (``lr_update`` when the LR it applied changed),
  :meth:`~RankProtocol.collective_failed` (frames other than ``new_session``, a save and a stop
  are held until the group re-forms, then replayed in order).

Frames that arrive while the executor is busy (a batch, a reduce, a callback) wait in its own
inbox; the protocol sees them in arrival order, which the control connection (TCP) preserves.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from flodl.errors import RemoteProtocolError
from flodl.wire.frames import (
    Batch,
    Checkpoint,
    CoordFrame,
    DeclareDead,
    EpochAggregated,
    EpochPlan,
    EvalBroadcast,
    ExecuteEval,
    ExtendPartition,
    LrUpdate,
    Metrics,
    NewSession,
    PartitionRevoked,
    RankFrame,
    RequestParams,
    RevokePartition,
    SaveConsensusModel,
    SessionFailed,
    SetEpochCallbackRole,
    SetGlobalStep,
    Shutdown,
    ShutdownWithSave,
    SnapshotReady,
    StartEpoch,
    SyncAck,
    SyncNow,
    Throttle,
    Update,
)

__all__ = [
    "RankProtocol",
    "Slice",
    "StepSums",
    "Action",
    "Broadcast",
    "Reduce",
    "Train",
    "Wait",
    "Stop",
    "RunEval",
    "RunCheckpoint",
    "SaveBundle",
    "RunEpochFn",
    "Reform",
    "PeerDead",
    "Answer",
]


@dataclass(slots=True)
class Slice:
    """A plan the rank trains batch by batch: ``size`` samples from ``offset`` of the epoch's
    slice of the shared permutation; ``pos`` samples of it are trained."""

    epoch: int
    offset: int
    size: int
    pos: int = 0


@dataclass
class StepSums:
    """Sums over a run of steps (a slice on a rank, an epoch on one device)."""

    batches: int = 0
    loss_sum: float = 0.0
    compute_ms: float = 0.0
    data_ms: float = 0.0
    scalars: dict[str, list[float]] = field(default_factory=dict)

    def add(
        self, loss: float, compute_ms: float, data_ms: float, scalars: dict[str, list[float]]
    ) -> None:
        self.batches += 1
        self.loss_sum += loss
        self.compute_ms += compute_ms
        self.data_ms += data_ms
        for k, (s, c) in scalars.items():
            slot = self.scalars.setdefault(k, [0.0, 0.0])
            slot[0] += s
            slot[1] += c


# ---- what to do at a step boundary --------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Broadcast:
    """The initial state exchange (every replica starts from the lowest live rank's state)."""


@dataclass(frozen=True, slots=True)
class Reduce:
    """Enter averaging cycle ``cycle`` (call :meth:`RankProtocol.begin_reduce`); ``heal``:
    copy the outer optimizer's state to the members awaiting the consensus as well."""

    cycle: int
    heal: bool = False


@dataclass(frozen=True, slots=True)
class Train:
    """Train the next ``batch_size`` samples of ``slice`` from ``slice.pos``."""

    slice: Slice


@dataclass(frozen=True, slots=True)
class Wait:
    """Nothing to do until the next frame arrives."""


@dataclass(frozen=True, slots=True)
class Stop:
    """The coordinator ended the run (``save_reason`` and ``detail`` set after a
    ShutdownWithSave)."""

    save_reason: str | None
    detail: str = ""


# ---- work a frame asks for at once --------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RunEval:
    schedule_id: int
    epoch: int


@dataclass(frozen=True, slots=True)
class RunCheckpoint:
    version: int


@dataclass(frozen=True, slots=True)
class SaveBundle:
    frame: SaveConsensusModel


@dataclass(frozen=True, slots=True)
class RunEpochFn:
    epoch: int


@dataclass(frozen=True, slots=True)
class Reform:
    """Re-form the collective group (collective modes)."""

    session: int
    store_prefix: str
    new_rank: int
    new_world_size: int
    ranks: tuple[int, ...] = ()
    """The members, ascending global ranks."""


@dataclass(frozen=True, slots=True)
class PeerDead:
    rank: int
    reason: str


@dataclass(frozen=True, slots=True)
class Answer:
    """Frames to send to the coordinator now, in order."""

    frames: tuple[RankFrame, ...]


Action = (
    Broadcast
    | Reduce
    | Train
    | Wait
    | Stop
    | RunEval
    | RunCheckpoint
    | SaveBundle
    | RunEpochFn
    | Reform
    | PeerDead
    | Answer
)


class RankProtocol:
    """One rank's view of the run.

    Args:
        rank: this rank.
        batch_size: samples per batch.
        waits_for_update: after a reduce the rank waits for the coordinator's ``update`` (the
            mode's trait; CPU averaging, not Async).
        session: the collective session the rank was admitted to.
        incarnation: the ``accept``'s; above 0 the rank rejoins a running run: no initial
            broadcast, and nothing trained before its first reduce gives it the consensus
            (it enters that reduce with weight 0: its window is empty).
    """

    def __init__(
        self,
        rank: int,
        batch_size: int,
        *,
        waits_for_update: bool,
        session: int = 0,
        incarnation: int = 0,
    ) -> None:
        self.rank = rank
        self.batch_size = batch_size
        self.waits_for_update = waits_for_update
        self.session = session
        self.queue: deque[Slice] = deque()
        self.deferred: deque[CoordFrame] = deque()
        """Frames to apply before any newer one (held during a re-formation, then replayed)."""
        self.started = False
        """The first frame after ``accept`` arrived: the cohort formed."""
        self.incarnation = incarnation
        self.broadcast_done = incarnation > 0
        self.needs_consensus = incarnation > 0
        """A rejoined rank before its first reduce: it holds no consensus yet, so it must
        take the round's result as is (never blend it, as ``cpu_async`` does) and train
        nothing before."""
        self.pending_reduce: int | None = None
        self.pending_heal = False
        self.waiting_update = False
        self.throttled = False
        self.awaiting_session = False
        self.held: list[CoordFrame] = []
        self.step = 0
        self.window_steps = 0
        self.global_step = 0
        self.local_since_avg = 0
        self.epoch_role: int | None = None
        self.last_eval: tuple[int, float] | None = None
        self.stopped: Stop | None = None
        self.sums = StepSums()
        self.last_lr: float | None = None

    # ------------------------------------------------------------------ frames in
    def receive(self, frame: CoordFrame) -> list[Action]:
        """Apply ``frame`` (in arrival order); the work it asks for at once."""
        if self.stopped is not None:
            return []
        self.started = True
        if self.awaiting_session:
            if isinstance(frame, Shutdown | ShutdownWithSave):
                self._replay_held()
            elif isinstance(frame, NewSession):
                actions = self._apply(frame)
                self._replay_held()
                return actions
            elif not isinstance(frame, SaveConsensusModel):  # a save needs no collective
                self.held.append(frame)
                return []
        return self._apply(frame)

    def _replay_held(self) -> None:
        self.awaiting_session = False
        self.deferred.extendleft(reversed(self.held))
        self.held = []

    def reform_of(self, frame: NewSession) -> Reform:
        """What ``frame`` asks of this rank: form the session at its position among the
        members (protocol 10: every member gets the same frame).

        Raises:
            RemoteProtocolError: the frame does not list this rank (nothing changed).
        """
        position = frame.position(self.rank)
        if position is None:
            raise RemoteProtocolError(
                f"new_session {frame.session} does not list rank {self.rank} among its members"
            )
        return Reform(
            frame.session,
            frame.store_prefix,
            position,
            frame.new_world_size,
            tuple(frame.members()),
        )

    def _apply(self, frame: CoordFrame) -> list[Action]:
        match frame:
            case StartEpoch(plan=plan):
                self._enqueue(plan)
                self.throttled = False
            case ExtendPartition(epoch=e, partition_offset=off, partition_size=size):
                self.queue.append(Slice(e, off, size))
                self.throttled = False
            case RequestParams(cycle=c):
                self.pending_reduce, self.pending_heal = c, False
                self.throttled = False
            case SyncNow(cycle=c, heal=heal):
                self.pending_reduce, self.pending_heal = c, heal
                self.throttled = False
            case Update(next_plan=plan, global_step=g):
                self.waiting_update = False
                self.throttled = False
                if plan is not None:
                    self._enqueue(plan)
                if g is not None:  # (the set_global_step CPU modes fold in)
                    self.global_step = g
                    self.local_since_avg = 0
            case Throttle():
                self.throttled = True
            case SetGlobalStep(global_step=g):
                self.global_step = g
                self.local_since_avg = 0
            case NewSession():
                reform = self.reform_of(frame)
                self.session = reform.session
                return [reform]
            case RevokePartition():
                return [Answer(self._revoke(frame))]
            case DeclareDead(rank=r, reason=why):
                return [PeerDead(r, why)]
            case Shutdown():
                self.stopped = Stop(None)
                return [self.stopped]
            case ShutdownWithSave(reason=reason, detail=detail):
                self.stopped = Stop(reason, detail)
                return [self.stopped]
            case ExecuteEval(schedule_id=sid, epoch=epoch):
                return [RunEval(sid, epoch)]
            case Checkpoint(version=v):
                return [RunCheckpoint(v)]
            case SaveConsensusModel():
                return [SaveBundle(frame)]
            case SetEpochCallbackRole(rank=r):
                self.epoch_role = r
            case EpochAggregated(metrics=m):
                if self.epoch_role == self.rank:
                    return [RunEpochFn(m.epoch)]
            case EvalBroadcast(epoch=e, metric=v):
                self.last_eval = (e, v)
            case _:
                pass
        return []

    def _enqueue(self, plan: EpochPlan) -> None:
        self.queue.append(Slice(plan.epoch, plan.partition_offset, plan.partition_size))

    def _revoke(self, frame: RevokePartition) -> tuple[RankFrame, ...]:
        """Drop the part of the asked range this rank has not started (frames apply at a step
        boundary, so nothing is half-trained): the range is the end of one queued slice, which
        is cut short; a slice it empties is gone, and one it completes sends its ``metrics``
        as if its last batch had just been trained."""
        epoch, start = frame.epoch, frame.partition_offset
        stop = start + frame.partition_size
        out: list[RankFrame] = []
        dropped = 0
        for i, sl in enumerate(self.queue):
            if sl.epoch == epoch and sl.offset + sl.size == stop and sl.offset <= start:
                cut = max(start, sl.offset + sl.pos)
                dropped = stop - cut
                sl.size = cut - sl.offset
                if sl.pos >= sl.size:  # nothing of it left to train
                    del self.queue[i]
                    if sl.pos > 0:  # (only the head is started)
                        out.append(self._slice_metrics(sl.epoch))
                break
        out.append(
            PartitionRevoked(
                rank=self.rank,
                epoch=epoch,
                partition_offset=frame.partition_offset,
                partition_size=frame.partition_size,
                revoked_size=dropped,
            )
        )
        return tuple(out)

    # ------------------------------------------------------------------ actions out
    def next_action(self) -> Broadcast | Reduce | Train | Wait | Stop:
        """What to do at this step boundary (apply every frame that arrived first)."""
        if self.stopped is not None:
            return self.stopped
        if not self.started:
            return Wait()
        if not self.broadcast_done:
            return Broadcast()
        if self.pending_reduce is not None:
            return Reduce(self.pending_reduce, self.pending_heal)
        if self.needs_consensus:
            return Wait()
        if self.awaiting_session or self.waiting_update or self.throttled or not self.queue:
            return Wait()
        return Train(self.queue[0])

    def lr_step(self) -> int:
        """The step the LR schedule is evaluated at (the global step plus local progress)."""
        return self.global_step + self.local_since_avg

    def lr_set(self, lr: float) -> LrUpdate | None:
        """The rank set its optimizer's LR: the ``lr_update`` frame to send when the value
        changed (a non-finite or negative LR is applied but never reported)."""
        if lr == self.last_lr or not math.isfinite(lr) or lr < 0:
            return None
        self.last_lr = lr
        return LrUpdate(rank=self.rank, lr=lr)

    # ------------------------------------------------------------------ reports back
    def broadcasted(self) -> None:
        """The initial state exchange finished."""
        self.broadcast_done = True

    def trained(
        self,
        compute_ms: float,
        data_ms: float,
        loss: float,
        scalars: dict[str, list[float]] | None = None,
    ) -> Batch:
        """The batch :class:`Train` asked for is trained: its ``batch`` frame, carrying the
        slice's ``metrics`` when that was the slice's last batch."""
        head = self.queue[0]
        self.step += 1
        self.window_steps += 1
        self.local_since_avg += 1
        self.sums.add(loss, compute_ms, data_ms, scalars or {})
        head.pos += self.batch_size
        metrics = None
        if head.pos >= head.size:
            self.queue.popleft()
            metrics = self._slice_metrics(head.epoch)
        return Batch(
            rank=self.rank,
            epoch=head.epoch,
            step=self.step,
            batch_ms=compute_ms,
            data_ms=data_ms,
            loss=loss,
            metrics=metrics,
        )

    def _slice_metrics(self, epoch: int) -> Metrics:
        """The ``metrics`` frame of the slice just finished (its sums start over)."""
        st, bs = self.sums, self.batch_size
        busy = st.compute_ms + st.data_ms
        metrics = Metrics(
            rank=self.rank,
            epoch=epoch,
            avg_loss=st.loss_sum / max(1, st.batches),
            batches_processed=st.batches,
            samples_processed=st.batches * bs,
            epoch_ms=busy,
            share_complete_ms=busy,
            compute_only_ms=st.compute_ms,
            data_starve_ms=st.data_ms,
            scalars={k: (v[0], int(v[1])) for k, v in sorted(st.scalars.items())[:256]},
        )
        self.sums = StepSums()
        return metrics

    def begin_reduce(self, cycle: int) -> tuple[SnapshotReady | None, int]:
        """Enter cycle ``cycle``: its ``snapshot_ready`` frame and the window's step count (the
        reduce weight is ``n ** gamma``).

        No frame where the rank waits for the update (CPU Sync and Cadence): from here to the
        update it trains nothing, so its done counts cannot move before its ``sync_ack`` and
        the coordinator reads them from its own ledger if the rank dies in between
        (docs/design.md §2, commit rule): one frame fewer per rank per cycle."""
        self.pending_reduce = None
        if self.waits_for_update:
            return None, self.window_steps
        return SnapshotReady(rank=self.rank, cycle=cycle, step=self.step), self.window_steps

    def collective_failed(self) -> SessionFailed:
        """Forming the current session, or a collective in it, failed (a peer died, or was
        late): hold every frame but ``new_session``, a save and a stop until the group
        re-forms. Returns the ``session_failed`` to send: without a death nothing else would
        make the coordinator re-form."""
        self.awaiting_session = True
        return SessionFailed(rank=self.rank, session=self.session)

    def admitted(self, session: int, incarnation: int) -> None:
        """The ``accept`` arrived: the session, and — ``incarnation > 0`` — a rejoin."""
        self.session = session
        self.incarnation = incarnation
        if incarnation > 0:
            self.broadcast_done = True
            self.needs_consensus = True

    def end_reduce(
        self,
        cycle: int,
        *,
        divergence: float | None = None,
        pre_norm: float | None = None,
        post_norm: float | None = None,
        consensus: bool = True,
    ) -> SyncAck:
        """The reduce finished: its ``sync_ack``; the rank then waits for its ``update`` where
        the mode says so. ``consensus``: the round realized one (a round of total weight 0
        leaves every rank its own state, so a rejoined rank still awaits it)."""
        ack = SyncAck(
            rank=self.rank,
            cycle=cycle,
            step=self.step,
            session=self.session,
            divergence=divergence,
            pre_norm=pre_norm,
            post_norm=post_norm,
        )
        self.window_steps = 0
        if consensus:
            self.needs_consensus = False
        if self.waits_for_update:
            self.waiting_update = True
        return ack
