"""One framework-owned training step and what it needs, shared by every tier: the rank loop
(:mod:`flodl.rank.runtime`), the single-device run (:mod:`flodl.local`) and the user-owned
:class:`~flodl.worker.Worker` loop.

The user's ``train_step`` computes the loss; the framework does backward, ``max_grad_norm``
clipping and the optimizer step (:func:`optimizer_step`, :func:`apply_loss`), collects
``record_scalar`` values, runs user callbacks without letting them break training
(:func:`timed_callback`) and restores a bundle (:func:`restore_bundle`).
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from flodl import checkpoint
from flodl.config import ElCheConfig, JobSpec
from flodl.data import BatchDataset
from flodl.errors import CheckpointError, FlodlError
from flodl.outer import OuterConfig, OuterStep
from flodl.rank.protocol import StepSums
from flodl.rank.snapshot import model_signature
from flodl.sampling import SHUFFLE_BASE_SEED, pick_to_sample

__all__ = [
    "TrainJob",
    "StepSums",
    "record_scalar",
    "scalar_scope",
    "fetch_batch",
    "optimizer_step",
    "apply_loss",
    "timed_callback",
    "restore_bundle",
]

logger = logging.getLogger(__name__)

ModelFactory = Callable[[torch.device], torch.nn.Module]
OptimFactory = Callable[[Iterator[torch.nn.Parameter]], torch.optim.Optimizer]
TrainStep = Callable[[torch.nn.Module, list[torch.Tensor]], torch.Tensor]
Scheduler = Callable[[int], float]
"""``lr(global_step)`` for one rank."""
EpochFn = Callable[[int, torch.nn.Module], None]
"""``epoch_fn(epoch, model)`` on the epoch-callback role rank after each epoch."""
CheckpointFn = Callable[[int, torch.nn.Module], None]
"""``checkpoint_fn(epoch, model)`` on the checkpoint role rank, with the consensus parameters."""
EvalFn = Callable[[torch.nn.Module, Any], float]
"""``eval_fn(model, eval_dataset) -> metric`` on the eval role rank, with the consensus."""

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


@contextlib.contextmanager
def scalar_scope(scalars: dict[str, list[float]]) -> Iterator[None]:
    """``record_scalar`` calls inside this block add to ``scalars`` (name → [sum, count])."""
    token = _SCALARS.set(scalars)
    try:
        yield
    finally:
        _SCALARS.reset(token)


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
    seed: int = SHUFFLE_BASE_SEED
    augment: int = 1
    epoch_splits: int = 1
    scheduler_fn: Callable[[int], Scheduler] | None = None
    lr_scale_ratio: float = 1.0
    step_hook: Callable[[int, int], None] | None = None
    """Test hook ``(rank, step)`` called inside the timed compute of every step (e.g. to make
    a rank artificially slower); not for production use."""
    epoch_fn: EpochFn | None = None
    checkpoint_fn: CheckpointFn | None = None
    eval_fn: EvalFn | None = None
    eval_dataset: Any = None
    save_path: str | None = None
    """Bundle stem: ``<stem>.fdl``, ``<stem>.rank<N>.optim``, ``<stem>.outer.fdl``."""
    resume_from: str | None = None
    """Bundle stem to restore the model, optimizer and outer state from before training."""
    outer: OuterConfig = field(default_factory=OuterConfig)
    description: JobSpec | None = None
    """The job as the rank's ``hello`` describes it (docs/design.md §2c); ``None``: the
    hello carries none (a hand-built job)."""

    @property
    def keeps_consensus(self) -> bool:
        """Whether the rank keeps a copy of the last consensus (saves, evals and checkpoint
        callbacks see it instead of the rank's local drift; EASGD's result is it)."""
        return (
            self.save_path is not None
            or self.eval_fn is not None
            or self.checkpoint_fn is not None
            or self.elche.traits.elastic_blend
        )


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
    with scalar_scope(scalars):
        loss = job.train_step(model, batch)
    return apply_loss(job, model, optim, loss, step)


def apply_loss(
    job: TrainJob, model: torch.nn.Module, optim: torch.optim.Optimizer, loss: Any, step: int
) -> float:
    """Backward, ``max_grad_norm`` clipping and the optimizer step for a computed ``loss``
    (gradients must have been zeroed before the forward). Returns the loss value.

    Raises:
        FlodlError: ``loss`` is not a scalar tensor, or it (of ``step``) is not finite.
    """
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


def timed_callback(name: str, fn: Callable[[], Any]) -> tuple[Any, float, str | None]:
    """Run a user callback: ``(result, elapsed_ms, error)``; an exception becomes ``error``
    (logged with its traceback) and never reaches the training loop."""
    t0 = time.perf_counter()
    try:
        result = fn()
    except Exception as exc:
        logger.exception("%s raised (training continues)", name)
        return None, (time.perf_counter() - t0) * 1000.0, f"{type(exc).__name__}: {exc}"[:4000]
    return result, (time.perf_counter() - t0) * 1000.0, None


def restore_bundle(
    job: TrainJob,
    model: torch.nn.Module,
    optim: torch.optim.Optimizer,
    rank: int,
    outer: OuterStep | None = None,
) -> checkpoint.ModelBundle | None:
    """``resume_from``: load the consensus model, this rank's optimizer state and (collective
    placement) the outer optimizer state. A missing or stale optimizer/outer file is warned
    about and that state starts fresh; a missing or foreign model file raises.

    The files are the ones the bundle's meta names (its save's tag). A rank that did not exist
    at the save (the run resumes on more ranks) takes rank ``rank mod world_size_at_save``'s
    optimizer state: every rank's moments estimate the same gradient statistics
    (docs/design.md §6, "Resume at another world size").

    Raises:
        CheckpointError: the meta or the model file is missing, corrupt or from another model.
    """
    stem = job.resume_from
    if stem is None:
        return None
    meta = checkpoint.read_meta(stem)
    tag = meta.bundle_tag
    bundle = checkpoint.load_model(stem, tag)
    bundle.load_into(model, model_signature(model))
    source = rank % meta.world_size_at_save
    if source != rank:
        logger.info(
            "rank %d did not exist at the save (world size %d): it takes rank %d's optimizer state",
            rank,
            meta.world_size_at_save,
            source,
        )
    try:
        saved = checkpoint.load_optim(stem, source, tag)
    except CheckpointError as exc:
        logger.warning("rank %d: optimizer state not restored (%s); starting it fresh", rank, exc)
        saved = None
    if saved is None:
        logger.warning("rank %d: no optimizer state in the bundle; starting it fresh", rank)
    elif saved.global_step != bundle.global_step:
        logger.warning(
            "rank %d: optimizer state is from global step %d, the model from %d; starting it fresh",
            rank,
            saved.global_step,
            bundle.global_step,
        )
    else:
        optim.load_state_dict(saved.state)
    if outer is not None and not outer.config.is_identity:
        try:
            state = checkpoint.load_outer(stem, tag)
            if state is not None and state.global_step == bundle.global_step:
                outer.restore(state.state, list(model.parameters()))
            else:
                logger.warning("rank %d: no matching outer optimizer state; zero momentum", rank)
        except (CheckpointError, ValueError) as exc:
            logger.warning("rank %d: outer state not restored (%s); zero momentum", rank, exc)
    return bundle
