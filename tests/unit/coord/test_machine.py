"""The pure coordinator machine driven with hand-written frames on a fake clock.

Production constants throughout: heartbeat timeout 30 s, stall ceiling max(10 × 30, 300) = 300 s,
join timeout 300 s, coordinator heartbeat 1 s. No sleeps: time is an argument.
"""

from __future__ import annotations

import itertools
import random
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import pytest
from fakeclock import FakeClock

from flodl.config import CoordConfig, ElCheConfig, MaxFailure, validated
from flodl.coord.effects import (
    Alert,
    Close,
    Effect,
    EpochDone,
    EvalDone,
    OpenReduce,
    RankDead,
    RankLeft,
    RankRejoined,
    Record,
    RefusePeer,
    Reply,
    RunOver,
    Send,
    WriteMeta,
)
from flodl.coord.inputs import ChildExited, PeerLost, ReduceDone
from flodl.coord.ledger import BatchRange
from flodl.coord.liveness import RankState
from flodl.coord.machine import Coordinator, RunPhase
from flodl.coord.resume import META_SCHEMA_VERSION
from flodl.timeouts import Timeouts
from flodl.wire.frames import (
    PROTOCOL_VERSION,
    Accept,
    Batch,
    BundleSaved,
    CoordHeartbeat,
    DeclareDead,
    EpochAggregated,
    EpochPlan,
    EvalResult,
    ExecuteEval,
    Exiting,
    ExtendPartition,
    Heartbeat,
    Hello,
    Metrics,
    NewSession,
    PartitionRevoked,
    RankExited,
    Reject,
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
    rank_spans,
)

SIG = "a" * 64
BS = 32


def make_config(
    mode: str = "cpu_cadence", world_size: int = 2, dataset_len: int = 640, **kw: Any
) -> CoordConfig:
    return validated(
        CoordConfig,
        world_size=world_size,
        dataset_len=dataset_len,
        batch_size=BS,
        elche=ElCheConfig.preset(mode),
        **kw,
    )


def hello(rank: int, world_size: int = 2, **kw: Any) -> Hello:
    values: dict[str, Any] = {"run_id": "run", "model_signature": SIG, **kw}
    return Hello(rank=rank, world_size=world_size, **values)


def batch(rank: int, step: int, epoch: int = 0, ms: float | None = None) -> Batch:
    ms = 10.0 + rank if ms is None else ms
    return Batch(rank=rank, epoch=epoch, step=step, batch_ms=ms, loss=1.0)


def chunk_metrics(rank: int, epoch: int, n: int) -> Metrics:
    return Metrics(
        rank=rank,
        epoch=epoch,
        avg_loss=1.0,
        batches_processed=n,
        samples_processed=BS * n,
        epoch_ms=10.0 * n,
        share_complete_ms=10.0 * n,
        compute_only_ms=10.0 * n,
    )


def with_report(b: Batch, report: Metrics) -> Batch:
    return Batch(**(b.model_dump() | {"metrics": report}))


