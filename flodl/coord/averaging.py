"""Averaging: the cycle from trigger to finalize, what it commits, and what ElChe learns from it.

Pure module (docs/design.md §2). One cycle at a time, on both backends:

* **trigger** when the count gate opens: ``request_params`` (CPU; with ``throttle`` in CPU Sync)
  or ``sync_now`` (collective) to every live rank, and — CPU — the reduce server opens the round;
* **snapshot**: a rank entering the reduce reports ``snapshot_ready``; its done count per epoch
  is what the cycle will commit (overwritten by its ``sync_ack``, which also closes its window).
  In the modes that wait for the update (CPU Sync and Cadence) ranks send none: a rank trains
  nothing between entering the reduce and the update, so the ledger's count when it acks — or
  dies inside the cycle — is the same snapshot;
* **finalize** once every live expected rank acked and — CPU — the reduce server reported the
  round (:class:`~flodl.coord.cycle.Cycle`). Contributors are the ranks that acked plus — CPU —
  those the server folded in (a rank that died after its upload was folded still contributed),
  or — collective — the members of the session the acks were made under;
* **feedback**: ElChe gets the closed windows (compute-only speeds, the delivered-speed feed
  where the mode grows its window); the convergence guard and the LR meta-controller judge the
  divergence the ranks measured, through the verdict seam;
* **release**: ``update`` (CPU; Cadence folds the rank's next chunk into it) and the new global
  step.

Commit rule ("trained exactly once"): a batch is committed when a cycle that folded in the
rank's parameters finalizes; a rank that dies inside a pending cycle after snapshotting has its
forfeit deferred to the finalize, which knows whether its window was folded in.
"""

from __future__ import annotations

from collections.abc import Sequence

from flodl.config import CoordConfig
from flodl.coord.cycle import Cycle, RankWindow, ranks_to_throttle
from flodl.coord.dispatch import Dispatch
from flodl.coord.effects import Alert, Effect, OpenReduce, Send
from flodl.coord.elche import ElChe, WindowReport
from flodl.coord.guards import ConvergenceGuard, DivergenceReport
from flodl.coord.inputs import ReduceDone
from flodl.coord.membership import Membership
from flodl.coord.meta import MetaController
from flodl.coord.metrics import WindowStats
from flodl.coord.outbound import built_update
from flodl.coord.verdicts import ConvergenceAction, NudgeDown, Stable
from flodl.wire.frames import (
    Batch,
    CoordFrame,
    EpochPlan,
    LrUpdate,
    RequestParams,
    SetGlobalStep,
    SnapshotReady,
    SyncAck,
    SyncNow,
    Throttle,
)

__all__ = ["Averaging"]


