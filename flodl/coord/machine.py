"""The coordinator: a sans-IO state machine that paces, feeds and averages a training cluster.

Rules (h11's header style: everything that changes coordinator state lives in this package):

1. **No I/O, no clock.** ``handle(input, now)``, ``tick(now)`` and ``next_deadline()`` are the
   whole interface; ``now`` is monotonic seconds supplied by the shell. The machine returns
   :mod:`~flodl.coord.effects` as data. Nothing a peer sends raises: a protocol violation
   (:class:`~flodl.errors.RemoteProtocolError`) evicts that rank with a reason. Our own bug
   (:class:`~flodl.errors.LocalProtocolError`, or any other exception) propagates: it is never
   blamed on a rank.
2. **A router.** This class owns the concerns and sequences them; each lives in its own module:
   :mod:`~flodl.coord.membership` (the roster, the handshake, liveness, collective sessions),
   :mod:`~flodl.coord.dispatch` (epochs, plans, take/forfeit/commit, the count gate),
   :mod:`~flodl.coord.averaging` (cycles, commits, ElChe and guard feedback),
   :mod:`~flodl.coord.callbacks` (roles, callback schedules and failover, bundles) and
   :mod:`~flodl.coord.reporting` (epoch metrics, sub-epoch reports).
3. **Run phases** (:mod:`~flodl.coord.phases`): a table says which inputs each phase accepts,
   and :meth:`Coordinator._enter` is the one place the phase changes, with its reason
   (``phase_log``).
4. **Tick order**: coordinator heartbeat → formation timeout → stale ranks → progress watchdog
   → reduce stall ceiling. Everything else is event-driven: the count gate is evaluated after
   every input that can change it, never on a wall-clock trigger.
"""

from __future__ import annotations

import random
from collections.abc import Collection
from typing import Any, Final

from flodl.config import CoordConfig
from flodl.coord.admission import Admission, running_refusal
from flodl.coord.averaging import Averaging
from flodl.coord.callbacks import Callbacks
from flodl.coord.cycle import Cycle, RankWindow
from flodl.coord.dispatch import Dispatch
from flodl.coord.effects import (
    Alert,
    Close,
    Effect,
    RankDead,
    RankLeft,
    Record,
    RefusePeer,
    Reply,
    RunOver,
)
from flodl.coord.elche import ElChe
from flodl.coord.guards import ConvergenceGuard, MsfGuard, make_guard
from flodl.coord.inputs import ChildExited, Input, PeerLost, ReduceDone
from flodl.coord.ledger import CoverageReport
from flodl.coord.liveness import RankState
from flodl.coord.membership import Membership
from flodl.coord.meta import MetaController
from flodl.coord.phases import ACCEPTS, RunPhase
from flodl.coord.reporting import Reporting
from flodl.coord.resume import META_SCHEMA_VERSION, ResumeState
from flodl.errors import LocalProtocolError, RemoteProtocolError
from flodl.wire.frames import (
    Batch,
    BundleSaved,
    CheckpointResult,
    CoordFrame,
    CoordHeartbeat,
    EpochFnElapsed,
    EpochPlan,
    EvalResult,
    Exiting,
    Heartbeat,
    Hello,
    Intent,
    LrUpdate,
    Metrics,
    PartitionRevoked,
    RankExited,
    RankFrame,
    Reject,
    ResourceSample,
    SaveReason,
    SessionFailed,
    SetGlobalStep,
    Shutdown,
    ShutdownWithSave,
    SnapshotReady,
    SyncAck,
)

__all__ = ["RunPhase", "ResumeState", "Coordinator", "META_SCHEMA_VERSION"]

