"""A deterministic simulated cluster: fake ranks around the real pure coordinator.

Pure module: a virtual clock, one seeded ``random.Random``, a ``(time, seq)`` event heap, no
threads, no sleeps (the FoundationDB style of STYLE.md §2.7). The real
:class:`~flodl.coord.machine.Coordinator` makes every decision; simulated ranks only model what
real ranks do with its frames:

* each rank trains its assigned slices batch by batch (``ms_per_batch × jitter``), sends a
  ``batch`` frame per step and a ``metrics`` frame per finished slice, heartbeats every second;
* on ``request_params`` / ``sync_now`` it enters the reduce at its next step boundary
  (``snapshot_ready``); the CPU reduce completes when every expected live rank uploaded (the
  simulated reduce server then reports :class:`~flodl.coord.inputs.ReduceDone`), the collective
  when every member of the current session entered; then the rank acks (``sync_ack``);
* CPU Sync/Cadence ranks wait for the ``update`` (Cadence gets its next chunk folded in);
* failures: ``kill`` (the launcher reports the exit after ``detect_delay_s``) and ``hang``
  (silence: only the heartbeat timeout notices).

Same seed ⇒ identical trace (the effect log digest proves it). :meth:`SimCluster.run` checks
the coordinator's invariants after every step and raises :class:`InvariantViolation`.
"""

from __future__ import annotations

import hashlib
import heapq
import math
import random
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from flodl.config import CoordConfig, ElCheConfig, MaxFailure, validated
from flodl.coord.cycle import should_average
from flodl.coord.effects import (
    Alert,
    Close,
    Effect,
    EpochDone,
    OpenReduce,
    RankDead,
    RunOver,
    Send,
    WriteMeta,
)
from flodl.coord.inputs import ChildExited, ReduceDone
from flodl.coord.liveness import RankState
from flodl.coord.machine import Coordinator, RunPhase
from flodl.errors import InvariantViolation
from flodl.timeouts import Timeouts
from flodl.wire.frames import (
    Batch,
    BundleSaved,
    DeclareDead,
    EpochFnElapsed,
    EpochMetrics,
    EpochPlan,
    Exiting,
    ExtendPartition,
    Heartbeat,
    Hello,
    Metrics,
    NewSession,
    RankFrame,
    RequestParams,
    SaveConsensusModel,
    SetEpochCallbackRole,
    Shutdown,
    ShutdownWithSave,
    SnapshotReady,
    StartEpoch,
    SyncAck,
    SyncNow,
    Throttle,
    Update,
)

__all__ = ["Failure", "SimCluster", "SimTrace", "InvariantViolation"]

_SIGNATURE = "0" * 64


@dataclass(frozen=True, slots=True)
class Failure:
    """A fault injected at virtual time ``at_s``.

    ``kind``: ``"kill"`` (process dies; the launcher reports it after ``detect_delay_s``),
    ``"hang"`` (the rank goes silent; only the heartbeat timeout notices).
    """

    rank: int
    at_s: float
    kind: Literal["kill", "hang"] = "kill"


@dataclass(slots=True)
class SimTrace:
    """What a simulated run did."""

    mode: str
    seed: int
    ok: bool = False
    reason: str = ""
    save_reason: str | None = None
    wall_s: float = 0.0
    cycles: int = 0
    anchors: list[int] = field(default_factory=list)
    batch_counts: list[list[int]] = field(default_factory=list)
    busy_s: list[float] = field(default_factory=list)
    idle_s: list[float] = field(default_factory=list)
    samples: list[int] = field(default_factory=list)
    epochs: list[EpochMetrics] = field(default_factory=list)
    coverage_ok: list[bool] = field(default_factory=list)
    deaths: list[tuple[float, int, str]] = field(default_factory=list)
    shutdowns_with_save: int = 0
    digest: str = ""
    steps: int = 0

    @property
    def idle_fraction(self) -> list[float]:
        return [i / self.wall_s if self.wall_s > 0 else 0.0 for i in self.idle_s]

    def summary(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "seed": self.seed,
            "ok": self.ok,
            "reason": self.reason,
            "wall_s": round(self.wall_s, 3),
            "syncs": self.cycles,
            "final_anchor": self.anchors[-1] if self.anchors else None,
            "final_counts": self.batch_counts[-1] if self.batch_counts else None,
            "idle_fraction": [round(f, 4) for f in self.idle_fraction],
            "samples": self.samples,
        }


