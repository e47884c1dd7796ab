"""The one training entry: ``Trainer.builder(...).run()`` or ``Trainer.run(..., TrainerConfig)``.

``run()`` decides the process's role from the environment (the trampoline, docs/design.md §2c):

* a rank (``FLODL_RANK``, or torchrun's / SLURM's variables with ``FLODL_COORD``): it trains
  in the calling thread until the coordinator ends the run (:mod:`flodl.launch.child`); then
  a rank started by another launcher (tier 4) returns a finished handle, having raised at once
  whatever ended the rank (``CoordinatorLost``, a failing ``train_step``), and a child of
  flodl's own launcher exits instead of returning;
* a cluster is configured (``local_ranks``, ``local_devices``, ``cluster``, ``flodl launch``,
  or two or more GPUs visible with ``device`` ``"auto"`` or ``"cuda"``): this process becomes
  the launcher (:mod:`flodl.launch.launcher`) and returns a handle at once;
* otherwise: one device, in process, no coordinator, on a background thread (:mod:`flodl.local`).

Every configuration error is raised by ``run()`` as a :class:`~flodl.errors.ConfigError`
naming the field, before any process starts.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from flodl import checkpoint
from flodl.chaos import RECORD_DIR_ENV, ChaosPlan
from flodl.config import ElCheConfig, MaxFailure, Reduction, validated
from flodl.data import as_batch_dataset
from flodl.errors import ConfigError, FlodlError
from flodl.handle import TrainerHandle
from flodl.launch.builder import ClusterBuilder
from flodl.launch.cluster import CLUSTER_ENV_VAR, Cluster
from flodl.launch.env import is_launched, local_host_names, rank_env
from flodl.local import LocalRun, LocalSchedule
from flodl.outer import OuterConfig
from flodl.rank.resources import ResourceProbe, ResourceSampler
from flodl.rank.snapshot import TrainedState
from flodl.rank.step import TrainJob, record_scalar
from flodl.trainer_config import TrainerConfig, job_spec, monitor_session
from flodl.wire.frames import EpochMetrics

if TYPE_CHECKING:
    from flodl.worker import Worker

__all__ = ["Trainer", "TrainerBuilder", "TrainerConfig", "TrainerHandle", "record_scalar"]


Fn = Callable[..., Any]

logger = logging.getLogger(__name__)


class TrainerBuilder:
    """Chained setters over :class:`TrainerConfig`; ``run()`` validates and starts."""

    def __init__(self, model_factory: Fn, optim_factory: Fn, train_step: Fn | None) -> None:
        self._factories = (model_factory, optim_factory, train_step)
        self._values: dict[str, Any] = {}

    def _set(self, key: str, value: Any) -> TrainerBuilder:
        self._values[key] = value
        return self

    def dataset(self, ds: Any) -> TrainerBuilder:
        return self._set("dataset", ds)

    def batch_size(self, n: int) -> TrainerBuilder:
        return self._set("batch_size", n)

    def num_epochs(self, n: int) -> TrainerBuilder:
        return self._set("num_epochs", n)

    def elche(self, cfg: ElCheConfig) -> TrainerBuilder:
        return self._set("elche", cfg)

    def max_grad_norm(self, v: float) -> TrainerBuilder:
        return self._set("max_grad_norm", v)

    def scheduler_fn(self, fn: Callable[[int], Callable[[int], float]]) -> TrainerBuilder:
        return self._set("scheduler_fn", fn)

    def lr_scale_ratio(self, v: float) -> TrainerBuilder:
        return self._set("lr_scale_ratio", v)

    def metrics_fn(self, fn: Callable[[EpochMetrics], None]) -> TrainerBuilder:
        return self._set("metrics_fn", fn)

    def max_failure(self, mf: MaxFailure) -> TrainerBuilder:
        return self._set("max_failure", mf)

    def respawn(self, times: int) -> TrainerBuilder:
        """A launcher (local ranks, a cluster) restarts a rank process that fails, up to
        ``times`` times per rank, without restarting the others; the new process rejoins the
        run (docs/design.md §2, "Rejoin")."""
        return self._set("respawn", times)

    def heartbeat_timeout(self, seconds: float) -> TrainerBuilder:
        return self._set("heartbeat_timeout", seconds)

    def augment(self, k: int) -> TrainerBuilder:
        return self._set("augment", k)

    def epoch_splits(self, n: int) -> TrainerBuilder:
        return self._set("epoch_splits", n)

    def seed(self, s: int) -> TrainerBuilder:
        return self._set("seed", s)

    def device(self, d: str) -> TrainerBuilder:
        return self._set("device", d)

    def local_ranks(self, n: int) -> TrainerBuilder:
        """Launch ``n`` ranks on this host (one process each)."""
        return self._set("ranks", n)

    def local_devices(self, devices: list[str | int]) -> TrainerBuilder:
        """Launch one rank per entry on this host: ``cpu``, ``cuda:N`` or ``N``. CPU and GPU
        ranks may mix and a GPU may be listed more than once in the CPU averaging modes
        (docs/design.md §2c, "Devices")."""
        return self._set("local_devices", devices)

    def save_path(self, stem: str) -> TrainerBuilder:
        return self._set("save_path", stem)

    def cluster(self, cluster: Cluster) -> TrainerBuilder:
        """Launch on these hosts and devices (``ClusterBuilder(...).build()``)."""
        return self._set("cluster", cluster)

    def resume_from(self, stem: str) -> TrainerBuilder:
        return self._set("resume_from", stem)

    def checkpoint_every(self, n: int) -> TrainerBuilder:
        return self._set("checkpoint_every", n)

    def checkpoint_at_epoch(self, epoch: int) -> TrainerBuilder:
        return self._set("checkpoint_at_epoch", epoch)

    def checkpoint_fn(self, fn: Callable[[int, Any], None]) -> TrainerBuilder:
        return self._set("checkpoint_fn", fn)

    def eval_dataset(self, ds: Any) -> TrainerBuilder:
        return self._set("eval_dataset", ds)

    def eval_fn(self, fn: Callable[[Any, Any], float]) -> TrainerBuilder:
        return self._set("eval_fn", fn)

    def eval_result_fn(self, fn: Callable[[int, float], None]) -> TrainerBuilder:
        return self._set("eval_result_fn", fn)

    def eval_every(self, n: int) -> TrainerBuilder:
        return self._set("eval_every", n)

    def epoch_fn(self, fn: Callable[[int, Any], None]) -> TrainerBuilder:
        return self._set("epoch_fn", fn)

    def epoch_callback_policy(self, policy: str | int) -> TrainerBuilder:
        """``EpochCallbackPolicy.Fastest`` or ``EpochCallbackPolicy.Rank(n)``."""
        return self._set("epoch_callback_policy", policy)

    def outer_optimizer(self, outer: OuterConfig) -> TrainerBuilder:
        return self._set("outer_optimizer", outer)

    def reports_per_epoch(self, n: int) -> TrainerBuilder:
        """``n`` sub-epoch ``node`` reports per epoch (records, dashboard, progress), each after
        another ``1/n`` of the epoch's batches, whatever the averaging cadence (an epoch of
        fewer than ``n`` batches gets one per batch); off: one report per epoch."""
        return self._set("reports_per_epoch", n)

    def record_log(self, directory: str, max_bytes: int = 0) -> TrainerBuilder:
        self._set("record_log_max_bytes", max_bytes)
        return self._set("record_log", str(directory))

    def dashboard(self, port: int = 0) -> TrainerBuilder:
        """Serve the live dashboard on 127.0.0.1:``port`` (0: any free port; the URL is
        printed and on ``handle.dashboard_url``)."""
        return self._set("dashboard", port)

    def save_dashboard(self, path: str) -> TrainerBuilder:
        return self._set("save_dashboard", str(path))

    def dashboard_theme(self, theme: str) -> TrainerBuilder:
        return self._set("dashboard_theme", theme)

    def scalar_reduction(self, name: str, how: Reduction | str) -> TrainerBuilder:
        reductions = dict(self._values.get("scalar_reductions", {}))
        reductions[name] = how
        return self._set("scalar_reductions", reductions)

    def progress(self, on: bool = True) -> TrainerBuilder:
        return self._set("progress", on)

    def chaos(self, plan: ChaosPlan) -> TrainerBuilder:
        """Inject the plan's faults into the ranks (tests, resilience drills)."""
        return self._set("chaos", plan)

    def config(self) -> TrainerConfig:
        if "dataset" not in self._values:
            raise ConfigError("invalid TrainerConfig: dataset: required (call .dataset(ds))")
        return validated(TrainerConfig, **self._values)

    def run(self) -> TrainerHandle:
        """Start the run; ``join()`` on the handle waits for it and returns the consensus.

        In one process, or as a launcher (tiers 1-3), this returns at once. In a rank process
        started by another launcher (tier 4: torchrun, SLURM, by hand) the rank trains here,
        in the calling thread: it returns a finished handle, and raises at once what ended
        the rank (``CoordinatorLost``, a failing ``train_step``). A child of flodl's own
        launcher exits here (its state goes to the launcher).
        """
        model_factory, optim_factory, train_step = self._factories
        config = self.config()
        _check_factories(model_factory, optim_factory, train_step, config)  # refuses None
        assert train_step is not None
        return Trainer.run(model_factory, optim_factory, train_step, config)

    def into_worker(self) -> Worker:
        """The cooperative tier: a :class:`~flodl.worker.Worker` whose loop you own."""
        return Trainer.worker(*self._factories, self.config())