class Cluster:
    """N fake ranks played synchronously against a real Coordinator, answering like
    ``flodl/sim/cluster.py`` (train → snapshot_ready (Async, collective) → [ReduceDone] →
    sync_ack → update …)."""

    def __init__(self, config: CoordConfig) -> None:
        self.config, self.clock = config, FakeClock()
        self.coord = Coordinator(config, random.Random(0))
        w = self.w = config.world_size
        self.cpu = config.elche.backend == "cpu"
        self.fold_metrics = True
        """Slice reports ride on the slice's last batch (a rank's way); False: separate frames."""
        self.trace: list[Any] = []  # inputs and effects, in order
        self.inbox: list[deque[Any]] = [deque() for _ in range(w)]
        # [epoch, left, done, end batch] per slice
        self.work: list[deque[list[int]]] = [deque() for _ in range(w)]
        self.step = [0] * w
        self.wanted: list[int | None] = [None] * w
        self.in_reduce: list[int | None] = [None] * w
        self.waiting, self.session = [False] * w, [0] * w
        self.members = [tuple(range(w))] * w
        self.out: set[int] = set()  # dead or exited: acts no more
        self.expected: dict[int, set[int]] = {}
        self.entered: dict[Any, set[int]] = {}
        self.batch_ms: list[float] | None = None  # None: 10 + rank ms a batch
        self.role = [0] * w  # the epoch-callback role each rank was told
        self.epoch_fns: list[tuple[int, int]] = []  # (epoch, rank) of every epoch_fn run
        self.evals: list[tuple[int, int]] = []  # (epoch tag, rank) of every eval run

    def feed(self, event: Any) -> list[Effect]:
        self.trace.append(event)
        return self._route(self.coord.handle(event, self.clock.now))

    def tick(self) -> list[Effect]:
        return self._route(self.coord.tick(self.clock.now))

    def _route(self, effects: list[Effect]) -> list[Effect]:
        self.trace.extend(effects)
        for e in effects:
            if isinstance(e, Send):
                self.inbox[e.rank].append(e.frame)
            elif isinstance(e, OpenReduce):
                self.expected[e.cycle] = set(e.ranks)
            elif isinstance(e, RankDead):
                self.out.add(e.rank)
                for c in list(self.expected):
                    self.expected[c].discard(e.rank)
                    self._maybe_reduced(c)
        return effects

    def join(self) -> None:
        for r in range(self.w):
            self.feed(hello(r, self.w))

    def kill(self, rank: int) -> list[Effect]:
        self.out.add(rank)
        return self.feed(ChildExited(rank, -9))

    def run(self, until: Callable[[], bool] = lambda: False, limit: int = 20_000) -> None:
        for _ in range(limit):
            moved = False
            for r in range(self.w):
                if until():
                    return
                moved = self.act(r) or moved
            if not moved:
                return
        raise AssertionError("the cluster did not settle")

    def act(self, r: int) -> bool:
        if r in self.out:
            return False
        if self.inbox[r]:
            self._receive(r, self.inbox[r].popleft())
        elif (wanted := self.wanted[r]) is not None:
            self._enter_reduce(r, wanted)
        elif self.waiting[r] or self.in_reduce[r] is not None:
            return False
        else:
            while self.work[r] and self.work[r][0][1] == 0:
                self.work[r].popleft()
            if not self.work[r]:
                return False
            head = self.work[r][0]
            head[1], head[2], self.step[r] = head[1] - 1, head[2] + 1, self.step[r] + 1
            ms = None if self.batch_ms is None else self.batch_ms[r]
            done = batch(r, self.step[r], head[0], ms)
            if head[1] > 0:
                self.feed(done)
            elif self.fold_metrics:  # the slice's report rides on its last batch, as a rank's
                self.feed(with_report(done, chunk_metrics(r, head[0], head[2])))
            else:  # the separate frame (a slice cut short by a revoke reports so)
                self.feed(done)
                self.feed(chunk_metrics(r, head[0], head[2]))
        return True

    def _receive(self, r: int, frame: Any) -> None:
        match frame:
            case StartEpoch(plan=plan) | Update(next_plan=EpochPlan() as plan):
                self.waiting[r] = False
                end = (plan.partition_offset + plan.partition_size) // BS
                self.work[r].append([plan.epoch, plan.partition_size // BS, 0, end])
            case ExtendPartition(epoch=epoch, partition_offset=offset, partition_size=size):
                self.work[r].append([epoch, size // BS, 0, (offset + size) // BS])
            case RevokePartition(epoch=epoch, partition_offset=offset, partition_size=size):
                # the untrained part of a slice is its last ``left`` batches
                dropped = 0
                for entry in self.work[r]:
                    if entry[0] == epoch and entry[3] == (offset + size) // BS:
                        dropped = min(entry[1], size // BS)
                        entry[1] -= dropped
                        entry[3] -= dropped
                        break
                self.feed(
                    PartitionRevoked(
                        rank=r,
                        epoch=epoch,
                        partition_offset=offset,
                        partition_size=size,
                        revoked_size=dropped * BS,
                    )
                )
            case Update():
                self.waiting[r] = False
            case RequestParams(cycle=c) | SyncNow(cycle=c):
                self.wanted[r] = c
            case NewSession(session=s):
                self.session[r], self.members[r] = s, tuple(frame.members())
                if (cycle := self.in_reduce[r]) is not None:
                    self._enter_collective(r, cycle)
            case SaveConsensusModel(target_rank=target, version=v):
                self.feed(BundleSaved(rank=r, version=v, model=target == r))
            case SetEpochCallbackRole(rank=role):
                self.role[r] = role
            case EpochAggregated(metrics=m) if self.role[r] == r:  # as RankProtocol does
                self.epoch_fns.append((m.epoch, r))
            case ExecuteEval(schedule_id=sid, epoch=epoch):
                self.evals.append((epoch, r))
                self.feed(
                    EvalResult(rank=r, schedule_id=sid, epoch=epoch, metric=0.5, elapsed_ms=1.0)
                )
            case Shutdown() | ShutdownWithSave():
                self.out.add(r)
                self.feed(Exiting(rank=r))

    def _enter_reduce(self, r: int, c: int) -> None:
        self.wanted[r], self.in_reduce[r] = None, c
        if not self.config.elche.traits.waits_for_update:  # as RankProtocol.begin_reduce
            self.feed(SnapshotReady(rank=r, cycle=c, step=self.step[r]))
        if self.cpu:
            self.entered.setdefault(c, set()).add(r)
            self._maybe_reduced(c)
        else:
            self._enter_collective(r, c)

    def _maybe_reduced(self, c: int) -> None:
        ranks = self.expected.get(c)
        if not ranks or not ranks <= self.entered.get(c, set()):
            return
        del self.expected[c]
        self.feed(ReduceDone(c, tuple(sorted(ranks)), float(len(ranks))))
        self._ack(sorted(ranks), c)

    def _enter_collective(self, r: int, c: int) -> None:
        entered = self.entered.setdefault((c, self.session[r]), set())
        entered.add(r)
        if set(self.members[r]) <= entered:
            self._ack(self.members[r], c)

    def _ack(self, ranks: Sequence[int], c: int) -> None:
        for r in ranks:
            if r not in self.out and self.in_reduce[r] == c:
                self.in_reduce[r] = None
                self.waiting[r] = self.cpu and self.config.elche.policy != "async"
                self.feed(SyncAck(rank=r, cycle=c, step=self.step[r], session=self.session[r]))


def of(effects: Sequence[Any], kind: type) -> list[Any]:
    return [e for e in effects if isinstance(e, kind)]


def sends(effects: Sequence[Any], kind: type) -> list[tuple[int, Any]]:
    return [(e.rank, e.frame) for e in effects if isinstance(e, Send) and isinstance(e.frame, kind)]


def commit_bundles(c: Cluster, effects: Sequence[Any]) -> tuple[list[WriteMeta], list[Any]]:
    """Answer the bundle requests in ``effects`` as the writer rank would; the metas written
    and every effect of the answers (a stop held for the bundle goes out with its commit)."""
    out: list[Any] = []
    for rank, frame in sends(effects, SaveConsensusModel):
        if frame.target_rank == rank:
            out += c.feed(BundleSaved(rank=rank, version=frame.version, model=True))
    return of(out, WriteMeta), out


def plan(offset: int, size: int, epoch: int = 0) -> EpochPlan:
    return EpochPlan(epoch=epoch, partition_offset=offset, partition_size=size)


def session(number: int, *, ranks: list[int]) -> NewSession:
    return NewSession(
        session=number,
        store_prefix=f"run/s{number}",
        new_world_size=len(ranks),
        spans=rank_spans(ranks),
    )


def index(trace: Sequence[Any], pred: Callable[[Any], bool]) -> int:
    return next(i for i, e in enumerate(trace) if pred(e))


def joined(mode: str = "cpu_cadence", world_size: int = 2, **kw: Any) -> Cluster:
    cluster = Cluster(make_config(mode, world_size, **kw))
    cluster.join()
    return cluster


def runs_to_completion(c: Cluster) -> None:
    """Run ``c`` to its end: the run completes, every epoch's coverage exact."""
    c.run()
    assert c.coord.done and c.coord.phase_log[-1][1] == "run complete"
    for epoch in range(c.config.total_epochs):
        cov = c.coord.coverage(epoch)
        assert cov is not None and cov.ok, (epoch, cov)


def heartbeat_all(c: Cluster, ranks: Sequence[int]) -> None:
    for r in ranks:
        c.feed(Heartbeat(rank=r, step=c.step[r]))


# =============================================================================================
# Handshake and formation
# =============================================================================================


def test_production_constants() -> None:
    config = make_config()
    assert config.heartbeat_timeout_s == 30.0
    assert config.stall_ceiling_s == 300.0
    assert config.join_timeout_s == 300.0


def test_hello_is_accepted_with_the_run_parameters() -> None:
    coord = Coordinator(make_config(), random.Random(0))
    effects = coord.handle(hello(0), 0.0)
    assert effects == [
        Reply(Accept(run_id="run", rank=0, world_size=2, session=0, heartbeat_timeout_s=30.0))
    ]
    assert coord.phase is RunPhase.FORMING
    assert coord.membership.liveness.state(0) is RankState.ALIVE


@pytest.mark.parametrize(
    ("frame", "needle"),
    [
        (hello(0, protocol=PROTOCOL_VERSION + 1), f"protocol {PROTOCOL_VERSION + 1} not supported"),
        (hello(0, run_id="other"), "run id 'other'"),
        (hello(0, world_size=3), "world size 3"),
        (hello(2), "rank 2 out of range"),
    ],
)
def test_hello_refusals_carry_a_reason(frame: Hello, needle: str) -> None:
    coord = Coordinator(make_config(), random.Random(0))
    effects = coord.handle(frame, 0.0)
    assert len(effects) == 2
    reply, refuse = effects
    assert isinstance(reply, Reply) and isinstance(reply.frame, Reject)
    assert needle in reply.frame.reason
    assert refuse == RefusePeer(reply.frame.reason)
    assert coord.membership.liveness.joined_count() == 0
    assert coord.handle(hello(0), 0.0)[0] == Reply(  # the real rank 0 can still join
        Accept(run_id="run", rank=0, world_size=2, heartbeat_timeout_s=30.0)
    )


def refusal(effects: list[Effect]) -> str:
    assert [type(e) for e in effects] == [Reply, RefusePeer]
    reply = effects[0]
    assert isinstance(reply, Reply) and isinstance(reply.frame, Reject)
    return reply.frame.reason


def test_duplicate_rank_is_refused() -> None:
    coord = Coordinator(make_config(world_size=3), random.Random(0))
    coord.handle(hello(1, 3), 0.0)
    assert "duplicate rank" in refusal(coord.handle(hello(1, 3), 0.5))
    assert coord.phase is RunPhase.FORMING
    assert coord.membership.liveness.joined_count() == 1


def test_mismatched_model_signature_is_refused() -> None:
    coord = Coordinator(make_config(), random.Random(0))
    coord.handle(hello(0), 0.0)
    reason = refusal(coord.handle(hello(1, model_signature="b" * 64), 0.0))
    assert "model signature" in reason and "bbbbbbbbbbbb" in reason
    assert coord.phase is RunPhase.FORMING
    assert coord.membership.liveness.state(1) is RankState.JOINING


def rejoined_in_a_pending_cycle(mode: str, world_size: int) -> tuple[Cluster, list[Effect], int]:
    """A collective run whose rank 1, killed after two cycles, says hello again while the
    fourth (or a later) cycle is pending: the cluster, the effects of that hello, and where in
    the trace it came."""
    c = joined(mode, world_size, dataset_len=3200 * world_size)
    c.run(until=lambda: c.coord.sync_rounds >= 2)
    c.kill(1)
    c.run(until=lambda: c.coord.sync_rounds >= 4 and c.coord.cycle.pending)
    hello_at = len(c.trace)
    return c, revive(c, 1), hello_at


@pytest.mark.parametrize("mode", ["nccl_sync", "nccl_cadence"])
def test_a_rank_rejoining_a_collective_run_grows_the_group_back_once_no_cycle_is_pending(
    mode: str,
) -> None:
    c, out, hello_at = rejoined_in_a_pending_cycle(mode, 3)
    # a cycle is pending: re-forming now would split its members; the grow waits for it
    assert sends(out, NewSession) == []
    assert c.coord.membership.awaiting == {1}
    mark = len(c.trace)
    c.run(until=lambda: bool(sends(c.trace[mark:], NewSession)))
    grown = sends(c.trace[mark:], NewSession)
    assert sorted(r for r, _ in grown) == [0, 1, 2]
    assert all(f.members() == [0, 1, 2] for _, f in grown)
    assert not sends(c.trace[mark:], DeclareDead)  # a grow, not a death
    c.run()
    assert c.coord.done and c.coord.phase_log[-1][1] == "run complete"
    assert c.step[1] > 0
    # the rounds it takes part in while it awaits the consensus heal it (the outer state is
    # copied to it), every member told alike; none before its hello, none after its catch-up
    syncs = sends(c.trace, SyncNow)
    caught_up = index(c.trace, lambda e: isinstance(e, Record) and e.kind == "rank_rejoined")
    healing = sorted({f.cycle for _, f in syncs if f.heal})
    assert healing and all(
        f.heal == (f.cycle in healing) for _, f in syncs
    )  # one flag per cycle, the same to every member
    assert all(1 in {r for r, f in syncs if f.cycle == cycle} for cycle in healing)
    assert not [f for r, f in sends(c.trace[caught_up:], SyncNow) if f.heal]
    assert not [f for _, f in sends(c.trace[:hello_at], SyncNow) if f.heal]
    for epoch in range(c.config.total_epochs):
        cov = c.coord.coverage(epoch)
        assert cov is not None and cov.ok, (epoch, cov)


@pytest.mark.parametrize("mode", ["nccl_sync", "nccl_cadence"])
def test_a_death_while_a_rejoined_rank_awaits_the_pending_cycle_re_forms_without_it(
    mode: str,
) -> None:
    # Rank 1 rejoined after the pending cycle's trigger, so it was never asked into it. A death
    # re-forms the group now: with that cycle's ranks only (with rank 1 the others would wait
    # in their collective for a member that never comes: found by the simulator), and rank 1
    # comes in at the grow once the cycle is over.
    c, _, _ = rejoined_in_a_pending_cycle(mode, 4)
    out = c.kill(3)
    assert sorted(r for r, _ in sends(out, DeclareDead)) == [0, 1, 2]
    reformed = sends(out, NewSession)
    assert sorted(r for r, _ in reformed) == [0, 2]
    assert all(f.members() == [0, 2] for _, f in reformed)
    mark = len(c.trace)
    c.run(until=lambda: bool(sends(c.trace[mark:], NewSession)))
    assert not c.coord.cycle.pending  # the grow comes once the cycle is over
    grown = sends(c.trace[mark:], NewSession)
    assert sorted(r for r, _ in grown) == [0, 1, 2]
    assert all(f.members() == [0, 1, 2] for _, f in grown)
    runs_to_completion(c)
    assert c.step[1] > 0


@pytest.mark.parametrize("mode", ["nccl_sync", "nccl_cadence"])
def test_the_death_of_a_rejoined_rank_outside_the_group_re_forms_nothing(mode: str) -> None:
    # Rank 1 rejoined after the pending cycle's trigger and dies before the grow: the group and
    # the collective its members are in are whole, so no new session (it would split the
    # members already in that collective from those that take the new session first: the
    # simulator's run then never ended)
    c, _, _ = rejoined_in_a_pending_cycle(mode, 4)
    out = c.kill(1)
    assert sorted(r for r, _ in sends(out, DeclareDead)) == [0, 2, 3]
    assert sends(out, NewSession) == []
    runs_to_completion(c)


def revive(c: Cluster, rank: int) -> list[Effect]:
    """A new incarnation of a killed fake rank says hello (its fake state starts over)."""
    c.out.discard(rank)
    c.inbox[rank].clear()
    c.work[rank].clear()
    c.wanted[rank] = c.in_reduce[rank] = None
    c.waiting[rank] = False
    return c.feed(hello(rank, c.w))


@pytest.mark.parametrize("mode", ["cpu_sync", "cpu_cadence", "cpu_async"])
def test_a_dead_rank_rejoins_a_cpu_run_and_trains_once_it_has_the_consensus(mode: str) -> None:
    c = joined(mode, 3, dataset_len=9600)
    c.run(until=lambda: c.coord.sync_rounds >= 3)
    c.kill(2)
    c.run(until=lambda: c.coord.sync_rounds >= 6)
    c.clock.advance(2.0)
    out = revive(c, 2)
    # the reduce server takes its data hello before the accept goes out
    rejoined = index(out, lambda e: isinstance(e, RankRejoined))
    replied = index(out, lambda e: isinstance(e, Reply))
    assert rejoined < replied and out[rejoined] == RankRejoined(2, 1)
    reply = out[replied]
    assert isinstance(reply, Reply) and isinstance(reply.frame, Accept)
    assert reply.frame.incarnation == 1
    assert c.coord.membership.awaiting == {2}
    assert c.coord.membership.incarnations == [0, 0, 1]
    assert [r for r, _ in sends(out, SetGlobalStep)] == [2]
    assert [r for r, _ in sends(out, SetEpochCallbackRole)] == [2]
    assert sends(out, StartEpoch) == []
    mark = len(c.trace)
    c.run()
    assert c.coord.done and c.coord.phase_log[-1][1] == "run complete"
    caught_up = index(c.trace, lambda e: isinstance(e, Record) and e.kind == "rank_rejoined")
    before = c.trace[mark:caught_up]
    # no work reaches it before a cycle it entered (weight 0: no steps) finalized
    assert not [f for r, f in sends(before, StartEpoch) if r == 2]
    assert not [f for r, f in sends(before, ExtendPartition) if r == 2]
    assert not [f for r, f in sends(before, Update) if r == 2 and f.next_plan is not None]
    # it took part in the cycle that gave it the consensus (CPU Sync and Cadence ranks send
    # no snapshot_ready: their ack says it)
    assert any(isinstance(e, SyncAck) and e.rank == 2 for e in before)
    [record] = [e for e in c.trace if isinstance(e, Record) and e.kind == "rank_rejoined"]
    assert record.data["rank"] == 2 and record.data["incarnation"] == 1
    assert record.data["down_s"] == 2.0 and record.data["world_size"] == 3
    assert c.step[2] > 0  # the new incarnation trained
    for epoch in range(c.config.total_epochs):
        cov = c.coord.coverage(epoch)
        assert cov is not None and cov.ok, (epoch, cov)


def test_roles_never_move_to_a_rank_that_awaits_the_consensus() -> None:
    c = joined("cpu_cadence", 3, dataset_len=9600, epoch_callback_policy=0)
    c.run(until=lambda: c.coord.sync_rounds >= 2)
    c.kill(1)
    c.run(until=lambda: c.coord.sync_rounds >= 4 and not c.coord.cycle.pending)
    revive(c, 1)
    assert c.coord.membership.awaiting == {1}
    out = c.kill(0)  # the pinned role rank dies while rank 1 still awaits the consensus
    roles = c.coord.callbacks.roles
    assert (roles.epoch_callback_role, roles.eval_role, roles.checkpoint_role) == (2, 2, 2)
    assert {f.rank for _, f in sends(out, SetEpochCallbackRole)} == {2}


def test_losing_every_consensus_holder_while_a_rank_awaits_it_stops_the_run_at_once() -> None:
    c = joined("cpu_cadence", 2, dataset_len=9600, save_bundles=True)
    c.run(until=lambda: c.coord.sync_rounds >= 2)
    c.kill(1)
    c.run(until=lambda: c.coord.sync_rounds >= 4 and not c.coord.cycle.pending)
    revive(c, 1)
    c.kill(0)  # the only rank with the consensus: rank 1 has nothing to take it from
    assert c.coord.save_reason == "all_ranks_lost"
    assert "every rank that held the consensus is lost" in c.coord.save_detail


def test_a_rejoin_is_refused_once_the_run_stops_and_nothing_changes() -> None:
    c = joined("cpu_cadence", 3, dataset_len=9600, max_failure=MaxFailure(absolute=1))
    c.run(until=lambda: c.coord.sync_rounds >= 2)
    c.kill(2)  # past the failure budget: shutdown_with_save
    assert c.coord.phase is RunPhase.SHUTDOWN
    before = (c.coord.phase, c.coord.membership.incarnations[:], c.coord.sync_rounds)
    reason = refusal(revive(c, 2))
    assert reason == "rank 2 cannot rejoin: the run is shutdown"
    assert (c.coord.phase, c.coord.membership.incarnations, c.coord.sync_rounds) == before


def test_a_second_hello_of_a_rejoined_rank_is_a_duplicate() -> None:
    c = joined("cpu_cadence", 3, dataset_len=9600)
    c.run(until=lambda: c.coord.sync_rounds >= 2)
    c.kill(1)
    revive(c, 1)
    assert "already connected (duplicate rank)" in refusal(c.feed(hello(1, 3)))
    assert c.coord.membership.incarnations == [0, 1, 0]


@pytest.mark.parametrize("mode", ["cpu_cadence", "cpu_sync", "cpu_async"])
def test_formation_completes_when_every_rank_joined_cpu(mode: str) -> None:
    coord = Coordinator(make_config(mode), random.Random(0))
    first = coord.handle(hello(0), 0.0)
    assert sends(first, StartEpoch) == [] and of(first, OpenReduce) == []
    last = coord.handle(hello(1), 0.1)
    assert coord.phase is RunPhase.TRAINING
    assert of(last, OpenReduce) == [OpenReduce(0, (0, 1))]
    starts = sends(last, StartEpoch)
    assert [r for r, _ in starts] == [0, 1]
    plans = [(f.plan.partition_offset, f.plan.partition_size) for _, f in starts]
    if mode == "cpu_async":  # uncalibrated probe chunk of 4 batches, then the edge schedule
        assert plans == [(0, 128), (128, 320)]
    else:
        assert plans == [(0, 320), (320, 320)]
    roles = index(last, lambda e: isinstance(e, Send) and isinstance(e.frame, SetEpochCallbackRole))
    assert roles < index(last, lambda e: isinstance(e, Send) and isinstance(e.frame, StartEpoch))
    assert index(last, lambda e: isinstance(e, OpenReduce)) < roles


@pytest.mark.parametrize("mode", ["nccl_cadence", "nccl_sync"])
def test_formation_completes_when_every_rank_joined_collective(mode: str) -> None:
    c = Cluster(make_config(mode))
    c.join()
    assert c.coord.phase is RunPhase.TRAINING
    assert of(c.trace, OpenReduce) == []
    assert [r for r, _ in sends(c.trace, StartEpoch)] == [0, 1]


def test_formation_timeout_at_exactly_300s_names_the_missing_ranks() -> None:
    c = Cluster(make_config(world_size=3))
    c.feed(hello(0, 3))
    for t in range(20, 300, 20):  # rank 0 is alive and well; ranks 1 and 2 never come
        c.clock.advance_to(float(t))
        c.feed(Heartbeat(rank=0, step=0))
        assert of(c.tick(), RunOver) == []
    c.clock.advance_to(299.999)
    assert of(c.tick(), RunOver) == []
    assert c.coord.next_deadline() == 300.0
    c.clock.advance_to(300.0)
    effects = c.tick()
    over = of(effects, RunOver)
    assert len(over) == 1 and over[0].ok is False
    assert "formation timeout" in over[0].reason and "[1, 2]" in over[0].reason
    assert (0, Shutdown()) in sends(effects, Shutdown)
    assert of(effects, RankDead) == []
    assert c.coord.done and c.coord.next_deadline() is None
    c.clock.advance(60.0)
    assert c.tick() == []


# =============================================================================================
# Liveness
# =============================================================================================


def test_silent_rank_is_evicted_at_exactly_30s() -> None:
    c = joined()
    for t in (10.0, 20.0):
        c.clock.advance_to(t)
        c.feed(Heartbeat(rank=0, step=0))
    c.clock.advance_to(29.999)
    early = c.tick()
    assert all(isinstance(e, Send) and isinstance(e.frame, CoordHeartbeat) for e in early)
    assert c.coord.next_deadline() == 30.0
    c.clock.advance_to(30.0)
    effects = c.tick()
    dead = of(effects, RankDead)
    assert len(dead) == 1 and dead[0].rank == 1
    assert "heartbeat timeout" in dead[0].reason and "30" in dead[0].reason
    assert Close(1, dead[0].reason) in effects
    assert [a.cls for a in of(effects, Alert)] == ["rank_lost"]
    assert c.coord.membership.liveness.alive() == [0]


def test_tick_at_next_deadline_evicts_with_a_fractional_last_seen() -> None:
    c = joined()
    c.clock.advance_to(0.7)
    heartbeat_all(c, (0, 1))
    c.clock.advance_to(20.0)
    c.feed(Heartbeat(rank=0, step=0))
    c.clock.advance_to(29.999)
    c.tick()
    # Follow next_deadline() like the shell's timer: it may fire early (a cached lower bound,
    # e.g. the coordinator heartbeat) but never late, and never re-arms the instant it fired at.
    dead: list[int] = []
    for _ in range(10):
        deadline = c.coord.next_deadline()
        assert deadline is not None
        assert deadline <= 0.7 + 30.0
        c.clock.advance_to(deadline)
        dead = [d.rank for d in of(c.tick(), RankDead)]
        assert c.coord.next_deadline() != deadline
        if dead:
            break
    assert dead == [1]
    assert c.clock.now == 0.7 + 30.0


def test_any_frame_refreshes_liveness() -> None:
    c = joined()
    c.clock.advance_to(29.0)
    c.feed(Heartbeat(rank=0, step=0))
    c.feed(batch(1, 1))  # a batch counts as much as a heartbeat
    c.clock.advance_to(58.999)
    assert of(c.tick(), RankDead) == []
    assert c.coord.next_deadline() == 59.0
    c.clock.advance_to(59.0)
    assert sorted(d.rank for d in of(c.tick(), RankDead)) == [0, 1]


def test_coordinator_heartbeat_every_second() -> None:
    c = joined(world_size=3)
    c.clock.advance_to(0.5)
    assert c.tick() == []
    c.clock.advance_to(1.0)
    assert c.tick() == [Send(r, CoordHeartbeat()) for r in range(3)]
    c.clock.advance_to(1.5)
    assert c.tick() == []
    assert c.coord.next_deadline() == 2.0
    c.kill(1)
    c.clock.advance_to(2.0)
    assert c.tick() == [Send(0, CoordHeartbeat()), Send(2, CoordHeartbeat())]


def test_coordinator_heartbeat_three_times_a_short_timeout() -> None:
    """With a 1.5 s liveness timeout the coordinator heartbeats every 0.5 s, not every second:
    a rank watching for it would otherwise be one late frame from losing its coordinator."""
    c = joined(world_size=2, timeouts=Timeouts(1.5))
    c.clock.advance_to(0.4)
    assert c.tick() == []
    assert c.coord.next_deadline() == 0.5
    for at in (0.5, 1.0, 1.5):
        c.clock.advance_to(at)
        heartbeat_all(c, (0, 1))
        assert c.tick() == [Send(r, CoordHeartbeat()) for r in range(2)]


# =============================================================================================
# Exits
# =============================================================================================


def test_child_exit_is_the_fast_death_path() -> None:
    c = joined()
    c.clock.advance_to(0.25)
    effects = c.feed(ChildExited(1, -9))
    assert effects[0] == RankDead(1, "process exited with code -9")
    assert c.coord.membership.liveness.state(1) is RankState.DEAD
    assert c.feed(ChildExited(1, -9)) == []  # declared once


def test_supervisor_rank_exited_and_peer_lost_are_deaths_too() -> None:
    c = joined(world_size=3)
    accept = c.feed(hello(0, 3, role="supervisor"))
    assert [type(e) for e in accept] == [Reply]
    effects = c.feed(RankExited(rank=2, exit_code=137))
    assert of(effects, RankDead) == [RankDead(2, "process exited with code 137")]
    lost = of(c.feed(PeerLost(1, "eof")), RankDead)
    assert lost == [RankDead(1, "connection lost: eof")]


def test_exiting_before_the_end_is_a_death() -> None:
    c = joined()
    effects = c.feed(Exiting(rank=1))
    assert of(effects, RankDead) == [RankDead(1, "rank exited before the run ended")]


def test_exiting_during_shutdown_is_clean_and_a_late_peer_lost_changes_nothing() -> None:
    c = joined()
    c.run(until=lambda: c.coord.phase is RunPhase.SHUTDOWN)
    assert sends(c.trace, Shutdown) == [(0, Shutdown()), (1, Shutdown())]
    # no death: an averaging round that waited for the rank's upload stops waiting for it
    assert c.feed(Exiting(rank=0)) == [RankLeft(0)]
    assert c.coord.membership.liveness.state(0) is RankState.EXITED
    assert c.feed(PeerLost(0, "eof")) == []
    assert c.feed(ChildExited(0, 0)) == []
    c.clock.advance_to(45.0)  # the exited rank is never stale; rank 1 is, and only rank 1
    assert [d.rank for d in of(c.tick(), RankDead)] == [1]
    assert of(c.trace, RankDead)[0].rank == 1


def test_clean_run_end_is_never_a_death() -> None:
    c = joined()
    c.run(until=lambda: c.coord.phase is RunPhase.SHUTDOWN)
    c.feed(Exiting(rank=0))
    effects = c.feed(Exiting(rank=1))
    assert effects == [RankLeft(1), RunOver(ok=True, reason="run complete", save_reason=None)]
    assert of(c.trace, RankDead) == []
    assert c.feed(PeerLost(1, "eof")) == []
    assert c.coord.done and c.coord.next_deadline() is None


# =============================================================================================
# Averaging cycles
# =============================================================================================


def test_cpu_cadence_cycle_end_to_end() -> None:
    c = joined("cpu_cadence", dataset_len=1280)  # 40 batches, anchor 10: 2 windows + tail
    c.run()
    t = c.trace
    assert [(r, f.plan.partition_offset) for r, f in sends(t, StartEpoch)] == [(0, 0), (1, 320)]
    trigger = index(t, lambda e: isinstance(e, OpenReduce) and e.cycle == 1)
    assert of(t[:trigger], Batch) == [
        batch(r, s) if s < 10 else with_report(batch(r, s), chunk_metrics(r, 0, 10))
        for s in range(1, 11)
        for r in (0, 1)
    ]
    assert of(t, Metrics) == []  # every slice's report rode on its last batch
    assert t[trigger] == OpenReduce(1, (0, 1))
    assert sends(t[trigger : trigger + 3], RequestParams) == [
        (0, RequestParams(cycle=1)),
        (1, RequestParams(cycle=1)),
    ]
    update = index(t, lambda e: isinstance(e, Send) and isinstance(e.frame, Update))
    assert of(t, SnapshotReady) == []  # a Cadence rank waits for the update: no snapshot frame
    for needed in (
        ReduceDone(1, (0, 1), 2.0),
        SyncAck(rank=0, cycle=1, step=10),
        SyncAck(rank=1, cycle=1, step=10),
    ):
        assert trigger < t.index(needed) < update
    # the next chunk and the global step, folded in: no set_global_step in a CPU mode
    assert sends(t[update : update + 2], Update) == [
        (0, Update(version=1, next_plan=plan(640, 320), global_step=20)),
        # the epoch's last slice: the epoch-callback role runs epoch_fn after it
        (1, Update(version=1, next_plan=plan(960, 320), global_step=20)),
    ]
    assert sends(t[update:], SetGlobalStep) == []
    assert sends(c.trace, Throttle) == []  # cadence never throttles
    done = of(t, EpochDone)
    assert [d.metrics.epoch for d in done] == [0]
    assert sum(done[0].metrics.per_rank_samples) == 1280
    coverage = c.coord.coverage(0)
    assert coverage is not None and coverage.ok and coverage.committed == 40
    assert index(t, lambda e: isinstance(e, EpochDone)) < t.index(Send(0, Shutdown()))
    assert t.index(Send(1, Shutdown())) < t.index(Exiting(rank=1))
    assert t[-1] == RunOver(ok=True, reason="run complete", save_reason=None)
    assert of(t, RankDead) == []
    assert c.coord.global_step == 40


def test_cpu_finalize_waits_for_every_ack_and_the_reduce_done() -> None:
    c = joined("cpu_cadence", dataset_len=1280)
    for s in range(1, 11):
        assert of(c.feed(batch(0, s)), OpenReduce) == []
        effects = c.feed(batch(1, s))
        assert (of(effects, OpenReduce) != []) == (s == 10)  # count gate, never earlier
    assert c.coord.cycle.pending and c.coord.cycle.number == 1
    assert c.feed(SnapshotReady(rank=0, cycle=1, step=10)) == []
    assert c.feed(SnapshotReady(rank=1, cycle=1, step=10)) == []
    assert c.feed(SyncAck(rank=0, cycle=1, step=10)) == []
    assert c.feed(ReduceDone(1, (0, 1), 2.0)) == []
    assert c.feed(SyncAck(rank=1, cycle=0, step=10)) == []  # a stale cycle's ack is ignored
    assert c.feed(ReduceDone(0, (0, 1), 2.0)) == []  # so is a stale round's reduce
    assert c.coord.cycle.pending
    effects = c.feed(SyncAck(rank=1, cycle=1, step=10))
    assert [r for r, _ in sends(effects, Update)] == [0, 1]
    assert not c.coord.cycle.pending
    assert c.coord.sync_rounds == 1
    assert c.feed(SyncAck(rank=1, cycle=1, step=10)) == []  # never folded twice
    assert c.coord.sync_rounds == 1


@pytest.mark.parametrize("mode", ["cpu_cadence", "cpu_sync"])
@pytest.mark.parametrize("folded", [True, False])
@pytest.mark.parametrize("rejoined", [False, True])
def test_a_rank_dead_inside_a_cpu_cycle_is_committed_exactly_when_its_upload_was_folded(
    mode: str, folded: bool, rejoined: bool
) -> None:
    # CPU Sync and Cadence ranks send no snapshot_ready: for a rank that dies before its ack,
    # the cycle commits the ledger's done count at its death, and only if the reduce server
    # folded its upload in; otherwise all of its work goes back, at the finalize. A new
    # incarnation admitted before that finalize (the cycle waits on another rank) changes
    # none of it: what the old one's upload carried is committed, never retrained.
    c = joined(mode, dataset_len=1280)  # 40 batches
    trained = 10 if mode == "cpu_cadence" else 1  # Cadence: the chunk; Sync: one step
    for s in range(1, trained + 1):
        c.feed(batch(0, s))
        c.feed(batch(1, s))
    assert c.coord.cycle.pending and c.coord.cycle.number == 1
    work = c.coord.dispatch.works[0]
    held = work.pending(1)
    if folded:
        assert c.feed(ReduceDone(1, (0, 1), 2.0)) == []
    c.kill(1)
    assert work.pending(1) == held  # nothing forfeited before the finalize knows
    if rejoined:
        c.clock.advance(2.0)
        revive(c, 1)
        assert c.coord.membership.awaiting == {1} and work.pending(1) == held
        # frames of the pending cycle from the new incarnation, never asked into it, change
        # nothing (they would have replaced the snapshot the finalize settles)
        kept = c.coord.averaging.windows[1]
        snapshot, window = kept.snapshot, kept.window
        assert c.feed(SnapshotReady(rank=1, cycle=1, step=0)) == []
        assert c.feed(SyncAck(rank=1, cycle=1, step=0)) == []
        assert kept.snapshot is snapshot and kept.window is window and kept.closed_window is None
    if not folded:
        c.feed(ReduceDone(1, (0,), 1.0))
    effects = c.feed(SyncAck(rank=0, cycle=1, step=trained))
    updates = sends(effects, Update)
    assert [r for r, _ in updates] == ([0, 1] if rejoined else [0])
    assert all(f.next_plan is None for r, f in updates if r == 1)  # it awaits the consensus
    assert work.committed(0) == trained
    assert work.committed(1) == (trained if folded else 0)
    assert work.pending(1) == 0 and work.in_flight(1) == 0  # the rest went back
    report = work.coverage_report()
    assert report.ok and report.committed == trained * (2 if folded else 1)


@pytest.mark.parametrize("mode", ["cpu_cadence", "cpu_sync"])
def test_a_rank_that_acked_the_pending_cycle_and_rejoins_before_it_finalizes_awaits_the_next(
    mode: str,
) -> None:
    # Its old incarnation acked, then died; another rank holds the cycle open. The new
    # incarnation took no part in that cycle: its finalize commits what the old upload carried
    # and gives the new incarnation no consensus (it was taken to hold it, got work it could
    # not train, and the cohort wedged until the stall ceiling). Only a cycle it enters does.
    c = joined(mode, 3, dataset_len=1920)  # 60 batches
    trained = 10 if mode == "cpu_cadence" else 1
    for s in range(1, trained + 1):
        for r in range(3):
            c.feed(batch(r, s))
    assert c.coord.cycle.pending and c.coord.cycle.number == 1
    c.feed(ReduceDone(1, (0, 1, 2), 3.0))
    c.feed(SyncAck(rank=2, cycle=1, step=trained))
    c.kill(2)
    c.clock.advance(2.0)
    revive(c, 2)
    c.feed(SyncAck(rank=1, cycle=1, step=trained))
    effects = c.feed(SyncAck(rank=0, cycle=1, step=trained))
    assert c.coord.sync_rounds == 1
    work = c.coord.dispatch.works[0]
    assert work.committed(2) == trained and work.pending(2) == 0
    assert c.coord.membership.awaiting == {2}
    assert not [e for e in effects if isinstance(e, Record) and e.kind == "rank_rejoined"]
    assert not [f for r, f in sends(effects, Update) if r == 2 and f.next_plan is not None]
    assert not [f for r, f in sends(effects, StartEpoch) if r == 2]
    assert not [f for r, f in sends(effects, ExtendPartition) if r == 2]


def test_cpu_cycle_without_reduce_done_never_finalizes() -> None:
    c = joined("cpu_cadence", dataset_len=1280)
    for s in range(1, 11):
        c.feed(batch(0, s))
        c.feed(batch(1, s))
    for r in (0, 1):
        c.feed(SnapshotReady(rank=r, cycle=1, step=10))
        assert c.feed(SyncAck(rank=r, cycle=1, step=10)) == []
    assert c.coord.cycle.pending and sends(c.trace, Update) == []


def test_cpu_sync_cycle_sends_throttle_with_request_params() -> None:
    c = joined("cpu_sync")
    assert c.feed(batch(0, 1)) == []
    effects = c.feed(batch(1, 1))
    assert effects == [
        OpenReduce(1, (0, 1)),
        Send(0, RequestParams(cycle=1)),
        Send(0, Throttle()),
        Send(1, RequestParams(cycle=1)),
        Send(1, Throttle()),
    ]


def test_cpu_max_batch_diff_throttles_a_rank_that_runs_ahead_once() -> None:
    config = validated(
        CoordConfig,
        world_size=2,
        dataset_len=1280,
        batch_size=BS,
        elche=ElCheConfig.cpu_cadence(max_batch_diff=2),
    )
    c = Cluster(config)
    c.join()
    throttles = [sends(c.feed(batch(0, s)), Throttle) for s in range(1, 6)]
    assert throttles == [[], [], [(0, Throttle())], [], []]  # 3 > 0 + 2, then once per window
    assert sends(c.feed(batch(1, 1)), Throttle) == []


def test_role_rank_death_rebroadcasts_the_epoch_callback_role() -> None:
    c = joined("cpu_cadence", world_size=3, dataset_len=3200)
    assert sends(c.trace, SetEpochCallbackRole)[0] == (0, SetEpochCallbackRole(rank=0))
    effects = c.kill(0)
    assert sends(effects, SetEpochCallbackRole) == [
        (1, SetEpochCallbackRole(rank=1)),
        (2, SetEpochCallbackRole(rank=1)),
    ]
    assert sends(c.kill(2), SetEpochCallbackRole) == []  # not a role rank: nothing moves


@pytest.mark.parametrize("mode", ["nccl_sync", "nccl_cadence"])
def test_collective_cycle_sends_sync_now(mode: str) -> None:
    c = joined(mode)
    steps = 1 if mode == "nccl_sync" else 10
    effects: list[Effect] = []
    for s in range(1, steps + 1):
        c.feed(batch(0, s))
        effects = c.feed(batch(1, s))
    assert effects == [Send(0, SyncNow(cycle=1)), Send(1, SyncNow(cycle=1))]
    assert sends(c.trace, RequestParams) == [] and of(c.trace, OpenReduce) == []


def test_collective_death_reforms_the_session_with_renumbered_ranks() -> None:
    c = joined("nccl_cadence", world_size=4, dataset_len=6400)
    effects = c.kill(0)
    survivors = [1, 2, 3]
    assert sends(effects, DeclareDead) == [
        (r, DeclareDead(rank=0, reason="process exited with code -9")) for r in survivors
    ]
    assert sends(effects, NewSession) == [(r, session(1, ranks=survivors)) for r in survivors]
    # One frame for every member (the shell encodes its body once); each member's rank in
    # the new group is its position among the survivors.
    [frame] = {id(f): f for _, f in sends(effects, NewSession)}.values()
    assert [frame.position(r) for r in (0, 1, 2, 3)] == [None, 0, 1, 2]
    effects = c.kill(2)
    assert sends(effects, NewSession) == [(r, session(2, ranks=[1, 3])) for r in (1, 3)]
    [frame] = {id(f): f for _, f in sends(effects, NewSession)}.values()
    assert (frame.position(1), frame.position(3)) == (0, 1)
    assert sends(effects, ShutdownWithSave) == []


def test_a_session_failed_re_forms_the_same_members_once_per_session() -> None:
    # Rank 1 could not gather session 1 (a member busy past the deadline): the same members
    # re-form as session 2 (nothing else would: no death). A second report of session 1 is
    # stale; a report from a rank outside the session, or a dead one, re-forms nothing.
    c = joined("nccl_cadence", world_size=4, dataset_len=6400)
    c.kill(0)
    survivors = [1, 2, 3]
    out = c.feed(SessionFailed(rank=1, session=1))
    assert sends(out, NewSession) == [(r, session(2, ranks=survivors)) for r in survivors]
    assert sends(out, DeclareDead) == []
    [alert] = [a for a in of(out, Alert) if a.cls == "session_retry"]
    assert "rank 1 could not form or use collective session 1" in alert.detail
    assert "re-form as session 2" in alert.detail
    assert c.feed(SessionFailed(rank=2, session=1)) == []  # stale: session 2 went out
    assert c.feed(SessionFailed(rank=0, session=2)) == []  # the dead rank
    out = c.feed(SessionFailed(rank=3, session=2))  # session 2 failed too: session 3
    assert [f.session for _, f in sends(out, NewSession)] == [3, 3, 3]
    runs_to_completion(c)


@pytest.mark.parametrize("mode", ["nccl_sync", "nccl_cadence"])
def test_a_session_failed_while_a_cycle_is_pending_re_forms_that_cycles_ranks(mode: str) -> None:
    # Rank 1 rejoined after the pending cycle's trigger (it is outside the group until the
    # grow): a report re-forms the pending cycle's ranks only, as a death would, and rank 1
    # comes in at the grow once the cycle is over; its own report (not a member) re-forms
    # nothing
    c, _, _ = rejoined_in_a_pending_cycle(mode, 4)
    current = c.coord.membership.sessions.session
    assert c.feed(SessionFailed(rank=1, session=current)) == []
    out = c.feed(SessionFailed(rank=2, session=current))
    assert sorted(r for r, _ in sends(out, NewSession)) == [0, 2, 3]
    mark = len(c.trace)
    c.run(until=lambda: bool(sends(c.trace[mark:], NewSession)))
    assert not c.coord.cycle.pending
    assert sorted(r for r, _ in sends(c.trace[mark:], NewSession)) == [0, 1, 2, 3]
    c.run()
    assert c.coord.done and c.coord.phase_log[-1][1] == "run complete"


def test_a_session_failed_in_a_cpu_mode_changes_nothing() -> None:
    c = joined("cpu_cadence", world_size=3, dataset_len=3200)
    assert c.feed(SessionFailed(rank=1, session=0)) == []


def test_cpu_death_sends_no_session_frames() -> None:
    c = joined("cpu_cadence", world_size=3, dataset_len=3200)
    effects = c.kill(1)
    assert sends(effects, DeclareDead) == [] and sends(effects, NewSession) == []
    assert sends(effects, ShutdownWithSave) == []


# =============================================================================================
# Eval schedule and epoch tags
# =============================================================================================


@pytest.mark.parametrize(
    ("epochs", "every", "splits", "tags"),
    [
        (3, None, 1, [0, 1, 2]),  # every epoch; the last one's eval is the final eval
        (4, 2, 1, [1, 3]),  # the due eval of the last epoch is the final one: not two
        (3, 2, 1, [1, 2]),  # the final eval runs whatever eval_every says
        (2, None, 2, [0, 1, 2, 3]),  # epochs are splits: 0..num_epochs × splits − 1
    ],
)
def test_every_eval_is_tagged_with_the_0_based_epoch_it_follows(
    epochs: int, every: int | None, splits: int, tags: list[int]
) -> None:
    c = joined(
        "cpu_cadence",
        3,
        dataset_len=3200,
        num_epochs=epochs,
        epoch_splits=splits,
        has_eval=True,
        eval_every=every,
    )
    c.run()
    assert c.coord.done and c.coord.phase_log[-1][1] == "run complete"
    assert [e for e, _ in c.evals] == tags
    done = [e.epoch for e in c.trace if isinstance(e, EvalDone)]
    assert done == tags  # what eval_result_fn receives
    metrics = [e.metrics.epoch for e in c.trace if isinstance(e, EpochDone)]
    assert metrics == list(range(epochs * splits))  # the same numbering as EpochMetrics
    final = [f for _, f in sends(c.trace, ExecuteEval) if f.epoch == tags[-1]]
    assert [f.schedule_id for f in final] == [epochs * splits]  # one final eval, told apart


# =============================================================================================
# Callback roles of a pinned rank (EpochCallbackPolicy.Rank(n))
# =============================================================================================


def pinned(world_size: int = 3, **kw: Any) -> Cluster:
    """Rank 2 pinned; rank 1 is the fastest (5 ms a batch), rank 0 the lowest and slowest."""
    config = make_config(
        "cpu_cadence",
        world_size,
        dataset_len=9600,
        num_epochs=4,
        epoch_callback_policy=2,
        has_eval=True,
        has_epoch_fn=True,
        **kw,
    )
    c = Cluster(config)
    c.batch_ms = [30.0, 5.0, 10.0][:world_size]
    return c


def roles_of(c: Cluster) -> tuple[int, int, int]:
    roles = c.coord.callbacks.roles
    return (roles.epoch_callback_role, roles.eval_role, roles.checkpoint_role)


def test_a_dead_pinned_rank_lends_its_callbacks_to_the_fastest_survivor_until_it_rejoins() -> None:
    c = pinned()
    c.join()
    c.run(until=lambda: len(c.evals) >= 1)
    assert c.epoch_fns == [(0, 2)] and c.evals == [(0, 2)]  # the pinned rank, while it lives
    out = c.kill(2)
    # every role goes to the fastest survivor (rank 1), not the lowest (rank 0), and it is said
    assert roles_of(c) == (1, 1, 1)
    assert {f.rank for _, f in sends(out, SetEpochCallbackRole)} == {1}
    [alert] = [e for e in of(out, Alert) if e.cls == "callback_roles_moved"]
    assert "pinned rank 2 died" in alert.detail and "fastest live rank 1" in alert.detail
    assert any(isinstance(e, Record) and e.kind == "roles" for e in out)
    c.run(until=lambda: len(c.evals) >= 2)
    assert c.epoch_fns[1] == (1, 1) and c.evals[1] == (1, 1)  # epoch_fn and eval go on
    c.clock.advance(2.0)
    revive(c, 2)
    assert roles_of(c) == (1, 1, 1)  # not before it holds the consensus
    c.run()
    assert c.coord.done and c.coord.phase_log[-1][1] == "run complete"
    back = index(c.trace, lambda e: isinstance(e, Record) and e.kind == "rank_rejoined")
    assert roles_of(c) == (2, 2, 2)
    moved = [e for e in c.trace[back:] if isinstance(e, Alert) and e.cls == "callback_roles_moved"]
    assert [e.detail for e in moved] == [
        "pinned rank 2 holds the consensus again: callback roles back on it"
    ]
    assert [e for e, _ in c.epoch_fns] == [0, 1, 2, 3]  # one epoch_fn per epoch, none lost
    assert [r for e, r in c.epoch_fns if e >= 2] == [2, 2]  # back on the pinned rank
    assert [r for e, r in c.evals if e in (2,)] == [2]


def test_a_pinned_rank_that_has_not_joined_lends_its_callbacks_until_it_joins() -> None:
    c = pinned(min_world_size=2)
    c.feed(hello(0, 3))
    out = c.feed(hello(1, 3))  # training starts without rank 2
    assert c.coord.phase is RunPhase.TRAINING
    assert roles_of(c) == (0, 0, 0)  # nobody is calibrated yet: the lowest rank that joined
    [alert] = [e for e in of(out, Alert) if e.cls == "callback_roles_moved"]
    assert "pinned rank 2 has not joined" in alert.detail
    assert {f.rank for _, f in sends(out, SetEpochCallbackRole)} == {0}
    c.run(until=lambda: len(c.evals) >= 1)
    assert c.epoch_fns == [(0, 0)] and c.evals == [(0, 0)]  # they used to be lost
    c.feed(hello(2, 3))
    c.run()
    assert c.coord.done and c.coord.phase_log[-1][1] == "run complete"
    assert roles_of(c) == (2, 2, 2)
    assert [e for e, _ in c.epoch_fns] == [0, 1, 2, 3]
    assert c.epoch_fns[-1] == (3, 2)


# =============================================================================================
# Stall ceiling and failure thresholds
# =============================================================================================


@pytest.mark.parametrize("mode", ["cpu_cadence", "nccl_cadence"])
def test_stall_ceiling_at_exactly_300s(mode: str) -> None:
    c = joined(mode, dataset_len=1280, save_bundles=True)
    for s in range(1, 11):
        c.feed(batch(0, s))
        c.feed(batch(1, s))
    assert c.coord.cycle.pending and c.coord.cycle.pending_since_at == 0.0
    c.feed(SnapshotReady(rank=0, cycle=1, step=10))
    if mode == "nccl_cadence":
        c.feed(SyncAck(rank=0, cycle=1, step=10))  # rank 1 never acks
    for t in range(10, 300, 10):  # both ranks heartbeat all along
        c.clock.advance_to(float(t))
        heartbeat_all(c, (0, 1))
        c.tick()
    c.clock.advance_to(299.9)
    heartbeat_all(c, (0, 1))
    assert [e for e in c.tick() if not isinstance(e, Send)] == []
    assert c.coord.next_deadline() == 300.0
    c.clock.advance_to(300.0)
    effects = c.tick()
    alerts = of(effects, Alert)
    assert [(a.cls, a.severity) for a in alerts] == [("reduce_stall", "critical")]
    assert "waiting for ranks" in alerts[0].detail and "300" in alerts[0].detail
    if mode == "nccl_cadence":
        assert "[1]" in alerts[0].detail
    assert of(effects, WriteMeta) == []  # the meta waits for the model file
    bundle = sends(effects, SaveConsensusModel)
    assert [r for r, _ in bundle] == [0, 1]  # every rank saves its part, before stopping
    # the stop is held until the bundle commits, so a failed writer could still fail over
    assert sends(effects, ShutdownWithSave) == []
    metas, committed = commit_bundles(c, effects)
    assert len(metas) == 1 and metas[0].meta["save_reason"] == "reduce_stall"
    stops = sends(committed, ShutdownWithSave)
    assert [(r, f.reason) for r, f in stops] == [(0, "reduce_stall"), (1, "reduce_stall")]
    assert of(effects, RankDead) == []
    c.clock.advance_to(301.0)
    heartbeat_all(c, (0, 1))
    later = c.tick()
    assert sends(later, ShutdownWithSave) == [] and of(later, Alert) == []
    c.feed(Exiting(rank=0))
    over = c.feed(Exiting(rank=1))
    waiting = "[1]" if mode == "nccl_cadence" else "[0, 1]"
    detail = f"averaging cycle 1 pending for 300 s (ceiling 300 s); waiting for ranks {waiting}"
    assert over == [
        RankLeft(1),
        RunOver(
            ok=False, reason="run stopped: reduce_stall", save_reason="reduce_stall", detail=detail
        ),
    ]


def test_max_failure_absolute_broadcasts_one_shutdown_with_save() -> None:
    c = joined(
        "cpu_cadence",
        world_size=3,
        dataset_len=3200,
        max_failure=MaxFailure(absolute=1),
        save_bundles=True,
    )
    effects = c.kill(1)
    metas, committed = commit_bundles(c, effects)
    assert len(metas) == 1 and metas[0].meta["save_reason"] == "max_failure_exceeded"
    stops = sends(committed, ShutdownWithSave)
    assert [(r, f.reason) for r, f in stops] == [
        (0, "max_failure_exceeded"),
        (2, "max_failure_exceeded"),
    ]
    assert "1 of 3" in stops[0][1].detail
    assert c.coord.phase is RunPhase.SHUTDOWN
    second = c.kill(2)
    assert of(second, RankDead) == [RankDead(2, "process exited with code -9")]
    assert sends(second, ShutdownWithSave) == [] and of(second, WriteMeta) == []
    assert len(sends(c.trace, ShutdownWithSave)) == 2
    over = c.feed(Exiting(rank=0))
    assert over == [
        RankLeft(0),
        RunOver(
            ok=False,
            reason="run stopped: max_failure_exceeded",
            save_reason="max_failure_exceeded",
            detail="1 of 3 ranks dead, max_failure allows fewer than 1",
        ),
    ]


def test_collective_with_two_ranks_stops_on_single_survivor() -> None:
    c = joined("nccl_cadence", save_bundles=True)
    effects = c.kill(1)
    assert sends(effects, NewSession) == []
    metas, committed = commit_bundles(c, effects)
    assert [m.meta["save_reason"] for m in metas] == ["single_survivor"]
    assert [(r, f.reason) for r, f in sends(committed, ShutdownWithSave)] == [
        (0, "single_survivor")
    ]


def test_cpu_losing_every_rank_is_all_ranks_lost() -> None:
    c = joined("cpu_cadence", save_bundles=True)
    assert sends(c.kill(0), ShutdownWithSave) == []  # CPU goes on with one rank
    effects = c.kill(1)
    # no rank left to write the model: no meta, the previous checkpoint stays the resume point
    assert of(effects, WriteMeta) == []
    assert any(a.cls == "checkpoint_failed" for a in of(effects, Alert))
    assert of(effects, RunOver) == [
        RunOver(
            ok=False,
            reason="run stopped: all_ranks_lost",
            save_reason="all_ranks_lost",
            detail="all 2 ranks lost",
        )
    ]


# =============================================================================================
# Protocol violations
# =============================================================================================


def test_batch_for_an_epoch_never_given_evicts_only_that_rank() -> None:
    c = joined("cpu_cadence", world_size=3, dataset_len=3200)
    effects = c.feed(batch(0, 1, epoch=5))
    dead = of(effects, RankDead)
    assert len(dead) == 1 and dead[0].rank == 0
    assert "protocol violation" in dead[0].reason
    assert "trained a batch of epoch 5 it was not given" in dead[0].reason
    assert c.coord.membership.liveness.alive() == [1, 2]
    assert c.coord.in_flight(0) == 0  # its chunk went back to the pool
    assert of(c.feed(batch(1, 1)), RankDead) == []


def test_batch_beyond_the_granted_chunk_is_a_protocol_violation() -> None:
    c = joined("cpu_cadence", dataset_len=1280)
    for s in range(1, 11):
        assert of(c.feed(batch(0, s)), RankDead) == []
    dead = of(c.feed(batch(0, 11)), RankDead)
    assert len(dead) == 1 and "protocol violation" in dead[0].reason
    assert "trained a batch of epoch 0 it was not given" in dead[0].reason


def test_a_batch_carrying_another_ranks_report_is_a_protocol_violation() -> None:
    c = joined("cpu_cadence", dataset_len=1280)
    for s in range(1, 10):
        c.feed(batch(0, s))
    dead = of(c.feed(with_report(batch(0, 10), chunk_metrics(1, 0, 10))), RankDead)
    assert len(dead) == 1 and dead[0].rank == 0
    assert "protocol violation" in dead[0].reason and "rank 1's metrics" in dead[0].reason


@pytest.mark.parametrize("fold", [True, False])
def test_a_slice_report_counts_once_whether_it_rides_on_the_batch_or_not(fold: bool) -> None:
    c = joined("cpu_cadence", dataset_len=1280)
    c.fold_metrics = fold
    c.run()
    [done] = of(c.trace, EpochDone)
    assert done.metrics.per_rank_samples == [640, 640]  # each rank's 20 batches, once
    assert bool(of(c.trace, Metrics)) is not fold


def test_frames_from_dead_or_unknown_ranks_change_nothing() -> None:
    c = joined()
    c.kill(1)
    assert c.feed(batch(1, 1)) == []
    assert c.feed(Heartbeat(rank=1, step=3)) == []
    assert c.feed(Heartbeat(rank=7, step=3)) == []
    assert c.feed(ChildExited(7, -9)) == []
    assert c.coord.membership.liveness.alive() == [0]


# =============================================================================================
# Dead-rank work
# =============================================================================================


@pytest.mark.parametrize("mode", ["cpu_cadence", "nccl_cadence", "cpu_async"])
def test_dead_rank_chunk_is_redispatched_to_a_survivor(mode: str) -> None:
    c = joined(mode, world_size=3, dataset_len=3200)  # 100 batches
    c.run(until=lambda: c.step[1] >= 3)
    lost = c.coord.dispatch.works[0].outstanding(1)[0]
    cut = len(c.trace)
    c.kill(1)
    c.run()
    plans = [
        (r, f.plan if isinstance(f, StartEpoch) else f.next_plan)
        for e in c.trace[cut:]
        if isinstance(e, Send)
        for r, f in [(e.rank, e.frame)]
        if isinstance(f, StartEpoch) or (isinstance(f, Update) and f.next_plan is not None)
    ]
    at = lost.start * BS
    regranted = [
        r
        for r, p in plans
        if p is not None and p.partition_offset <= at < p.partition_offset + p.partition_size
    ]
    assert regranted and set(regranted) <= {0, 2}
    coverage = c.coord.coverage(0)
    assert coverage is not None and coverage.ok and coverage.committed == 100
    assert of(c.trace, RunOver) == [RunOver(ok=True, reason="run complete", save_reason=None)]


@pytest.mark.parametrize("mode", ["cpu_cadence", "nccl_cadence"])
def test_death_inside_the_final_window_still_closes_the_epoch(mode: str) -> None:
    # 20 batches, anchor 10: the first window is already the epoch's final window. The dead
    # rank's chunk returns to the pool and must still be trained by the survivor.
    c = joined(mode, world_size=2 if mode == "cpu_cadence" else 3, dataset_len=640)
    c.run(until=lambda: c.step[1] >= 3)
    c.kill(1)
    c.run()
    coverage = c.coord.coverage(0)
    assert coverage is not None and coverage.committed == coverage.total, (
        f"epoch wedged: {c.coord.dispatch.works}, final plans {c.coord.dispatch.final_plans}"
    )
    assert of(c.trace, RunOver) == [RunOver(ok=True, reason="run complete", save_reason=None)]


@pytest.mark.parametrize("mode", ["cpu_sync", "nccl_sync"])
def test_dead_rank_partition_is_split_among_survivors(mode: str) -> None:
    c = joined(mode, world_size=3, dataset_len=960)  # 30 batches: partitions of 10
    c.run(until=lambda: c.step[1] >= 3)
    cut = len(c.trace)
    c.kill(1)
    c.run()
    extends = sends(c.trace[cut:], ExtendPartition)
    assert {r for r, _ in extends} == {0, 2}
    pieces = sorted(
        BatchRange(f.partition_offset // BS, (f.partition_offset + f.partition_size) // BS)
        for _, f in extends
    )
    assert pieces[-1].stop == 20  # rank 1's partition was [10, 20)
    assert all(a.stop == b.start for a, b in itertools.pairwise(pieces))
    assert abs(pieces[0].size - pieces[-1].size) <= 1  # split equally
    coverage = c.coord.coverage(0)
    assert coverage is not None and coverage.ok and coverage.committed == 30
    assert of(c.trace, RunOver) == [RunOver(ok=True, reason="run complete", save_reason=None)]


def rebalanced(mode: str) -> tuple[Cluster, int]:
    """3 ranks, 300 batches an epoch (partitions of 100); rank 2 dies early in epoch 0 and
    comes back mid-epoch. Returns the cluster, run until rank 2 holds the consensus, and the
    trace index of its ``rank_rejoined`` record."""
    c = joined(mode, 3, dataset_len=9600)
    c.run(until=lambda: c.coord.sync_rounds >= 3)
    c.kill(2)
    c.run(until=lambda: c.coord.sync_rounds >= 20)
    revive(c, 2)
    c.run(until=lambda: any(isinstance(e, Record) and e.kind == "rank_rejoined" for e in c.trace))
    return c, index(c.trace, lambda e: isinstance(e, Record) and e.kind == "rank_rejoined")


@pytest.mark.parametrize("mode", ["cpu_sync", "nccl_sync"])
def test_a_rank_rejoining_mid_epoch_gets_a_share_of_the_open_partitions(mode: str) -> None:
    c, at = rebalanced(mode)
    work = c.coord.dispatch.works[0]
    untrained = [work.in_flight(r) for r in range(3)]
    assert untrained[2] == 0 and min(untrained[:2]) > 100  # the survivors hold all of it
    c.run(until=lambda: not c.coord.dispatch.revoking and not c.coord.dispatch.wants)
    after = c.trace[at:]
    revokes = sends(after, RevokePartition)
    assert {r for r, _ in revokes} == {0, 1}  # each gives back the end of its queue
    answers = [e for e in after if isinstance(e, PartitionRevoked)]
    assert len(answers) == len(revokes)
    given = sum(f.partition_size for r, f in sends(after, ExtendPartition) if r == 2) // BS
    assert given == sum(a.revoked_size for a in answers) // BS
    assert abs(given - sum(untrained) / 3) <= 2  # Sync splits equally
    [asked] = [e.data for e in after if isinstance(e, Record) and e.kind == "repartition"]
    [done] = [e.data for e in after if isinstance(e, Record) and e.kind == "repartitioned"]
    assert asked["untrained"] == sum(untrained) and dict(asked["owed"])[2] >= given
    assert dict(done["given"]) == {2: given}
    runs_to_completion(c)
    assert c.coord.coverage(0).committed == 300  # type: ignore[union-attr]


def test_a_donor_that_dies_before_it_answers_forfeits_the_asked_range_too() -> None:
    c, at = rebalanced("cpu_sync")
    assert [r for r, _ in sends(c.trace[at:], RevokePartition)] == [0, 1]
    while (1, 0) in c.coord.dispatch.revoking:
        c.act(1)  # rank 1 answers first
    assert c.coord.dispatch.wants  # rank 2 is still owed what rank 0 will give back
    out = c.kill(0)  # its revoke is still in its inbox: the last answer will never come
    assert not [k for k in c.coord.dispatch.revoking if k[0] == 0]
    # the re-split is over: nothing is owed any more (a later re-split starts from scratch)
    assert not c.coord.dispatch.wants
    assert [e.kind for e in out if isinstance(e, Record)].count("repartitioned") == 1
    runs_to_completion(c)


@pytest.mark.parametrize(
    ("offset", "size", "revoked"),
    [(0, 64, 0), (640, 64, 96)],  # a revoke never sent; one that drops more than asked
)
def test_an_answer_to_a_revoke_not_asked_for_is_a_protocol_violation(
    offset: int, size: int, revoked: int
) -> None:
    c = joined("cpu_sync", 2, dataset_len=1280)
    c.run(until=lambda: c.coord.sync_rounds >= 1)
    if revoked:
        c.coord.dispatch.revoking[(0, 0)] = [BatchRange(offset // BS, (offset + size) // BS)]
    frame = PartitionRevoked(
        rank=0, epoch=0, partition_offset=offset, partition_size=size, revoked_size=revoked
    )
    out = c.feed(frame)
    assert [e.rank for e in of(out, RankDead)] == [0]
    assert "protocol violation" in of(out, RankDead)[0].reason


# =============================================================================================
# Checkpoint meta
# =============================================================================================


def test_meta_record_shape() -> None:
    c = joined("cpu_cadence", dataset_len=1280)
    c.run(until=lambda: c.coord.sync_rounds == 1)
    meta = c.coord.meta_record("graceful_shutdown")
    assert set(meta) == {
        "schema_version",
        "epoch",
        "global_step",
        "sync_round",
        "world_size_at_save",
        "save_reason",
        "elche_state",
        "coverage",
    }
    assert meta["schema_version"] == META_SCHEMA_VERSION == 3
    assert (meta["epoch"], meta["global_step"], meta["sync_round"]) == (0, 20, 1)
    assert meta["world_size_at_save"] == 2
    assert meta["save_reason"] == "graceful_shutdown"
    elche = meta["elche_state"]
    assert set(elche) == {
        "anchor",
        "anchor_rank",
        "smoothed_ms_per_batch",
        "phase",
        "calibration_count",
        "trend_history",
    }
    assert elche["anchor"] == c.coord.elche.anchor
    assert len(elche["smoothed_ms_per_batch"]) == 2
    assert isinstance(elche["trend_history"], list)
    assert meta["coverage"] == {
        "seed": 42,
        "epoch_splits": 1,
        "batch_size": BS,
        "per_epoch": [
            {"epoch": 0, "total_samples": 1280, "uncovered_ranges": [[640, 640]]},
        ],
    }  # batches [0, 20) are committed; [20, 40) = samples 640.. (offset, size) is not


def test_meta_written_at_the_end_of_a_clean_run() -> None:
    c = joined("cpu_cadence", save_bundles=True)
    c.run()
    metas = of(c.trace, WriteMeta)
    assert [m.meta["save_reason"] for m in metas] == ["graceful_shutdown"]
    meta = metas[0].meta
    assert meta["epoch"] == 1 and meta["global_step"] == 20
    assert meta["coverage"]["per_epoch"] == []


# =============================================================================================
# Progress watchdog (a wedged cohort: alive, heartbeating, training nothing)
# =============================================================================================


@pytest.mark.parametrize("mode", ["cpu_cadence", "nccl_sync"])
def test_a_wedged_cohort_ends_in_shutdown_with_save_at_the_stall_ceiling(mode: str) -> None:
    c = joined(mode, save_bundles=True)
    start = c.clock.now
    # Ranks stay alive (heartbeats every second) but never train: a stuck data loader, say.
    while c.clock.now < start + 299.0:
        c.clock.advance(1.0)
        heartbeat_all(c, (0, 1))
        effects = c.tick()
        assert of(effects, ShutdownWithSave) == []
    deadline = c.coord.next_deadline()
    assert deadline is not None
    assert deadline <= start + 300.0
    c.clock.advance_to(start + 300.0)
    heartbeat_all(c, (0, 1))
    effects = c.tick()
    alerts = [a for a in of(effects, Alert) if a.cls == "reduce_stall"]
    assert len(alerts) == 1
    assert "no training progress" in alerts[0].detail
    metas, committed = commit_bundles(c, effects)
    assert len(metas) == 1
    saves = [s for s in of(committed, Send) if isinstance(s.frame, ShutdownWithSave)]
    assert sorted(s.rank for s in saves) == [0, 1]
    assert {s.frame.reason for s in saves} == {"reduce_stall"}
    # it fires once
    c.clock.advance(1.0)
    assert of(c.tick(), Alert) == []


@pytest.mark.parametrize("stop", ["end_of_run", "reduce_stall"])
def test_a_rank_that_never_exits_after_the_stop_is_declared_dead_at_the_stall_ceiling(
    stop: str,
) -> None:
    # A rank stuck outside a step (a callback that never returns) heartbeats and never answers
    # the stop; the run used to wait for its Exiting for good (and its launcher with it).
    c = joined("cpu_cadence")
    if stop == "end_of_run":
        c.run(until=lambda: c.coord.phase is RunPhase.SHUTDOWN)
    else:
        start = c.clock.now
        c.clock.advance_to(start + 300.0)
        heartbeat_all(c, (0, 1))
        assert [a for a in of(c.tick(), Alert) if a.cls == "reduce_stall"]
    assert c.coord.phase is RunPhase.SHUTDOWN
    stopped_at = c.clock.now
    assert c.feed(Exiting(rank=0)) == [RankLeft(0)]
    while c.clock.now < stopped_at + 299.0:  # rank 1 heartbeats and answers nothing
        c.clock.advance(1.0)
        heartbeat_all(c, (1,))
        effects = c.tick()
        assert of(effects, RankDead) == [] and of(effects, RunOver) == []
    deadline = c.coord.next_deadline()
    assert deadline is not None and deadline <= stopped_at + 300.0
    c.clock.advance_to(stopped_at + 300.0)
    heartbeat_all(c, (1,))
    effects = c.tick()
    assert of(effects, RankDead) == [
        RankDead(1, "did not exit within 300 s of the stop (its training thread answers no frame)")
    ]
    [over] = of(effects, RunOver)
    assert over.ok == (stop == "end_of_run")
    assert c.coord.done and c.coord.next_deadline() is None


def test_training_progress_keeps_the_watchdog_quiet() -> None:
    c = joined("cpu_cadence")
    c.clock.advance(299.0)
    heartbeat_all(c, (0, 1))
    c.feed(batch(0, 0))
    c.clock.advance(299.0)
    heartbeat_all(c, (0, 1))
    assert [a for a in of(c.tick(), Alert) if a.cls == "reduce_stall"] == []


# =============================================================================================
# Resume seeding
# =============================================================================================


def test_resume_skips_probe_and_trains_only_the_uncovered_ranges() -> None:
    from flodl.coord.elche_state import ElCheState
    from flodl.coord.resume import ResumeState

    cfg = make_config("cpu_cadence", world_size=2, dataset_len=640, num_epochs=2)
    state = ElCheState(
        anchor=4,
        anchor_rank=1,
        smoothed_ms_per_batch=[10.0, 20.0],
        phase="stable",
        calibration_count=7,
        trend_history=[0.01, 0.02],
    )
    # epoch 1 of 2 was interrupted: samples [320, 640) of its 640 (batch 32) are still to train
    resume = ResumeState(
        epoch=1, global_step=30, sync_round=5, elche=state, uncovered=((320, 320),)
    )
    coord = Coordinator(cfg, random.Random(0), resume=resume)
    assert coord.elche.phase.value == "stable"
    assert coord.elche.calibrated
    assert coord.elche.batch_counts == [8, 4]
    out: list[Any] = []
    for r in range(2):
        out += coord.handle(Hello(run_id="run", rank=r, world_size=2, model_signature=SIG), 0.0)
    plans = [s.frame.plan for s in of(out, Send) if isinstance(s.frame, StartEpoch)]
    assert {p.epoch for p in plans} == {1}
    assert min(p.partition_offset for p in plans) >= 320
    assert coord.global_step == 30
    assert coord.sync_rounds == 5
    meta = coord.meta_record("graceful_shutdown")
    assert meta["coverage"]["per_epoch"] == [
        {"epoch": 1, "total_samples": 640, "uncovered_ranges": [[320, 320]]}
    ]


def test_a_rank_whose_process_exits_before_joining_fails_the_formation_at_once() -> None:
    c = Cluster(make_config("cpu_cadence", world_size=3))
    c.feed(hello(0, 3))
    effects = c.feed(ChildExited(2, 1))
    [over] = of(effects, RunOver)
    assert not over.ok and over.reason == "rank 2 never joined: process exited with code 1"
    assert [r for r, _ in sends(effects, Shutdown)] == [0]  # the joined rank is told to stop
    assert c.coord.done
