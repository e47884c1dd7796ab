"""The rank's main-thread training loop, for every pacing policy and both averaging backends.

The main thread owns torch and ``torch.distributed``; the bridge thread owns the control
socket. The loop never awaits: between optimizer steps it drains the bridge's inbox and obeys
the coordinator (DESIGN.md §2, STYLE.md §2.2):

* ``start_epoch`` / ``extend_partition`` / a folded ``update.next_plan`` queue slices of the
  shared permutation (identical on every process: :func:`flodl.coord.chunks.permutation`);
* each step trains one batch (``train_step`` gives the loss; the framework does backward,
  ``max_grad_norm`` clipping, the optimizer step and the LR from ``scheduler_fn`` driven by the
  coordinator's global step) and reports a ``batch`` frame (compute ms, data ms, loss); a
  finished slice reports ``metrics``;
* ``request_params`` (CPU) / ``sync_now`` (collective) make the rank take part in the averaging
  cycle at its next step boundary: ``snapshot_ready``, the weighted reduce (weight ``n^gamma``
  for the ``n`` steps since the last cycle), the divergence numbers of flodl-spec.md §3.1 in
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

import contextvars
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from flodl.config import ElCheConfig
from flodl.coord.chunks import epoch_slice, index_space, permutation, pick_to_sample
from flodl.data import BatchDataset
from flodl.errors import CollectiveFailed, CoordinatorLost, FlodlError
from flodl.rank.bridge import RankBridge
from flodl.rank.collectives import divergence
from flodl.rank.snapshot import TrainedState, float_buffers, model_signature, write_death_record
from flodl.wire.frames import (
    Accept,
    Batch,
    Checkpoint,
    CheckpointResult,
    CoordFrame,
    CoordHeartbeat,
    DeclareDead,
    EpochAggregated,
    EpochPlan,
    EvalBroadcast,
    EvalResult,
    ExecuteEval,
    Exiting,
    ExtendPartition,
    Hello,
    LrUpdate,
    Metrics,
    NewSession,
    RequestParams,
    SaveConsensusModel,
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

__all__ = ["RankSpec", "TrainJob", "run_rank", "record_scalar"]

logger = logging.getLogger(__name__)

ModelFactory = Callable[[torch.device], torch.nn.Module]
OptimFactory = Callable[[Iterator[torch.nn.Parameter]], torch.optim.Optimizer]
TrainStep = Callable[[torch.nn.Module, list[torch.Tensor]], torch.Tensor]
Scheduler = Callable[[int], float]
"""``lr(global_step)`` for one rank."""

_SCALARS: contextvars.ContextVar[dict[str, list[float]] | None] = contextvars.ContextVar(
    "flodl_scalars", default=None
)


def record_scalar(name: str, value: float) -> None:
    """Inside ``train_step``: add ``value`` to this step's scalar ``name`` (rolled up per chunk
    as sum and count, then per epoch on the host). Outside a training step it does nothing."""
    acc = _SCALARS.get()
    if acc is None:
        return
    v = float(value)
    if math.isfinite(v):
        slot = acc.setdefault(name, [0.0, 0.0])
        slot[0] += v
        slot[1] += 1


@dataclass(frozen=True)
class RankSpec:
    """Where this rank is and whom it talks to.

    Args:
        coord_host / coord_port: the coordinator's control address.
        secret: the run secret.
        run_id: the run id the coordinator expects.
        rank / world_size: this rank's global rank and the world size.
        device: ``"cpu"`` or ``"cuda:N"``.
        liveness_timeout_s: coordinator silence after which the rank stops (scaled).
        collective_timeout_s: torch.distributed timeout, kept below the liveness timeout so a
            rank never hangs in a collective.
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
    liveness_timeout_s: float = 30.0
    collective_timeout_s: float = 20.0
    stem: str | None = None
    threads: int | None = None
    connect_timeout_s: float = 30.0


@dataclass(frozen=True)
class TrainJob:
    """What to train and how."""

    model_factory: ModelFactory
    optim_factory: OptimFactory
    train_step: TrainStep
    dataset: BatchDataset
    batch_size: int
    elche: ElCheConfig = field(default_factory=ElCheConfig)
    max_grad_norm: float | None = None
    seed: int = 42
    augment: int = 1
    epoch_splits: int = 1
    scheduler_fn: Callable[[int], Scheduler] | None = None
    lr_scale_ratio: float = 1.0
    step_hook: Callable[[int, int], None] | None = None
    """Test hook ``(rank, step)`` called inside the timed compute of every step (e.g. to make
    a rank artificially slower); not for production use."""


@dataclass
class _Slice:
    epoch: int
    picks: list[int]
    tail: bool
    pos: int = 0