class Trainer:
    """Namespace for the two entry forms."""

    @staticmethod
    def builder(model_factory: Fn, optim_factory: Fn, train_step: Fn | None) -> TrainerBuilder:
        """``train_step`` may be ``None`` only for ``into_worker()`` (your loop computes the
        loss); ``run()`` refuses it."""
        return TrainerBuilder(model_factory, optim_factory, train_step)

    @staticmethod
    def run(
        model_factory: Fn, optim_factory: Fn, train_step: Fn, config: TrainerConfig
    ) -> TrainerHandle:
        _check_factories(model_factory, optim_factory, train_step, config)
        config = _env_overrides(config)
        job = _job(model_factory, optim_factory, train_step, config)
        if rank_env() is not None:
            from flodl.launch.child import run_as_rank

            return run_as_rank(job, config.heartbeat_timeout, config.device)
        cluster, device = _placement(config)
        if cluster is not None:
            from flodl.launch.launcher import launch

            return launch(job, config, cluster)
        return _run_single(job, config, device)

    @staticmethod
    def worker(
        model_factory: Fn, optim_factory: Fn, train_step: Fn | None, config: TrainerConfig
    ) -> Worker:
        """The cooperative tier's entry (``builder(...).into_worker()``); ``train_step`` may be
        ``None`` since the user's loop computes the loss."""
        from flodl.worker import Worker

        step = _no_train_step if train_step is None else train_step
        _check_factories(model_factory, optim_factory, step, config)
        config = _env_overrides(config)
        job = _job(model_factory, optim_factory, step, config)
        if rank_env() is not None:
            from flodl.launch.child import rank_spec
            from flodl.rank.runtime import RankLoop

            return Worker(
                loop=RankLoop(
                    rank_spec(config.heartbeat_timeout, job.save_path, config.device), job
                ),
                launched=is_launched(),
            )
        cluster, device = _placement(config)
        if cluster is not None:
            from flodl.launch.launcher import launch

            return Worker(handle=launch(job, config, cluster))
        return Worker(local=LocalRun(job, _local_schedule(config, device)))


