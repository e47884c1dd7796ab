"""The single-device run (tier 1): one process, one device, no coordinator.

The same contract as a cluster run, in process: the shared permutation of every epoch
(:func:`flodl.sampling.permutation`), the framework-owned step, ``EpochMetrics`` per epoch,
``epoch_fn``, ``checkpoint_fn``, ``eval_fn``/``eval_result_fn`` with the same schedule and
epoch tags as the coordinator's (the final eval is the last epoch's, tagged
``total_epochs − 1``), bundles at ``checkpoint_every``/``checkpoint_at_epoch``/requested epochs
and at the end, and ``resume_from`` (a bundle saved by a world-size-1 run; its uncovered ranges
are trained).

:class:`LocalRun` is a generator-driven loop so that both the Trainer (which owns the step) and
the cooperative :class:`~flodl.worker.Worker` (whose user owns it) drive it.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from flodl import checkpoint
from flodl.coord.metrics import ReportScheduler, WindowStats
from flodl.coord.resume import META_SCHEMA_VERSION, bundle_tag
from flodl.errors import CheckpointError, FlodlError
from flodl.rank.snapshot import TrainedState, model_signature
from flodl.rank.step import (
    StepSums,
    TrainJob,
    apply_loss,
    fetch_batch,
    restore_bundle,
    scalar_scope,
    timed_callback,
)
from flodl.sampling import epoch_batches, epoch_slice, index_space, permutation
from flodl.wire.frames import EpochMetrics

__all__ = ["LocalSchedule", "LocalRun"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LocalSchedule:
    """When callbacks and saves fire (the coordinator's rules, for one process)."""

    num_epochs: int
    device: str = "cpu"
    checkpoint_every: int | None = None
    checkpoint_at_epoch: int | None = None
    eval_every: int | None = None
    eval_result_fn: Callable[[int, float], None] | None = None
    metrics_fn: Callable[[EpochMetrics], None] | None = None
    reports_per_epoch: int | None = None
    """Sub-epoch reports (to ``on_report``), as the coordinator's: the ``k``-th at ``k/n`` of
    the epoch's batches."""


SubEpochReport = Callable[[int, float, dict[str, float]], None]
"""``(epoch, epoch_progress, node)``: a sub-epoch report of the one rank (its batches since the
previous report, as :meth:`~flodl.coord.metrics.WindowStats.node` builds it)."""


class LocalRun:
    """One device, in process. Iterate :meth:`batches` and call :meth:`step` once per batch
    (or :meth:`train` for the framework's own step); :meth:`result` is the final state.

    Args:
        job: what to train.
        schedule: callbacks and saves.
        on_metrics: receives every epoch's :class:`EpochMetrics` (after ``metrics_fn``).
        on_report: receives the sub-epoch reports (``reports_per_epoch``).

    Raises:
        CheckpointError: ``resume_from`` names a missing, corrupt or foreign bundle.
    """

    def __init__(
        self,
        job: TrainJob,
        schedule: LocalSchedule,
        on_metrics: Callable[[EpochMetrics], None] | None = None,
        on_report: SubEpochReport | None = None,
    ) -> None:
        self.job = job
        self.schedule = schedule
        self.on_metrics = on_metrics
        self.on_report = on_report if schedule.reports_per_epoch is not None else None
        self._reports = ReportScheduler(schedule.reports_per_epoch)
        self._since = WindowStats()
        self._epoch = (0, 0, 0)
        """The epoch being trained: (index, its batches, the batches this run trains of it)."""
        self._trained = 0
        self.device = torch.device(schedule.device)
        torch.manual_seed(job.seed)
        self.model: torch.nn.Module = job.model_factory(self.device)
        self.optim: torch.optim.Optimizer = job.optim_factory(self.model.parameters())
        self.scheduler = job.scheduler_fn(1) if job.scheduler_fn else None
        self.space = index_space(len(job.dataset), job.augment)
        self.total_epochs = schedule.num_epochs * job.epoch_splits
        self.global_step = 0
        self.start_epoch = 0
        self.uncovered: list[tuple[int, int]] | None = None
        self.intents: set[str] = set()
        self.evals: list[tuple[int, float]] = []
        self._pending: tuple[float, float] | None = None
        self._sums = StepSums()
        self._done = False
        self._saves = 0
        if job.resume_from is not None:
            self._resume(job.resume_from)

    # ------------------------------------------------------------------ resume
    def _resume(self, stem: str) -> None:
        meta = checkpoint.read_meta(stem)
        state = checkpoint.resume_state(
            meta,
            seed=self.job.seed,
            batch_size=self.job.batch_size,
            epoch_splits=self.job.epoch_splits,
            total_epochs=self.total_epochs,
        )
        bundle = restore_bundle(self.job, self.model, self.optim, 0)
        if bundle is not None and bundle.global_step != meta.global_step:
            raise CheckpointError(
                f"{bundle.path} is from global step {bundle.global_step} but "
                f"{checkpoint.meta_path(stem)} from {meta.global_step}: the two come from "
                "different saves"
            )
        self.start_epoch = state.epoch
        self.global_step = state.global_step
        self.uncovered = list(state.uncovered) if state.uncovered is not None else None

    # ------------------------------------------------------------------ the loop
    def _epoch_batches(self, epoch: int) -> list[int]:
        bs = self.job.batch_size
        n = epoch_batches(epoch, self.space, bs, self.job.epoch_splits)
        if epoch == self.start_epoch and self.uncovered is not None:
            picked: list[int] = []
            for offset, size in self.uncovered:
                first = offset // bs
                picked.extend(range(first, min(n, first + -(-size // bs))))
            return picked
        return list(range(n))

    def batches(self) -> Iterator[list[torch.Tensor]]:
        """Every batch of the run on the device; the gradients are zeroed and the LR set
        before each is yielded. Callbacks and saves run between epochs."""
        job, bs = self.job, self.job.batch_size
        for epoch in range(self.start_epoch, self.total_epochs):
            started = time.perf_counter()
            data_pass, start, _ = epoch_slice(epoch, self.space, job.epoch_splits)
            perm = permutation(self.space, data_pass, job.seed)
            self._sums = StepSums()
            todo = self._epoch_batches(epoch)
            total = epoch_batches(epoch, self.space, bs, job.epoch_splits)
            self._epoch, self._trained = (epoch, total, len(todo)), 0
            for b in todo:
                t0 = time.perf_counter()
                batch = fetch_batch(job, perm[start + b * bs : start + (b + 1) * bs], self.device)
                t1 = time.perf_counter()
                if self.scheduler is not None:
                    for group in self.optim.param_groups:
                        group["lr"] = float(self.scheduler(self.global_step))
                self.model.train()
                self.optim.zero_grad(set_to_none=True)
                self._pending = (t0, t1)
                yield batch
                if self._pending is not None:
                    raise FlodlError("call step(loss) once for every batch before the next one")
            self._end_epoch(epoch, started)
        self._end_run()

    def step(self, loss: Any) -> float:
        """Backward, clipping and the optimizer step for the current batch's ``loss``."""
        if self._pending is None:
            raise FlodlError("step() needs a batch from batches() first")
        t0, t1 = self._pending
        value = apply_loss(self.job, self.model, self.optim, loss, self.global_step + 1)
        self._pending = None
        self.global_step += 1
        sums = self._sums
        sums.batches += 1
        sums.loss_sum += value
        compute_ms = (time.perf_counter() - t1) * 1000.0
        sums.compute_ms += compute_ms
        sums.data_ms += (t1 - t0) * 1000.0
        if self.on_report is not None:
            self._report(compute_ms, (t1 - t0) * 1000.0, value)
        return value

    def _report(self, compute_ms: float, data_ms: float, loss: float) -> None:
        assert self.on_report is not None
        self._since.add(compute_ms, data_ms, loss, self.job.batch_size)
        self._trained += 1
        epoch, total, todo = self._epoch
        if self._reports.due(epoch, self._trained, todo):
            node, self._since = self._since.node(1.0), WindowStats()
            progress = min(1.0, (total - todo + self._trained) / max(1, total))
            self.on_report(epoch, progress, node)

    def train(self, batch: list[torch.Tensor]) -> float:
        """The framework's step: ``train_step`` gives the loss (``record_scalar`` counts)."""
        with scalar_scope(self._sums.scalars):
            loss = self.job.train_step(self.model, batch)
        return self.step(loss)

    def run(self) -> TrainedState:
        for batch in self.batches():
            self.train(batch)
        return self.result()

    def result(self) -> TrainedState:
        return TrainedState.of(self.model)

    @property
    def done(self) -> bool:
        return self._done

    # ------------------------------------------------------------------ epoch boundaries
    def _end_epoch(self, epoch: int, started: float) -> None:
        s, bs = self._sums, self.job.batch_size
        busy = s.compute_ms + s.data_ms
        means = {k: total / n for k, (total, n) in sorted(s.scalars.items()) if n}
        loss = s.loss_sum / max(1, s.batches)
        m = EpochMetrics(
            epoch=epoch,
            avg_loss=loss,
            epoch_ms=(time.perf_counter() - started) * 1000.0,
            scalars=means,
            per_rank=[means],
            per_rank_loss=[loss],
            per_rank_throughput=[1000.0 * s.batches * bs / busy if busy > 0 else 0.0],
            per_rank_batch_share=[1.0],
            per_rank_samples=[s.batches * bs],
            per_rank_share_complete_ms=[busy],
            per_rank_compute_only_ms=[s.compute_ms],
            per_rank_data_starve_ms=[s.data_ms],
            device_indices=[self.device.index],
            syncs=0,
        )
        fn = self.schedule.metrics_fn
        if fn is not None:
            timed_callback(f"metrics_fn (epoch {epoch})", lambda: fn(m))
        if self.on_metrics is not None:
            self.on_metrics(m)
        epoch_fn = self.job.epoch_fn
        if epoch_fn is not None:
            timed_callback(f"epoch_fn (epoch {epoch})", lambda: epoch_fn(epoch, self.model))
        last = epoch == self.total_epochs - 1
        if self._checkpoint_due(epoch):
            self.intents.discard("checkpoint_now")
            self._checkpoint_fn(epoch)
            if not last:
                self._save_bundle(epoch + 1)
        if not last and self._eval_due(epoch):
            self.intents.discard("eval_now")
            self._eval(epoch)

    def _end_run(self) -> None:
        if self.job.eval_fn is not None:
            self._eval(self.total_epochs - 1)  # the final eval: the last epoch's, run once
        self._save_bundle(self.total_epochs)
        self._done = True

    def _checkpoint_due(self, epoch: int) -> bool:
        s = self.schedule
        every = s.checkpoint_every is not None and (epoch + 1) % s.checkpoint_every == 0
        return every or s.checkpoint_at_epoch == epoch or "checkpoint_now" in self.intents

    def _eval_due(self, epoch: int) -> bool:
        if self.job.eval_fn is None:
            return False
        every = 1 if self.schedule.eval_every is None else self.schedule.eval_every
        return (epoch + 1) % every == 0 or "eval_now" in self.intents

    def _checkpoint_fn(self, epoch: int) -> None:
        fn = self.job.checkpoint_fn
        if fn is not None:
            timed_callback(f"checkpoint_fn (epoch {epoch})", lambda: fn(epoch, self.model))

    def _eval(self, epoch: int) -> None:
        fn = self.job.eval_fn
        if fn is None:
            return
        self.model.eval()
        try:
            value, _, error = timed_callback(
                f"eval_fn (epoch {epoch})", lambda: fn(self.model, self.job.eval_dataset)
            )
        finally:
            self.model.train()
        if error is not None:
            return
        try:
            metric = float(value)
        except (TypeError, ValueError):
            logger.error("eval_fn returned %s, not a number", type(value).__name__)
            return
        self.evals.append((epoch, metric))
        result_fn = self.schedule.eval_result_fn
        if result_fn is not None:
            timed_callback("eval_result_fn", lambda: result_fn(epoch, metric))

    def _save_bundle(self, next_epoch: int) -> None:
        """Model and optimizer state under a new tag, then the meta that commits them (the
        previous bundle stays the resume point until it is written). A failed write is logged
        and training goes on."""
        stem = self.job.save_path
        if stem is None:
            return
        self._saves += 1
        tag = bundle_tag(self.global_step, self._saves, random.getrandbits(24))
        try:
            checkpoint.save_model(
                stem,
                list(self.model.parameters()),
                list(self.model.buffers()),
                signature=model_signature(self.model),
                global_step=self.global_step,
                sync_round=0,
                epoch=next_epoch,
                tag=tag,
            )
            checkpoint.save_optim(
                stem,
                0,
                self.optim.state_dict(),
                global_step=self.global_step,
                sync_round=0,
                tag=tag,
            )
            checkpoint.commit_bundle(stem, {**self._meta(next_epoch), "bundle_tag": tag})
        except Exception:
            logger.exception("saving the checkpoint bundle %s failed (training continues)", stem)

    def _meta(self, next_epoch: int) -> dict[str, Any]:
        return {
            "schema_version": META_SCHEMA_VERSION,
            "epoch": next_epoch,
            "global_step": self.global_step,
            "sync_round": 0,
            "world_size_at_save": 1,
            "save_reason": "graceful_shutdown",
            "elche_state": None,
            "coverage": {
                "seed": self.job.seed,
                "epoch_splits": self.job.epoch_splits,
                "batch_size": self.job.batch_size,
                "per_epoch": [],
            },
        }