@dataclass
class _SliceStats:
    batches: int = 0
    loss_sum: float = 0.0
    compute_ms: float = 0.0
    data_ms: float = 0.0
    scalars: dict[str, list[float]] = field(default_factory=dict)


class _Stop(Exception):
    def __init__(self, save_reason: str | None) -> None:
        super().__init__(save_reason or "shutdown")
        self.save_reason = save_reason


def fetch_batch(job: TrainJob, picks: Sequence[int], device: torch.device) -> list[torch.Tensor]:
    """The batch of these permutation picks, on ``device`` (augmented picks map to samples)."""
    samples = [pick_to_sample(p, job.augment)[0] for p in picks]
    return [t.to(device, non_blocking=True) for t in job.dataset.get_batch(samples)]


def optimizer_step(
    job: TrainJob,
    model: torch.nn.Module,
    optim: torch.optim.Optimizer,
    batch: list[torch.Tensor],
    scalars: dict[str, list[float]],
    step: int,
) -> float:
    """One framework-owned step on every tier: ``train_step`` (forward + loss, with
    ``record_scalar`` collecting into ``scalars``), backward, ``max_grad_norm`` clipping, the
    optimizer step. Returns the loss.

    Raises:
        FlodlError: ``train_step`` returned no scalar tensor, or the loss (of ``step``) is not
            finite.
    """
    model.train()
    optim.zero_grad(set_to_none=True)
    token = _SCALARS.set(scalars)
    try:
        loss = job.train_step(model, batch)
    finally:
        _SCALARS.reset(token)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise FlodlError("train_step must return a scalar loss tensor")
    loss.backward()  # type: ignore[no-untyped-call]
    if job.max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), job.max_grad_norm)
    optim.step()
    value = float(loss.detach())
    if not math.isfinite(value):
        raise FlodlError(f"non-finite loss {value} at step {step}")
    return value