def _check_factories(
    model_factory: Fn, optim_factory: Fn, train_step: Fn | None, config: TrainerConfig
) -> None:
    if not isinstance(config, TrainerConfig):
        raise ConfigError("Trainer.run needs a TrainerConfig as its 4th argument")
    for name, fn in (
        ("model_factory", model_factory),
        ("optim_factory", optim_factory),
        ("train_step", train_step),
    ):
        if not callable(fn):
            raise ConfigError(f"{name} must be callable, got {type(fn).__name__}")


def _env_overrides(c: TrainerConfig) -> TrainerConfig:
    """``FLODL_RECORD_LOG`` gives a record directory to a run that did not set one (``flodl
    chaos`` uses it to read the run's recovery records)."""
    records = os.environ.get(RECORD_DIR_ENV)
    if records and c.record_log is None and rank_env() is None:
        return c.model_copy(update={"record_log": records})
    return c


def _no_train_step(model: Any, batch: Any) -> Any:
    raise FlodlError("this Worker's loop computes the loss itself: call worker.step(loss)")


def _placement(c: TrainerConfig) -> tuple[Cluster | None, str]:
    """The cluster to launch (``None``: one device, in process) and that one device.

    Precedence: the cluster ``flodl launch`` hands over > ``cluster`` > ``local_devices`` >
    ``local_ranks`` > auto-promote (two or more GPUs visible with ``device`` ``"auto"`` or
    ``"cuda"``) > one device. ``device="auto"`` (the default) means the GPUs ``nvidia-smi``
    shows (``CUDA_VISIBLE_DEVICES`` honoured) when torch is built with CUDA, else the CPU;
    the launcher never initialises CUDA (docs/design.md §2c, "Devices").
    """
    handed = os.environ.get(CLUSTER_ENV_VAR)
    cluster: Cluster | None = None
    if handed:
        cluster = Cluster.from_env_json(handed)
    elif c.cluster is not None:
        cluster = c.cluster
    elif c.local_devices is not None:
        cluster = ClusterBuilder.local_devices(c.local_devices)
    if cluster is not None:
        # a one-rank cluster still launches when its rank is elsewhere or its devices unknown
        if (
            not cluster.is_resolved
            or cluster.world_size > 1
            or not cluster.is_local(local_host_names())
        ):
            return cluster, "cpu"
        return None, cluster.ranks()[0].device
    if c.device == "cpu" or (c.device.startswith("cuda:") and c.ranks is None):
        return _local_ranks(c.ranks, c.device), c.device
    gpus = _visible_gpus(c.device)
    if c.ranks is not None:
        if c.device == "auto" and gpus < c.ranks:
            if gpus:
                logger.info(
                    "device auto: %d GPU(s) visible for %d local ranks; the ranks run on the "
                    "CPU (device('cuda') shares the GPUs among them)",
                    gpus,
                    c.ranks,
                )
            return _local_ranks(c.ranks, "cpu"), "cpu"
        return _local_ranks(c.ranks, "cuda", gpus), "cuda"
    if gpus >= 2:
        return ClusterBuilder.all_local_gpus(gpus), "cuda"
    if c.device == "auto":
        return None, "cuda" if gpus == 1 else "cpu"
    return None, c.device


