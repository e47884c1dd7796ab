"""The coordinator: a sans-IO state machine that paces, feeds and averages a training cluster.

Rules (h11's header style: everything that changes coordinator state lives in this package):

1. **No I/O, no clock.** ``handle(input, now)``, ``tick(now)`` and ``next_deadline()`` are the
   whole interface; ``now`` is monotonic seconds supplied by the shell. The machine returns
   :mod:`~flodl.coord.effects` as data and never raises for anything a peer sends: a protocol
   violation evicts that rank with a reason.
2. **Run phases.** ``FORMING`` (handshakes until every rank joined, or the join timeout) →
   ``TRAINING`` (dispatch, cycles, epochs) → ``FINAL_EVAL`` (optional) → ``SHUTDOWN`` (waiting
   for every rank to exit) → ``DONE``. An unrecoverable state jumps to ``SHUTDOWN`` through
   ShutdownWithSave with a SaveReason.
3. **Sub-machines and what they see.** :class:`~flodl.coord.liveness.Liveness` sees every
   frame (refresh), deaths and exits; :class:`~flodl.coord.elche.ElChe` sees one window report
   per finished cycle; the guard and meta-controller one divergence report per cycle;
   :class:`~flodl.coord.chunks.EpochWork` (one per open epoch) sees every ``batch`` (advance),
   every finished cycle (commit) and every death (forfeit); :class:`~flodl.coord.cycle.Cycle`
   sees triggers, snapshots, acks, reduce completions and deaths; :class:`~flodl.coord.roles.Roles`
   sees calibrations, deaths and callback results.
4. **Tick order** (flodl-spec.md §6.1): coordinator heartbeat → formation timeout → stale ranks
   → reduce stall ceiling. Everything else is event-driven: the count gate is evaluated after
   every input that can change it, never on a wall-clock trigger.

Commit rule (what "trained exactly once" means): a batch is *committed* when an averaging cycle
that folded in the rank's parameters finalizes. The rank's done count is snapshotted when it
enters the reduce (``snapshot_ready``, overwritten by its ``sync_ack``); at finalize, every
contributor's snapshot is committed. Contributors are the ranks that acked, plus — CPU — the
ranks the reduce server reported in :class:`~flodl.coord.inputs.ReduceDone` (a rank that died
after its upload was folded still contributed), or — collective — the members of the session
the acks were made under. A dead rank's uncommitted work goes back to the pool (progressive) or
is split among survivors with ``extend_partition`` (whole-epoch partitions); when it died inside
a pending cycle after snapshotting, that forfeit waits for the finalize, which knows whether its
window was folded in.
"""

from __future__ import annotations

