"""The rank's main-thread training loop, for every pacing policy and both averaging backends.

The main thread owns torch and ``torch.distributed``; the bridge thread owns the control
socket. The loop never awaits: between optimizer steps it drains the bridge's inbox and obeys
the coordinator (docs/design.md §2b). What a frame means, and what to do next, is the pure
:class:`~flodl.rank.protocol.RankProtocol` (the simulator drives it too), executed here:

* ``start_epoch`` / ``extend_partition`` / a folded ``update.next_plan`` queue slices of the
  shared permutation (identical on every process: :func:`flodl.sampling.permutation`);
* each step trains one batch (``train_step`` gives the loss; the framework does backward,
  ``max_grad_norm`` clipping, the optimizer step and the LR from ``scheduler_fn`` driven by the
  coordinator's global step) and reports a ``batch`` frame (compute ms, data ms, loss), which
  carries the slice's ``metrics`` when it finished one;
* ``request_params`` (CPU) / ``sync_now`` (collective) make the rank take part in the averaging
  cycle at its next step boundary: ``snapshot_ready`` (Async, collective), the weighted reduce
  (weight ``n^gamma`` for the ``n`` steps since the last cycle), the divergence numbers in
  ``sync_ack``; CPU Sync/Cadence then wait for ``update`` (Cadence's carries the next chunk),
  Async blends the consensus elastically (EASGD) and goes on;
* a collective that fails because a peer died waits for ``new_session``, re-forms the group
  among the survivors and redoes the reduce from its pre-sync copy;
* ``shutdown`` returns the final :class:`TrainedState` after sending ``exiting``;
  ``shutdown_with_save`` does the same with ``save_reason`` set; any exception writes
  ``<stem>.rank<N>.death.json`` and propagates, so the process exits non-zero and peers are
  never left blocked.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import socket
import time
from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from flodl import checkpoint
from flodl.chaos import RankChaos
from flodl.errors import CollectiveFailed, CoordinatorLost, FlodlError, RunStopped
from flodl.outer import OuterStep
from flodl.rank.bridge import RankBridge
from flodl.rank.collectives import divergence
from flodl.rank.gpu import gpu_identity
from flodl.rank.protocol import (
    Answer,
    PeerDead,
    RankProtocol,
    Reduce,
    Reform,
    RunCheckpoint,
    RunEpochFn,
    RunEval,
    SaveBundle,
    Slice,
    Stop,
    Train,
)
from flodl.rank.snapshot import TrainedState, float_buffers, model_signature, write_death_record
from flodl.rank.step import (
    TrainJob,
    fetch_batch,
    optimizer_step,
    restore_bundle,
    timed_callback,
)
from flodl.rank.step_clock import HungStep, StepClock
from flodl.rank.watchdog import StepWatchdog
from flodl.sampling import epoch_slice, index_space, permutation
from flodl.timeouts import Timeouts
from flodl.wire.frames import (
    Accept,
    BundleSaved,
    CheckpointResult,
    CoordFrame,
    EpochFnElapsed,
    EvalResult,
    Exiting,
    Hello,
    NewSession,
    SaveConsensusModel,
)

__all__ = ["RankSpec", "RankLoop", "run_rank"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RankSpec:
    """Where this rank is and whom it talks to.

    Args:
        coord_host / coord_port: the coordinator's control address.
        secret: the run secret.
        run_id: the run id the coordinator expects.
        rank / world_size: this rank's global rank and the world size.
        device: ``"cpu"`` or ``"cuda:N"``.
        timeouts: this rank's deadlines until the coordinator's ``accept`` arrives (connecting,
            the handshake); from then on the rank obeys the coordinator's, derived from the
            ``heartbeat_timeout_s`` and ``timeout_scale`` it sends.
        stem: file stem for death records (``<stem>.rank<N>.death.json``).
        threads: ``torch.set_num_threads`` (CPU ranks sharing a host split its cores).
    """

    coord_host: str
    coord_port: int
    secret: bytes
    run_id: str
    rank: int
    world_size: int
    device: str = "cpu"
    timeouts: Timeouts = field(default_factory=Timeouts)
    stem: str | None = None
    threads: int | None = None


class RankLoop:
    """One rank's training: the protocol's actions executed with torch, the bridge and the
    averaging backend. Built by :func:`run_rank`, or by a cooperative
    :class:`~flodl.worker.Worker` that owns the loop."""

    def __init__(self, spec: RankSpec, job: TrainJob) -> None:
        self.spec = spec
        self.job = job
        self.el = job.elche
        self.device = torch.device(spec.device)
        self.space = index_space(len(job.dataset), job.augment)
        self.protocol = RankProtocol(
            spec.rank, job.batch_size, waits_for_update=self.el.traits.waits_for_update
        )
        self.timeouts = spec.timeouts
        self._perm: tuple[int, list[int]] | None = None
        self.model: torch.nn.Module
        self.optim: torch.optim.Optimizer
        self.bridge: RankBridge | None = None
        self.client: Any = None
        self.collective: Any = None
        self.consensus: list[torch.Tensor] | None = None
        self._pre: list[torch.Tensor] | None = None
        """The pre-reduce copy of the parameters (:meth:`_pre_sync_copy`)."""
        self.outer: OuterStep | None = None
        self._timing = (0.0, 0.0)
        self.chaos: RankChaos | None = None
        self.step_clock: StepClock | None = None
        """The steps' clock for the hung-step watchdog (from the coordinator's ``accept``)."""
        self._watchdog: StepWatchdog | None = None

    @property
    def step(self) -> int:
        """Optimizer steps this rank took."""
        return self.protocol.step

    @property
    def last_eval(self) -> tuple[int, float] | None:
        """The latest ``(epoch, metric)`` the coordinator broadcast."""
        return self.protocol.last_eval

    # ------------------------------------------------------------------ setup
    def run(self) -> TrainedState:
        accept = self.start()
        try:
            return self._train(accept)
        finally:
            self.close()

    def _train(self, accept: Accept) -> TrainedState:
        job = self.job
        try:
            self.begin(accept)
            for batch in self.batches():
                scalars: dict[str, list[float]] = {}
                loss = optimizer_step(job, self.model, self.optim, batch, scalars, self.step + 1)
                if job.step_hook is not None:
                    job.step_hook(self.spec.rank, self.step + 1)
                self.after_step(loss, scalars)
        except RunStopped as stop:
            return self._finish(stop.save_reason, stop.detail)
        raise AssertionError("unreachable: batches() ends only by RunStopped")

    def start(self) -> Accept:
        """Model, optimizer, restore, and the connection (the first half of :meth:`run`).

        From the coordinator's ``accept`` on, the rank obeys the deadlines it sends."""
        spec, job = self.spec, self.job
        if spec.threads is not None:
            torch.set_num_threads(max(1, spec.threads))
        torch.manual_seed(job.seed + spec.rank)
        self.model = job.model_factory(self.device)
        self.optim = job.optim_factory(self.model.parameters())
        self.params = list(self.model.parameters())
        self.fbuffers = float_buffers(self.model)
        if not self.el.traits.cpu_averaging and not job.outer.is_identity:
            self.outer = OuterStep(job.outer)  # collective placement: replicated per rank
        restore_bundle(job, self.model, self.optim, spec.rank, self.outer)
        self.scheduler = job.scheduler_fn(spec.world_size) if job.scheduler_fn else None
        self.lr_scale = 1.0 + (spec.world_size - 1) * job.lr_scale_ratio
        gpu = gpu_identity(self.device)
        hello = Hello(
            run_id=spec.run_id,
            rank=spec.rank,
            world_size=spec.world_size,
            model_signature=model_signature(self.model),
            host=socket.gethostname()[:255],
            device=spec.device,
            gpu=gpu.uuid if gpu is not None else None,
            job=job.description,
        )
        self.bridge = RankBridge(
            spec.coord_host,
            spec.coord_port,
            spec.secret,
            hello,
            liveness_timeout_s=spec.timeouts.heartbeat_s,
            hard_exit_grace_s=spec.timeouts.hard_exit_grace_s,
            on_hard_exit=self._hard_exit_record,
            connect_timeout_s=spec.timeouts.connect_s,
        )
        accept = self.bridge.start()
        self.timeouts = Timeouts(accept.heartbeat_timeout_s, accept.timeout_scale)
        # after the stop, the main thread finishes its step and writes its final state; one
        # stuck for good (a callback) still ends by the stall ceiling, never outliving the run
        self.bridge.set_hard_exit_grace(
            self.timeouts.hard_exit_grace_s, after_stop_s=self.timeouts.stall_ceiling_s
        )
        self._watch_steps()
        self.protocol.admitted(accept.session, accept.incarnation)
        if accept.incarnation > 0:
            # a rejoin: the model comes from the next averaging round; the inner optimizer
            # starts fresh (docs/design.md §2, "Rejoin")
            self.optim = job.optim_factory(self.model.parameters())
            logger.info(
                "rank %d rejoins the run (incarnation %d): waiting for the consensus",
                spec.rank,
                accept.incarnation,
            )
        self.chaos = RankChaos.from_environ(spec.rank, incarnation=accept.incarnation)
        if self.chaos is not None:
            bridge = self.bridge
            self.chaos.abort_control = lambda: bridge.abort("chaos: control connection cut")
            self.chaos.abort_data = lambda: self.client.abort() if self.client else None
            self.chaos.flush_control = lambda: bridge.flush(self.timeouts.heartbeat_s)
        return accept

    def _watch_steps(self) -> None:
        """Start the hung-step watchdog on the coordinator's deadlines (docs/design.md §2b,
        "A hung training step"): a step over its limit ends this process, so the run goes
        on without it."""
        t = self.timeouts
        self.step_clock = StepClock(t.step_hang_floor_s, t.step_hang_ceiling_s)
        self._watchdog = StepWatchdog(self.step_clock, t.step_hang_floor_s, self._hung_record)
        self._watchdog.start()

    def _hung_record(self, hung: HungStep, stack: str) -> None:
        """The watchdog is about to end the process: leave the death record, with the stack."""
        spec = self.spec
        if spec.stem is not None:
            why = f"{hung.describe()}; the training thread was at:\n{stack}"
            write_death_record(spec.stem, spec.rank, spec.world_size, why)

    def _hard_exit_record(self, reason: str) -> None:
        """The bridge is about to end the process: leave the death record the main thread,
        stuck somewhere, could not write."""
        spec = self.spec
        if spec.stem is not None:
            why = f"coordinator lost: {reason} (the main thread did not return in time)"
            write_death_record(spec.stem, spec.rank, spec.world_size, why)

    def begin(self, accept: Accept) -> None:
        """Wait for the cohort, connect the averaging backend, take rank 0's state."""
        # Training starts when every rank joined: the first frame after Accept says so (the
        # coordinator opens the initial-broadcast round before sending it). It is applied
        # after the broadcast, as every later frame.
        first = self._next_frame()
        # A run that started below its maximum world size forms its collective group among
        # the ranks that joined: the coordinator's first frame announces that session.
        formed = (
            self.protocol.reform_of(first)
            if isinstance(first, NewSession) and accept.incarnation == 0
            else None
        )
        if formed is None:
            self.protocol.deferred.append(first)
        else:
            self.protocol.session = formed.session
        self.protocol.started = True
        self._connect_backend(accept, formed)
        if self.chaos is not None:
            self.chaos.begin()
        if accept.incarnation == 0:  # a rejoined rank takes the consensus in its first reduce
            self._initial_broadcast()
            self.protocol.broadcasted()

    def batches(self) -> Iterator[list[torch.Tensor]]:
        """Obey the coordinator between steps and yield each batch to train (LR set); the
        consumer calls :meth:`after_step` before asking for the next. Ends by raising
        :class:`~flodl.errors.RunStopped` when the coordinator ends the run."""
        protocol = self.protocol
        while True:
            self._drain()
            match protocol.next_action():
                case Reduce(cycle=cycle, heal=heal):
                    self._reduce(cycle, heal)
                case Train(slice=head):
                    bs = self.job.batch_size
                    t0 = time.perf_counter()
                    if self.step_clock is not None:
                        self.step_clock.started(t0)
                    batch = fetch_batch(self.job, self._picks(head, bs), self.device)
                    t1 = time.perf_counter()
                    self._apply_lr()
                    self._timing = (t0, t1)
                    yield batch
                case Stop(save_reason=reason, detail=detail):
                    raise RunStopped(reason, detail)
                case _:  # Wait (Broadcast is done in begin())
                    self._obey(self._next_frame())

    def _connect_backend(self, accept: Accept, formed: Reform | None = None) -> None:
        spec = self.spec
        if self.el.traits.cpu_averaging:
            from flodl.rank.reduce_client import ReduceClient

            if accept.data_port is None:
                raise FlodlError(
                    f"this rank is configured for {self.el.mode} (CPU averaging) but the "
                    "coordinator runs a collective mode: use the same mode on both"
                )
            self.client = ReduceClient(
                spec.coord_host,
                accept.data_port,
                spec.secret,
                spec.rank,
                spec.world_size,
                run_id=spec.run_id,
                bf16_wire=self.el.bf16_wire,
                timeout_s=self.timeouts.data_io_s,
                # on the coordinator's host the rounds go through shared memory (docs/design.md §1);
                # FLODL_SHARED_MEMORY=0 keeps every rank on TCP
                shared_memory=os.environ.get("FLODL_SHARED_MEMORY", "1") != "0",
            )
            self.client.connect(spec.timeouts.connect_s)
        else:
            from flodl.rank.collectives import Collective

            if accept.store_port is None:
                raise FlodlError(
                    f"this rank is configured for {self.el.mode} (collective averaging) but the "
                    "coordinator runs a CPU mode: use the same mode on both"
                )
            self.collective = Collective(
                spec.coord_host,
                accept.store_port,
                device=self.device,
                timeout_s=self.timeouts.collective_s,
            )
            if formed is not None:
                self.collective.form(
                    formed.store_prefix,
                    formed.new_rank,
                    formed.new_world_size,
                    members=formed.ranks,
                )
            elif accept.incarnation == 0:
                self.collective.form(f"{spec.run_id}/s{accept.session}", spec.rank, spec.world_size)
            # else: a rank joining the running run forms the session its new_session announces

    def _initial_broadcast(self) -> None:
        """Replicas start identical: rank 0's parameters and float buffers everywhere
        (collective: redone from the new group's rank 0 if a peer dies meanwhile; CPU: the
        reduce server keeps the lowest contributing rank's upload, so rank 0 dying first is
        survived the same way)."""
        with torch.no_grad():
            if self.client is not None:
                # every rank uploads; the server keeps the lowest live rank's state
                self.client.reduce(0, self.params, 1.0, self.fbuffers, True)
            else:
                # An all-reduce with weight 1 at the group's rank 0 (the lowest live global
                # rank), 0 elsewhere: bit-exact rank 0's state, and unlike a broadcast a dead
                # peer fails it on every rank, so all of them redo it in the new session.
                data = [p.data for p in self.params]
                while True:
                    try:
                        root = self.collective.rank == 0
                        self.collective.weighted_average(data, 1.0 if root else 0.0)
                        self.collective.average_buffers(self.fbuffers, root)
                        break
                    except CollectiveFailed as exc:
                        logger.warning(
                            "rank %d: initial broadcast failed (%s); waiting for a new session",
                            self.spec.rank,
                            exc,
                        )
                        self._await_session()
                if self.outer is not None and self.outer.prev is None:
                    self.outer.apply(self.params)  # first window: prev_global = consensus
            self._keep_consensus()

    # ------------------------------------------------------------------ control frames
    def _next_frame(self) -> CoordFrame:
        """The next frame to apply: a deferred one first, else the bridge's (blocking)."""
        assert self.bridge is not None
        if self.protocol.deferred:
            return self.protocol.deferred.popleft()
        while True:
            frame = self.bridge.recv(timeout=1.0)
            if frame is not None:
                return frame

    def _drain(self) -> None:
        """Apply every frame that is waiting, without blocking."""
        assert self.bridge is not None
        deferred = self.protocol.deferred
        while deferred:
            self._obey(deferred.popleft())
        while (frame := self.bridge.poll()) is not None:
            self._obey(frame)

    def _obey(self, frame: CoordFrame) -> None:
        """Apply one frame and run the work it asks for at once."""
        for action in self.protocol.receive(frame):
            match action:
                case RunEval(schedule_id=sid, epoch=epoch):
                    self._run_eval(sid, epoch)
                case RunCheckpoint(version=v):
                    self._run_checkpoint_fn(v)
                case SaveBundle(frame=save):
                    self._save_bundle(save)
                case RunEpochFn(epoch=epoch):
                    self._run_epoch_fn(epoch)
                case Reform(store_prefix=prefix, new_rank=nr, new_world_size=nw, ranks=members):
                    self._reform(prefix, nr, nw, members)
                case Answer(frames=frames):
                    for reply in frames:
                        self._send(reply)
                case PeerDead(rank=r, reason=why):
                    logger.info("rank %d: peer %d declared dead (%s)", self.spec.rank, r, why)
                case Stop(save_reason=reason, detail=detail):
                    raise RunStopped(reason, detail)

    def _reform(self, prefix: str, rank: int, world_size: int, members: Sequence[int]) -> None:
        """Form the announced session; if it cannot gather (a member died meanwhile, or was
        busy past the deadline), hold everything but the next ``new_session`` and say so
        (``session_failed``): the coordinator sends one for the death, or for the report."""
        if self.collective is None:
            return
        if self._newer_session():  # (it came while this rank was busy: this one cannot gather)
            self.protocol.collective_failed()  # hold frames until it; no report: this is stale
            return
        if self.chaos is not None:
            self.chaos.in_reform()
        try:
            self.collective.form(
                prefix, rank, world_size, superseded=self._newer_session, members=members or None
            )
        except CollectiveFailed as exc:
            logger.warning("rank %d: %s; waiting for the next session", self.spec.rank, exc)
            self._send(self.protocol.collective_failed())

    def _newer_session(self) -> bool:
        """Whether a ``new_session`` after the one being formed has arrived (frames the bridge
        received meanwhile move, in order, to the deferred queue)."""
        assert self.bridge is not None
        deferred = self.protocol.deferred
        while (frame := self.bridge.poll()) is not None:
            deferred.append(frame)
        return any(
            isinstance(f, NewSession) and f.session > self.protocol.session for f in deferred
        )

    def _send(self, frame: Any) -> None:
        assert self.bridge is not None
        self.bridge.send(frame)

    def _picks(self, head: Slice, bs: int) -> list[int]:
        """The permutation picks of the next batch of ``head`` (one data pass cached)."""
        data_pass, start, _ = epoch_slice(head.epoch, self.space, self.job.epoch_splits)
        if self._perm is None or self._perm[0] != data_pass:
            self._perm = (data_pass, permutation(self.space, data_pass, self.job.seed))
        lo = start + head.offset + head.pos
        return self._perm[1][lo : lo + bs]

    # ------------------------------------------------------------------ callbacks and saves
    @contextlib.contextmanager
    def _consensus_model(self) -> Iterator[torch.nn.Module]:
        """The model holding the last consensus (not this rank's local drift), in eval mode;
        restored afterwards."""
        model, backup = self.model, None
        with torch.no_grad():
            if self.consensus is not None:
                backup = [p.detach().clone() for p in self.params]
                for p, c in zip(self.params, self.consensus, strict=True):
                    p.copy_(c)
        was_training = model.training
        model.eval()
        try:
            yield model
        finally:
            model.train(was_training)
            if backup is not None:
                with torch.no_grad():
                    for p, b in zip(self.params, backup, strict=True):
                        p.copy_(b)

    def _run_epoch_fn(self, epoch: int) -> None:
        fn = self.job.epoch_fn
        if fn is None:
            return
        self._chaos_callback()
        _, ms, _ = timed_callback(f"epoch_fn (epoch {epoch})", lambda: fn(epoch, self.model))
        self._send(EpochFnElapsed(rank=self.spec.rank, epoch=epoch, elapsed_ms=ms))

    def _run_eval(self, schedule_id: int, epoch: int) -> None:
        fn, metric, ms = self.job.eval_fn, None, 0.0
        error: str | None = "no eval_fn on this rank"
        if fn is not None:
            self._chaos_callback()
            with self._consensus_model() as model:
                value, ms, error = timed_callback(
                    f"eval_fn (epoch {epoch})", lambda: fn(model, self.job.eval_dataset)
                )
            if error is None:
                try:
                    metric = float(value)
                except (TypeError, ValueError):
                    error = f"eval_fn returned {type(value).__name__}, not a number"
                else:
                    if not math.isfinite(metric):
                        metric, error = None, f"eval_fn returned {value!r}"
        self._send(
            EvalResult(
                rank=self.spec.rank,
                schedule_id=schedule_id,
                epoch=epoch,
                metric=metric,
                elapsed_ms=ms,
                error=error,
            )
        )

    def _run_checkpoint_fn(self, version: int) -> None:
        fn, ms = self.job.checkpoint_fn, 0.0
        error: str | None = "no checkpoint_fn on this rank"
        if fn is not None:
            self._chaos_callback()
            with self._consensus_model() as model:
                _, ms, error = timed_callback(
                    f"checkpoint_fn (epoch {version})", lambda: fn(version, model)
                )
        self._send(
            CheckpointResult(rank=self.spec.rank, version=version, elapsed_ms=ms, error=error)
        )

    def _chaos_callback(self) -> None:
        if self.chaos is not None:
            self.chaos.in_callback()

    def _save_bundle(self, frame: SaveConsensusModel) -> None:
        """This rank's part of a bundle: its optimizer state; the model (and the collective
        outer state) when it is the target."""
        t0 = time.perf_counter()
        wrote, errors = False, []
        stem, rank = self.job.save_path, self.spec.rank
        if stem is None:
            errors.append("no save_path on this rank")
        else:
            try:
                checkpoint.save_optim(
                    stem,
                    rank,
                    self.optim.state_dict(),
                    global_step=frame.global_step,
                    sync_round=frame.sync_round,
                    tag=frame.tag,
                )
            except Exception as exc:
                logger.exception("rank %d: saving its optimizer state failed", rank)
                errors.append(f"optimizer state: {type(exc).__name__}: {exc}")
            if self.chaos is not None:
                self.chaos.in_save()
            if frame.target_rank == rank:
                try:
                    checkpoint.save_model(
                        stem,
                        self.consensus if self.consensus is not None else self.params,
                        list(self.model.buffers()),
                        signature=model_signature(self.model),
                        global_step=frame.global_step,
                        sync_round=frame.sync_round,
                        epoch=frame.epoch,
                        tag=frame.tag,
                    )
                    wrote = True
                    if self.outer is not None and self.outer.state():
                        checkpoint.save_outer(
                            stem, self.outer.state(), global_step=frame.global_step, tag=frame.tag
                        )
                except Exception as exc:  # a failed save never kills training
                    logger.exception("rank %d: saving bundle %d failed", rank, frame.version)
                    errors.append(f"{type(exc).__name__}: {exc}")
            if self.chaos is not None:
                self.chaos.after_save(wrote_model=wrote)
        self._send(
            BundleSaved(
                rank=rank,
                version=frame.version,
                model=wrote,
                elapsed_ms=(time.perf_counter() - t0) * 1000.0,
                error="; ".join(errors)[:4000] or None,
            )
        )

    def _keep_consensus(self) -> None:
        if not self.job.keeps_consensus:
            return
        with torch.no_grad():
            if self.consensus is None:
                self.consensus = [p.detach().clone() for p in self.params]
            else:
                for c, p in zip(self.consensus, self.params, strict=True):
                    c.copy_(p)

    # ------------------------------------------------------------------ training
    def after_step(self, loss_v: float, scalars: dict[str, list[float]]) -> None:
        """Account the step of the batch :meth:`batches` yielded last and report it."""
        t0, t1 = self._timing
        t2 = time.perf_counter()
        if self.step_clock is not None:
            self.step_clock.ended(t2)
        batch = self.protocol.trained((t2 - t1) * 1000.0, (t1 - t0) * 1000.0, loss_v, scalars)
        assert self.bridge is not None
        self.bridge.set_step(self.step)
        self._send(batch)  # (with the slice's metrics when it finished one)
        if self.chaos is not None:
            self.chaos.on_step(self.step, batch.epoch)

    def _apply_lr(self) -> None:
        if self.scheduler is None:
            return
        lr = float(self.scheduler(self.protocol.lr_step())) * self.lr_scale
        for group in self.optim.param_groups:
            group["lr"] = lr
        update = self.protocol.lr_set(lr)
        if update is not None:
            self._send(update)

    # ------------------------------------------------------------------ averaging
    def _reduce(self, cycle: int, heal: bool = False) -> None:
        snapshot, n = self.protocol.begin_reduce(cycle)
        if snapshot is not None:
            self._send(snapshot)
        if self.chaos is not None:
            self.chaos.before_reduce()
        weight = float(n) ** self.el.gamma if n > 0 else 0.0
        adopt = self.protocol.needs_consensus  # a rejoined rank takes the round as is
        with torch.no_grad():
            pre = self._pre_sync_copy()
            if self.client is not None:
                total, _ = self.client.reduce(cycle, self.params, weight, self.fbuffers, n > 0)
                if total > 0:
                    # evals, checkpoints and the final state use the consensus, never one
                    # rank's elastic blend or local drift
                    self._keep_consensus()
                alpha = self.el.easgd_alpha
                if alpha is not None and alpha < 1.0 and total > 0 and not adopt:
                    for p, old in zip(self.params, pre, strict=True):
                        p.mul_(alpha).add_(old, alpha=1.0 - alpha)
            else:
                total = self._collective_reduce(weight, n > 0, pre, heal=heal, holder=not adopt)
                if total > 0:  # nothing realized: everyone keeps its state, no outer step
                    if self.outer is not None:
                        self.outer.apply(self.params)
                    self._keep_consensus()
            if self.job.outer.resets_inner:
                self.optim.state = defaultdict(dict)  # DiLoCo: a fresh inner optimizer
            d, pre_norm, post_norm = divergence(pre, self.params, consume_pre=True)
        ack = self.protocol.end_reduce(
            cycle, divergence=d, pre_norm=pre_norm, post_norm=post_norm, consensus=total > 0
        )
        if self.chaos is not None:
            self.chaos.before_ack()
        self._send(ack)
        if self.chaos is not None:
            self.chaos.after_ack()

    def _pre_sync_copy(self) -> list[torch.Tensor]:
        """The parameters as they are before this rank's reduce, in buffers kept from round to
        round (a fresh copy each round cost a page fault per 4 KiB on the training thread). A
        round uses them to redo a failed collective, to blend (EASGD) and, last, as scratch for
        the divergence; nothing keeps them past the round."""
        if self._pre is None:
            self._pre = [p.detach().clone() for p in self.params]
        else:
            for b, p in zip(self._pre, self.params, strict=True):
                b.copy_(p.detach())
        return self._pre

    def _collective_reduce(
        self,
        weight: float,
        mover: bool,
        pre: list[torch.Tensor],
        *,
        heal: bool = False,
        holder: bool = True,
    ) -> float:
        """The weighted all-reduce (redone after a re-formation); returns the total weight.
        ``heal``: a member awaits the consensus (``holder`` False on that member); with an
        outer optimizer every member then copies the outer state, bit-exact, from the lowest
        member that holds one, so the new incarnation steps it as the others do."""
        while True:
            try:
                total = self.collective.weighted_average([p.data for p in self.params], weight)
                self.collective.average_buffers(self.fbuffers, mover)
                outer = self.outer
                if heal and outer is not None:
                    if not holder or outer.prev is None or outer.velocity is None:
                        # (a new incarnation's own state, if any, is stale: it is overwritten)
                        outer.prev = [torch.zeros_like(p) for p in self.params]
                        outer.velocity = [torch.zeros_like(p) for p in self.params]
                        holder = False
                    self.collective.share_from_lowest([*outer.prev, *outer.velocity], holder)
                return float(total)
            except CollectiveFailed as exc:
                logger.warning(
                    "rank %d: collective failed (%s); waiting for a new session",
                    self.spec.rank,
                    exc,
                )
                for p, old in zip(self.params, pre, strict=True):
                    p.data.copy_(old)  # redo from the pre-sync copy
                self._await_session()

    def _await_session(self) -> None:
        """Hold other frames until the coordinator re-forms the group, without the dead or,
        for this rank's ``session_failed``, with the same members (a save and a stop are
        applied at once)."""
        protocol = self.protocol
        self._send(protocol.collective_failed())
        while protocol.awaiting_session:
            self._obey(self._next_frame())

    def _finish(self, save_reason: str | None, detail: str = "") -> TrainedState:
        state = TrainedState.of(self.model, save_reason)
        state.save_detail = detail
        if self.consensus is not None:  # EASGD: the run's result is the consensus
            state.params = [c.to("cpu", copy=True) for c in self.consensus]
        if self.chaos is not None:
            state.params = self.chaos.final_params(state.params)
        if self.bridge is not None:
            self.bridge.send_resource_sample()
        self._send(Exiting(rank=self.spec.rank))
        return state

    def close(self) -> None:
        if self._watchdog is not None:
            self._watchdog.stop()
        for closer in (
            getattr(self.client, "close", None),
            getattr(self.collective, "destroy", None),
        ):
            if closer is not None:
                try:
                    closer()
                except Exception:
                    logger.debug("teardown step failed", exc_info=True)
        if self.bridge is not None:
            self.bridge.close()


def run_rank(spec: RankSpec, job: TrainJob) -> TrainedState:
    """Train as rank ``spec.rank`` until the coordinator ends the run.

    Returns:
        The final state (``save_reason`` set after a ShutdownWithSave).

    Raises:
        CoordinatorLost: the coordinator went silent or away (a death record was written).
        Exception: anything ``train_step`` or the model raised (a death record was written).
    """
    try:
        return RankLoop(spec, job).run()
    except BaseException as exc:
        if spec.stem is not None and not isinstance(exc, KeyboardInterrupt):
            kind = "coordinator lost" if isinstance(exc, CoordinatorLost) else type(exc).__name__
            write_death_record(spec.stem, spec.rank, spec.world_size, f"{kind}: {exc}")
        raise
