"""A deterministic simulated cluster: the production coordinator and rank protocol on a clock.

Pure module (docs/design.md §3): a virtual clock, one seeded ``random.Random``, a
``(time, seq)`` event heap, no threads, no sleeps. Every decision is made by production code:

* the coordinator is the real :class:`~flodl.coord.machine.Coordinator`;
* every rank is a real :class:`~flodl.rank.protocol.RankProtocol` (what each frame means,
  what to do next, which frames it sends); the simulator only plays its executor: a batch takes
  ``ms_per_batch × jitter`` of virtual time, a reduce ``reduce_ms``, an ``epoch_fn``
  ``epoch_fn_ms``, and frames that arrive while the rank is busy wait in its inbox, as they do
  in the bridge's;
* the CPU reduce server is played with the real :class:`~flodl.coord.rounds.RoundBook`; a rank
  waiting for a round longer than the data-plane timeout fails, as its reduce client does;
* a collective completes when every member of the rank's session entered it; a member's death
  fails it for the others (at once for a kill, after the collective timeout for a hang), who
  then hold frames until ``new_session`` and redo it in the new group, as the runtime does;
* the network keeps each connection's order (TCP does): a frame is never delivered before an
  earlier one on the same connection, whatever delay is drawn for it.

Failures: ``kill`` (the launcher reports the exit after ``detect_delay_s``), ``hang``
(silence: only the heartbeat timeout notices), ``rejoin`` (:class:`Failure`). Same seed ⇒
identical trace (the effect log digest proves it). :meth:`SimCluster.run` checks the
coordinator's invariants after every step and raises :class:`~flodl.errors.InvariantViolation`;
a rank that fails without a fault injected into it is a violation too.
"""

from __future__ import annotations

import hashlib
import heapq
import math
import random
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from flodl.config import DEFAULT_BATCH_SIZE, CoordConfig, ElCheConfig, MaxFailure, validated
from flodl.coord.effects import (
    Alert,
    Effect,
    EpochDone,
    OpenReduce,
    RankDead,
    RankLeft,
    RankRejoined,
    Record,
    Reply,
    RunOver,
    Send,
)
from flodl.coord.inputs import ChildExited, ReduceDone
from flodl.coord.machine import Coordinator
from flodl.coord.resume import ResumeState
from flodl.coord.rounds import RoundBook
from flodl.errors import InvariantViolation
from flodl.rank.protocol import (
    Answer,
    Broadcast,
    RankProtocol,
    Reduce,
    Reform,
    RunEpochFn,
    SaveBundle,
    Stop,
    Train,
)
from flodl.sim.invariants import frame_violation, state_violation
from flodl.sim.trace import Failure, SimTrace
from flodl.timeouts import Timeouts
from flodl.wire.frames import (
    Accept,
    BundleSaved,
    CoordFrame,
    CoordHeartbeat,
    EpochFnElapsed,
    Exiting,
    Heartbeat,
    Hello,
    RankFrame,
    Reject,
)

__all__ = ["Failure", "SimCluster", "SimTrace"]  # Failure and SimTrace: flodl.sim.trace

_SIGNATURE = "0" * 64


Busy = Literal["batch", "reduce", "callback"]


@dataclass(slots=True)
class _SimRank:
    rank: int
    ms_per_batch: float
    proto: RankProtocol
    alive: bool = True
    hung: bool = False
    exited: bool = False
    inbox: deque[CoordFrame] = field(default_factory=deque)
    busy: Busy | None = None
    reduce_cycle: int | None = None
    """The cycle the rank is reducing (0: the initial broadcast), until it finishes."""
    group: tuple[int, int] | None = None
    """(cycle, session) of the collective the rank waits in."""
    members: tuple[int, ...] = ()
    last_ms: float = 0.0
    busy_s: float = 0.0
    samples: int = 0
    reduce_seq: int = 0
    reduce_deadline: float | None = None
    """When the CPU reduce the rank is in times out (``data_io_s`` after it began)."""
    killed_at: float | None = None

    @property
    def running(self) -> bool:
        return self.alive and not self.hung and not self.exited