class Averaging:
    """The averaging cycles of one run.

    Args:
        config: the run's configuration.
        membership: the roster.
        elche: the cadence controller fed by every finished cycle.
        dispatch: the ledger owner (commits, forfeits, the count gate).
        cycle: the one cycle (shared with dispatch, which holds barrier-paced work while it is
            pending).
        windows: each rank's averaging window (shared with dispatch).
        guard: the convergence guard.
        meta_controller: the LR meta-controller, or ``None``.
    """

    def __init__(
        self,
        config: CoordConfig,
        membership: Membership,
        elche: ElChe,
        dispatch: Dispatch,
        cycle: Cycle,
        windows: list[RankWindow],
        guard: ConvergenceGuard,
        meta_controller: MetaController | None,
    ) -> None:
        self.config = config
        self.traits = config.elche.traits
        self.membership = membership
        self.elche = elche
        self.dispatch = dispatch
        self.cycle = cycle
        self.windows = windows
        self.guard = guard
        self.meta_controller = meta_controller
        self.throttled: set[int] = set()
        self.deferred_forfeit: set[int] = set()
        self._divergence: dict[int, tuple[float | None, float | None, float | None]] = {}
        self.prev_sync_ms = 0.0
        self.sync_rounds = 0
        self.global_step = 0
        self.last_lr: float | None = None
        self.last_d_raw: float | None = None

    # ------------------------------------------------------------------ rank frames
    def on_batch(self, batch: Batch) -> None:
        """A trained batch enters its rank's window."""
        run = self.windows[batch.rank]
        if batch.step > run.step:  # (max() of two costs 8× this on Python 3.11)
            run.step = batch.step
        run.window.add(batch.batch_ms, batch.data_ms, batch.loss, self.config.batch_size)

    def throttle_leaders(self, out: list[Effect]) -> None:
        """CPU lead limit (``max_batch_diff``): O(W) per batch, paid only when configured."""
        limit = self.config.elche.max_batch_diff
        if limit is None or not self.traits.cpu_averaging or self.cycle.pending:
            return
        for r in ranks_to_throttle(
            alive=self.membership.alive(),
            window_steps=[w.window.steps for w in self.windows],
            max_batch_diff=limit,
            already=self.throttled,
        ):
            self.throttled.add(r)
            out.append(Send(r, Throttle()))

    def on_lr(self, frame: LrUpdate) -> None:
        """The LR the meta-controller watches: the lowest live rank's."""
        if self.last_lr is None or frame.rank == min(self.membership.alive()):
            self.last_lr = frame.lr

    def on_snapshot(self, frame: SnapshotReady) -> None:
        cycle = self.cycle
        if cycle.pending and frame.cycle == cycle.number and frame.rank in cycle.expected:
            run = self.windows[frame.rank]
            run.snapshot = self.dispatch.snapshot(frame.rank)
            run.snapshot_cycle = frame.cycle

    def on_ack(self, ack: SyncAck) -> bool:
        """A rank finished its part of the pending cycle; True once the cycle may finalize."""
        cycle = self.cycle
        number = ack.cycle
        rank = ack.rank
        # Only a rank the cycle expects: one admitted after the trigger (a new incarnation
        # whose old one died inside this cycle, say) was never asked and must not overwrite
        # the window or the snapshot the finalize settles.
        if not cycle.pending or number != cycle.number or rank not in cycle.expected:
            return False
        run = self.windows[rank]
        run.snapshot = self.dispatch.snapshot(rank)
        run.snapshot_cycle = number
        run.ack_session = ack.session
        spare = run.spare
        run.spare = None
        run.closed_window = run.window
        run.window = WindowStats() if spare is None else spare.reset()
        # No count-gate refresh here: nothing reads the gate while the cycle is pending, and
        # the finalize rebuilds every rank's flags (Dispatch.invalidate_cohort).
        if ack.divergence is not None:  # (the guard reads only the ranks that measured one)
            self._divergence[rank] = (ack.divergence, ack.pre_norm, ack.post_norm)
        return cycle.ack(rank, ack.step) and cycle.ready()

    def on_reduce_done(self, event: ReduceDone) -> bool:
        """The CPU reduce server folded the round; True once the cycle may finalize."""
        if not self.cycle.pending or event.cycle != self.cycle.number:
            return False
        self.cycle.mark_reduce_done(event.contributors, event.weight_total)
        return self.cycle.ready()

    # ------------------------------------------------------------------ trigger
    def open_initial_round(self, out: list[Effect]) -> None:
        """CPU: round 0 is the initial broadcast (every rank uploads, the lowest live rank's
        state is what everyone receives)."""
        if self.traits.cpu_averaging:
            out.append(OpenReduce(0, tuple(self.membership.alive())))

    def maybe_trigger(self, now: float, out: list[Effect]) -> None:
        """Start a cycle if none is pending and the count gate is open (never on a clock)."""
        if self.cycle.pending or not self.dispatch.gate_open():
            return
        alive = self.membership.alive()
        number = self.cycle.begin(alive, now)
        self.throttled.clear()
        self._divergence = {}
        if self.traits.cpu_averaging:
            out.append(OpenReduce(number, tuple(alive)))
            request: CoordFrame = RequestParams(cycle=number)
            throttle = Throttle() if self.traits.throttle_at_trigger else None  # (one for all)
            for r in alive:
                out.append(Send(r, request))
                if throttle is not None:
                    out.append(Send(r, throttle))
        else:
            # a rank awaiting the consensus takes part: it gets the outer state too
            heal = not self.membership.awaiting.isdisjoint(alive)
            sync: CoordFrame = SyncNow(cycle=number, heal=heal)
            for r in alive:
                out.append(Send(r, sync))

    # ------------------------------------------------------------------ deaths
    def on_death(self, rank: int) -> bool:
        """A rank died: never wait for it. True when its forfeit must wait for the finalize
        (it snapshotted inside the pending cycle, or — modes that wait for the update — it was
        one of the cycle's ranks)."""
        if not self.cycle.pending:
            return False
        took_part = rank in self.cycle.expected
        self.cycle.drop(rank)
        run = self.windows[rank]
        if took_part and self.traits.waits_for_update and run.snapshot_cycle != self.cycle.number:
            # These ranks send no snapshot_ready: once in the reduce a rank trains nothing until
            # the update, and its batches reached us ahead of it, so its done counts now are
            # those it entered the reduce with. The finalize commits them only if the reduce
            # server folded its upload in; a rank that never entered gets all of it forfeited.
            run.snapshot = self.dispatch.snapshot(rank)
            run.snapshot_cycle = self.cycle.number
        if run.snapshot_cycle == self.cycle.number:
            self.deferred_forfeit.add(rank)
            return True
        return False

    def forget_snapshot(self, rank: int) -> None:
        self.windows[rank].snapshot = None

    def on_admit(self, rank: int) -> None:
        """A new incarnation of ``rank`` was admitted: it starts a fresh window. Where the old
        one died inside the pending cycle (its forfeit deferred), that cycle's finalize still
        commits what the old upload carried and forfeits the rest: its snapshot is kept for
        it, or the folded batches would go back to the pool and be trained twice."""
        fresh = RankWindow()
        if rank in self.deferred_forfeit:
            old = self.windows[rank]
            fresh.snapshot, fresh.snapshot_cycle = old.snapshot, old.snapshot_cycle
        self.windows[rank] = fresh

    # ------------------------------------------------------------------ finalize
    def sync_ms(self, now: float) -> float:
        """The pending cycle's duration so far, ms."""
        return max(0.0, (now - self.cycle.pending_since_at) * 1000.0)

    def contributors(self) -> set[int]:
        acked = set(self.cycle.acked)
        if self.traits.cpu_averaging and self.cycle.contributors is not None:
            acked.update(self.cycle.contributors)
            return acked
        sessions = {self.windows[r].ack_session for r in acked}
        if sessions == {self.membership.sessions.session}:
            return acked | set(self.membership.sessions.members)
        return acked

    def commit(self, out: list[Effect], *, redistribute: bool) -> None:
        """Commit every contributor's snapshot; settle the forfeits deferred to this cycle."""
        number = self.cycle.number
        windows, commit = self.windows, self.dispatch.commit
        for r in sorted(self.contributors()):
            run = windows[r]
            if run.snapshot_cycle == number and run.snapshot is not None:
                commit(r, run.snapshot)
        for r in sorted(self.deferred_forfeit):
            self.dispatch.forfeit(r, out, redistribute=redistribute)
            self.forget_snapshot(r)
        self.deferred_forfeit.clear()

    def closed_windows(self) -> list[WindowStats]:
        return [
            w.closed_window if w.closed_window is not None else WindowStats() for w in self.windows
        ]

    def report_window(self, windows: Sequence[WindowStats]) -> bool:
        """Feed ElChe the closed windows; True when this report calibrated it."""
        was = self.elche.calibrated
        self.elche.report_window(
            _window_report(windows, self.membership.alive_mask(), self.prev_sync_ms),
            delivered_capable=self.traits.adaptive_window,
        )
        return self.elche.calibrated and not was

    def judge(self, steps: Sequence[int], out: list[Effect]) -> None:
        """The guard's verdict on the closed windows and the LR meta-controller's nudge,
        through ElChe's verdict seam, in the original's order: the meta-controller observes the
        guard's action and its nudge goes first (a nudge discards a staged growth proposal,
        which the guard's Stable would otherwise commit), then the guard's verdict."""
        action = self._guard_action(steps)
        if self.meta_controller is not None:
            nudge = self.meta_controller.observe(
                self.last_lr, self.elche.anchor, action, self.elche.phase
            )
            if nudge is not None:
                self.elche.apply_verdict(nudge)
                causes = ", ".join(self.meta_controller.last_causes)
                out.append(
                    Alert(
                        "drift",
                        "root",
                        f"LR meta-controller nudged the anchor down ×{nudge.factor:.3g} ({causes})",
                    )
                )
        stable = isinstance(action, Stable)
        if stable:
            self.elche.apply_verdict(
                Stable(relax_up=self.traits.overshoot and self.config.elche.relax_up)
            )
        else:
            self.elche.apply_verdict(action)
            if isinstance(action, NudgeDown):
                out.append(
                    Alert("drift", "root", f"guard nudged the anchor down ×{action.factor:g}")
                )
        self.dispatch.observe_verdict(stable)

    def _guard_action(self, steps: Sequence[int]) -> ConvergenceAction:
        if not self.traits.adaptive_window:
            return Stable()
        deltas = []
        pre_norms: list[float] = []
        post: float | None = None
        for r in sorted(self._divergence):
            d, pre, post_norm = self._divergence[r]
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

    def close(self, sync_ms: float, steps: Sequence[int]) -> None:
        """Count the finished cycle: syncs, the global step, the closed windows."""
        self.sync_rounds += 1
        self.prev_sync_ms = sync_ms
        self.global_step += sum(steps)
        windows = self.windows
        for r in self.membership.alive():
            run = windows[r]
            run.spare, run.closed_window = run.closed_window, None

    def release(self, number: int, out: list[Effect], fold_plans: dict[int, EpochPlan]) -> None:
        """Tell live ranks the cycle is over and the new global step: CPU modes send one
        ``update`` each (with the rank's next chunk folded in where ``fold_plans`` has one, and
        the global step), the collective modes ``set_global_step``."""
        g = self.global_step
        # Frames are immutable: one instance serves every rank that gets the same content.
        if not self.traits.cpu_averaging:
            step: CoordFrame = SetGlobalStep(global_step=g)
            out.extend(Send(r, step) for r in self.membership.alive())
            return
        bare: CoordFrame = built_update(number, None, g)
        get = fold_plans.get
        for r in self.membership.alive():
            plan = get(r)
            out.append(
                Send(
                    r,
                    bare if plan is None else built_update(number, plan, g),
                )
            )


def _window_report(
    windows: Sequence[WindowStats], alive: Sequence[bool], sync_ms: float
) -> WindowReport:
    n = len(windows)
    delivered_ms = [0.0] * n
    delivered_batches = [0] * n
    fill_ms = [0.0] * n
    wall_ms = [0.0] * n
    steps = [0] * n
    coherent = True
    for r, (w, a) in enumerate(zip(windows, alive, strict=True)):
        s = steps[r] = w.steps
        wall_ms[r] = w.compute_ms
        if s >= 2 and w.first_ms is not None:
            marginal = w.compute_ms + w.data_ms - w.first_ms
            per = marginal / (s - 1)
            # (max(0.0, x) as a conditional: the builtin costs 8× it on Python 3.11)
            delivered_ms[r] = marginal if marginal > 0.0 else 0.0
            delivered_batches[r] = s - 1
            fill = w.first_ms - per
            fill_ms[r] = fill if fill > 0.0 else 0.0
        elif a and s == 1:
            coherent = False
    return WindowReport(
        wall_ms=wall_ms,
        steps=steps,
        delivered_ms=delivered_ms,
        delivered_batches=delivered_batches,
        fill_ms=fill_ms,
        delivered_coherent=coherent,
        sync_ms=sync_ms,
    )