class _Rank:
    def __init__(self, spec: RankSpec, job: TrainJob) -> None:
        self.spec = spec
        self.job = job
        self.el = job.elche
        self.device = torch.device(spec.device)
        self.space = index_space(len(job.dataset), job.augment)
        self.queue: deque[_Slice] = deque()
        self.perms: dict[int, list[int]] = {}
        self.step = 0
        self.window_steps = 0
        self.global_step = 0
        self.local_since_avg = 0
        self.pending_reduce: int | None = None
        self.waiting_update = False
        self.throttled = False
        self.session = 0
        self.deferred: deque[CoordFrame] = deque()
        self.stats = _SliceStats()
        self.last_lr: float | None = None
        self.model: torch.nn.Module
        self.optim: torch.optim.Optimizer
        self.bridge: RankBridge | None = None
        self.client: Any = None
        self.collective: Any = None
        self.consensus: list[torch.Tensor] | None = None

    # ------------------------------------------------------------------ setup
    def run(self) -> TrainedState:
        spec, job = self.spec, self.job
        if spec.threads is not None:
            torch.set_num_threads(max(1, spec.threads))
        torch.manual_seed(job.seed + spec.rank)
        self.model = job.model_factory(self.device)
        self.optim = job.optim_factory(self.model.parameters())
        self.params = list(self.model.parameters())
        self.fbuffers = float_buffers(self.model)
        self.scheduler = job.scheduler_fn(spec.world_size) if job.scheduler_fn else None
        self.lr_scale = 1.0 + (spec.world_size - 1) * job.lr_scale_ratio
        hello = Hello(
            run_id=spec.run_id,
            rank=spec.rank,
            world_size=spec.world_size,
            model_signature=model_signature(self.model),
            device=spec.device,
        )
        self.bridge = RankBridge(
            spec.coord_host,
            spec.coord_port,
            spec.secret,
            hello,
            liveness_timeout_s=spec.liveness_timeout_s,
            connect_timeout_s=spec.connect_timeout_s,
        )
        accept = self.bridge.start()
        try:
            return self._train(accept)
        finally:
            self._close()

    def _train(self, accept: Accept) -> TrainedState:
        # Training starts when every rank joined: the first frame after Accept says so (the
        # coordinator opens the initial-broadcast round before sending it).
        first = self._recv_blocking()
        self.deferred.append(first)
        self._connect_backend(accept)
        self._initial_broadcast()
        try:
            while True:
                self._drain()
                if self.pending_reduce is not None:
                    self._reduce(self.pending_reduce)
                    continue
                if self.waiting_update or self.throttled or not self._has_work():
                    self._handle(self._recv_blocking())
                    continue
                self._train_one()
        except _Stop as stop:
            return self._finish(stop.save_reason)

    def _connect_backend(self, accept: Accept) -> None:
        spec = self.spec
        if self.el.backend == "cpu":
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
                bf16_wire=self.el.bf16_wire,
                timeout_s=max(spec.liveness_timeout_s, 1.0) * 4,
            )
            self.client.connect(spec.connect_timeout_s)
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
                timeout_s=spec.collective_timeout_s,
            )
            self.session = accept.session
            self.collective.form(f"{spec.run_id}/s{accept.session}", spec.rank, spec.world_size)

    def _initial_broadcast(self) -> None:
        """Replicas start identical: rank 0's parameters and buffers everywhere."""
        with torch.no_grad():
            if self.client is not None:
                root = self.spec.rank == 0
                self.client.reduce(0, self.params, 1.0 if root else 0.0, self.fbuffers, root)
            else:
                self.collective.broadcast([p.data for p in self.params] + self.fbuffers, src=0)

    # ------------------------------------------------------------------ control frames
    def _recv_blocking(self) -> CoordFrame:
        assert self.bridge is not None
        if self.deferred:
            return self.deferred.popleft()
        while True:
            frame = self.bridge.recv(timeout=1.0)
            if frame is not None:
                return frame

    def _drain(self) -> None:
        assert self.bridge is not None
        while self.deferred:
            self._handle(self.deferred.popleft())
        while (frame := self.bridge.poll()) is not None:
            self._handle(frame)

    def _handle(self, frame: CoordFrame) -> None:
        match frame:
            case StartEpoch(plan=plan):
                self._enqueue(plan)
                self.throttled = False
            case ExtendPartition(epoch=e, partition_offset=off, partition_size=size):
                self._enqueue(EpochPlan(epoch=e, partition_offset=off, partition_size=size))
                self.throttled = False
            case RequestParams(cycle=c) | SyncNow(cycle=c):
                self.pending_reduce = c
                self.throttled = False
            case Update(next_plan=plan):
                self.waiting_update = False
                self.throttled = False
                if plan is not None:
                    self._enqueue(plan)
            case Throttle():
                self.throttled = True
            case SetGlobalStep(global_step=g):
                self.global_step = g
                self.local_since_avg = 0
            case NewSession(session=s, store_prefix=prefix, new_rank=nr, new_world_size=nw):
                self._reform(s, prefix, nr, nw)
            case DeclareDead(rank=r, reason=why):
                logger.info("rank %d: peer %d declared dead (%s)", self.spec.rank, r, why)
            case Shutdown():
                raise _Stop(None)
            case ShutdownWithSave(reason=reason):
                raise _Stop(reason)
            case ExecuteEval(schedule_id=sid, epoch=epoch):
                self._send(
                    EvalResult(
                        rank=self.spec.rank,
                        schedule_id=sid,
                        epoch=epoch,
                        elapsed_ms=0.0,
                        error="no eval_fn on this rank",
                    )
                )
            case Checkpoint(version=v):
                self._send(
                    CheckpointResult(
                        rank=self.spec.rank, version=v, elapsed_ms=0.0, error="no checkpoint_fn"
                    )
                )
            case (
                SetEpochCallbackRole()
                | EpochAggregated()
                | EvalBroadcast()
                | CoordHeartbeat()
                | SaveConsensusModel()
            ):
                pass
            case _:
                logger.debug("rank %d ignores %s", self.spec.rank, frame.kind)

    def _send(self, frame: Any) -> None:
        assert self.bridge is not None
        self.bridge.send(frame)

    def _enqueue(self, plan: EpochPlan) -> None:
        data_pass, start, _ = epoch_slice(plan.epoch, self.space, self.job.epoch_splits)
        perm = self.perms.get(data_pass)
        if perm is None:
            self.perms = {data_pass: permutation(self.space, data_pass, self.job.seed)}
            perm = self.perms[data_pass]
        lo = start + plan.partition_offset
        picks = perm[lo : lo + plan.partition_size]
        self.queue.append(_Slice(plan.epoch, picks, plan.epoch_tail))

    def _has_work(self) -> bool:
        return bool(self.queue)

    # ------------------------------------------------------------------ training
    def _train_one(self) -> None:
        job, bs = self.job, self.job.batch_size
        head = self.queue[0]
        t0 = time.perf_counter()
        batch = fetch_batch(job, head.picks[head.pos : head.pos + bs], self.device)
        t1 = time.perf_counter()
        self._apply_lr()
        scalars: dict[str, list[float]] = {}
        loss_v = optimizer_step(job, self.model, self.optim, batch, scalars, self.step + 1)
        if job.step_hook is not None:
            job.step_hook(self.spec.rank, self.step + 1)
        t2 = time.perf_counter()
        self.step += 1
        self.window_steps += 1
        self.local_since_avg += 1
        assert self.bridge is not None
        self.bridge.set_step(self.step)
        compute_ms, data_ms = (t2 - t1) * 1000.0, (t1 - t0) * 1000.0
        self._send(
            Batch(
                rank=self.spec.rank,
                epoch=head.epoch,
                step=self.step,
                batch_ms=compute_ms,
                data_ms=data_ms,
                loss=loss_v,
            )
        )
        st = self.stats
        st.batches += 1
        st.loss_sum += loss_v
        st.compute_ms += compute_ms
        st.data_ms += data_ms
        for k, (s, c) in scalars.items():
            slot = st.scalars.setdefault(k, [0.0, 0.0])
            slot[0] += s
            slot[1] += c
        head.pos += bs
        if head.pos >= len(head.picks):
            self.queue.popleft()
            self._report_slice(head.epoch)

    def _report_slice(self, epoch: int) -> None:
        st, bs = self.stats, self.job.batch_size
        busy = st.compute_ms + st.data_ms
        self._send(
            Metrics(
                rank=self.spec.rank,
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
        )
        self.stats = _SliceStats()

    def _apply_lr(self) -> None:
        if self.scheduler is None:
            return
        lr = float(self.scheduler(self.global_step + self.local_since_avg)) * self.lr_scale
        for group in self.optim.param_groups:
            group["lr"] = lr
        if lr != self.last_lr and math.isfinite(lr) and lr >= 0:
            self.last_lr = lr
            self._send(LrUpdate(rank=self.spec.rank, lr=lr))

    # ------------------------------------------------------------------ averaging
    def _reduce(self, cycle: int) -> None:
        self.pending_reduce = None
        self._send(SnapshotReady(rank=self.spec.rank, cycle=cycle, step=self.step))
        n = self.window_steps
        weight = float(n) ** self.el.gamma if n > 0 else 0.0
        with torch.no_grad():
            pre = [p.detach().clone() for p in self.params]
            if self.client is not None:
                total, _ = self.client.reduce(cycle, self.params, weight, self.fbuffers, n > 0)
                alpha = self.el.easgd_alpha
                if alpha is not None and alpha < 1.0 and total > 0:
                    # keep the consensus: evals, checkpoints and the final state use it,
                    # never one rank's elastic blend
                    self.consensus = [p.detach().clone() for p in self.params]
                    for p, old in zip(self.params, pre, strict=True):
                        p.mul_(alpha).add_(old, alpha=1.0 - alpha)
            else:
                self._collective_reduce(weight, n > 0, pre)
            d, pre_norm, post_norm = divergence(pre, self.params)
        self._send(
            SyncAck(
                rank=self.spec.rank,
                cycle=cycle,
                step=self.step,
                session=self.session,
                divergence=d,
                pre_norm=pre_norm,
                post_norm=post_norm,
            )
        )
        self.window_steps = 0
        if self.client is not None and self.el.policy != "async":
            self.waiting_update = True

    def _collective_reduce(self, weight: float, mover: bool, pre: list[torch.Tensor]) -> None:
        while True:
            try:
                self.collective.weighted_average([p.data for p in self.params], weight)
                self.collective.average_buffers(self.fbuffers, mover)
                return
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
        """Hold other frames until the coordinator re-forms the group without the dead."""
        start = self.session
        held: list[CoordFrame] = []
        while self.session == start:
            frame = self._recv_blocking()
            if isinstance(frame, NewSession):
                self._handle(frame)
            elif isinstance(frame, Shutdown | ShutdownWithSave):
                self.deferred.extendleft(reversed(held))
                self._handle(frame)
            else:
                held.append(frame)
        self.deferred.extendleft(reversed(held))

    def _reform(self, session: int, prefix: str, new_rank: int, new_world: int) -> None:
        if self.collective is None:
            return
        self.session = session
        self.collective.form(prefix, new_rank, new_world)

    # ------------------------------------------------------------------ teardown
    def _finish(self, save_reason: str | None) -> TrainedState:
        state = TrainedState.of(self.model, save_reason)
        if self.consensus is not None:  # EASGD: the run's result is the consensus
            state.params = [c.to("cpu", copy=True) for c in self.consensus]
        self._send(Exiting(rank=self.spec.rank))
        return state

    def _close(self) -> None:
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
        return _Rank(spec, job).run()
    except BaseException as exc:
        if spec.stem is not None and not isinstance(exc, KeyboardInterrupt):
            kind = "coordinator lost" if isinstance(exc, CoordinatorLost) else type(exc).__name__
            write_death_record(spec.stem, spec.rank, spec.world_size, f"{kind}: {exc}")
        raise