class SimCluster:
    """Drive the real coordinator and rank protocol with simulated ranks on a virtual clock.

    Args:
        world_size: number of ranks.
        mode: one of the five modes (``nccl_cadence``…).
        speeds: ms per batch of each rank (its compute speed).
        dataset_len: samples in the dataset.
        batch_size: per-rank batch size.
        epochs: epochs to train.
        failures: faults to inject.
        seed: seeds every random choice (jitter, network delay).
        jitter: relative half-width of per-batch time noise (0.05 = ±5 %).
        net_delay_ms: one-way control-frame delay (uniform in [0.5×, 1.5×]; each connection
            keeps its order).
        reduce_ms: duration of one parameter reduce (upload+sum+download).
        heartbeat_timeout_s: staleness threshold.
        heartbeat_s: rank heartbeat interval (``None``: the production cadence for
            ``heartbeat_timeout_s``, :attr:`~flodl.timeouts.Timeouts.heartbeat_interval_s`).
        detect_delay_s: launcher child-exit report latency for kills (and the time a
            collective takes to fail on a killed peer's reset).
        max_failure: the run's failure budget.
        check_invariants: verify the invariants after every step (slower, for tests).
        epoch_fn_ms: wall time of ``epoch_fn`` on the epoch-callback role rank at every epoch
            transition (0: no epoch_fn); it blocks that rank, as a real callback.
        elche: ElChe overrides applied to the mode's preset.
        divergence: the divergence rank ``r`` measures around cycle ``c`` as
            ``divergence(c, r)`` and sends in its ``sync_ack`` (``None``: it reports none, as
            without a model); the convergence guard and the LR meta-controller judge it.
        lr: the LR rank ``r`` reports at its step ``s`` as ``lr(s, r)`` (an ``lr_update``
            frame each time the value changes; ``None``: the rank has no scheduler).
        resume: what a checkpoint meta seeds into the coordinator (a resumed run, maybe saved
            at another world size).
        min_world_size: training starts once this many ranks joined (``None``: all).
        join_at: the virtual time each rank says ``hello`` (``None``: all at 0); with
            ``min_world_size``, ranks that come after the formation join the running run.
        reports_per_epoch: the coordinator's sub-epoch reports (``SimTrace.reports``).
        epoch_callback_policy: ``"fastest"`` or a pinned rank (``SimTrace.epoch_fns`` says
            which rank ran each ``epoch_fn``).
        speed_at: ``speed_at(rank, t)``: the rank's ms per batch at virtual time ``t`` (a
            speed that changes over the run, as a replayed record log's does); ``None`` from it,
            or no ``speed_at``, means the rank's ``speeds`` entry.
        keep_records: keep every record the coordinator writes in ``SimTrace.records``, in
            the record log's format with ``ts`` the virtual time in ms.
    """

    def __init__(
        self,
        world_size: int,
        mode: str,
        speeds: Sequence[float],
        *,
        dataset_len: int,
        batch_size: int = DEFAULT_BATCH_SIZE,
        epochs: int = 1,
        failures: Sequence[Failure] = (),
        seed: int = 0,
        jitter: float = 0.05,
        net_delay_ms: float = 0.2,
        reduce_ms: float = 5.0,
        heartbeat_timeout_s: float = 30.0,
        heartbeat_s: float | None = None,
        detect_delay_s: float = 0.005,
        max_failure: MaxFailure | None = None,
        check_invariants: bool = True,
        elche: dict[str, Any] | None = None,
        epoch_fn_ms: float = 0.0,
        divergence: Callable[[int, int], float | None] | None = None,
        lr: Callable[[int, int], float] | None = None,
        resume: ResumeState | None = None,
        min_world_size: int | None = None,
        join_at: Sequence[float] | None = None,
        reports_per_epoch: int | None = None,
        epoch_callback_policy: Literal["fastest"] | int = "fastest",
        speed_at: Callable[[int, float], float | None] | None = None,
        keep_records: bool = False,
    ) -> None:
        if len(speeds) != world_size:
            raise ValueError(f"speeds has {len(speeds)} entries for world_size {world_size}")
        if any(not (s > 0 and math.isfinite(s)) for s in speeds):
            raise ValueError("every speed must be a finite ms/batch > 0")
        self.timeouts = Timeouts(heartbeat_timeout_s)
        self.config = validated(
            CoordConfig,
            world_size=world_size,
            dataset_len=dataset_len,
            batch_size=batch_size,
            num_epochs=epochs,
            elche=ElCheConfig.preset(mode, **(elche or {})),
            timeouts=self.timeouts,
            min_world_size=min_world_size,
            max_failure=max_failure,
            has_epoch_fn=epoch_fn_ms > 0,
            reports_per_epoch=reports_per_epoch,
            epoch_callback_policy=epoch_callback_policy,
        )
        self._job = self.config.job_spec()
        self.traits = self.config.elche.traits
        self.epoch_fn_s = epoch_fn_ms / 1000.0
        self.divergence = divergence
        self.lr = lr
        self.mode = mode
        self.rng = random.Random(seed)
        self.seed = seed
        self.coord = Coordinator(self.config, random.Random(seed), resume=resume)
        waits = self.traits.waits_for_update
        self.ranks = [
            _SimRank(
                r,
                float(s),
                RankProtocol(r, batch_size, waits_for_update=waits),
                members=tuple(range(world_size)),
            )
            for r, s in enumerate(speeds)
        ]
        self.jitter = jitter
        self.speed_at = speed_at
        self.keep_records = keep_records
        self.net_s = net_delay_ms / 1000.0
        self.reduce_s = reduce_ms / 1000.0
        self.heartbeat_s = (
            self.timeouts.heartbeat_interval_s if heartbeat_s is None else float(heartbeat_s)
        )
        self.detect_delay_s = detect_delay_s
        self.check_invariants = check_invariants
        self.now = 0.0
        self._heap: list[tuple[float, int, str, Any]] = []
        self._seq = 0
        self._reduce_watch_armed = False
        """Whether a ``reduce_timeout`` event is queued (at most one: :meth:`_reduce_watch`)."""
        self._digest = hashlib.sha256()
        self._book = RoundBook(world_size)
        self._collective: dict[tuple[int, int], set[int]] = {}
        self._channel_at: dict[tuple[str, int], float] = {}
        self._faulted: set[int] = set()
        self._join_at = join_at
        if join_at is not None and len(join_at) != world_size:
            raise ValueError(f"join_at has {len(join_at)} entries for world_size {world_size}")
        self._rejoining: int | None = None
        """The rank whose ``hello`` the coordinator is handling (its reply has no rank)."""
        self._counts_version = -1
        self.trace = SimTrace(mode=mode, seed=seed, samples=[0] * world_size)
        self._failures = sorted(failures, key=lambda f: (f.at_s, f.rank))
        for f in self._failures:
            self._push(f.at_s, "fault", f)

    # ------------------------------------------------------------------ event plumbing
    def _push(self, at: float, kind: str, payload: Any) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (at, self._seq, kind, payload))

    def _delivery(self, channel: tuple[str, int]) -> float:
        """When a frame sent now on ``channel`` arrives: a random delay, never before the
        frame sent before it on the same connection."""
        at = max(
            self.now + self.net_s * self.rng.uniform(0.5, 1.5), self._channel_at.get(channel, 0.0)
        )
        self._channel_at[channel] = at
        return at

    def _to_coord(self, frame: RankFrame) -> None:
        self._push(self._delivery(("up", frame.rank)), "coord", frame)

    def _to_rank(self, rank: int, frame: CoordFrame) -> None:
        self._push(self._delivery(("down", rank)), "rank", (rank, frame))

    # ------------------------------------------------------------------ run
    def run(self, *, max_virtual_s: float = 1e7, max_events: int = 50_000_000) -> SimTrace:
        """Simulate until the coordinator says the run is over; returns the trace."""
        for r in self.ranks:
            at = 0.0 if self._join_at is None else float(self._join_at[r.rank])
            self._push(at, "join", r.rank)
        events = 0
        while not self.coord.done:
            deadline = self.coord.next_deadline()
            nxt = self._heap[0][0] if self._heap else math.inf
            at = min(nxt, deadline if deadline is not None else math.inf)
            if at == math.inf:
                raise InvariantViolation(f"seed={self.seed}: simulation wedged at {self.now:.3f} s")
            if at > max_virtual_s:
                raise InvariantViolation(
                    f"seed={self.seed}: run exceeded {max_virtual_s} virtual s"
                )
            self.now = max(self.now, at)
            if self._heap and self._heap[0][0] <= at:
                _, _, kind, payload = heapq.heappop(self._heap)
                self._event(kind, payload)
            else:
                self._apply(self.coord.tick(self.now))
                again = self.coord.next_deadline()
                if again is not None and again <= self.now and not self.coord.done:
                    raise InvariantViolation(
                        f"seed={self.seed}: tick({self.now}) left a deadline at {again} armed"
                    )
            events += 1
            if events > max_events:
                raise InvariantViolation(f"seed={self.seed}: over {max_events} events")
            if self.check_invariants:
                self._check(self.violation())
        self.trace.wall_s = self.now
        self.trace.busy_s = [r.busy_s for r in self.ranks]
        self.trace.idle_s = [max(0.0, self.now - r.busy_s) for r in self.ranks]
        self.trace.samples = [r.samples for r in self.ranks]
        self.trace.steps = events
        self.trace.digest = self._digest.hexdigest()
        return self.trace

    def _event(self, kind: str, payload: Any) -> None:
        if kind == "coord":
            self._rejoining = payload.rank if isinstance(payload, Hello) else None
            self._apply(self.coord.handle(payload, self.now))
            self._rejoining = None
        elif kind == "rank":
            rank, frame = payload
            self._arrive(self.ranks[rank], frame)
        elif kind == "batch_done":
            self._batch_done(self.ranks[payload])
        elif kind == "heartbeat":
            r = self.ranks[payload]
            if r.running:  # the bridge beats even while the main thread is busy
                self._to_coord(Heartbeat(rank=r.rank, step=r.proto.step))
                self._push(self.now + self.heartbeat_s, "heartbeat", payload)
        elif kind == "fault":
            self._fault(payload)
        elif kind == "join":
            r = self.ranks[payload]
            if r.running:  # (a rank killed before its join time never says hello)
                self._say_hello(r)
        elif kind == "reduced":
            self._reduced(payload)
        elif kind == "collective_failed":
            self._collective_failed(payload)
        elif kind == "reduce_timeout":
            self._reduce_watch()
        elif kind == "callback_done":
            self._callback_done(self.ranks[payload[0]], payload[1])
        elif kind == "launcher":
            self._to_coord_input(payload)

    def _to_coord_input(self, event: ReduceDone | ChildExited) -> None:
        self._apply(self.coord.handle(event, self.now))

    # ------------------------------------------------------------------ coordinator effects
    def _apply(self, effects: list[Effect]) -> None:
        for e in effects:
            if self.check_invariants:  # repr of every effect is slow; benchmarks skip it
                self._digest.update(f"{self.now:.9f}{e!r}".encode())
            if self.keep_records:
                self._keep_record(e)
            match e:
                case Send(rank=rank, frame=frame):
                    if self.check_invariants:
                        self._check(frame_violation(frame))
                    r = self.ranks[rank]
                    if r.alive and not r.exited and not isinstance(frame, CoordHeartbeat):
                        self._to_rank(rank, frame)
                case OpenReduce(cycle=cycle, ranks=ranks):
                    opened = self._book.open(cycle, ranks)
                    for rank, why in opened.refused:
                        self._rank_fails(self.ranks[rank], f"data connection cut: {why}")
                    if opened.complete is not None:
                        self._round_complete(cycle, opened.complete)
                case RankDead(rank=rank, reason=reason):
                    self.trace.deaths.append((self.now, rank, reason))
                    self._leave_rounds(rank)
                case RankRejoined(rank=rank, incarnation=incarnation):
                    self.trace.rejoins.append((self.now, rank, incarnation))
                    if self.traits.cpu_averaging:
                        self._book.rejoin(rank)
                case Reply(frame=Accept(rank=rank, session=session, incarnation=k)) if k > 0:
                    self.ranks[rank].proto.admitted(session, k)
                case Reply(frame=Reject(reason=reason)) if self._rejoining is not None:
                    self.trace.rejoin_refusals.append((self.now, self._rejoining, reason))
                    # the refused process gives up: its connection is closed, so none of its
                    # frames reaches the coordinator as the rank's (a respawn may follow)
                    refused = self.ranks[self._rejoining]
                    refused.alive, refused.killed_at = False, self.now
                case RankLeft(rank=rank):
                    self._leave_rounds(rank)
                case EpochDone(metrics=m):
                    self.trace.epochs.append(m)
                    self.trace.epoch_at.append(self.now)
                    cov = self.coord.coverage(m.epoch)
                    self.trace.coverage_ok.append(cov is not None and cov.ok)
                case Alert(cls=cls, detail=detail):
                    self.trace.alerts.append((self.now, cls, detail))
                case Record(path="root", kind="node", data=data):
                    self.trace.reports.append((self.now, data["epoch"], data["epoch_progress"]))
                case Record(path="root", kind="contribution", data=data):
                    self.trace.contribution = data["ranks"]
                case RunOver(ok=ok, reason=reason, save_reason=save):
                    self.trace.ok, self.trace.reason, self.trace.save_reason = ok, reason, save
                case _:
                    pass
        self.trace.cycles = self.coord.sync_rounds
        if not self.trace.anchors or self.trace.anchors[-1] != self.coord.elche.anchor:
            self.trace.anchors.append(self.coord.elche.anchor)
        # Counts only change when the coordinator's cohort does (finalize, death, new epoch):
        # copying and comparing W counts after every event would make the simulator O(W²).
        version = self.coord.cohort_version
        if version != self._counts_version:
            self._counts_version = version
            counts = self.coord.elche.batch_counts
            if not self.trace.batch_counts or self.trace.batch_counts[-1] != counts:
                self.trace.batch_counts.append(counts)

    def _keep_record(self, e: Effect) -> None:
        """``keep_records``: a record or alert as the record log would hold it."""
        if isinstance(e, EpochDone):  # merged into its epoch record, as the sinks do
            m = e.metrics
            for rec in reversed(self.trace.records):
                if rec["kind"] == "epoch" and rec["data"].get("epoch") == m.epoch:
                    rec["data"].update(epoch_ms=m.epoch_ms, syncs=m.syncs, anchor=m.anchor)
                    break
            return
        if isinstance(e, Record):
            path, kind, data = e.path, e.kind, dict(e.data)
        elif isinstance(e, Alert):
            path, kind, data = e.path, "event", {"class": e.cls, "detail": e.detail}
        else:
            return
        ts = round(self.now * 1000.0, 3)
        self.trace.records.append({"ts": ts, "path": path, "kind": kind, "data": data})

    def _leave_rounds(self, rank: int) -> None:
        if self.traits.cpu_averaging:
            for cycle, contributors in self._book.leave(rank):
                self._round_complete(cycle, contributors)

    # ------------------------------------------------------------------ the rank executor
    def _arrive(self, r: _SimRank, frame: CoordFrame) -> None:
        if not r.running:
            return
        r.inbox.append(frame)
        if r.busy is None:
            self._step(r)

    def _step(self, r: _SimRank) -> None:
        """The rank's main thread at a step boundary: apply the frames waiting, one at a time
        (callbacks run inline, as in the runtime), then do what the protocol says."""
        proto = r.proto
        while r.running and r.busy is None:
            while r.inbox and r.busy is None and not self._redo_due(r):
                for action in proto.receive(r.inbox.popleft()):
                    self._immediate(r, action)
                    if not r.running:
                        return
                if proto.deferred:  # frames held during a re-formation come back first
                    r.inbox.extendleft(reversed(proto.deferred))
                    proto.deferred.clear()
            if not r.running or r.busy is not None:
                return
            if r.reduce_cycle is not None:
                if self._redo_due(r):  # the collective is redone in the re-formed group
                    self._enter_collective(r, r.reduce_cycle)
                return  # else: waiting for new_session
            match proto.next_action():
                case Stop():
                    self._exit(r)
                    return
                case Broadcast():
                    self._begin_reduce(r, 0)
                case Reduce(cycle=cycle):
                    snapshot, _ = proto.begin_reduce(cycle)
                    if snapshot is not None:
                        self._to_coord(snapshot)
                    self._begin_reduce(r, cycle)
                case Train():
                    self._start_batch(r)
                case _:  # Wait
                    return

    @staticmethod
    def _redo_due(r: _SimRank) -> bool:
        return r.reduce_cycle is not None and r.group is None and not r.proto.awaiting_session

    def _immediate(self, r: _SimRank, action: object) -> None:
        match action:
            case Stop():
                self._exit(r)
            case SaveBundle(frame=save):
                model = save.target_rank == r.rank
                self._to_coord(BundleSaved(rank=r.rank, version=save.version, model=model))
            case RunEpochFn(epoch=epoch) if self.epoch_fn_s > 0:
                self.trace.epoch_fns.append((self.now, epoch, r.rank))
                r.busy = "callback"
                r.busy_s += self.epoch_fn_s
                self._push(self.now + self.epoch_fn_s, "callback_done", (r.rank, epoch))
            case Reform(ranks=members):
                r.members = members
            case Answer(frames=frames):
                for reply in frames:
                    self._to_coord(reply)
            case _:
                pass

    def _exit(self, r: _SimRank) -> None:
        if r.exited:
            return
        stop = r.proto.stopped
        if stop is not None and stop.save_reason is not None:
            self.trace.shutdowns_with_save += 1
        r.exited = True
        self._to_coord(Exiting(rank=r.rank))

    def _start_batch(self, r: _SimRank) -> None:
        if self.lr is not None:
            update = r.proto.lr_set(self.lr(r.proto.lr_step(), r.rank))
            if update is not None:
                self._to_coord(update)
        base = None if self.speed_at is None else self.speed_at(r.rank, self.now)
        ms = (r.ms_per_batch if base is None else base) * self.rng.uniform(
            1 - self.jitter, 1 + self.jitter
        )
        r.busy = "batch"
        r.busy_s += ms / 1000.0
        r.last_ms = ms
        self._push(self.now + ms / 1000.0, "batch_done", r.rank)

    def _batch_done(self, r: _SimRank) -> None:
        if not r.running:
            return
        r.busy = None
        loss = 1.0 / (1.0 + 0.01 * (r.proto.step + 1))
        batch = r.proto.trained(r.last_ms, 0.0, loss)
        r.samples += self.config.batch_size
        self._to_coord(batch)
        self._step(r)

    def _callback_done(self, r: _SimRank, epoch: int) -> None:
        if not r.running:
            return
        r.busy = None
        elapsed_ms = self.epoch_fn_s * 1000.0
        self._to_coord(EpochFnElapsed(rank=r.rank, epoch=epoch, elapsed_ms=elapsed_ms))
        self._step(r)

    # ------------------------------------------------------------------ averaging
    def _begin_reduce(self, r: _SimRank, cycle: int) -> None:
        r.busy = "reduce"
        r.reduce_cycle = cycle
        r.reduce_seq += 1
        if self.traits.cpu_averaging:
            problem = self._book.problem(r.rank, cycle)
            if problem is not None:
                self._rank_fails(r, f"upload refused: {problem}")
                return
            r.reduce_deadline = self.now + self.timeouts.data_io_s
            if not self._reduce_watch_armed:  # (an armed watch is never later than this one)
                self._reduce_watch_armed = True
                self._push(r.reduce_deadline, "reduce_timeout", None)
            contributors = self._book.upload(r.rank, cycle)
            if contributors is not None:
                self._round_complete(cycle, contributors)
        else:
            self._enter_collective(r, cycle)

    def _round_complete(self, cycle: int, contributors: tuple[int, ...]) -> None:
        """The reduce server folded a round: it reports to the coordinator at once and sends
        the consensus to the contributors ``reduce_ms`` later."""
        self._to_coord_input(ReduceDone(cycle, contributors, float(len(contributors))))
        self._push(self.now + self.reduce_s, "reduced", (cycle, contributors, None))

    def _enter_collective(self, r: _SimRank, cycle: int) -> None:
        r.busy = "reduce"
        key = (cycle, r.proto.session)
        r.group = key
        gone = [self.ranks[m] for m in r.members if not self.ranks[m].running]
        if gone:  # a member is dead, hung or gone: the collective fails on this rank too
            self._push(self.now + self._fail_after(gone), "collective_failed", (r.rank, key))
            return
        entered = self._collective.setdefault(key, set())
        entered.add(r.rank)
        if set(r.members) <= entered:
            del self._collective[key]
            self._push(self.now + self.reduce_s, "reduced", (cycle, r.members, key[1]))

    def _fail_after(self, gone: Sequence[_SimRank]) -> float:
        """A reset from a dead or exited peer arrives at once; a hung one is noticed only by
        the collective timeout."""
        if all(m.hung and m.alive for m in gone):
            return self.timeouts.collective_s
        return self.detect_delay_s

    def _collective_failed(self, payload: tuple[int, tuple[int, int]]) -> None:
        rank, key = payload
        r = self.ranks[rank]
        if not r.running or r.group != key:
            return
        self._collective.get(key, set()).discard(rank)
        r.group = None
        r.busy = None
        self._to_coord(r.proto.collective_failed())
        self._step(r)

    def _reduced(self, payload: tuple[int, tuple[int, ...], int | None]) -> None:
        cycle, ranks, session = payload
        for rank in ranks:
            r = self.ranks[rank]
            if not r.running or r.reduce_cycle != cycle:
                continue
            if session is not None and r.group != (cycle, session):
                continue
            r.reduce_cycle = None
            r.group = None
            r.busy = None
            if cycle == 0:
                r.proto.broadcasted()
            else:
                d = None if self.divergence is None else self.divergence(cycle, rank)
                self._to_coord(r.proto.end_reduce(cycle, divergence=d))
            self._step(r)

    def _reduce_watch(self) -> None:
        """The reduce watchdog: every rank still in a CPU reduce it began ``data_io_s`` ago
        fails, as a rank's data-plane read times out; the watch re-arms at the earliest deadline
        of a rank still reducing.

        One queued event for all ranks, not one per rank per cycle: those were cancelled only
        by being ignored when they fired, so the event queue held up to ``world × data_io_s /
        cycle`` dead timers (90,112 by the end of bench_coord's 4,096-rank run, garbage the
        collector's passes traversed). Deadlines only grow (``now + data_io_s``), so a watch
        armed at the earliest one is never late for a rank that begins later, and each rank
        still fails exactly at its deadline."""
        self._reduce_watch_armed = False
        earliest = math.inf
        for r in self.ranks:
            at = r.reduce_deadline
            if at is None or not (r.running and r.busy == "reduce"):
                continue
            if at <= self.now:
                self._rank_fails(
                    r, f"reduce round {r.reduce_cycle} timed out ({self.timeouts.data_io_s:g} s)"
                )
            else:
                earliest = min(earliest, at)
        if earliest < math.inf:
            self._reduce_watch_armed = True
            self._push(earliest, "reduce_timeout", None)

    def _rank_fails(self, r: _SimRank, why: str) -> None:
        """A rank dies on its own (its process exits 1 with a death record)."""
        if not r.running:
            return
        self.trace.rank_failures.append((self.now, r.rank, why))
        self._kill(r)

    def _kill(self, r: _SimRank) -> None:
        r.alive = False
        r.killed_at = self.now
        self._push(self.now + self.detect_delay_s, "launcher", ChildExited(r.rank, -9))
        self._fail_collectives_of(r)

    def _fail_collectives_of(self, gone: _SimRank) -> None:
        """Every collective ``gone`` belongs to fails for the members waiting in it."""
        delay = self._fail_after([gone])
        for other in self.ranks:
            if other.group is not None and gone.rank in other.members and other is not gone:
                self._push(self.now + delay, "collective_failed", (other.rank, other.group))

    def _fault(self, f: Failure) -> None:
        r = self.ranks[f.rank]
        if f.kind == "rejoin":
            if r.hung and r.alive:  # its process ends first, as a kill; the respawn follows
                self._kill(r)  # (docs/design.md §3, "Membership that grows back")
                again = Failure(f.rank, self.now + self.heartbeat_s, "rejoin", f.ms_per_batch)
                self._push(again.at_s, "fault", again)
            elif not r.exited:  # (as a launcher: a rank that left cleanly is never respawned)
                self._respawn(r, f.ms_per_batch)
            return
        if not r.running:
            return
        self._faulted.add(f.rank)
        if f.kind == "kill":
            self._kill(r)
        else:
            r.hung = True
            self._fail_collectives_of(r)

    def _respawn(self, old: _SimRank, ms_per_batch: float | None) -> None:
        """A new incarnation of a killed rank: a fresh rank protocol (the accept tells it it
        rejoins), the same speed, its counters carried over (the trace sums both)."""
        if old.alive or old.killed_at is None or self.now < old.killed_at + self.heartbeat_s:
            raise ValueError(
                f"rank {old.rank}: a rejoin needs a rank killed at least one heartbeat before"
            )
        new = _SimRank(
            old.rank,
            old.ms_per_batch if ms_per_batch is None else ms_per_batch,
            RankProtocol(
                old.rank, self.config.batch_size, waits_for_update=self.traits.waits_for_update
            ),
            members=old.members,
            busy_s=old.busy_s,
            samples=old.samples,
            reduce_seq=old.reduce_seq,
        )
        self.ranks[old.rank] = new
        self._say_hello(new)

    def _say_hello(self, r: _SimRank) -> None:
        hello = Hello(
            run_id=self.config.run_id,
            rank=r.rank,
            world_size=len(self.ranks),
            model_signature=_SIGNATURE,
            job=self._job,
        )
        self._to_coord(hello)
        self._push(self.now + self.heartbeat_s, "heartbeat", r.rank)

    # ------------------------------------------------------------------ invariants
    def violation(self) -> str | None:
        """The first invariant the coordinator's state breaks now, in words, or None
        (``flodl.sim.invariants``; :meth:`run` checks it after every step)."""
        return state_violation(
            self.coord,
            self.traits,
            self.trace,
            world=len(self.ranks),
            stall_ceiling_s=self.config.stall_ceiling_s,
            now=self.now,
        )

    def _check(self, problem: str | None) -> None:
        """Raise ``problem`` (a check of ``flodl.sim.invariants`` found one)."""
        if problem is not None:
            self._violate(problem)

    def _violate(self, what: str) -> None:
        raise InvariantViolation(f"seed={self.seed} mode={self.mode} t={self.now:.4f}: {what}")