import enum
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from flodl.config import CoordConfig
from flodl.coord.cycle import Cycle, CyclePhase, Sessions, ranks_to_throttle
from flodl.coord.effects import (
    Alert,
    BundleRequested,
    Close,
    Effect,
    EpochDone,
    EvalDone,
    OpenReduce,
    RankDead,
    Record,
    RefusePeer,
    Reply,
    RunOver,
    Send,
    WriteMeta,
)
from flodl.coord.elche import ElChe, WindowReport
from flodl.coord.guards import ConvergenceGuard, DivergenceReport, make_guard
from flodl.coord.inputs import ChildExited, Input, PeerLost, ReduceDone
from flodl.coord.ledger import BatchRange, CoverageReport, EpochWork, from_samples, to_samples
from flodl.coord.liveness import Liveness, RankState, unrecoverable_reason
from flodl.coord.meta import MetaController
from flodl.coord.metrics import (
    EpochAggregator,
    ReportScheduler,
    WindowStats,
    node_paths,
    window_records,
)
from flodl.coord.partition import (
    carve_ranges,
    chunk_batches,
    final_window_alloc,
    partition_sizes,
    split_among,
)
from flodl.coord.resume import META_SCHEMA_VERSION, ResumeState
from flodl.coord.roles import CheckpointRetry, Roles
from flodl.coord.verdicts import ConvergenceAction, NudgeDown, Stable
from flodl.errors import LocalProtocolError
from flodl.sampling import epoch_batches
from flodl.timeouts import HEARTBEAT_INTERVAL_S
from flodl.wire.frames import (
    PROTOCOL_VERSION,
    Accept,
    Batch,
    BundleSaved,
    Checkpoint,
    CheckpointResult,
    CoordFrame,
    CoordHeartbeat,
    DeclareDead,
    EpochAggregated,
    EpochFnElapsed,
    EpochPlan,
    EvalBroadcast,
    EvalResult,
    ExecuteEval,
    Exiting,
    ExtendPartition,
    Heartbeat,
    Hello,
    Intent,
    LrUpdate,
    Metrics,
    NewSession,
    RankExited,
    RankFrame,
    Reject,
    RequestParams,
    ResourceSample,
    SaveConsensusModel,
    SaveReason,
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

__all__ = ["RunPhase", "ResumeState", "Coordinator", "META_SCHEMA_VERSION"]

COORD_HEARTBEAT_S = HEARTBEAT_INTERVAL_S
OVERSHOOT_INITIAL = 3


class RunPhase(enum.Enum):
    FORMING = "forming"
    TRAINING = "training"
    FINAL_EVAL = "final_eval"
    SHUTDOWN = "shutdown"
    DONE = "done"


@dataclass(slots=True)
class _RankRun:
    step: int = 0
    window: WindowStats = field(default_factory=WindowStats)
    closed_window: WindowStats | None = None
    snapshot: dict[int, int] | None = None
    snapshot_cycle: int = -1
    ack_session: int = 0
    device: int | None = None


class Coordinator:
    """The pure coordinator machine.

    Args:
        config: the run's configuration.
        rng: the only source of randomness (reserved for tie-breaks and jitter; decisions are
            deterministic for a given input sequence).
        resume: state read from a checkpoint meta, or ``None`` for a fresh run.
        guard: a user convergence guard (overrides the configured one).
    """

    def __init__(
        self,
        config: CoordConfig,
        rng: random.Random | None = None,
        *,
        resume: ResumeState | None = None,
        guard: ConvergenceGuard | None = None,
    ) -> None:
        self.config = config
        self.rng = rng if rng is not None else random.Random(0)
        w = config.world_size
        self.world_size = w
        el = config.elche
        self.traits = t = el.traits
        self.progressive = config.progressive
        self.phase = RunPhase.FORMING
        self.liveness = Liveness(w, config.heartbeat_timeout_s)
        self.elche = ElChe(
            w,
            anchor=el.anchor,
            max_anchor=el.effective_max_anchor,
            min_anchor=el.min_anchor,
            overhead_target=el.effective_overhead_target,
            max_batch_diff=el.max_batch_diff,
            window_growth_applicable=t.adaptive_window,
        )
        if el.partition_ratios is not None:
            self.elche.with_partition_ratios(el.partition_ratios)
        if guard is None and el.convergence_guard == "msf":
            from flodl.coord.guards import MsfGuard

            guard = MsfGuard()
        self.guard = make_guard(
            convergence_guard=guard,
            no_divergence_guard=el.no_divergence_guard or el.convergence_guard == "none",
            divergence_threshold=el.divergence_threshold,
            easgd_alpha=el.easgd_alpha,
        )
        self.meta_controller = MetaController() if el.meta_controller else None
        self.cycle = Cycle(needs_reduce_done=t.cpu_averaging)
        self.sessions = Sessions(session=0, members=tuple(range(w)))
        self.roles = Roles(config.epoch_callback_policy)
        self.aggregator = EpochAggregator(w, dict(config.scalar_reductions))
        self.reports = ReportScheduler(config.reports_per_epoch)
        self.paths = node_paths(w, config.hosts)
        self.ranks = [_RankRun() for _ in range(w)]
        self.works: dict[int, EpochWork] = {}
        self.epoch_started_at: dict[int, float] = {}
        self.final_plans: dict[int, tuple[int, list[int]]] = {}
        self.last_progress_at = 0.0
        self.next_epoch = 0
        self.last_aggregated = -1
        self.global_step = 0
        self.sync_rounds = 0
        self.prev_sync_ms = 0.0
        self.last_lr: float | None = None
        self.last_d_raw: float | None = None
        self.signature: str | None = None
        self.throttled: set[int] = set()
        self.deferred_forfeit: set[int] = set()
        self.intents: set[str] = set()
        self.checkpoints: dict[int, CheckpointRetry] = {}
        self.bundles: dict[int, tuple[CheckpointRetry, dict[str, Any], str]] = {}
        """Requested bundles awaiting their model file: version → (writer failover, meta to
        write once the ``.fdl`` is on disk, why it was saved)."""
        self._bundle_seq = 0
        self._unrecovered: list[int] = []
        """Ranks declared dead since the last finalized cycle (for the ``recovered`` record)."""
        self.final_eval_epoch: int | None = None
        self.save_reason: SaveReason | None = None
        self.max_overshoot = el.max_overshoot if el.max_overshoot is not None else OVERSHOOT_INITIAL
        self.coverage_log: dict[int, CoverageReport] = {}
        # Incremental count gate (O(1) per batch; see _refresh): per-rank "hit its count or
        # quiesced" and "moved this window" flags, with counts over live ranks.
        self._sat = [False] * w
        self._moved = [False] * w
        self._unsat = 0
        self._moved_count = 0
        self._cohort_cache: tuple[list[int], list[bool], int] | None = None
        self._cohort_version = 0
        self._stall_ceiling_s = config.stall_ceiling_s
        self._barrier = el.barrier_paced
        self._bs = config.batch_size
        self._join_deadline_at: float | None = None
        self._heartbeat_at: float | None = None
        self._started = False
        self._run_over = False
        if resume is not None:
            self._seed_resume(resume)

    # =========================================================================================
    # Public interface
    # =========================================================================================

    def handle(self, event: RankFrame | Input, now: float) -> list[Effect]:
        """Apply one input received at monotonic ``now`` (seconds); return the effects."""
        out: list[Effect] = []
        self._arm_clocks(now)
        match event:
            case Hello():
                self._on_hello(event, now, out)
            case PeerLost(rank=rank, reason=reason):
                if self._in_range(rank):
                    self._on_gone(rank, f"connection lost: {reason}", now, out)
            case ChildExited(rank=rank, exit_code=code) | RankExited(rank=rank, exit_code=code):
                if self._in_range(rank):
                    self._on_gone(rank, f"process exited with code {code}", now, out)
            case ReduceDone():
                self._on_reduce_done(event, now, out)
            case _:
                self._on_rank_frame(event, now, out)
        return out

    def tick(self, now: float) -> list[Effect]:
        """Fire every deadline ≤ ``now``: heartbeats, formation timeout, stale ranks, stall."""
        out: list[Effect] = []
        self._arm_clocks(now)
        if self.phase is RunPhase.DONE:
            return out
        if self._heartbeat_at is not None and now >= self._heartbeat_at:
            beat = CoordHeartbeat()
            for r in self.liveness.alive():
                out.append(Send(r, beat))
            self._heartbeat_at = now + COORD_HEARTBEAT_S
        if (
            self.phase is RunPhase.FORMING
            and self._join_deadline_at is not None
            and now >= self._join_deadline_at
        ):
            missing = [
                r for r in range(self.world_size) if self.liveness.state(r) is RankState.JOINING
            ]
            self._finish_run(
                out, ok=False, reason=f"formation timeout: ranks {missing} never joined"
            )
            return out
        for r in self.liveness.stale(now):
            timeout = self.liveness.heartbeat_timeout_s
            self._declare_dead(r, f"no frame for {timeout:g} s (heartbeat timeout)", now, out)
        progress_at = self._progress_deadline()
        if progress_at is not None and now >= progress_at:
            detail = (
                f"no training progress for {now - self.last_progress_at:.0f} s (ceiling "
                f"{self.config.stall_ceiling_s:g} s): the cohort is wedged"
            )
            out.append(Alert("reduce_stall", "root", detail, "critical"))
            self._shutdown_with_save("reduce_stall", detail, out)
        stall_at = self.cycle.stall_deadline(self.config.stall_ceiling_s)
        if stall_at is not None and now >= stall_at and self.save_reason is None:
            waiting = sorted(self.cycle.expected - set(self.cycle.acked))
            detail = (
                f"averaging cycle {self.cycle.number} pending for "
                f"{now - self.cycle.pending_since_at:.0f} s (ceiling "
                f"{self.config.stall_ceiling_s:g} s); waiting for ranks {waiting}"
            )
            out.append(Alert("reduce_stall", "root", detail, "critical"))
            self._shutdown_with_save("reduce_stall", detail, out)
        return out

    def next_deadline(self) -> float | None:
        """Earliest ``now`` at which :meth:`tick` can change anything; None if nothing armed.

        Called by the shell after every input, so it allocates nothing."""
        phase = self.phase
        if phase is RunPhase.DONE:
            return None
        best = self._heartbeat_at
        live = self.liveness.next_deadline()
        if live is not None and (best is None or live < best):
            best = live
        join_at = self._join_deadline_at if phase is RunPhase.FORMING else None
        if join_at is not None and (best is None or join_at < best):
            best = join_at
        if self.save_reason is None:
            cycle = self.cycle
            if cycle.phase is CyclePhase.PENDING:
                at = cycle.pending_since_at + self._stall_ceiling_s
            elif phase is RunPhase.TRAINING:
                at = self.last_progress_at + self._stall_ceiling_s
            else:
                return best
            if best is None or at < best:
                best = at
        return best

    def _progress_deadline(self) -> float | None:
        """Safety net against a wedged cohort (no batch and no finalized cycle for the stall
        ceiling while training, outside a pending cycle, which has its own ceiling)."""
        if self.phase is not RunPhase.TRAINING or self.cycle.pending or self.save_reason:
            return None
        return self.last_progress_at + self._stall_ceiling_s

    # --- read-only views used by shells, the simulator and tests -----------------------------

    @property
    def done(self) -> bool:
        return self.phase is RunPhase.DONE

    def coverage(self, epoch: int) -> CoverageReport | None:
        """The coverage report of a finished epoch (checked when it closed), or of an open one."""
        if epoch in self.works:
            return self.works[epoch].coverage_report()
        return self.coverage_log.get(epoch)

    @property
    def cohort_version(self) -> int:
        """Bumped whenever ElChe's counts or the live set may have changed."""
        return self._cohort_version

    def gate_open(self) -> bool:
        """Whether the incremental count gate says a cycle may start (for invariant checks
        against :func:`~flodl.coord.cycle.should_average`)."""
        return self._unsat == 0 and self._moved_count > 0 and self.liveness.alive_count() > 0

    def in_flight(self, rank: int) -> int:
        """Batches handed to ``rank`` and not yet trained, over every open epoch."""
        works = self.works
        if len(works) == 1:  # the common case (barrier-paced runs have one open epoch)
            for w in works.values():
                return w.in_flight(rank)
        return sum(w.in_flight(rank) for w in works.values())

    def meta_record(self, reason: SaveReason | str) -> dict[str, Any]:
        """The checkpoint meta (flodl-spec.md §8) as JSON-ready data."""
        state = self.elche.to_state()
        history = self.guard.trend_history()
        elche_state = state.to_dict()
        elche_state["trend_history"] = history
        epochs = sorted(self.works)
        epoch = epochs[0] if epochs else min(self.next_epoch, self.config.total_epochs)
        return {
            "schema_version": META_SCHEMA_VERSION,
            "epoch": epoch,
            "global_step": self.global_step,
            "sync_round": self.sync_rounds,
            "world_size_at_save": self.world_size,
            "save_reason": reason,
            "elche_state": elche_state,
            "coverage": {
                "seed": self.config.seed,
                "epoch_splits": self.config.epoch_splits,
                "batch_size": self.config.batch_size,
                "per_epoch": [
                    {
                        "epoch": e,
                        "total_samples": self.works[e].total_batches * self.config.batch_size,
                        "uncovered_ranges": [
                            list(to_samples(r, self.config.batch_size))
                            for r in self.works[e].uncovered_ranges()
                        ],
                    }
                    for e in epochs
                ],
            },
        }

    # =========================================================================================
    # Handshake and membership
    # =========================================================================================

    def _on_hello(self, hello: Hello, now: float, out: list[Effect]) -> None:
        reason = self._refusal(hello)
        if reason is not None:
            out.append(Reply(Reject(reason=reason)))
            out.append(RefusePeer(reason))
            return
        out.append(
            Reply(
                Accept(
                    run_id=self.config.run_id,
                    rank=hello.rank,
                    world_size=self.world_size,
                    session=self.sessions.session,
                    heartbeat_timeout_s=self.config.heartbeat_timeout_s,
                )
            )
        )
        if hello.role == "supervisor":
            return
        if self.signature is None:
            self.signature = hello.model_signature
        self.liveness.join(hello.rank, now)
        if self.liveness.joined_count() == self.world_size:
            self._begin_training(now, out)

    def _refusal(self, hello: Hello) -> str | None:
        if hello.protocol != PROTOCOL_VERSION:
            return (
                f"protocol {hello.protocol} not supported (coordinator speaks {PROTOCOL_VERSION})"
            )
        if hello.run_id != self.config.run_id:
            return f"run id {hello.run_id!r} does not match this run ({self.config.run_id!r})"
        if hello.world_size != self.world_size:
            return f"world size {hello.world_size} does not match this run ({self.world_size})"
        if hello.rank >= self.world_size:
            return f"rank {hello.rank} out of range for world size {self.world_size}"
        if hello.role == "supervisor":
            return None
        state = self.liveness.state(hello.rank)
        if state is RankState.ALIVE:
            return f"rank {hello.rank} is already connected (duplicate rank)"
        if state is RankState.DEAD:
            return f"rank {hello.rank} was declared dead; ranks cannot rejoin a run"
        if state is RankState.EXITED:
            return f"rank {hello.rank} already finished"
        if self.phase is not RunPhase.FORMING:
            return "the run is no longer forming"
        if self.signature is not None and hello.model_signature != self.signature:
            return (
                f"model signature {hello.model_signature[:12]}… differs from the first rank's "
                f"{self.signature[:12]}… (a different model or dtype)"
            )
        return None

    def _in_range(self, rank: int) -> bool:
        return 0 <= rank < self.world_size

    def _on_gone(self, rank: int, reason: str, now: float, out: list[Effect]) -> None:
        state = self.liveness.state(rank)
        if state is RankState.ALIVE:
            self._declare_dead(rank, reason, now, out)
        elif state is RankState.JOINING and self.phase is RunPhase.FORMING:
            # its process is gone before it ever joined (a bad bundle, an import error): the
            # cohort can never form, so fail now instead of at the formation timeout
            self._finish_run(out, ok=False, reason=f"rank {rank} never joined: {reason}")

    # =========================================================================================
    # Rank frames
    # =========================================================================================

    def _on_rank_frame(self, frame: RankFrame, now: float, out: list[Effect]) -> None:
        rank = frame.rank
        if not self._in_range(rank) or not self.liveness.is_alive(rank):
            return  # late frames from a dead or finished rank change nothing
        self.liveness.seen(rank, now)
        try:
            match frame:
                case Heartbeat():
                    return
                case Batch():
                    self._on_batch(frame, now, out)
                case SnapshotReady():
                    self._on_snapshot(frame)
                case SyncAck():
                    self._on_ack(frame, now, out)
                case Metrics():
                    self.aggregator.add(frame)
                case LrUpdate():
                    if self.last_lr is None or rank == min(self.liveness.alive()):
                        self.last_lr = frame.lr
                case Intent():
                    self.intents.add(frame.intent)
                case EvalResult():
                    self._on_eval_result(frame, now, out)
                case CheckpointResult():
                    self._on_checkpoint_result(frame, out)
                case BundleSaved():
                    self._on_bundle_saved(frame, out)
                case EpochFnElapsed():
                    self.roles.observe_cost("epoch_fn", rank, frame.elapsed_ms)
                case ResourceSample():
                    out.append(Record(self.paths[rank], "resource", frame.model_dump()))
                case Exiting():
                    self._on_exiting(rank, now, out)
                case _:
                    return
        except LocalProtocolError as exc:
            self._declare_dead(rank, f"protocol violation: {exc}", now, out)

    def _on_batch(self, batch: Batch, now: float, out: list[Effect]) -> None:
        rank = batch.rank
        work = self.works.get(batch.epoch)
        if work is None or work.in_flight(rank) == 0:
            raise LocalProtocolError(
                f"rank {rank} trained a batch of epoch {batch.epoch} it was not given", rank=rank
            )
        work.advance(rank)
        self.last_progress_at = now
        run = self.ranks[rank]
        run.step = max(run.step, batch.step)
        run.window.add(batch.batch_ms, batch.data_ms, batch.loss, self._bs)
        if self.config.elche.max_batch_diff is not None and self.traits.cpu_averaging:
            self._throttle_leaders(out)
        if self.progressive and work.in_flight(rank) == 0:
            self._dispatch(rank, now, out)
        self._refresh(rank)
        self._maybe_trigger(now, out)

    def _throttle_leaders(self, out: list[Effect]) -> None:
        """CPU lead limit (``max_batch_diff``): O(W) per batch, paid only when configured."""
        if not self.cycle.pending:
            for r in ranks_to_throttle(
                alive=self.liveness.alive(),
                window_steps=self._window_steps(),
                max_batch_diff=self.config.elche.max_batch_diff,
                already=self.throttled,
            ):
                self.throttled.add(r)
                out.append(Send(r, Throttle()))

    def _on_snapshot(self, frame: SnapshotReady) -> None:
        if self.cycle.pending and frame.cycle == self.cycle.number:
            run = self.ranks[frame.rank]
            run.snapshot = {e: w.done(frame.rank) for e, w in self.works.items()}
            run.snapshot_cycle = frame.cycle

    def _on_ack(self, ack: SyncAck, now: float, out: list[Effect]) -> None:
        if not self.cycle.pending or ack.cycle != self.cycle.number:
            return
        run = self.ranks[ack.rank]
        run.snapshot = {e: w.done(ack.rank) for e, w in self.works.items()}
        run.snapshot_cycle = ack.cycle
        run.ack_session = ack.session
        run.closed_window = run.window
        run.window = WindowStats()
        self._refresh(ack.rank)
        self._pending_divergence[ack.rank] = (ack.divergence, ack.pre_norm, ack.post_norm)
        if self.cycle.ack(ack.rank, ack.step):
            self._maybe_finalize(now, out)

    def _on_reduce_done(self, event: ReduceDone, now: float, out: list[Effect]) -> None:
        if self.cycle.pending and event.cycle == self.cycle.number:
            self.cycle.mark_reduce_done(event.contributors, event.weight_total)
            self._maybe_finalize(now, out)

    def _on_exiting(self, rank: int, now: float, out: list[Effect]) -> None:
        if self.phase is RunPhase.SHUTDOWN:
            if self.liveness.mark_exited(rank):
                self._forget(rank)
            self._maybe_done(out)
        else:
            self._declare_dead(rank, "rank exited before the run ended", now, out)

    # =========================================================================================
    # Training: epochs and dispatch
    # =========================================================================================

    def _begin_training(self, now: float, out: list[Effect]) -> None:
        self.phase = RunPhase.TRAINING
        self.last_progress_at = now
        self._refresh_all()
        self._started = True
        self._pending_divergence: dict[int, tuple[float | None, float | None, float | None]] = {}
        if self.traits.cpu_averaging:
            out.append(OpenReduce(0, tuple(self.liveness.alive())))
        if self.global_step > 0:  # resumed: schedulers continue where the run stopped
            step: CoordFrame = SetGlobalStep(global_step=self.global_step)
            for r in self.liveness.alive():
                out.append(Send(r, step))
        self._advance_epochs(now, out)

    def _epoch_batches(self, epoch: int) -> int:
        c = self.config
        return epoch_batches(epoch, c.index_space, c.batch_size, c.epoch_splits)

    def _open_epoch(self, epoch: int, now: float, out: list[Effect]) -> EpochWork:
        work = self.works.get(epoch)
        if work is not None:
            return work
        uncovered = self._resume_uncovered if epoch == self._resume_epoch else None
        work = EpochWork(epoch, self._epoch_batches(epoch), self.world_size, uncovered=uncovered)
        self.works[epoch] = work
        self.epoch_started_at[epoch] = now
        self.next_epoch = max(self.next_epoch, epoch + 1)
        self.elche.set_max_total_batches(max(1, work.total_batches))
        self._invalidate_cohort()
        self._send_roles_if_dirty(out)
        self._epoch_boundary_callbacks(epoch, out)
        if not self.progressive:
            alive = self.liveness.alive_mask()
            calibrated = self.elche.calibrated or self.elche.has_speed_hint()
            sizes = partition_sizes(
                work.remaining(),
                self.world_size,
                alive=alive,
                ms_per_batch=self.elche.smoothed_ms if calibrated else None,
                ratios=self.config.elche.partition_ratios,
                proportional=self.traits.speed_proportional and calibrated,
            )
            pieces = carve_ranges(work.unassigned_ranges(), sizes)
            for rank, ranges in enumerate(pieces):
                for rng in ranges:
                    work.assign(rank, rng)
                    plan = self._plan(epoch, rng, tail=True)  # a whole-epoch partition
                    out.append(Send(rank, StartEpoch(plan=plan)))
                self._refresh(rank)
        return work

    def _plan(self, epoch: int, rng: BatchRange, *, tail: bool = False) -> EpochPlan:
        offset, size = to_samples(rng, self._bs)
        return EpochPlan(epoch=epoch, partition_offset=offset, partition_size=size, epoch_tail=tail)

    def _advance_epochs(self, now: float, out: list[Effect]) -> None:
        """Close finished epochs in order, open the next one, dispatch, or end the run."""
        while self.phase is RunPhase.TRAINING:
            if self.works:
                first = min(self.works)
                if not self.works[first].is_done():
                    break
                self._close_epoch(first, now, out)
                continue
            if self.next_epoch >= self.config.total_epochs:
                self._end_of_training(now, out)
                return
            self._open_epoch(self.next_epoch, now, out)
        if self.phase is not RunPhase.TRAINING:
            return
        if self.progressive:
            for r in self.liveness.alive():
                self._dispatch(r, now, out)
        self._maybe_trigger(now, out)

    def _dispatch(self, rank: int, now: float, out: list[Effect]) -> EpochPlan | None:
        """Give ``rank`` its next progressive chunk if the pacing rules allow; the plan is also
        returned so a CPU Cadence finalize can fold it into ``update``."""
        plan = self._take_chunk(rank, now, out)
        if plan is not None:
            out.append(Send(rank, StartEpoch(plan=plan)))
        return plan

    def _take_chunk(self, rank: int, now: float, out: list[Effect]) -> EpochPlan | None:
        if self.phase is not RunPhase.TRAINING or not self.liveness.is_alive(rank):
            return None
        barrier = self._barrier
        if barrier and (self.cycle.pending or self.in_flight(rank) > 0):
            return None
        # Work already handed out counts against the window budget: without this an Async
        # rank would pile up a chunk per finalize and the overshoot bound would not hold.
        steps = self.ranks[rank].window.steps + self.in_flight(rank)
        counts, _, sum_counts = self._cohort()
        count = counts[rank]
        overshoot = self.max_overshoot if self.traits.overshoot else 0
        if steps >= count + overshoot:
            return None
        work = self._first_unassigned()
        if work is None:
            if barrier or self.next_epoch >= self.config.total_epochs:
                return None
            work = self._open_epoch(self.next_epoch, now, out)
            if work.remaining() == 0:
                return None
        final_slot = self._final_slot(work, rank) if barrier else None
        size = chunk_batches(
            barrier_paced=barrier,
            count=count,
            steps_in_window=steps,
            remaining=work.remaining(),
            sum_counts=sum_counts,
            final_slot=final_slot,
            max_overshoot=overshoot,
            calibrated=self.elche.calibrated or self.elche.has_speed_hint(),
            world_size=self.world_size,
            total_batches=work.total_batches,
        )
        if size <= 0:
            return None
        rng = work.take(rank, size)
        if rng is None:
            return None
        self._refresh(rank)
        if final_slot is not None:
            self.final_plans[work.epoch][1][rank] = max(0, final_slot - rng.size)
        return self._plan(work.epoch, rng, tail=work.remaining() == 0)

    def _final_slot(self, work: EpochWork, rank: int) -> int | None:
        counts, alive, _ = self._cohort()
        key = self._cohort_version
        pinned = self.final_plans.get(work.epoch)
        if pinned is None or pinned[0] != key:  # pinned once per (epoch, cohort version)
            rem = work.remaining()
            # final_window_due() without its O(W) sum (Σ counts is cached with the cohort)
            if not 0 < rem < self._cohort()[2] + self.world_size:
                return None
            pinned = (key, final_window_alloc(rem, counts, alive))
            self.final_plans[work.epoch] = pinned
        return pinned[1][rank]

    def _close_epoch(self, epoch: int, now: float, out: list[Effect]) -> None:
        work = self.works.pop(epoch)
        report = work.coverage_report()
        self.coverage_log[epoch] = report
        if not report.ok:
            out.append(
                Alert("coverage", "root", f"epoch {epoch} coverage broken: {report}", "critical")
            )
        self.final_plans.pop(epoch, None)
        self.last_aggregated = epoch
        started = self.epoch_started_at.pop(epoch, now)
        metrics = self.aggregator.finish(
            epoch,
            epoch_ms=max(0.0, (now - started) * 1000.0),
            batch_share=self.elche.recent_batch_share(),
            syncs=self.sync_rounds,
            anchor=self.elche.anchor,
            devices=[r.device for r in self.ranks],
        )
        for r in self.liveness.alive():
            out.append(Send(r, EpochAggregated(metrics=metrics)))
        out.append(
            Record(
                "root",
                "epoch",
                {
                    "epoch": epoch,
                    "avg_loss": metrics.avg_loss,
                    "batch_counts": list(self.elche.batch_counts),
                    "heartbeat_age_s": self._heartbeat_ages(now),
                    "phase": self.elche.phase.value,
                },
            )
        )
        out.append(EpochDone(metrics))  # after its record: sinks merge the two

    def _heartbeat_ages(self, now: float) -> list[float | None]:
        """Seconds since each live rank's last frame (``None`` for dead or finished ranks)."""
        return [
            round(max(0.0, now - self.liveness.last_seen_at(r)), 3)
            if self.liveness.is_alive(r)
            else None
            for r in range(self.world_size)
        ]

    def _epoch_boundary_callbacks(self, epoch: int, out: list[Effect]) -> None:
        """Checkpoint and eval for the epoch that just ended (``epoch - 1``), dispatched before
        the first ``start_epoch`` of ``epoch`` so the role rank runs them in FIFO order."""
        done = epoch - 1
        if done < self._first_epoch:  # closed by the run this one resumes: already done
            return
        self._maybe_checkpoint(done, out)
        self._maybe_eval(done, out)

    def _checkpoint_due(self, epoch: int) -> bool:
        c = self.config
        every = c.checkpoint_every is not None and (epoch + 1) % c.checkpoint_every == 0
        return every or c.checkpoint_at_epoch == epoch or "checkpoint_now" in self.intents

    def _maybe_checkpoint(self, epoch: int, out: list[Effect], *, bundle: bool = True) -> None:
        if not self._checkpoint_due(epoch):
            return
        self.intents.discard("checkpoint_now")
        target = self._checkpoint_target()
        if target is None:
            return
        if self.config.has_checkpoint_fn:
            retry = CheckpointRetry(version=epoch)
            retry.first(target)
            self.checkpoints[epoch] = retry
            out.append(Send(target, Checkpoint(version=epoch, target_rank=target)))
        if bundle:
            self._request_bundle("graceful_shutdown", f"checkpoint after epoch {epoch}", out)

    def _checkpoint_target(self) -> int | None:
        target = self.roles.checkpoint_role
        if self.liveness.is_alive(target):
            return target
        alive = self.liveness.alive()
        return alive[0] if alive else None

    # --- bundles (flodl-spec.md §8): the meta commits a bundle once its model file exists ----

    def _request_bundle(self, reason: SaveReason, detail: str, out: list[Effect]) -> None:
        """Ask every live rank for its part of a new bundle (the checkpoint role rank writes
        the model); the meta, computed now, is written when the model file is on disk."""
        if not self.config.save_bundles:
            return
        writer = self._checkpoint_target()
        if writer is None:
            out.append(Alert("checkpoint_failed", "root", f"no live rank to save ({detail})"))
            return
        version = self._bundle_seq
        self._bundle_seq += 1
        retry = CheckpointRetry(version=version)
        retry.first(writer)
        self.bundles[version] = (retry, self.meta_record(reason), detail)
        out.append(BundleRequested(version))
        frame: CoordFrame = self._bundle_frame(version, writer)
        for r in self.liveness.alive():
            out.append(Send(r, frame))

    def _bundle_frame(self, version: int, writer: int) -> SaveConsensusModel:
        meta = self.bundles[version][1]
        return SaveConsensusModel(
            target_rank=writer,
            version=version,
            global_step=meta["global_step"],
            sync_round=meta["sync_round"],
            epoch=meta["epoch"],
        )

    def _on_bundle_saved(self, res: BundleSaved, out: list[Effect]) -> None:
        self.roles.observe_cost("checkpoint", res.rank, res.elapsed_ms)
        pending = self.bundles.get(res.version)
        if pending is None or pending[0].target != res.rank:
            if res.error is not None:  # a rank's optimizer state: the bundle still commits
                out.append(
                    Alert(
                        "checkpoint_failed",
                        self.paths[res.rank],
                        f"rank {res.rank} could not save its part of bundle {res.version}: "
                        f"{res.error}",
                    )
                )
            return
        if res.model:  # the model file is on disk: the meta commits the bundle
            del self.bundles[res.version]
            out.append(WriteMeta(pending[1], pending[2], res.version))
            if res.error is not None:
                out.append(
                    Alert(
                        "checkpoint_failed",
                        self.paths[res.rank],
                        f"bundle {res.version}: rank {res.rank} wrote the model but not its "
                        f"optimizer state: {res.error}",
                    )
                )
            return
        why = f"rank {res.rank}: {res.error or 'no model file written'}"
        self._retry_bundle(res.version, why, out)

    def _retry_bundle(self, version: int, why: str, out: list[Effect]) -> None:
        retry, _, detail = self.bundles[version]
        nxt = None if self.phase is RunPhase.SHUTDOWN else retry.next_target(self.liveness.alive())
        if nxt is None:
            del self.bundles[version]
            out.append(
                Alert(
                    "checkpoint_failed",
                    "root",
                    f"bundle {version} ({detail}) not saved ({why}); the previous checkpoint "
                    "stays the one to resume from",
                )
            )
            return
        out.append(Send(nxt, self._bundle_frame(version, nxt)))

    def _failover_bundles(self, dead: int, out: list[Effect]) -> None:
        for version in sorted(self.bundles):
            if self.bundles[version][0].target == dead:
                self._retry_bundle(version, f"rank {dead} died", out)

    def _eval_due(self, epoch: int) -> bool:
        every = self.config.effective_eval_every
        due = every is not None and (epoch + 1) % every == 0
        return (due or "eval_now" in self.intents) and self.config.has_eval

    def _maybe_eval(self, epoch: int, out: list[Effect], *, final: bool = False) -> bool:
        if not (final or self._eval_due(epoch)):
            return False
        self.intents.discard("eval_now")
        target = self.roles.eval_role
        if not self.liveness.is_alive(target):
            return False
        out.append(
            Send(
                target,
                ExecuteEval(
                    schedule_id=epoch,
                    epoch=epoch,
                    target_rank=target,
                    adopt_consensus=self.traits.elastic_blend,
                ),
            )
        )
        return True

    def _end_of_training(self, now: float, out: list[Effect]) -> None:
        final = self.config.total_epochs
        # checkpoint_fn for the last epoch; its bundle is the end-of-run one
        self._maybe_checkpoint(final - 1, out, bundle=False)
        if self.config.has_eval and self._maybe_eval(final, out, final=True):
            self.phase = RunPhase.FINAL_EVAL
            self.final_eval_epoch = final
            return
        self._begin_shutdown(out)

    def _begin_shutdown(self, out: list[Effect]) -> None:
        self._request_bundle("graceful_shutdown", "end of run", out)
        self.phase = RunPhase.SHUTDOWN
        for r in self.liveness.alive():
            out.append(Send(r, Shutdown()))
        self._maybe_done(out)

    def _maybe_done(self, out: list[Effect]) -> None:
        if self.phase is RunPhase.SHUTDOWN and self.liveness.alive_count() == 0:
            ok = self.save_reason is None
            reason = "run complete" if ok else f"run stopped: {self.save_reason}"
            self._finish_run(out, ok=ok, reason=reason)

    def _finish_run(self, out: list[Effect], *, ok: bool, reason: str) -> None:
        if self._run_over:
            return
        self._run_over = True
        if self.phase is RunPhase.FORMING:
            for r in self.liveness.alive():
                out.append(Send(r, Shutdown()))
        self.phase = RunPhase.DONE
        out.append(RunOver(ok=ok, reason=reason, save_reason=self.save_reason))

    # =========================================================================================
    # Averaging cycles
    # =========================================================================================

    def _cohort(self) -> tuple[list[int], list[bool], int]:
        """(counts ≥ 1 for live ranks and 0 for the dead, live mask, Σ counts), cached until
        ElChe's counts or the membership change (reading them per dispatch would be O(W))."""
        if self._cohort_cache is None:
            alive = self.liveness.alive_mask()
            counts = [
                max(1, c) if a else 0 for c, a in zip(self.elche.batch_counts, alive, strict=True)
            ]
            self._cohort_cache = (counts, alive, sum(counts))
        return self._cohort_cache

    def _invalidate_cohort(self) -> None:
        self._cohort_cache = None
        self._cohort_version += 1
        self._refresh_all()

    def _refresh(self, rank: int) -> None:
        """Recompute ``rank``'s count-gate flags and the live counters."""
        live = self.liveness.is_alive(rank)
        steps = self.ranks[rank].window.steps
        if live:
            quiesced = self.in_flight(rank) == 0
            if self.traits.chunk_is_window and self.progressive:
                # One chunk = one window (possibly a final-window slot above the count):
                # the window is done when the chunk is, never in the middle of it.
                sat = quiesced
            else:
                need = 1 if self.traits.one_step_gate else self._cohort()[0][rank]
                sat = steps >= need or quiesced
            moved = steps > 0
        else:
            sat = moved = False
        if live:
            self._unsat += int(self._sat[rank]) - int(sat)
            self._moved_count += int(moved) - int(self._moved[rank])
        self._sat[rank], self._moved[rank] = sat, moved

    def _refresh_all(self) -> None:
        self._sat = [False] * self.world_size
        self._moved = [False] * self.world_size
        self._unsat = self.liveness.alive_count()
        self._moved_count = 0
        for r in range(self.world_size):
            if self.liveness.is_alive(r):
                self._refresh(r)

    def _forget(self, rank: int) -> None:
        """Drop a rank that just died or exited from the live counters."""
        if not self._sat[rank]:
            self._unsat -= 1
        if self._moved[rank]:
            self._moved_count -= 1
        self._sat[rank] = self._moved[rank] = False

    def _window_steps(self) -> list[int]:
        return [r.window.steps for r in self.ranks]

    def _maybe_trigger(self, now: float, out: list[Effect]) -> None:
        if self.phase is not RunPhase.TRAINING or self.cycle.pending:
            return
        # The count gate of cycle.should_average, kept incrementally: O(1) per batch.
        if self._unsat > 0 or self._moved_count == 0 or self.liveness.alive_count() == 0:
            return
        alive = self.liveness.alive()
        number = self.cycle.begin(alive, now)
        self.throttled.clear()
        self._pending_divergence = {}
        if self.traits.cpu_averaging:
            out.append(OpenReduce(number, tuple(alive)))
            for r in alive:
                out.append(Send(r, RequestParams(cycle=number)))
                if self.traits.throttle_at_trigger:
                    out.append(Send(r, Throttle()))
        else:
            for r in alive:
                out.append(Send(r, SyncNow(cycle=number)))

    def _maybe_finalize(self, now: float, out: list[Effect]) -> None:
        if not self.cycle.ready():
            return
        number = self.cycle.number
        self.last_progress_at = now
        try:
            self._finalize(now, out)
        finally:
            self.cycle.finish()  # never fold a round twice, even if finalizing failed
        self._release(number, now, out)
        self._advance_epochs(now, out)

    def _release(self, number: int, now: float, out: list[Effect]) -> None:
        """Tell live ranks the cycle is over: ``update`` (CPU; in Cadence with the next
        intra-epoch chunk folded in, saving a round trip) and the new global step."""
        cpu = self.traits.cpu_averaging
        fold = self.traits.folds_next_chunk and self.progressive
        # Frames are immutable: one instance serves every rank that gets the same content.
        step: CoordFrame = SetGlobalStep(global_step=self.global_step)
        bare: CoordFrame = Update(version=number, next_plan=None)
        for r in self.liveness.alive():
            if cpu:
                plan = None
                if fold and self._has_unassigned():
                    plan = self._take_chunk(r, now, out)
                out.append(
                    Send(r, bare if plan is None else Update(version=number, next_plan=plan))
                )
            out.append(Send(r, step))

    def _has_unassigned(self) -> bool:
        return self._first_unassigned() is not None

    def _first_unassigned(self) -> EpochWork | None:
        """The lowest open epoch with unassigned work (epochs are opened in order, so the
        dict's insertion order is ascending)."""
        for w in self.works.values():
            if w.remaining() > 0:
                return w
        return None

    def _contributors(self) -> set[int]:
        acked = set(self.cycle.acked)
        if self.traits.cpu_averaging and self.cycle.contributors is not None:
            return acked | set(self.cycle.contributors)
        sessions = {self.ranks[r].ack_session for r in acked}
        if sessions == {self.sessions.session}:
            return acked | set(self.sessions.members)
        return acked

    def _finalize(self, now: float, out: list[Effect]) -> None:
        number = self.cycle.number
        sync_ms = max(0.0, (now - self.cycle.pending_since_at) * 1000.0)
        contributors = self._contributors()
        # 1. commit contributors' snapshots; settle deferred forfeits.
        for r in sorted(contributors):
            run = self.ranks[r]
            if run.snapshot_cycle == number and run.snapshot is not None:
                for e, done in run.snapshot.items():
                    if e in self.works:
                        self.works[e].commit_upto(r, min(done, self.works[e].done(r)))
        for r in sorted(self.deferred_forfeit):
            self._forfeit(r, now, out, redistribute=self.phase is RunPhase.TRAINING)
        self.deferred_forfeit.clear()
        # 2. ElChe feedback from the closed windows.
        windows = [
            r.closed_window if r.closed_window is not None else WindowStats() for r in self.ranks
        ]
        steps = [w.steps for w in windows]
        self._stage_callback_slack()
        was_calibrated = self.elche.calibrated
        self.elche.report_window(
            _window_report(windows, self.liveness.alive_mask(), self.prev_sync_ms),
            delivered_capable=self.traits.adaptive_window,
        )
        if self.elche.calibrated and not was_calibrated:
            why = self.roles.on_first_calibration(self.liveness.alive(), self.elche.smoothed_ms)
            if why:
                out.append(Record("root", "roles", {"roles": why}))
        # 3. Guard + meta-controller through the verdict seam.
        action = self._guard_action(steps)
        old_anchor = self.elche.anchor
        if isinstance(action, Stable):
            self.elche.apply_verdict(
                Stable(relax_up=self.traits.overshoot and self.config.elche.relax_up)
            )
            if self.config.elche.max_overshoot is None and self.traits.overshoot:
                cap = min(10, max(3, self._epoch_batches(0) // 50))
                self.max_overshoot = min(cap, self.max_overshoot + 1)
        else:
            self.elche.apply_verdict(action)
            if self.config.elche.max_overshoot is None:
                self.max_overshoot = OVERSHOOT_INITIAL
            if isinstance(action, NudgeDown):
                out.append(
                    Alert("drift", "root", f"guard nudged the anchor down ×{action.factor:g}")
                )
        if self.meta_controller is not None:
            nudge = self.meta_controller.observe(
                self.last_lr, self.elche.anchor, action, self.elche.phase
            )
            if nudge is not None:
                self.elche.apply_verdict(nudge)
        self._invalidate_cohort()
        # 4. Counters, global step, records.
        self.sync_rounds += 1
        self.prev_sync_ms = sync_ms
        if self._unrecovered:  # the survivors completed a reduce after these deaths
            out.append(
                Record(
                    "root",
                    "recovered",
                    {"after_deaths": self._unrecovered, "syncs": self.sync_rounds},
                )
            )
            self._unrecovered = []
        self.global_step += sum(steps)
        for r in self.liveness.alive():
            run = self.ranks[r]
            run.closed_window = None
        if self.elche.anchor != old_anchor:
            out.append(Record("root", "anchor", {"from": old_anchor, "to": self.elche.anchor}))
        self._maybe_report(windows, sync_ms, now, out)

    def _guard_action(self, steps: Sequence[int]) -> ConvergenceAction:
        if not self.traits.adaptive_window:
            return Stable()
        deltas = []
        pre_norms: list[float] = []
        post: float | None = None
        for r in sorted(self._pending_divergence):
            d, pre, post_norm = self._pending_divergence[r]
            if d is not None:
                deltas.append(d)
                if pre is not None:
                    pre_norms.append(pre)
                if post_norm is not None:
                    post = post_norm
        if not deltas:
            return Stable()
        report = DivergenceReport(
            deltas=tuple(deltas),
            pre_norms=tuple(pre_norms) if len(pre_norms) == len(deltas) else None,
            post_norm=post,
        )
        self.last_d_raw = report.d_raw
        return self.guard.report(report, sum(steps), max(steps, default=0))

    def _stage_callback_slack(self) -> None:
        """Pre-shrink the role rank's quota when the next window is the epoch's last
        (flodl-spec.md §2.8), so a callback runs in freed slack instead of stretching the
        barrier."""
        if not self.elche.calibrated or not self.works:
            return
        work = self.works[min(self.works)]
        if work.remaining() > self.elche.total_batches:
            return
        slack = [0.0] * self.world_size
        epoch = work.epoch
        if self.config.has_epoch_fn:
            r = self.roles.epoch_callback_role
            slack[r] += self.roles.cost("epoch_fn", r)
        if self.config.has_checkpoint_fn and self._checkpoint_due(epoch):
            r = self.roles.checkpoint_role
            slack[r] += self.roles.cost("checkpoint", r)
        if self._eval_due(epoch):
            r = self.roles.eval_role
            slack[r] += self.roles.cost("eval", r)
        floor = max(0.05 * self.elche.anchor_wall_ms(), 100.0)
        slack = [
            s if s >= floor and self.liveness.is_alive(r) else 0.0 for r, s in enumerate(slack)
        ]
        if any(slack):
            self.elche.apply_callback_slack(slack)

    def _maybe_report(
        self, windows: Sequence[WindowStats], sync_ms: float, now: float, out: list[Effect]
    ) -> None:
        if self.config.reports_per_epoch is None or not self.works:
            return
        work = self.works[min(self.works)]
        committed = sum(work.committed(r) for r in range(self.world_size))
        if not self.reports.due(work.epoch, committed, work.total_batches):
            return
        shares = self.elche.recent_batch_share()
        nodes = {r: windows[r].node(shares[r]) for r in range(self.world_size)}
        engine: dict[str, Any] = {
            "epoch": work.epoch,
            "epoch_progress": committed / max(1, work.total_batches),
            "anchor": self.elche.anchor,
            "sync_ms": sync_ms,
            "batch_counts": self.elche.batch_counts,
            "syncs": self.sync_rounds,
            "heartbeat_age_s": self._heartbeat_ages(now),
        }
        if self.last_d_raw is not None:
            engine["d_raw"] = self.last_d_raw
        telemetry = self.guard.telemetry()
        if "lambda_ema" in telemetry:
            engine["lambda_ema"] = telemetry["lambda_ema"]
        for path, node in window_records(nodes, self.paths, engine):
            out.append(Record(path, "node", node))

    # =========================================================================================
    # Deaths
    # =========================================================================================

    def _declare_dead(self, rank: int, reason: str, now: float, out: list[Effect]) -> None:
        if not self.liveness.declare_dead(rank, reason):
            return
        self._forget(rank)
        out.append(RankDead(rank, reason))
        out.append(Close(rank, reason))
        out.append(
            Alert("rank_lost", self.paths[rank], f"rank {rank} declared dead: {reason}", "critical")
        )
        if self.phase is RunPhase.FORMING:
            self._finish_run(out, ok=False, reason=f"rank {rank} lost during formation: {reason}")
            return
        if self.phase is RunPhase.SHUTDOWN:
            self._forfeit(rank, now, out, redistribute=False)  # its work stays uncovered
            self._failover_bundles(rank, out)
            self._maybe_done(out)
            return
        self.elche.mark_dead(rank)
        self._invalidate_cohort()
        self._unrecovered.append(rank)
        alive = self.liveness.alive()
        run = self.ranks[rank]
        if self.cycle.pending:
            self.cycle.drop(rank)
            if run.snapshot_cycle == self.cycle.number:
                self.deferred_forfeit.add(rank)
        verdict = unrecoverable_reason(
            world_size=self.world_size,
            dead=len(self.liveness.dead()),
            alive=len(alive),
            needs_two=not self.traits.cpu_averaging,
            max_failure=self.config.max_failure,
        )
        if rank not in self.deferred_forfeit:
            # Past the failure budget the work stays uncovered (for the resume) instead of
            # being handed to survivors that are about to stop.
            self._forfeit(rank, now, out, redistribute=verdict is None)
        if verdict is not None:
            self._shutdown_with_save(verdict[0], verdict[1], out)
            return
        why = self.roles.on_death(rank, alive, self.elche.smoothed_ms)
        if why:
            out.append(Record("root", "roles", {"roles": why}))
        self._failover_checkpoints(rank, alive, out)
        self._failover_bundles(rank, out)
        if not self.traits.cpu_averaging:
            session, members = self.sessions.reform(alive)
            for r in alive:
                out.append(Send(r, DeclareDead(rank=rank, reason=reason)))
                out.append(
                    Send(
                        r,
                        NewSession(
                            session=session,
                            store_prefix=self.sessions.store_prefix(self.config.run_id),
                            new_rank=self.sessions.new_rank(r),
                            new_world_size=len(members),
                            ranks=list(members),
                        ),
                    )
                )
        self._send_roles_if_dirty(out)
        if self.phase is RunPhase.FINAL_EVAL and self.final_eval_epoch is not None:
            if not self._maybe_eval(self.final_eval_epoch, out, final=True):
                self._begin_shutdown(out)
            return
        self._maybe_finalize(now, out)
        if self.phase is RunPhase.TRAINING:
            if self.progressive:
                for r in alive:
                    if self.in_flight(r) == 0:
                        self._dispatch(r, now, out)
            self._maybe_trigger(now, out)

    def _forfeit(
        self, rank: int, now: float, out: list[Effect], *, redistribute: bool = True
    ) -> None:
        """Return the dead rank's uncommitted work: to the pool (progressive, or when the run
        is shutting down), else split among survivors with ``extend_partition``."""
        alive = self.liveness.alive()
        for epoch, work in sorted(self.works.items()):
            returned = work.forfeit(rank)
            if not returned or self.progressive or not alive or not redistribute:
                continue
            for survivor, piece in split_among(returned, alive):
                work.assign(survivor, piece)
                self._refresh(survivor)
                offset, size = to_samples(piece, self.config.batch_size)
                out.append(
                    Send(
                        survivor,
                        ExtendPartition(epoch=epoch, partition_offset=offset, partition_size=size),
                    )
                )
        self.ranks[rank].snapshot = None

    def _failover_checkpoints(self, dead: int, alive: Sequence[int], out: list[Effect]) -> None:
        for _version, retry in sorted(self.checkpoints.items()):
            if retry.target == dead:
                self._retry_checkpoint(retry, alive, f"rank {dead} died", out)

    def _retry_checkpoint(
        self, retry: CheckpointRetry, alive: Sequence[int], why: str, out: list[Effect]
    ) -> None:
        nxt = retry.next_target(alive)
        if nxt is None:
            self.checkpoints.pop(retry.version, None)
            out.append(
                Alert(
                    "checkpoint_failed",
                    "root",
                    f"checkpoint {retry.version} failed on every live rank ({why})",
                )
            )
            return
        out.append(Send(nxt, Checkpoint(version=retry.version, target_rank=nxt)))

    def _on_checkpoint_result(self, res: CheckpointResult, out: list[Effect]) -> None:
        self.roles.observe_cost("checkpoint", res.rank, res.elapsed_ms)
        retry = self.checkpoints.get(res.version)
        if retry is None or retry.target != res.rank:
            return
        if res.error is None:
            self.checkpoints.pop(res.version, None)
            if self.roles.checkpoint_role != res.rank:
                self.roles.checkpoint_role = res.rank
            return
        self._retry_checkpoint(retry, self.liveness.alive(), f"rank {res.rank}: {res.error}", out)

    def _on_eval_result(self, res: EvalResult, now: float, out: list[Effect]) -> None:
        self.roles.observe_cost("eval", res.rank, res.elapsed_ms)
        if res.error is None and res.metric is not None:
            out.append(EvalDone(res.epoch, res.metric))
            for r in self.liveness.alive():
                out.append(Send(r, EvalBroadcast(epoch=res.epoch, metric=res.metric)))
        else:
            out.append(Alert("eval_failed", self.paths[res.rank], f"eval {res.epoch}: {res.error}"))
        if self.phase is RunPhase.FINAL_EVAL and res.schedule_id == self.final_eval_epoch:
            self._begin_shutdown(out)

    def _shutdown_with_save(self, reason: SaveReason, detail: str, out: list[Effect]) -> None:
        if self.save_reason is not None or self.phase in (RunPhase.SHUTDOWN, RunPhase.DONE):
            return
        self.save_reason = reason
        self._request_bundle(reason, detail, out)
        self.phase = RunPhase.SHUTDOWN
        for r in self.liveness.alive():
            out.append(Send(r, ShutdownWithSave(reason=reason, detail=detail[:4096])))
        out.append(Record("root", "shutdown", {"shutdown_with_save": reason, "detail": detail}))
        self._maybe_done(out)

    def _send_roles_if_dirty(self, out: list[Effect]) -> None:
        if not self.roles.dirty:
            return
        self.roles.dirty = False
        frame: CoordFrame = SetEpochCallbackRole(rank=self.roles.epoch_callback_role)
        for r in self.liveness.alive():
            out.append(Send(r, frame))

    # =========================================================================================
    # Clocks and resume
    # =========================================================================================

    def _arm_clocks(self, now: float) -> None:
        if self._join_deadline_at is None:
            self._join_deadline_at = now + self.config.join_timeout_s
        if self._heartbeat_at is None:
            self._heartbeat_at = now + COORD_HEARTBEAT_S

    _first_epoch = 0
    _resume_epoch: int | None = None
    _resume_uncovered: list[BatchRange] | None = None

    def _seed_resume(self, resume: ResumeState) -> None:
        if not 0 <= resume.epoch <= self.config.total_epochs:
            raise LocalProtocolError(
                f"resume epoch {resume.epoch} outside 0..{self.config.total_epochs}"
            )
        self.next_epoch = resume.epoch
        self._first_epoch = resume.epoch
        self.last_aggregated = resume.epoch - 1
        self.global_step = resume.global_step
        self.sync_rounds = resume.sync_round
        if resume.elche is not None:
            self.elche.restore(resume.elche)
            history = resume.elche.trend_history
            restore = getattr(self.guard, "restore_history", None)
            if history and restore is not None:
                restore(history)
            if self.elche.calibrated:
                self.roles.on_first_calibration(range(self.world_size), self.elche.smoothed_ms)
        if resume.uncovered is not None:
            self._resume_epoch = resume.epoch
            bs = self.config.batch_size
            self._resume_uncovered = [from_samples(o, n, bs) for o, n in resume.uncovered]


# =============================================================================================
# Helpers
# =============================================================================================


def _window_report(
    windows: Sequence[WindowStats], alive: Sequence[bool], sync_ms: float
) -> WindowReport:
    delivered_ms: list[float] = []
    delivered_batches: list[int] = []
    fill_ms: list[float] = []
    for w in windows:
        if w.steps >= 2 and w.first_ms is not None:
            marginal = w.compute_ms + w.data_ms - w.first_ms
            per = marginal / (w.steps - 1)
            delivered_ms.append(max(0.0, marginal))
            delivered_batches.append(w.steps - 1)
            fill_ms.append(max(0.0, w.first_ms - per))
        else:
            delivered_ms.append(0.0)
            delivered_batches.append(0)
            fill_ms.append(0.0)
    coherent = all(
        not a or w.steps == 0 or w.steps >= 2 for w, a in zip(windows, alive, strict=True)
    )
    return WindowReport(
        wall_ms=[w.compute_ms for w in windows],
        steps=[w.steps for w in windows],
        delivered_ms=delivered_ms,
        delivered_batches=delivered_batches,
        fill_ms=fill_ms,
        delivered_coherent=coherent,
        sync_ms=sync_ms,
    )