def _local_ranks(ranks: int | None, device: str, gpus: int = 0) -> Cluster | None:
    if ranks is None or ranks < 2:
        return None
    return ClusterBuilder.local(ranks, "cpu" if device == "cpu" else "cuda", gpus=gpus or None)


def _visible_gpus(device: str) -> int:
    """How many GPUs ``nvidia-smi`` shows this process (0 for ``auto`` when torch has no CUDA:
    a CPU build of torch cannot use them)."""
    import torch

    if device == "auto" and not torch.backends.cuda.is_built():
        return 0
    from flodl.launch.gpus import detect_gpus

    return len(detect_gpus())


def _job(model_factory: Fn, optim_factory: Fn, train_step: Fn, c: TrainerConfig) -> TrainJob:
    dataset = as_batch_dataset(c.dataset)
    save_path = checkpoint.normalize_stem(c.save_path) if c.save_path else None
    resume_from = checkpoint.normalize_stem(c.resume_from) if c.resume_from else None
    return TrainJob(
        model_factory=model_factory,
        optim_factory=optim_factory,
        train_step=train_step,
        dataset=dataset,
        batch_size=c.batch_size,
        elche=c.elche,
        max_grad_norm=c.max_grad_norm,
        seed=c.seed,
        augment=c.augment,
        epoch_splits=c.epoch_splits,
        scheduler_fn=c.scheduler_fn,
        lr_scale_ratio=c.lr_scale_ratio,
        epoch_fn=c.epoch_fn,
        checkpoint_fn=c.checkpoint_fn,
        eval_fn=c.eval_fn,
        eval_dataset=c.eval_dataset,
        save_path=save_path,
        resume_from=resume_from,
        outer=c.outer_optimizer,
        description=job_spec(
            c, dataset_len=len(dataset), save_path=save_path, resume_from=resume_from
        ),
    )


def _local_schedule(c: TrainerConfig, device: str) -> LocalSchedule:
    return LocalSchedule(
        num_epochs=c.num_epochs,
        device=device,
        checkpoint_every=c.checkpoint_every,
        checkpoint_at_epoch=c.checkpoint_at_epoch,
        eval_every=c.eval_every,
        eval_result_fn=c.eval_result_fn,
        metrics_fn=c.metrics_fn,
        reports_per_epoch=c.reports_per_epoch,
    )


# ---------------------------------------------------------------------------------------------
# Tier 1: one device, in process
# ---------------------------------------------------------------------------------------------


def _run_single(job: TrainJob, c: TrainerConfig, device: str) -> TrainerHandle:
    handle = TrainerHandle(1)

    def body() -> None:
        try:
            state = _train_single(job, c, handle, device)
        except BaseException as exc:  # noqa: BLE001 - delivered to join()
            handle._finish(None, exc)
        else:
            handle._finish(state, None)

    thread = threading.Thread(target=body, name="flodl-single", daemon=True)
    thread.start()
    handle._joiner = lambda: thread.join()
    return handle


def _train_single(
    job: TrainJob, c: TrainerConfig, handle: TrainerHandle, device: str
) -> TrainedState:
    monitor = monitor_session(c, 1, None, run_info={"tier": "single"})
    if monitor is not None:
        handle.dashboard_url = monitor.url

    def on_metrics(m: EpochMetrics) -> None:
        if monitor is not None:
            monitor.epoch(m)
        handle._push(m)

    sampler: ResourceSampler | None = None
    if monitor is not None:  # the rank's resources, as a rank's bridge samples them
        path = monitor.paths[0]
        session = monitor
        sampler = ResourceSampler(
            ResourceProbe(0, device),
            lambda sample: session.record(path, "resource", sample.model_dump()),
        ).start()
    on_report = monitor.sub_epoch_report if monitor is not None else None
    try:
        # ``run`` (its model on the device included) lives on for the last sample below
        run = LocalRun(job, _local_schedule(c, device), on_metrics=on_metrics, on_report=on_report)
        return run.run()
    finally:
        if sampler is not None:
            sampler.stop()
        if monitor is not None:
            monitor.close()