_TRAINING: Final = RunPhase.TRAINING
"""(Read per frame: a module global, not the enum class's attribute, which costs 7× more on
Python 3.11; see :mod:`flodl.coord.liveness`.)"""


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
        self._accepts = ACCEPTS[self.phase]  # the phase's accepted kinds, set with the phase
        self.phase_log: list[tuple[RunPhase, str]] = [(RunPhase.FORMING, "the run started")]
        """Every phase the run entered, with why (read by tests and the simulator)."""
        self.save_reason: SaveReason | None = None
        self.save_detail = ""
        self.membership = Membership(
            w,
            config.run_id,
            config.timeouts,
            forming_size=config.forming_size,
            traits=config.elche.traits,
        )
        self._touch = self.membership.liveness.touch  # every rank frame calls it: bound once
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
            guard = MsfGuard()
        self.guard = make_guard(
            convergence_guard=guard,
            no_divergence_guard=el.no_divergence_guard or el.convergence_guard == "none",
            divergence_threshold=el.divergence_threshold,
            easgd_alpha=el.easgd_alpha,
        )
        self.cycle = Cycle(needs_reduce_done=t.cpu_averaging)
        self.windows = [RankWindow() for _ in range(w)]
        self.reporting = Reporting(config, self.membership)
        self.paths = self.reporting.paths
        self.callbacks = Callbacks(config, self.membership, self.paths, self.meta_record, self.rng)
        self.dispatch = Dispatch(
            config, self.membership, self.elche, self.cycle, self.windows, self._epoch_opened
        )
        self.averaging = Averaging(
            config,
            self.membership,
            self.elche,
            self.dispatch,
            self.cycle,
            self.windows,
            self.guard,
            MetaController() if el.meta_controller else None,
        )
        self.last_progress_at = 0.0
        self._stop: CoordFrame | None = None
        """The stop frame (``shutdown`` / ``shutdown_with_save``) held until the stop bundle
        commits: its writers must not exit before a failover can reach them."""
        self._stop_sent = False
        self._stop_deadline_at: float | None = None
        self._exit_deadline_at: float | None = None
        """When the ranks still alive after the stop frame are declared dead (the stall ceiling
        after it was sent): one stuck outside a step would otherwise hold the run open."""
        self._stall_ceiling_s = config.stall_ceiling_s
        self._heartbeat_every_s = config.timeouts.heartbeat_interval_s
        self._join_deadline_at: float | None = None
        self._heartbeat_at: float | None = None
        self._run_over = False
        self._resumed: ResumeState | None = None
        self.admission = Admission(
            self.membership,
            self.elche,
            self.dispatch,
            self.averaging,
            self.callbacks,
            self.cycle,
            collective=not t.cpu_averaging,
            paths=self.paths,
        )
        if resume is not None:
            self._seed_resume(resume)

    # =========================================================================================
    # Public interface
    # =========================================================================================

    def handle(self, event: RankFrame | Input, now: float) -> list[Effect]:
        """Apply one input received at monotonic ``now`` (seconds); return the effects."""
        out: list[Effect] = []
        if self._heartbeat_at is None:  # (set together with the join deadline, once)
            self._arm_clocks(now)
        if event.kind not in self._accepts:  # accepts(self.phase, kind), without hashing it
            self._not_accepted(event, now, out)
            return out
        on = _RANK_FRAME_HANDLERS.get(type(event))
        if on is not None:  # the hot path: a rank frame, found by its exact type
            self._on_rank_frame(event, on, now, out)  # type: ignore[arg-type]
            return out
        match event:
            case Hello():
                self._on_hello(event, now, out)
            case PeerLost(rank=rank, reason=reason):
                if self.membership.in_range(rank):
                    self._on_gone(rank, f"connection lost: {reason}", now, out)
            case ChildExited(rank=rank, exit_code=code) | RankExited(rank=rank, exit_code=code):
                if self.membership.in_range(rank):
                    self._on_gone(rank, f"process exited with code {code}", now, out)
            case ReduceDone():
                if self.averaging.on_reduce_done(event):
                    self._finalize_cycle(now, out)
            case _:  # (a subclass of a rank frame: its handler by isinstance, as a match did)
                on = next(
                    (h for t, h in _RANK_FRAME_HANDLERS.items() if isinstance(event, t)), None
                )
                self._on_rank_frame(event, on, now, out)
        return out

    def tick(self, now: float) -> list[Effect]:
        """Fire every deadline ≤ ``now``: heartbeats, formation timeout, stale ranks, stall."""
        out: list[Effect] = []
        self._arm_clocks(now)
        if self.phase is RunPhase.DONE:
            return out
        if self._heartbeat_at is not None and now >= self._heartbeat_at:
            out.extend(self.membership.broadcast(CoordHeartbeat()))
            self._heartbeat_at = now + self._heartbeat_every_s
        if (
            self.phase is RunPhase.FORMING
            and self._join_deadline_at is not None
            and now >= self._join_deadline_at
        ):
            missing = self.membership.joining()
            self._finish_run(
                out, ok=False, reason=f"formation timeout: ranks {missing} never joined"
            )
            return out
        for r in self.membership.stale(now):
            timeout = self.membership.timeouts.heartbeat_s
            self._declare_dead(r, f"no frame for {timeout:g} s (heartbeat timeout)", now, out)
        if self._stop_deadline_at is not None and now >= self._stop_deadline_at:
            self.callbacks.abandon_bundles(
                f"not committed within {self._stall_ceiling_s:g} s of the stop", out
            )
            self._maybe_release_stop(now, out)
        if self._exit_deadline_at is not None and now >= self._exit_deadline_at:
            self._exit_deadline_at = None
            for r in self.membership.alive():
                self._declare_dead(
                    r,
                    f"did not exit within {self._stall_ceiling_s:g} s of the stop (its "
                    "training thread answers no frame)",
                    now,
                    out,
                )
        progress_at = self._progress_deadline()
        if progress_at is not None and now >= progress_at:
            detail = (
                f"no training progress for {now - self.last_progress_at:.0f} s (ceiling "
                f"{self.config.stall_ceiling_s:g} s): the cohort is wedged"
            )
            out.append(Alert("reduce_stall", "root", detail, "critical"))
            self._shutdown_with_save("reduce_stall", detail, now, out)
        stall_at = self.cycle.stall_deadline(self.config.stall_ceiling_s)
        if stall_at is not None and now >= stall_at and self.save_reason is None:
            waiting = sorted(self.cycle.expected - set(self.cycle.acked))
            detail = (
                f"averaging cycle {self.cycle.number} pending for "
                f"{now - self.cycle.pending_since_at:.0f} s (ceiling "
                f"{self.config.stall_ceiling_s:g} s); waiting for ranks {waiting}"
            )
            out.append(Alert("reduce_stall", "root", detail, "critical"))
            self._shutdown_with_save("reduce_stall", detail, now, out)
        return out

    def next_deadline(self) -> float | None:
        """Earliest ``now`` at which :meth:`tick` can change anything; None if nothing armed.

        Called by the shell after every input, so it allocates nothing."""
        phase = self.phase
        if phase is RunPhase.DONE:
            return None
        best = self._heartbeat_at
        live = self.membership.next_deadline()
        if live is not None and (best is None or live < best):
            best = live
        join_at = self._join_deadline_at if phase is RunPhase.FORMING else None
        if join_at is not None and (best is None or join_at < best):
            best = join_at
        stop_at = self._stop_deadline_at
        if stop_at is not None and (best is None or stop_at < best):
            best = stop_at
        exit_at = self._exit_deadline_at
        if exit_at is not None and (best is None or exit_at < best):
            best = exit_at
        if self.save_reason is None:
            cycle = self.cycle
            if cycle.pending:
                at = cycle.pending_since_at + self._stall_ceiling_s
            elif phase is _TRAINING:
                at = self.last_progress_at + self._stall_ceiling_s
            else:
                return best
            if best is None or at < best:
                best = at
        return best

    # --- read-only views used by shells, the simulator and tests -----------------------------

    @property
    def done(self) -> bool:
        return self.phase is RunPhase.DONE

    @property
    def sync_rounds(self) -> int:
        """Averaging cycles finalized so far."""
        return self.averaging.sync_rounds

    @property
    def global_step(self) -> int:
        """Optimizer steps committed by finalized cycles (the LR schedules' clock)."""
        return self.averaging.global_step

    @property
    def cohort_version(self) -> int:
        """Bumped whenever ElChe's counts or the live set may have changed."""
        return self.dispatch.cohort_version

    def coverage(self, epoch: int) -> CoverageReport | None:
        """The coverage report of a finished epoch (checked when it closed), or of an open one."""
        return self.dispatch.coverage(epoch)

    def gate_open(self) -> bool:
        """Whether the incremental count gate says a cycle may start (for invariant checks
        against :func:`~flodl.coord.cycle.should_average`)."""
        return self.dispatch.gate_open()

    def in_flight(self, rank: int) -> int:
        """Batches handed to ``rank`` and not yet trained, over every open epoch."""
        return self.dispatch.in_flight(rank)

    def may_rejoin(self, rank: int) -> bool:
        """Whether a ``hello`` of a new incarnation of ``rank`` would be admitted now (it is
        dead, the run trains and is not stopping)."""
        m = self.membership
        running = running_refusal(self.phase, self.save_reason) is None
        return m.in_range(rank) and m.is_dead(rank) and running

    def meta_record(self, reason: SaveReason | str) -> dict[str, Any]:
        """The checkpoint meta as JSON-ready data (docs/design.md §2, "Meta")."""
        elche_state = self.elche.to_state().to_dict()
        elche_state["trend_history"] = self.guard.trend_history()
        c = self.config
        return {
            "schema_version": META_SCHEMA_VERSION,
            "epoch": self.dispatch.meta_epoch(),
            "global_step": self.averaging.global_step,
            "sync_round": self.averaging.sync_rounds,
            "world_size_at_save": self.world_size,
            "save_reason": reason,
            "elche_state": elche_state,
            "coverage": {
                "seed": c.seed,
                "epoch_splits": c.epoch_splits,
                "batch_size": c.batch_size,
                "per_epoch": self.dispatch.meta_coverage(),
            },
        }

    # =========================================================================================
    # Phases
    # =========================================================================================

    def _enter(self, phase: RunPhase, reason: str) -> None:
        """The one place the run phase changes."""
        if phase is not self.phase:
            self.phase_log.append((phase, reason))
            self.phase = phase
            self._accepts = ACCEPTS[phase]

    def _not_accepted(self, event: RankFrame | Input, now: float, out: list[Effect]) -> None:
        """An input the phase does not accept: a protocol violation from a live rank, nothing
        otherwise (a late frame after the run ended, say)."""
        rank = getattr(event, "rank", None)
        if (
            self.phase is not RunPhase.DONE
            and isinstance(rank, int)
            and self.membership.in_range(rank)
            and self.membership.is_alive(rank)
        ):
            why = f"protocol violation: {event.kind!r} while the run is {self.phase.value}"
            self._declare_dead(rank, why, now, out)

    def _begin_training(self, now: float, out: list[Effect]) -> None:
        self._enter(RunPhase.TRAINING, self.admission.formed(out))
        self.last_progress_at = now
        self.reporting.start(now)
        out.append(
            Record(
                "root",
                "job",
                {
                    "world_size": self.world_size,
                    "ranks": self.membership.alive(),
                    "job": self.config.job_spec().model_dump(mode="json"),
                },
            )
        )
        self.dispatch.refresh_all()
        self.averaging.open_initial_round(out)
        if self._resumed is not None:
            out.append(Record("root", "resumed", self._resumed.record(self.world_size)))
        if self.averaging.global_step > 0:  # resumed: schedulers continue where the run stopped
            out.extend(
                self.membership.broadcast(SetGlobalStep(global_step=self.averaging.global_step))
            )
        self._advance_epochs(now, out)

    def _epoch_opened(self, epoch: int, out: list[Effect]) -> None:
        """An epoch opened: roles and the epoch-boundary callbacks of the epoch that just
        ended go out before any of its work (FIFO on the role rank's connection)."""
        self.callbacks.send_roles_if_dirty(out)
        done = epoch - 1
        if done >= self.dispatch.first_epoch:  # not closed by the run this one resumes
            self.callbacks.epoch_boundary(done, out)

    def _advance_epochs(self, now: float, out: list[Effect], holding: Collection[int] = ()) -> None:
        """Close finished epochs in order, open the next one, dispatch, or end the run.

        ``holding``: ranks just handed a chunk (a finalize's folds); a barrier-paced mode gives
        a rank that holds work nothing more, so they are not asked again (O(W) calls saved)."""
        dispatch = self.dispatch
        while self.phase is _TRAINING:
            closed = dispatch.pop_done_epoch()
            if closed is not None:
                self.reporting.close_epoch(closed, now, self.elche, self.averaging.sync_rounds, out)
                continue
            if dispatch.works:
                break
            if dispatch.next_epoch >= self.config.total_epochs:
                self._end_of_training(now, out)
                return
            dispatch.open_epoch(dispatch.next_epoch, now, out)
        if self.phase is not _TRAINING:
            return
        if self.progressive:
            skip = holding if dispatch.barrier_paced else ()
            for r in self.membership.alive():
                if r not in skip:
                    dispatch.dispatch(r, now, out)
        self._maybe_trigger(now, out)

    def _end_of_training(self, now: float, out: list[Effect]) -> None:
        # checkpoint_fn for the last epoch; its bundle is the end-of-run one
        self.callbacks.maybe_checkpoint(self.config.total_epochs - 1, out, bundle=False)
        if self.callbacks.start_final_eval(out):
            self._enter(RunPhase.FINAL_EVAL, "every epoch trained: the final eval")
            return
        self._begin_shutdown("every epoch trained", now, out)

    def _begin_shutdown(self, why: str, now: float, out: list[Effect]) -> None:
        self.callbacks.request_bundle("graceful_shutdown", "end of run", out)
        self._enter(RunPhase.SHUTDOWN, why)
        self._stop_ranks(Shutdown(), now, out)
        self._maybe_done(out)

    def _shutdown_with_save(
        self, reason: SaveReason, detail: str, now: float, out: list[Effect]
    ) -> None:
        if self.save_reason is not None or self.phase in (RunPhase.SHUTDOWN, RunPhase.DONE):
            return
        self.save_reason = reason
        self.save_detail = detail
        self.callbacks.request_bundle(reason, detail, out)
        self._enter(RunPhase.SHUTDOWN, f"shutdown_with_save ({reason}): {detail}")
        self._stop_ranks(ShutdownWithSave(reason=reason, detail=detail[:4096]), now, out)
        out.append(Record("root", "shutdown", {"shutdown_with_save": reason, "detail": detail}))
        self._maybe_done(out)

    def _stop_ranks(self, frame: CoordFrame, now: float, out: list[Effect]) -> None:
        """Tell every live rank the run is over, once every pending bundle is committed (or
        abandoned): a writer that fails or dies must still find a live rank to fail over to."""
        self._stop = frame
        if self.callbacks.bundles:
            self._stop_deadline_at = now + self._stall_ceiling_s
        self._maybe_release_stop(now, out)

    def _maybe_release_stop(self, now: float, out: list[Effect]) -> None:
        if self._stop is None or self.callbacks.bundles:
            return
        frame, self._stop, self._stop_deadline_at = self._stop, None, None
        self._stop_sent = True
        self._exit_deadline_at = now + self._stall_ceiling_s
        out.extend(self.membership.broadcast(frame))

    def _maybe_done(self, out: list[Effect]) -> None:
        if self.phase is RunPhase.SHUTDOWN and self.membership.alive_count() == 0:
            ok = self.save_reason is None
            reason = "run complete" if ok else f"run stopped: {self.save_reason}"
            self._finish_run(out, ok=ok, reason=reason)

    def _finish_run(self, out: list[Effect], *, ok: bool, reason: str) -> None:
        if self._run_over:
            return
        self._run_over = True
        if self.phase is RunPhase.FORMING:
            out.extend(self.membership.broadcast(Shutdown()))
        self._enter(RunPhase.DONE, reason)
        out.append(
            RunOver(ok=ok, reason=reason, save_reason=self.save_reason, detail=self.save_detail)
        )

    def _progress_deadline(self) -> float | None:
        """Safety net against a wedged cohort (no batch and no finalized cycle for the stall
        ceiling while training, outside a pending cycle, which has its own ceiling)."""
        if self.phase is not _TRAINING or self.cycle.pending or self.save_reason:
            return None
        return self.last_progress_at + self._stall_ceiling_s

    # =========================================================================================
    # Handshake and membership
    # =========================================================================================

    def _on_hello(self, hello: Hello, now: float, out: list[Effect]) -> None:
        membership = self.membership
        reason = membership.refusal(
            hello,
            forming=self.phase is RunPhase.FORMING,
            rejoining=running_refusal(self.phase, self.save_reason),
        )
        if reason is not None:
            out.append(Reply(Reject(reason=reason)))
            out.append(RefusePeer(reason))
            return
        running = hello.role != "supervisor" and self.phase is not RunPhase.FORMING
        membership.place(hello)
        accept = membership.accept(hello, running=running)
        if running:  # a rejoin, or a rank that missed the formation
            self.admission.admit(hello.rank, accept, now, out)
            self._maybe_trigger(now, out)
            return
        out.append(Reply(accept))
        if hello.role == "supervisor":
            return
        if membership.join(hello, now):
            self._begin_training(now, out)

    def _on_gone(self, rank: int, reason: str, now: float, out: list[Effect]) -> None:
        state = self.membership.state(rank)
        if state is RankState.ALIVE:
            self._declare_dead(rank, reason, now, out)
        elif state is RankState.JOINING and self.phase is RunPhase.FORMING:
            # its process is gone before it ever joined (a bad bundle, an import error): the
            # cohort can never form, so fail now instead of at the formation timeout
            self._finish_run(out, ok=False, reason=f"rank {rank} never joined: {reason}")

    def _on_exiting(self, rank: int, now: float, out: list[Effect]) -> None:
        if self.phase is RunPhase.SHUTDOWN:
            if self.membership.mark_exited(rank):
                self.dispatch.gate.forget(rank)
                self.dispatch.invalidate_cohort()  # (the live set changed)
                out.append(RankLeft(rank))
            self._maybe_done(out)
        else:
            self._declare_dead(rank, "rank exited before the run ended", now, out)

    def _declare_dead(self, rank: int, reason: str, now: float, out: list[Effect]) -> None:
        membership, dispatch = self.membership, self.dispatch
        if not membership.declare_dead(rank, reason):
            return
        self.admission.on_death(rank, now)
        dispatch.gate.forget(rank)
        out.append(RankDead(rank, reason))
        out.append(Close(rank, reason))
        out.append(
            Alert("rank_lost", self.paths[rank], f"rank {rank} declared dead: {reason}", "critical")
        )
        # the alert lane collapses repeats; the record keeps every death (flodl sim replays it)
        out.append(Record(self.paths[rank], "rank_lost", {"rank": rank, "reason": reason}))
        if self.phase is RunPhase.FORMING:
            self._finish_run(out, ok=False, reason=f"rank {rank} lost during formation: {reason}")
            return
        if self.phase is RunPhase.SHUTDOWN:
            self._forfeit(rank, out, redistribute=False)  # its work stays uncovered
            self.callbacks.failover_bundles(rank, out, ranks_stopped=self._stop_sent)
            self._maybe_release_stop(now, out)
            self._maybe_done(out)
            return
        self.elche.mark_dead(rank)
        dispatch.invalidate_cohort()
        membership.record_death(rank)
        deferred = self.averaging.on_death(rank)
        verdict = membership.unrecoverable(
            max_failure=self.config.max_failure, needs_two=not self.traits.cpu_averaging
        )
        if not deferred:
            # Past the failure budget the work stays uncovered (for the resume) instead of
            # being handed to survivors that are about to stop.
            self._forfeit(rank, out, redistribute=verdict is None)
        # Its roles, and a save or a checkpoint_fn it was running, go to a survivor first:
        # the stop below waits for every pending bundle, and one left on a dead writer held it
        # until the stall ceiling (docs/design.md §6, "Stop bundles fail over too").
        self.callbacks.on_death(rank, self.elche.smoothed_ms, out)
        if verdict is not None:
            self._shutdown_with_save(verdict[0], verdict[1], now, out)
            return
        if not self.traits.cpu_averaging:
            out.extend(self.admission.reform_after_death(rank, reason))
        self.callbacks.send_roles_if_dirty(out)
        if self.phase is RunPhase.FINAL_EVAL:
            if not self.callbacks.retry_final_eval(out):
                self._begin_shutdown("the eval role died during the final eval", now, out)
            return
        if self.cycle.ready():
            self._finalize_cycle(now, out)
        if self.phase is _TRAINING:
            dispatch.dispatch_idle(now, out)
            self._maybe_trigger(now, out)

    def _forfeit(self, rank: int, out: list[Effect], *, redistribute: bool) -> None:
        self.dispatch.forfeit(rank, out, redistribute=redistribute)
        self.averaging.forget_snapshot(rank)

    # =========================================================================================
    # Rank frames
    # =========================================================================================

    def _on_rank_frame(self, frame: RankFrame, on: Any, now: float, out: list[Effect]) -> None:
        """A frame of a live rank refreshes its liveness, then goes to ``on`` (its handler in
        :data:`_RANK_FRAME_HANDLERS`; None: nothing more)."""
        rank = frame.rank
        if not self._touch(rank, now):
            return  # late frames from a dead or finished rank change nothing
        if on is None:
            return
        try:
            on(self, frame, now, out)
        except RemoteProtocolError as exc:
            self._declare_dead(rank, f"protocol violation: {exc}", now, out)

    # One handler per rank frame type, found by a dict lookup on the frame's type (a ``match``
    # tried the cases in turn: on the per-cycle frames that was a tenth of their cost).
    def _on_heartbeat(self, frame: Heartbeat, now: float, out: list[Effect]) -> None:
        return

    def _on_snapshot(self, frame: SnapshotReady, now: float, out: list[Effect]) -> None:
        self.averaging.on_snapshot(frame)

    def _on_sync_ack(self, frame: SyncAck, now: float, out: list[Effect]) -> None:
        if self.averaging.on_ack(frame):
            self._finalize_cycle(now, out)

    def _on_metrics(self, frame: Metrics, now: float, out: list[Effect]) -> None:
        self.reporting.on_metrics(frame)

    def _on_lr(self, frame: LrUpdate, now: float, out: list[Effect]) -> None:
        self.averaging.on_lr(frame)

    def _on_intent(self, frame: Intent, now: float, out: list[Effect]) -> None:
        self.callbacks.intents.add(frame.intent)

    def _on_eval_result(self, frame: EvalResult, now: float, out: list[Effect]) -> None:
        if self.callbacks.on_eval_result(frame, out) and self.phase is RunPhase.FINAL_EVAL:
            self._begin_shutdown("the final eval finished", now, out)

    def _on_checkpoint_result(self, frame: CheckpointResult, now: float, out: list[Effect]) -> None:
        self.callbacks.on_checkpoint_result(frame, out)

    def _on_bundle_saved(self, frame: BundleSaved, now: float, out: list[Effect]) -> None:
        self.callbacks.on_bundle_saved(frame, out, ranks_stopped=self._stop_sent)
        self._maybe_release_stop(now, out)

    def _on_epoch_fn_elapsed(self, frame: EpochFnElapsed, now: float, out: list[Effect]) -> None:
        self.callbacks.observe_epoch_fn(frame.rank, frame.elapsed_ms, out)

    def _on_session_failed(self, frame: SessionFailed, now: float, out: list[Effect]) -> None:
        reformed = self.admission.reform_after_failure(frame.rank, frame.session)
        if reformed:
            out.extend(reformed)
            out.append(
                Alert(
                    "session_retry",
                    self.paths[frame.rank],
                    f"rank {frame.rank} could not form or use collective session "
                    f"{frame.session} (a member late or gone): its members re-form as session "
                    f"{self.membership.sessions.session}",
                )
            )

    def _on_resource_sample(self, frame: ResourceSample, now: float, out: list[Effect]) -> None:
        out.append(Record(self.paths[frame.rank], "resource", frame.model_dump()))

    def _on_revoked(self, frame: PartitionRevoked, now: float, out: list[Effect]) -> None:
        training = self.phase is _TRAINING
        self.dispatch.on_revoked(frame, out, redistribute=training)
        self._maybe_trigger(now, out)

    def _on_exiting_frame(self, frame: Exiting, now: float, out: list[Effect]) -> None:
        self._on_exiting(frame.rank, now, out)

    def _on_batch(self, batch: Batch, now: float, out: list[Effect]) -> None:
        rank = batch.rank
        dispatch = self.dispatch
        left = dispatch.on_batch(batch)  # (its batches in flight now: counted once, used twice)
        slice_report = batch.metrics
        if slice_report is not None:  # the batch finished a slice: its report rides along
            if slice_report.rank != rank:
                raise RemoteProtocolError(
                    f"rank {rank} sent a batch carrying rank {slice_report.rank}'s metrics",
                    rank=rank,
                )
            self.reporting.on_metrics(slice_report)
        self.last_progress_at = now
        self.averaging.on_batch(batch)
        self.reporting.on_batch(batch, dispatch.works.get(batch.epoch), now, self.elche, out)
        self.averaging.throttle_leaders(out)
        if (
            left == 0
            and self.progressive
            and self.phase is _TRAINING
            and not dispatch.window_spent(rank)
        ):
            dispatch.dispatch(rank, now, out)
            left = -1  # (the hand-out changed it: refresh counts again)
        dispatch.refresh(rank, left)
        self._maybe_trigger(now, out)

    # =========================================================================================
    # Averaging cycles
    # =========================================================================================

    def _maybe_trigger(self, now: float, out: list[Effect]) -> None:
        if self.phase is _TRAINING:
            self.averaging.maybe_trigger(now, out)

    def _finalize_cycle(self, now: float, out: list[Effect]) -> None:
        """The pending cycle is complete: commit, learn, count, release, advance."""
        number = self.cycle.number
        self.last_progress_at = now
        try:
            self._finalize(now, out)
            self.admission.caught_up(now, out, training=self.phase is _TRAINING)
        finally:
            self.cycle.finish()  # never fold a round twice, even if finalizing failed
        fold: dict[int, EpochPlan] = {}
        if (
            self.phase is _TRAINING
            and self.traits.folds_next_chunk
            and self.progressive
            and self.dispatch.first_unassigned() is not None
        ):
            fold = self.dispatch.take_chunks(self.membership.alive(), now, out)
        self.averaging.release(number, out, fold)
        self.admission.maybe_grow_session(out)
        self._advance_epochs(now, out, holding=fold)

    def _finalize(self, now: float, out: list[Effect]) -> None:
        averaging = self.averaging
        sync_ms = averaging.sync_ms(now)
        # 1. commit contributors' snapshots; settle deferred forfeits.
        averaging.commit(out, redistribute=self.phase is _TRAINING)
        # 2. ElChe feedback from the closed windows (the role ranks' callback slack first).
        windows = averaging.closed_windows()
        steps = [w.steps for w in windows]
        live = self.membership.alive()
        self.reporting.window(self.cycle.number, now, sync_ms, windows, live, out)
        if averaging.report_window(windows):
            self.callbacks.elect(self.membership.training(), self.elche.smoothed_ms, out)
        # 3. Guard + meta-controller through the verdict seam; then the role ranks' callback
        # slack shrinks the coming window's counts.
        old_anchor = self.elche.anchor
        averaging.judge(steps, out)
        self.callbacks.stage_slack(self.elche, self.dispatch.current())
        self.dispatch.invalidate_cohort()
        # 4. Counters, global step, records.
        averaging.close(sync_ms, steps)
        recovered = self.membership.recovered()
        if recovered:  # the survivors completed a reduce after these deaths
            out.append(
                Record(
                    "root",
                    "recovered",
                    {"after_deaths": recovered, "syncs": averaging.sync_rounds},
                )
            )
        if self.elche.anchor != old_anchor:
            out.append(Record("root", "anchor", {"from": old_anchor, "to": self.elche.anchor}))
        self.reporting.after_cycle(
            sync_ms=sync_ms,
            syncs=averaging.sync_rounds,
            d_raw=averaging.last_d_raw,
            telemetry=self.guard.telemetry(),
        )

    # =========================================================================================
    # Clocks and resume
    # =========================================================================================

    def _arm_clocks(self, now: float) -> None:
        if self._join_deadline_at is None:
            self._join_deadline_at = now + self.config.join_timeout_s
        if self._heartbeat_at is None:
            self._heartbeat_at = now + self._heartbeat_every_s

    def _seed_resume(self, resume: ResumeState) -> None:
        if not 0 <= resume.epoch <= self.config.total_epochs:
            raise LocalProtocolError(
                f"resume epoch {resume.epoch} outside 0..{self.config.total_epochs}"
            )
        self.dispatch.seed_resume(resume)
        self.averaging.global_step = resume.global_step
        self.averaging.sync_rounds = resume.sync_round
        self._resumed = resume
        if resume.elche is not None:
            # at another world size, ranks that existed keep their speeds, new ones calibrate
            self.elche.restore(resume.elche.resized(self.world_size))
            history = resume.elche.trend_history
            restore = getattr(self.guard, "restore_history", None)
            if history and restore is not None:
                restore(history)
            if self.elche.calibrated:
                self.callbacks.roles.on_first_calibration(
                    range(self.world_size), self.elche.smoothed_ms
                )


_RANK_FRAME_HANDLERS: dict[type, Any] = {
    Heartbeat: Coordinator._on_heartbeat,
    Batch: Coordinator._on_batch,
    SnapshotReady: Coordinator._on_snapshot,
    SyncAck: Coordinator._on_sync_ack,
    Metrics: Coordinator._on_metrics,
    LrUpdate: Coordinator._on_lr,
    Intent: Coordinator._on_intent,
    EvalResult: Coordinator._on_eval_result,
    CheckpointResult: Coordinator._on_checkpoint_result,
    BundleSaved: Coordinator._on_bundle_saved,
    EpochFnElapsed: Coordinator._on_epoch_fn_elapsed,
    SessionFailed: Coordinator._on_session_failed,
    ResourceSample: Coordinator._on_resource_sample,
    PartitionRevoked: Coordinator._on_revoked,
    Exiting: Coordinator._on_exiting_frame,
}
"""Every rank frame the machine acts on (Hello is an input of its own), by exact type."""