@dataclass(slots=True)
class _SimRank:
    rank: int
    ms_per_batch: float
    alive: bool = True
    hung: bool = False
    exited: bool = False
    queue: deque[list[int]] = field(default_factory=deque)  # [epoch, batches_left, tail]
    step: int = 0
    training: bool = False
    reduce_wanted: int | None = None
    in_reduce: int | None = None
    waiting_update: bool = False
    throttled: bool = False
    slice_batches: int = 0
    slice_loss: float = 0.0
    slice_ms: float = 0.0
    last_ms: float = 0.0
    busy_s: float = 0.0
    samples: int = 0
    session: int = 0
    members: tuple[int, ...] = ()
    role: int = 0
    last_epoch: int = -1  # last epoch whose epoch_fn ran on this rank
    in_callback: bool = False


class SimCluster:
    """Drive the real coordinator with simulated ranks on a virtual clock.

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
        net_delay_ms: one-way control-frame delay (uniform in [0.5×, 1.5×]).
        reduce_ms: duration of one parameter reduce (upload+sum+download).
        heartbeat_timeout_s: staleness threshold.
        heartbeat_s: rank heartbeat interval.
        detect_delay_s: launcher child-exit report latency for kills.
        max_failure: the run's failure budget.
        check_invariants: verify the invariants after every step (slower, for tests).
        epoch_fn_ms: wall time of ``epoch_fn`` on the epoch-callback role rank at every epoch
            transition (0: no epoch_fn); it blocks that rank's training, as a real callback.
        elche: ElChe overrides applied to the mode's preset.
    """

    def __init__(
        self,
        world_size: int,
        mode: str,
        speeds: Sequence[float],
        *,
        dataset_len: int,
        batch_size: int = 32,
        epochs: int = 1,
        failures: Sequence[Failure] = (),
        seed: int = 0,
        jitter: float = 0.05,
        net_delay_ms: float = 0.2,
        reduce_ms: float = 5.0,
        heartbeat_timeout_s: float = 30.0,
        heartbeat_s: float = 1.0,
        detect_delay_s: float = 0.005,
        max_failure: MaxFailure | None = None,
        check_invariants: bool = True,
        elche: dict[str, Any] | None = None,
        epoch_fn_ms: float = 0.0,
    ) -> None:
        if len(speeds) != world_size:
            raise ValueError(f"speeds has {len(speeds)} entries for world_size {world_size}")
        if any(not (s > 0 and math.isfinite(s)) for s in speeds):
            raise ValueError("every speed must be a finite ms/batch > 0")
        self.config = validated(
            CoordConfig,
            world_size=world_size,
            dataset_len=dataset_len,
            batch_size=batch_size,
            num_epochs=epochs,
            elche=ElCheConfig.preset(mode, **(elche or {})),
            timeouts=Timeouts(heartbeat_timeout_s),
            max_failure=max_failure,
            has_epoch_fn=epoch_fn_ms > 0,
        )
        self.epoch_fn_s = epoch_fn_ms / 1000.0
        self.mode = mode
        self.rng = random.Random(seed)
        self.seed = seed
        self.coord = Coordinator(self.config, random.Random(seed))
        self.ranks = [_SimRank(r, float(s)) for r, s in enumerate(speeds)]
        self.jitter = jitter
        self.net_s = net_delay_ms / 1000.0
        self.reduce_s = reduce_ms / 1000.0
        self.heartbeat_s = heartbeat_s
        self.detect_delay_s = detect_delay_s
        self.check_invariants = check_invariants
        self.now = 0.0
        self._heap: list[tuple[float, int, str, Any]] = []
        self._seq = 0
        self._digest = hashlib.sha256()
        self._uploads: dict[int, set[int]] = {}
        self._expected: dict[int, set[int]] = {}
        self._collective: dict[tuple[int, int], set[int]] = {}
        self._counts_version = -1
        self.trace = SimTrace(mode=mode, seed=seed, samples=[0] * world_size)
        self._failures = sorted(failures, key=lambda f: (f.at_s, f.rank))
        for f in self._failures:
            self._push(f.at_s, "fault", f)

    # ------------------------------------------------------------------ event plumbing
    def _push(self, at: float, kind: str, payload: Any) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (at, self._seq, kind, payload))

    def _delay(self) -> float:
        return self.net_s * self.rng.uniform(0.5, 1.5)

    def _to_coord(self, frame: RankFrame | ChildExited | ReduceDone, at: float) -> None:
        self._push(at, "coord", frame)

    def _to_rank(self, rank: int, frame: Any, at: float) -> None:
        self._push(at, "rank", (rank, frame))

    # ------------------------------------------------------------------ run
    def run(self, *, max_virtual_s: float = 1e7, max_events: int = 50_000_000) -> SimTrace:
        """Simulate until the coordinator says the run is over; returns the trace."""
        for r in range(len(self.ranks)):
            hello = Hello(
                run_id=self.config.run_id,
                rank=r,
                world_size=len(self.ranks),
                model_signature=_SIGNATURE,
            )
            self._to_coord(hello, self._delay())
            self._push(self.heartbeat_s, "heartbeat", r)
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
                self._check()
        self.trace.wall_s = self.now
        self.trace.busy_s = [r.busy_s for r in self.ranks]
        self.trace.idle_s = [max(0.0, self.now - r.busy_s) for r in self.ranks]
        self.trace.samples = [r.samples for r in self.ranks]
        self.trace.steps = events
        self.trace.digest = self._digest.hexdigest()
        return self.trace

    def _event(self, kind: str, payload: Any) -> None:
        if kind == "coord":
            self._apply(self.coord.handle(payload, self.now))
        elif kind == "rank":
            rank, frame = payload
            self._rank_frame(self.ranks[rank], frame)
        elif kind == "batch_done":
            self._batch_done(self.ranks[payload])
        elif kind == "heartbeat":
            r = self.ranks[payload]
            if r.alive and not r.hung and not r.exited:
                self._to_coord(Heartbeat(rank=r.rank, step=r.step), self.now + self._delay())
                self._push(self.now + self.heartbeat_s, "heartbeat", payload)
        elif kind == "fault":
            self._fault(payload)
        elif kind == "reduced":
            self._reduce_complete(payload)
        elif kind == "callback_done":
            self._callback_done(self.ranks[payload[0]], payload[1])

    # ------------------------------------------------------------------ coordinator effects
    def _apply(self, effects: list[Effect]) -> None:
        for e in effects:
            if self.check_invariants:  # repr of every effect is slow; benchmarks skip it
                self._digest.update(f"{self.now:.9f}{e!r}".encode())
            match e:
                case Send(rank=rank, frame=frame):
                    r = self.ranks[rank]
                    if r.alive and not r.exited:
                        self._to_rank(rank, frame, self.now + self._delay())
                case OpenReduce(cycle=cycle, ranks=ranks):
                    self._expected[cycle] = set(ranks)
                    self._uploads.setdefault(cycle, set())
                    self._maybe_reduce_done(cycle)
                case RankDead(rank=rank, reason=reason):
                    self.trace.deaths.append((self.now, rank, reason))
                    for cycle, expected in list(self._expected.items()):
                        expected.discard(rank)
                        self._maybe_reduce_done(cycle)
                case EpochDone(metrics=m):
                    self.trace.epochs.append(m)
                    cov = self.coord.coverage(m.epoch)
                    self.trace.coverage_ok.append(cov is not None and cov.ok)
                case RunOver(ok=ok, reason=reason, save_reason=save):
                    self.trace.ok, self.trace.reason, self.trace.save_reason = ok, reason, save
                case WriteMeta() | Close() | Alert():
                    pass
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

    # ------------------------------------------------------------------ simulated ranks
    def _rank_frame(self, r: _SimRank, frame: Any) -> None:
        if not r.alive or r.hung or r.exited:
            return
        match frame:
            case StartEpoch(plan=plan):
                self._enqueue(r, plan)
                r.throttled = False
            case SetEpochCallbackRole(rank=role):
                r.role = role
            case ExtendPartition(epoch=epoch, partition_size=size):
                r.queue.append([epoch, size // self.config.batch_size, 0])
            case RequestParams(cycle=cycle) | SyncNow(cycle=cycle):
                r.reduce_wanted = cycle
                r.throttled = False
            case Update(next_plan=plan):
                r.waiting_update = False
                r.throttled = False
                if plan is not None:
                    self._enqueue(r, plan)
            case Throttle():
                r.throttled = True
            case DeclareDead():
                pass
            case SaveConsensusModel(target_rank=target, version=version):
                saved = BundleSaved(rank=r.rank, version=version, model=target == r.rank)
                self._to_coord(saved, self.now + self._delay())
            case NewSession(session=session, ranks=members):
                r.session = session
                r.members = tuple(members)
                if r.in_reduce is not None and not self.config.elche.traits.cpu_averaging:
                    self._enter_collective(r, r.in_reduce)
            case Shutdown() | ShutdownWithSave():
                if isinstance(frame, ShutdownWithSave):
                    self.trace.shutdowns_with_save += 1
                r.exited = True
                self._to_coord(Exiting(rank=r.rank), self.now + self._delay())
                return
            case _:
                pass
        self._continue(r)

    def _start_callback(self, r: _SimRank, epoch: int) -> None:
        """``epoch_fn`` for the epoch that just ended: blocks training, then reports."""
        r.in_callback = True
        self._push(self.now + self.epoch_fn_s, "callback_done", (r.rank, epoch))

    def _callback_done(self, r: _SimRank, epoch: int) -> None:
        r.in_callback = False
        if not r.alive or r.hung or r.exited:
            return
        frame = EpochFnElapsed(rank=r.rank, epoch=epoch, elapsed_ms=self.epoch_fn_s * 1000.0)
        self._to_coord(frame, self.now + self._delay())
        self._continue(r)

    def _enqueue(self, r: _SimRank, plan: EpochPlan) -> None:
        r.queue.append(
            [plan.epoch, plan.partition_size // self.config.batch_size, int(plan.epoch_tail)]
        )

    def _continue(self, r: _SimRank) -> None:
        """At a step boundary: reduce if asked, else train the next batch if allowed."""
        if r.training or r.in_reduce is not None or not r.alive or r.hung or r.exited:
            return
        if r.in_callback:
            return
        if r.reduce_wanted is not None:
            self._enter_reduce(r, r.reduce_wanted)
            return
        if r.waiting_update or r.throttled:
            return
        while r.queue and r.queue[0][1] <= 0:
            r.queue.popleft()
        if not r.queue:
            return
        ms = r.ms_per_batch * self.rng.uniform(1 - self.jitter, 1 + self.jitter)
        r.training = True
        r.busy_s += ms / 1000.0
        r.slice_ms += ms
        r.last_ms = ms
        self._push(self.now + ms / 1000.0, "batch_done", r.rank)

    def _batch_done(self, r: _SimRank) -> None:
        if not r.alive or r.hung or r.exited:
            return
        r.training = False
        head = r.queue[0]
        head[1] -= 1
        r.step += 1
        r.samples += self.config.batch_size
        loss = 1.0 / (1.0 + 0.01 * r.step)
        r.slice_batches += 1
        r.slice_loss += loss
        at = self.now + self._delay()
        self._to_coord(
            Batch(
                rank=r.rank,
                epoch=head[0],
                step=r.step,
                batch_ms=r.last_ms,
                loss=loss,
            ),
            at,
        )
        if head[1] == 0:
            r.queue.popleft()
            self._to_coord(
                Metrics(
                    rank=r.rank,
                    epoch=head[0],
                    avg_loss=r.slice_loss / r.slice_batches,
                    batches_processed=r.slice_batches,
                    samples_processed=r.slice_batches * self.config.batch_size,
                    epoch_ms=r.slice_ms,
                    share_complete_ms=r.slice_ms,
                    compute_only_ms=r.slice_ms,
                ),
                at,
            )
            r.slice_batches, r.slice_loss, r.slice_ms = 0, 0.0, 0.0
            # epoch_fn runs on the role rank when it finishes the epoch's tail slice
            if head[2] and r.rank == r.role and self.epoch_fn_s > 0 and head[0] > r.last_epoch:
                r.last_epoch = head[0]
                self._start_callback(r, head[0])
                return
        self._continue(r)

    def _enter_reduce(self, r: _SimRank, cycle: int) -> None:
        r.reduce_wanted = None
        r.in_reduce = cycle
        self._to_coord(
            SnapshotReady(rank=r.rank, cycle=cycle, step=r.step), self.now + self._delay()
        )
        if self.config.elche.traits.cpu_averaging:
            self._uploads.setdefault(cycle, set()).add(r.rank)
            self._maybe_reduce_done(cycle)
        else:
            self._enter_collective(r, cycle)

    def _maybe_reduce_done(self, cycle: int) -> None:
        expected = self._expected.get(cycle)
        uploads = self._uploads.get(cycle, set())
        if expected is None or cycle == 0 or not expected or not expected <= uploads:
            return
        contributors = tuple(sorted(expected))
        del self._expected[cycle]
        self._to_coord(ReduceDone(cycle, contributors, float(len(contributors))), self.now)
        self._push(self.now + self.reduce_s, "reduced", (cycle, contributors, 0))

    def _enter_collective(self, r: _SimRank, cycle: int) -> None:
        members = r.members or tuple(range(len(self.ranks)))
        key = (cycle, r.session)
        entered = self._collective.setdefault(key, set())
        entered.add(r.rank)
        if set(members) <= entered:
            del self._collective[key]
            self._push(self.now + self.reduce_s, "reduced", (cycle, members, r.session))

    def _reduce_complete(self, payload: tuple[int, tuple[int, ...], int]) -> None:
        cycle, ranks, session = payload
        for rank in ranks:
            r = self.ranks[rank]
            if not r.alive or r.hung or r.exited or r.in_reduce != cycle:
                continue
            if not self.config.elche.traits.cpu_averaging and r.session != session:
                continue
            r.in_reduce = None
            self._to_coord(
                SyncAck(rank=rank, cycle=cycle, step=r.step, session=r.session),
                self.now + self._delay(),
            )
            if self.config.elche.traits.waits_for_update:
                r.waiting_update = True
            self._continue(r)

    def _fault(self, f: Failure) -> None:
        r = self.ranks[f.rank]
        if not r.alive or r.exited:
            return
        if f.kind == "kill":
            r.alive = False
            self._to_coord(ChildExited(f.rank, -9), self.now + self.detect_delay_s)
        else:
            r.hung = True

    # ------------------------------------------------------------------ invariants
    def _check(self) -> None:
        c = self.coord
        if c.phase is RunPhase.FORMING:
            return
        barrier = self.config.elche.barrier_paced
        for e, work in c.dispatch.works.items():
            report = work.coverage_report()
            if not report.ok:
                self._violate(f"epoch {e} ledger broken: {report}")
            for rank in range(len(self.ranks)):
                dead = c.membership.state(rank) is RankState.DEAD
                if dead and rank not in c.averaging.deferred_forfeit and work.pending(rank):
                    self._violate(f"dead rank {rank} still holds work in epoch {e}")
                if barrier and c.progressive and len(work.outstanding(rank)) > 1:
                    self._violate(f"rank {rank} has more than one chunk in flight (epoch {e})")
        if barrier and c.phase is RunPhase.TRAINING and len(c.dispatch.works) > 1:
            self._violate(f"barrier-paced run has epochs {sorted(c.dispatch.works)} open at once")
        if c.phase is RunPhase.TRAINING and not c.cycle.pending:
            alive = c.membership.alive()
            expected = should_average(
                one_step=self.config.elche.traits.one_step_gate,
                alive=alive,
                window_steps=[r.window.steps for r in c.windows],
                counts=[max(1, n) for n in c.elche.batch_counts],
                quiesced=[c.in_flight(r) == 0 for r in range(len(self.ranks))],
                chunked=c.traits.chunk_is_window and c.progressive,
            )
            if expected != c.gate_open():
                self._violate(f"incremental count gate {c.gate_open()} != should_average")
        stall = c.cycle.stall_deadline(self.config.stall_ceiling_s)
        if stall is not None and self.now > stall + 1e-9 and c.save_reason is None:
            self._violate("a cycle stayed pending past the stall ceiling")
        for cov_ok in self.trace.coverage_ok:
            if not cov_ok:
                self._violate("an epoch closed without exact coverage")

    def _violate(self, what: str) -> None:
        raise InvariantViolation(f"seed={self.seed} mode={self.mode} t={self.now:.4f}: {what}")
