"""Hypothesis drives the real coordinator with arbitrary (authenticated) rank inputs.

Ranks here may misbehave in any way a decoded frame allows: batches for epochs they were never
given, acks for cycles that never ran, exits at random. The machine must never raise, and its
invariants must hold after every step.
"""

from __future__ import annotations

import math
import random

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from flodl.config import MODES, CoordConfig, ElCheConfig, validated
from flodl.coord.effects import Effect, RankDead, RunOver, Send
from flodl.coord.inputs import ChildExited, Input, PeerLost, ReduceDone
from flodl.coord.liveness import RankState
from flodl.coord.machine import Coordinator, RunPhase
from flodl.wire.frames import (
    Batch,
    Exiting,
    Heartbeat,
    Hello,
    Metrics,
    RankFrame,
    SessionFailed,
    SnapshotReady,
    StartEpoch,
    SyncAck,
)

W = 3
SIG = "a" * 64


class CoordinatorMachine(RuleBasedStateMachine):
    coord: Coordinator

    @initialize(mode=st.sampled_from(MODES), seed=st.integers(0, 2**16))
    def start(self, mode: str, seed: int) -> None:
        cfg = validated(
            CoordConfig,
            world_size=W,
            dataset_len=640,
            batch_size=32,
            num_epochs=2,
            elche=ElCheConfig.preset(mode),
        )
        self.coord = Coordinator(cfg, random.Random(seed))
        self.now = 0.0
        self.steps = [0] * W
        self.given: dict[int, list[int]] = {r: [] for r in range(W)}
        self.run_over = 0
        for r in range(W):
            self._feed(Hello(run_id="run", rank=r, world_size=W, model_signature=SIG))

    def _feed(self, event: RankFrame | Input) -> None:
        effects = self.coord.handle(event, self.now)
        self._observe(effects)

    def _observe(self, effects: list[Effect]) -> None:
        for e in effects:
            if isinstance(e, Send) and isinstance(e.frame, StartEpoch):
                self.given[e.rank].append(e.frame.plan.epoch)
            if isinstance(e, RunOver):
                self.run_over += 1
            if isinstance(e, RankDead):
                assert self.coord.membership.liveness.state(e.rank) is RankState.DEAD

    @rule(rank=st.integers(0, W - 1), honest=st.booleans(), epoch=st.integers(0, 3))
    def batch(self, rank: int, honest: bool, epoch: int) -> None:
        if honest and self.given[rank]:
            epoch = self.given[rank][-1]
        self.steps[rank] += 1
        self._feed(Batch(rank=rank, epoch=epoch, step=self.steps[rank], batch_ms=5.0, loss=1.0))

    @rule(rank=st.integers(0, W - 1), any_cycle=st.booleans())
    def snapshot_and_ack(self, rank: int, any_cycle: bool) -> None:
        cycle = self.coord.cycle.number + (1 if any_cycle else 0)
        session = self.coord.membership.sessions.session
        self._feed(SnapshotReady(rank=rank, cycle=cycle, step=self.steps[rank]))
        self._feed(SyncAck(rank=rank, cycle=cycle, step=self.steps[rank], session=session))

    @rule(partial=st.booleans())
    def reduce_done(self, partial: bool) -> None:
        alive = tuple(self.coord.membership.liveness.alive())
        ranks = alive[:1] if partial else alive
        self._feed(ReduceDone(self.coord.cycle.number, ranks, float(len(ranks))))

    @rule(rank=st.integers(0, W - 1))
    def metrics(self, rank: int) -> None:
        self._feed(
            Metrics(
                rank=rank,
                epoch=0,
                avg_loss=1.0,
                batches_processed=1,
                samples_processed=32,
                epoch_ms=5.0,
                share_complete_ms=5.0,
                compute_only_ms=5.0,
            )
        )

    @rule(rank=st.integers(0, W - 1), offset=st.integers(-1, 1))
    def session_failed(self, rank: int, offset: int) -> None:
        # the current session, a stale one or one not opened yet (a collective mode re-forms
        # for the current one only; a CPU mode has none to re-form)
        session = max(0, self.coord.membership.sessions.session + offset)
        self._feed(SessionFailed(rank=rank, session=session))

    @rule(rank=st.integers(0, W - 1))
    def heartbeat(self, rank: int) -> None:
        self._feed(Heartbeat(rank=rank, step=self.steps[rank]))

    @rule(rank=st.integers(0, W - 1), how=st.sampled_from(["exit", "lost", "exiting"]))
    def leave(self, rank: int, how: str) -> None:
        if how == "exit":
            self._feed(ChildExited(rank, 1))
        elif how == "lost":
            self._feed(PeerLost(rank, "reset"))
        else:
            self._feed(Exiting(rank=rank))

    @rule(rank=st.integers(0, W - 1))
    def late_hello(self, rank: int) -> None:
        self._feed(Hello(run_id="run", rank=rank, world_size=W, model_signature=SIG))

    @precondition(lambda self: self.coord.next_deadline() is not None)
    @rule(extra=st.floats(0.0, 400.0))
    def advance(self, extra: float) -> None:
        deadline = self.coord.next_deadline()
        assert deadline is not None
        self.now = max(self.now, min(deadline, self.now + extra))
        self._observe(self.coord.tick(self.now))

    @invariant()
    def ledgers_exact(self) -> None:
        for epoch, work in self.coord.dispatch.works.items():
            report = work.coverage_report()
            assert report.ok, (epoch, report)

    @invariant()
    def dead_ranks_hold_no_work(self) -> None:
        c = self.coord
        for r in c.membership.liveness.dead():
            if r in c.averaging.deferred_forfeit:
                continue
            for work in c.dispatch.works.values():
                assert work.pending(r) == 0

    @invariant()
    def run_ends_once(self) -> None:
        assert self.run_over <= 1
        if self.run_over:
            assert self.coord.phase is RunPhase.DONE

    @invariant()
    def deadline_is_finite_and_tick_clears_it(self) -> None:
        d = self.coord.next_deadline()
        if d is None:
            return
        assert math.isfinite(d)
        if d <= self.now:  # anything due fires at once and is not re-armed at the same instant
            self._observe(self.coord.tick(self.now))
            again = self.coord.next_deadline()
            assert again is None or again > self.now


CoordinatorMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestCoordinatorMachine = CoordinatorMachine.TestCase
