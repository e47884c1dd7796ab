"""The one training entry: ``Trainer.builder(...).run()`` or ``Trainer.run(..., TrainerConfig)``.

``run()`` decides the process's role from the environment (the trampoline, DESIGN.md §2):

* ``FLODL_RANK`` is set: this process is a rank (spawned by flodl's launcher, or by torchrun /
  SLURM / ssh joining a standalone coordinator): it trains until the coordinator ends the run.
  A launcher-spawned rank exits the process afterwards (code after ``join()`` runs once, in the
  launcher); an externally launched rank returns a handle whose ``is_primary`` says which rank
  should do the one-off work.
* a cluster is configured: this process becomes the launcher: it starts the coordinator
  service on a background thread, re-executes the user's own entry point once per local rank
  with ``FLODL_*`` variables (so factories may be lambdas), supervises the children (an exit is
  reported to the coordinator within milliseconds) and returns a handle at once.
* otherwise: one device, in process, no coordinator, on a background thread.

Every configuration error is raised by ``run()`` as a :class:`~flodl.errors.ConfigError`
naming the field, before any process starts.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import math
import os
import queue
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, Self

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from flodl import checkpoint
from flodl.chaos import CHAOS_ENV, RECORD_DIR_ENV, ChaosPlan
from flodl.config import CoordConfig, ElCheConfig, MaxFailure, Reduction, validated
from flodl.coord.effects import (
    Alert,
    BundleRequested,
    EpochDone,
    EvalDone,
    Record,
    RunOver,
    WriteMeta,
)
from flodl.coord.metrics import REDUCTIONS
from flodl.data import as_batch_dataset
from flodl.errors import ConfigError, FlodlError
from flodl.launch.cluster import CLUSTER_ENV_VAR, Cluster, ClusterBuilder
from flodl.local import LocalRun, LocalSchedule
from flodl.monitor.session import MonitorSession
from flodl.outer import OuterConfig
from flodl.rank.runtime import (
    RankSpec,
    TrainJob,
    record_scalar,
    run_rank,
    timed_callback,
)
from flodl.rank.snapshot import TrainedState
from flodl.wire.frames import EpochMetrics

if TYPE_CHECKING:
    from flodl.coord.service import BundleWriter
    from flodl.worker import Worker

__all__ = ["Trainer", "TrainerBuilder", "TrainerConfig", "TrainerHandle", "record_scalar"]

logger = logging.getLogger(__name__)

ENV_RANK = "FLODL_RANK"
ENV_WORLD = "FLODL_WORLD_SIZE"
ENV_COORD = "FLODL_COORD"
ENV_SECRET = "FLODL_SECRET"
ENV_SECRET_FILE = "FLODL_SECRET_FILE"
ENV_RUN_ID = "FLODL_RUN_ID"
ENV_DEVICE = "FLODL_DEVICE"
ENV_STEM = "FLODL_STEM"
ENV_THREADS = "FLODL_THREADS"
ENV_LAUNCHED = "FLODL_LAUNCHED"
ENV_FINAL_DIR = "FLODL_FINAL_DIR"
ENV_TIMEOUT_SCALE = "FLODL_NET_TIMEOUT_SCALE"
ENV_LOCAL_HOSTS = "FLODL_LOCAL_HOSTS"
ENV_PREFIX_OUTPUT = "FLODL_PREFIX_OUTPUT"


def timeout_scale() -> float:
    """``FLODL_NET_TIMEOUT_SCALE`` (≥ 0.01), scaling every network deadline; 1.0 if unset."""
    raw = os.environ.get(ENV_TIMEOUT_SCALE, "")
    if not raw:
        return 1.0
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{ENV_TIMEOUT_SCALE}={raw!r} is not a number") from None
    if not (value >= 0.01 and math.isfinite(value)):
        raise ConfigError(f"{ENV_TIMEOUT_SCALE}={raw!r} must be a finite number >= 0.01")
    return value


class TrainerConfig(BaseModel):
    """Every knob of a run (the config-bag form of the builder). Validated at ``run()``."""

    model_config = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True)

    dataset: Any
    batch_size: Annotated[int, Field(ge=1)] = 32
    num_epochs: Annotated[int, Field(ge=1)] = 1
    elche: ElCheConfig = Field(default_factory=ElCheConfig)
    max_grad_norm: Annotated[float, Field(gt=0.0, allow_inf_nan=False)] | None = None
    scheduler_fn: Callable[[int], Callable[[int], float]] | None = None
    lr_scale_ratio: Annotated[float, Field(ge=0.0, allow_inf_nan=False)] = 1.0
    metrics_fn: Callable[[EpochMetrics], None] | None = None
    max_failure: MaxFailure | None = None
    heartbeat_timeout: Annotated[float, Field(gt=0.0, allow_inf_nan=False)] = 30.0
    augment: Annotated[int, Field(ge=1)] = 1
    epoch_splits: Annotated[int, Field(ge=1)] = 1
    seed: int = 42
    device: str = "cpu"
    ranks: Annotated[int, Field(ge=1, le=4096)] | None = None
    """Local ranks to launch on this host (``None``: one device, in process)."""
    cluster: Cluster | None = None
    """Hosts and devices to launch on (``ClusterBuilder`` / ``fdl.cluster.yml``)."""
    save_path: str | None = None
    """Bundle stem: checkpoints, ShutdownWithSave and the end of the run write
    ``<stem>.fdl``, ``<stem>.rank<N>.optim``, ``<stem>.meta.json`` (and ``<stem>.outer.fdl``);
    death records go to ``<stem>.rank<N>.death.json``."""
    resume_from: str | None = None
    """Bundle stem to resume from (same world size, seed, batch size and epoch splits)."""
    checkpoint_every: Annotated[int, Field(ge=1)] | None = None
    """Save a bundle (and call ``checkpoint_fn``) after every n-th epoch."""
    checkpoint_at_epoch: Annotated[int, Field(ge=0)] | None = None
    """Save once, after this (0-based) epoch."""
    checkpoint_fn: Callable[[int, Any], None] | None = None
    """``checkpoint_fn(epoch, model)`` on the checkpoint role rank, with the consensus."""
    eval_dataset: Any = None
    eval_fn: Callable[[Any, Any], float] | None = None
    """``eval_fn(model, eval_dataset) -> metric`` on the eval role rank, with the consensus;
    every ``eval_every`` epochs (default every epoch) and once after the last epoch."""
    eval_result_fn: Callable[[int, float], None] | None = None
    """``eval_result_fn(epoch, metric)`` on the host; the final eval is tagged
    ``num_epochs × epoch_splits``."""
    eval_every: Annotated[int, Field(ge=1)] | None = None
    epoch_fn: Callable[[int, Any], None] | None = None
    """``epoch_fn(epoch, model)`` on the epoch-callback role rank after each epoch."""
    epoch_callback_policy: Literal["fastest"] | Annotated[int, Field(ge=0)] = "fastest"
    """``EpochCallbackPolicy.Fastest`` (default) or ``EpochCallbackPolicy.Rank(n)``."""
    outer_optimizer: OuterConfig = Field(default_factory=OuterConfig)
    """``OuterAvg()`` (default), ``SlowMomentum(lr, mu)`` or ``NesterovMomentum(lr, mu)``."""
    reports_per_epoch: Annotated[int, Field(ge=1, le=1000)] | None = None
    """Up to n sub-epoch node reports per epoch at reduce boundaries (off: one per epoch)."""
    record_log: str | None = None
    """Directory of the JSONL record tree (``root.log``, ``root/<host>/rank<N>.log``)."""
    record_log_max_bytes: Annotated[int, Field(ge=0)] = 0
    """Ring size per node (0: 32 MiB)."""
    dashboard: Annotated[int, Field(ge=0, le=65_535)] | None = None
    """Serve the live dashboard on this port of 127.0.0.1 (0: any free port)."""
    save_dashboard: str | None = None
    """Write one self-contained HTML dashboard of the whole run here at the end."""
    dashboard_theme: Literal["light", "dark"] | None = None
    """Pin the dashboard theme (default: the reader's OS preference)."""
    scalar_reductions: dict[str, Reduction] = Field(default_factory=dict)
    """User scalar name → ``Reduction`` across ranks (default ``MEAN``)."""
    progress: bool | None = None
    """Print progress lines (default: when stdout is a terminal)."""
    chaos: ChaosPlan | None = None
    """Inject these faults into the ranks (chaos mode; see :mod:`flodl.chaos`)."""

    @model_validator(mode="after")
    def _check(self) -> Self:
        if not (
            hasattr(self.dataset, "__len__")
            and (hasattr(self.dataset, "get_batch") or hasattr(self.dataset, "__getitem__"))
        ):
            raise ValueError("dataset must be a map-style dataset or a BatchDataset")
        n = len(self.dataset)
        if n < self.batch_size:
            raise ValueError(f"dataset has {n} samples, fewer than one batch ({self.batch_size})")
        if self.device != "cpu" and not self.device.startswith("cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.ranks is not None and self.cluster is not None:
            raise ValueError("set either ranks (local) or cluster, not both")
        ratios = self.elche.partition_ratios
        world = self.cluster.world_size if self.cluster is not None else (self.ranks or 1)
        if ratios is not None and len(ratios) != world:
            raise ValueError(f"elche.partition_ratios has {len(ratios)} entries for {world} ranks")
        policy = self.epoch_callback_policy
        if isinstance(policy, int) and policy >= world:
            raise ValueError(
                f"epoch_callback_policy Rank({policy}) is out of range for {world} rank(s)"
            )
        if self.eval_fn is None and (self.eval_result_fn is not None or self.eval_every):
            raise ValueError("eval_result_fn / eval_every need an eval_fn")
        core = sorted(set(self.scalar_reductions) & set(REDUCTIONS))
        if core:
            raise ValueError(
                f"scalar_reduction: {core} are framework metrics with fixed reductions"
            )
        return self


Fn = Callable[..., Any]


class TrainerBuilder:
    """Chained setters over :class:`TrainerConfig`; ``run()`` validates and starts."""

    def __init__(self, model_factory: Fn, optim_factory: Fn, train_step: Fn) -> None:
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
        return Trainer.run(*self._factories, self.config())

    def into_worker(self) -> Worker:
        """The cooperative tier: a :class:`~flodl.worker.Worker` whose loop you own."""
        return Trainer.worker(*self._factories, self.config())


class TrainerHandle:
    """What ``run()`` returns: ``join()`` the final state, stream :class:`EpochMetrics`."""

    def __init__(self, world_size: int, *, is_primary: bool = True) -> None:
        self.world_size = world_size
        self.is_primary = is_primary
        self.dashboard_url: str | None = None
        """The live dashboard's address while the run lasts (``dashboard(port)``)."""
        self._metrics: queue.SimpleQueue[EpochMetrics | None] = queue.SimpleQueue()
        self._done = threading.Event()
        self._state: TrainedState | None = None
        self._error: BaseException | None = None
        self._joiner: Callable[[], None] | None = None

    # producer side
    def _push(self, m: EpochMetrics) -> None:
        self._metrics.put(m)

    def _finish(self, state: TrainedState | None, error: BaseException | None) -> None:
        self._state, self._error = state, error
        self._metrics.put(None)
        self._done.set()

    # consumer side
    def join(self, timeout: float | None = None) -> TrainedState:
        """Wait for the run; returns the final consensus state (CPU tensors).

        Raises:
            FlodlError: the run failed (the message says why).
            TimeoutError: not finished within ``timeout`` seconds.
        """
        if self._joiner is not None:
            self._joiner()
        if not self._done.wait(timeout):
            raise TimeoutError(f"the run did not finish within {timeout} s")
        if self._error is not None:
            raise self._error
        assert self._state is not None
        return self._state

    def next_metrics(self, timeout: float | None = None) -> EpochMetrics | None:
        """The next epoch's metrics, blocking; ``None`` once the run is over (or timeout)."""
        if self._done.is_set() and self._metrics.empty():
            return None
        try:
            return self._metrics.get(timeout=timeout)
        except queue.Empty:
            return None

    def poll_metrics(self) -> list[EpochMetrics]:
        """Every epoch's metrics that arrived since the last call, without blocking."""
        out: list[EpochMetrics] = []
        while True:
            try:
                m = self._metrics.get_nowait()
            except queue.Empty:
                return out
            if m is None:
                self._metrics.put(None)
                return out
            out.append(m)


class Trainer:
    """Namespace for the two entry forms."""

    @staticmethod
    def builder(model_factory: Fn, optim_factory: Fn, train_step: Fn) -> TrainerBuilder:
        return TrainerBuilder(model_factory, optim_factory, train_step)

    @staticmethod
    def run(
        model_factory: Fn, optim_factory: Fn, train_step: Fn, config: TrainerConfig
    ) -> TrainerHandle:
        _check_factories(model_factory, optim_factory, train_step, config)
        config = _env_overrides(config)
        job = _job(model_factory, optim_factory, train_step, config)
        if rank_env() is not None:
            return _run_as_rank(job, config)
        cluster = _resolve_cluster(config)
        if cluster is not None and cluster.world_size > 1:
            return _launch(job, config, cluster)
        return _run_single(job, config)

    @staticmethod
    def worker(
        model_factory: Fn, optim_factory: Fn, train_step: Fn | None, config: TrainerConfig
    ) -> Worker:
        """The cooperative tier's entry (``builder(...).into_worker()``); ``train_step`` may be
        ``None`` since the user's loop computes the loss."""
        from flodl.rank.runtime import RankLoop
        from flodl.worker import Worker

        step = _no_train_step if train_step is None else train_step
        _check_factories(model_factory, optim_factory, step, config)
        config = _env_overrides(config)
        job = _job(model_factory, optim_factory, step, config)
        if rank_env() is not None:
            return Worker(
                loop=RankLoop(_rank_spec(config), job),
                launched=os.environ.get(ENV_LAUNCHED) == "1",
            )
        cluster = _resolve_cluster(config)
        if cluster is not None and cluster.world_size > 1:
            return Worker(handle=_launch(job, config, cluster))
        return Worker(local=LocalRun(job, _local_schedule(config)))


def _check_factories(
    model_factory: Fn, optim_factory: Fn, train_step: Fn, config: TrainerConfig
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


def _resolve_cluster(c: TrainerConfig) -> Cluster | None:
    """Precedence: the cluster ``flodl launch`` hands over > ``cluster`` > ``ranks``."""
    handed = os.environ.get(CLUSTER_ENV_VAR)
    if handed:
        return Cluster.from_env_json(handed)
    if c.cluster is not None:
        return c.cluster
    if c.ranks is not None:
        return ClusterBuilder.local(c.ranks, "cpu" if c.device == "cpu" else "cuda")
    if c.device == "cuda":
        # auto-promote: one rank per visible GPU (nvidia-smi; the launcher never touches CUDA)
        from flodl.launch.gpus import detect_gpus

        gpus = detect_gpus()
        if len(gpus) >= 2:
            return ClusterBuilder.all_local_gpus(len(gpus))
    return None


def local_host_names() -> frozenset[str]:
    """Names of this machine: its hostname, FQDN and ``FLODL_LOCAL_HOSTS`` (comma-separated
    aliases, e.g. names that resolve here); loopback names are always local."""
    names = {socket.gethostname(), socket.getfqdn()}
    names |= {n.strip() for n in os.environ.get(ENV_LOCAL_HOSTS, "").split(",") if n.strip()}
    return frozenset(n for n in names if n)


def _job(model_factory: Fn, optim_factory: Fn, train_step: Fn, c: TrainerConfig) -> TrainJob:
    return TrainJob(
        model_factory=model_factory,
        optim_factory=optim_factory,
        train_step=train_step,
        dataset=as_batch_dataset(c.dataset),
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
        save_path=checkpoint.normalize_stem(c.save_path) if c.save_path else None,
        resume_from=checkpoint.normalize_stem(c.resume_from) if c.resume_from else None,
        outer=c.outer_optimizer,
    )


def _local_schedule(c: TrainerConfig) -> LocalSchedule:
    return LocalSchedule(
        num_epochs=c.num_epochs,
        device=c.device,
        checkpoint_every=c.checkpoint_every,
        checkpoint_at_epoch=c.checkpoint_at_epoch,
        eval_every=c.eval_every,
        eval_result_fn=c.eval_result_fn,
        metrics_fn=c.metrics_fn,
    )


def _safe_metrics(fn: Callable[[EpochMetrics], None] | None, m: EpochMetrics) -> None:
    if fn is not None:
        timed_callback(f"metrics_fn (epoch {m.epoch})", lambda: fn(m))


# ---------------------------------------------------------------------------------------------
# Tier 1: one device, in process
# ---------------------------------------------------------------------------------------------


def _run_single(job: TrainJob, c: TrainerConfig) -> TrainerHandle:
    handle = TrainerHandle(1)

    def body() -> None:
        try:
            state = _train_single(job, c, handle)
        except BaseException as exc:  # noqa: BLE001 - delivered to join()
            handle._finish(None, exc)
        else:
            handle._finish(state, None)

    thread = threading.Thread(target=body, name="flodl-single", daemon=True)
    thread.start()
    handle._joiner = lambda: thread.join()
    return handle


def _train_single(job: TrainJob, c: TrainerConfig, handle: TrainerHandle) -> TrainedState:
    monitor = _monitor(c, 1, None, handle, run_info={"tier": "single"})

    def on_metrics(m: EpochMetrics) -> None:
        if monitor is not None:
            monitor.epoch(m)
        handle._push(m)

    try:
        return LocalRun(job, _local_schedule(c), on_metrics=on_metrics).run()
    finally:
        if monitor is not None:
            monitor.close()


def _monitor(
    c: TrainerConfig,
    world: int,
    hosts: tuple[str, ...] | None,
    handle: TrainerHandle,
    *,
    run_info: dict[str, Any],
) -> MonitorSession | None:
    """The run's monitoring session, or None when nothing observes the run."""
    progress = c.progress if c.progress is not None else sys.stdout.isatty()
    wanted = (
        c.record_log is not None
        or c.dashboard is not None
        or c.save_dashboard is not None
        or progress
        or world > 1  # alerts are always printed
    )
    if not wanted:
        return None
    session = MonitorSession(
        world_size=world,
        total_epochs=c.num_epochs * c.epoch_splits,
        batch_size=c.batch_size,
        hosts=hosts,
        record_dir=c.record_log,
        max_bytes=c.record_log_max_bytes,
        dashboard_port=c.dashboard,
        save_dashboard=c.save_dashboard,
        theme=c.dashboard_theme,
        progress=progress,
        sub_epoch_reports=c.reports_per_epoch is not None and world > 1,
        scalar_reductions={k: str(v) for k, v in c.scalar_reductions.items()},
        run_info={
            "mode": c.elche.mode,
            "batch_size": c.batch_size,
            "num_epochs": c.num_epochs,
            "dataset_len": len(c.dataset),
            **run_info,
        },
    )
    if session.url is not None:
        handle.dashboard_url = session.url
        print(f"flodl dashboard: {session.url}", flush=True)  # noqa: T201
    return session


# ---------------------------------------------------------------------------------------------
# Tier 4 (and the children of tier 2): this process is a rank
# ---------------------------------------------------------------------------------------------


def _env(name: str) -> str:
    value = os.environ.get(name)
    if value is None or value == "":
        raise ConfigError(f"this process is a rank but {name} is missing from the environment")
    return value


def _read_secret() -> bytes:
    if os.environ.get("FLODL_SECRET_STDIN") == "1":  # a rank started over ssh
        from flodl.launch.ssh import read_secret_from_stdin

        return read_secret_from_stdin()
    if os.environ.get(ENV_SECRET):
        try:
            return bytes.fromhex(os.environ[ENV_SECRET])
        except ValueError:
            raise ConfigError(f"{ENV_SECRET} must be hex") from None
    path = os.environ.get(ENV_SECRET_FILE)
    if not path:
        raise ConfigError(f"set {ENV_SECRET_FILE} (or {ENV_SECRET}) to the run secret")
    try:
        return bytes.fromhex(Path(path).read_text().strip())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read the run secret from {path}: {exc}") from None


# (rank, world size) variables of the launchers flodl rides, in precedence order.
_RANK_SOURCES = (
    (ENV_RANK, ENV_WORLD),  # flodl's own launcher, or set by hand
    ("RANK", "WORLD_SIZE"),  # torchrun
    ("SLURM_PROCID", "SLURM_NTASKS"),  # srun
)


def rank_env() -> tuple[int, int] | None:
    """``(rank, world_size)`` when this process is a rank, else None.

    A rank is a process with ``FLODL_RANK`` set, or one started by torchrun (``RANK``) or SLURM
    (``SLURM_PROCID``) that was told where the coordinator is (``FLODL_COORD``).

    Raises:
        ConfigError: the variables are present but malformed or out of range.
    """
    for rank_var, world_var in _RANK_SOURCES:
        raw = os.environ.get(rank_var)
        if raw is None or (rank_var != ENV_RANK and not os.environ.get(ENV_COORD)):
            continue
        world_raw = os.environ.get(ENV_WORLD) or os.environ.get(world_var)
        if world_raw is None:
            raise ConfigError(f"{rank_var} is set but neither {ENV_WORLD} nor {world_var} is")
        try:
            rank, world = int(raw), int(world_raw)
        except ValueError:
            raise ConfigError(
                f"{rank_var}={raw!r} and the world size {world_raw!r} must be integers"
            ) from None
        if not 0 <= rank < world:
            raise ConfigError(f"{rank_var}={rank} is out of range for world size {world}")
        return rank, world
    return None


def _rank_spec(c: TrainerConfig) -> RankSpec:
    """This rank's addresses and its side of the timeout hierarchy, all derived from one knob:
    ``hb = heartbeat_timeout × FLODL_NET_TIMEOUT_SCALE`` (docs/reliability.md)."""
    found = rank_env()
    assert found is not None
    rank, world = found
    host, _, port = _env(ENV_COORD).rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"{ENV_COORD} must be host:port, got {os.environ[ENV_COORD]!r}")
    hb = c.heartbeat_timeout * timeout_scale()
    threads = os.environ.get(ENV_THREADS)
    return RankSpec(
        coord_host=host.strip("[]"),
        coord_port=int(port),
        secret=_read_secret(),
        run_id=os.environ.get(ENV_RUN_ID, "run"),
        rank=rank,
        world_size=world,
        device=os.environ.get(ENV_DEVICE, "cpu"),
        liveness_timeout_s=hb,
        collective_timeout_s=hb * 2.0 / 3.0,  # below liveness: no rank hangs in a collective
        hard_exit_grace_s=max(2.0, hb / 3.0),
        stem=os.environ.get(ENV_STEM) or None,
        threads=int(threads) if threads else None,
        connect_timeout_s=hb,
    )


def _run_as_rank(job: TrainJob, c: TrainerConfig) -> TrainerHandle:
    spec = _rank_spec(c)
    launched = os.environ.get(ENV_LAUNCHED) == "1"
    try:
        state = run_rank(spec, job)
    except BaseException:
        if launched:
            # the launcher's user reads this child's stderr: say which rank died and why
            print(f"flodl: rank {spec.rank} failed:", file=sys.stderr)  # noqa: T201
            traceback.print_exc()
            _exit_launched_rank(None, spec.rank)
        raise
    if launched:
        _exit_launched_rank(state, spec.rank)
    handle = TrainerHandle(spec.world_size, is_primary=spec.rank == 0)
    handle._finish(state, None)
    return handle


def _exit_launched_rank(state: TrainedState | None, rank: int) -> None:
    """End a launcher-spawned rank process: its final state goes to the launcher (exit 0), or
    nothing does (exit 1). Code after ``join()``/``finish()`` runs once: in the launcher."""
    code = 1
    if state is not None:
        code = 0
        final_dir = os.environ.get(ENV_FINAL_DIR)
        if final_dir:
            try:
                _save_state(state, Path(final_dir) / f"final.rank{rank}.pt")
            except OSError:
                traceback.print_exc()
                code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _save_state(state: TrainedState, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save(
        {"params": state.params, "buffers": state.buffers, "save_reason": state.save_reason}, tmp
    )
    os.replace(tmp, path)


# ---------------------------------------------------------------------------------------------
# Tier 2: N local ranks (the launcher)
# ---------------------------------------------------------------------------------------------


@dataclass
class _HandleSink:
    handle: TrainerHandle
    metrics_fn: Callable[[EpochMetrics], None] | None
    bundles: BundleWriter
    eval_result_fn: Callable[[int, float], None] | None = None
    monitor: MonitorSession | None = None
    _epoch_extra: dict[str, Any] | None = None

    def write_meta(self, effect: WriteMeta) -> None:
        self.bundles.write_meta(effect)

    def bundle_requested(self, effect: BundleRequested) -> None:
        self.bundles.bundle_requested(effect)

    def record(self, effect: Record) -> None:
        if effect.kind == "epoch":  # merged into the epoch's records by epoch_done
            self._epoch_extra = dict(effect.data)
            return
        if self.monitor is not None:
            self.monitor.record(effect.path, effect.kind, effect.data)

    def alert(self, effect: Alert) -> None:
        if self.monitor is not None:
            self.monitor.alert(effect.cls, effect.path, effect.detail, effect.severity)
        else:
            print(f"flodl [{effect.cls}] {effect.path}: {effect.detail}", flush=True)  # noqa: T201

    def epoch_done(self, effect: EpochDone) -> None:
        extra, self._epoch_extra = self._epoch_extra or {}, None
        extra.pop("epoch", None)
        extra.pop("avg_loss", None)
        if self.monitor is not None:
            self.monitor.epoch(effect.metrics, extra)
        _safe_metrics(self.metrics_fn, effect.metrics)
        self.handle._push(effect.metrics)

    def eval_done(self, effect: EvalDone) -> None:
        fn = self.eval_result_fn
        if fn is not None:
            timed_callback("eval_result_fn", lambda: fn(effect.epoch, effect.metric))


def _child_argv() -> list[str]:
    """Re-execute the user's own entry point (script or ``-m module``, same argv)."""
    orig = list(getattr(sys, "orig_argv", []))
    if len(orig) >= 2:
        return [sys.executable, *orig[1:]]
    return [sys.executable, *sys.argv]


def _record_hosts(cluster: Cluster) -> tuple[str, ...]:
    """Each rank's host name as a record-tree path segment (``[A-Za-z0-9._-]``, ≤ 64)."""
    names = []
    for slot in cluster.ranks():
        host = cluster.workers[slot.worker_index].host
        names.append(re.sub(r"[^A-Za-z0-9._-]", "_", host)[:64].strip(".") or "host")
    return tuple(names)


def _launch(job: TrainJob, c: TrainerConfig, cluster: Cluster) -> TrainerHandle:
    from flodl.coord.service import BundleWriter, CoordinatorService, resume_from_bundle

    world = cluster.world_size
    local_names = local_host_names()
    all_local = cluster.is_local(local_names)
    bind_host = "127.0.0.1" if all_local else cluster.controller.host
    bind_port = 0 if all_local else cluster.controller.port
    scale = timeout_scale()
    coord_cfg = validated(
        CoordConfig,
        world_size=world,
        dataset_len=len(job.dataset),
        batch_size=c.batch_size,
        num_epochs=c.num_epochs,
        augment=c.augment,
        epoch_splits=c.epoch_splits,
        seed=c.seed,
        elche=c.elche,
        heartbeat_timeout_s=c.heartbeat_timeout * scale,
        join_timeout_s=10.0 * c.heartbeat_timeout * scale,
        stall_floor_s=300.0 * scale,
        max_failure=c.max_failure,
        run_id=f"run-{secrets.token_hex(4)}",
        epoch_callback_policy=c.epoch_callback_policy,
        has_epoch_fn=c.epoch_fn is not None,
        has_checkpoint_fn=c.checkpoint_fn is not None,
        checkpoint_every=c.checkpoint_every,
        checkpoint_at_epoch=c.checkpoint_at_epoch,
        has_eval=c.eval_fn is not None,
        eval_every=c.eval_every,
        save_bundles=job.save_path is not None,
        hosts=_record_hosts(cluster),
        reports_per_epoch=c.reports_per_epoch,
        scalar_reductions=c.scalar_reductions,
    )
    resume, outer_state = (
        resume_from_bundle(job.resume_from, coord_cfg) if job.resume_from else (None, None)
    )
    secret = secrets.token_bytes(32)
    handle = TrainerHandle(world)
    bundles = BundleWriter(job.save_path)
    monitor = _monitor(
        c,
        world,
        coord_cfg.hosts,
        handle,
        run_info={"run_id": coord_cfg.run_id, "hosts": sorted(set(coord_cfg.hosts or ()))},
    )
    sink = _HandleSink(handle, c.metrics_fn, bundles, c.eval_result_fn, monitor)
    run_dir = Path(tempfile.mkdtemp(prefix="flodl-"))
    ready: queue.SimpleQueue[int | BaseException] = queue.SimpleQueue()
    over_box: list[RunOver] = []
    loop_box: list[asyncio.AbstractEventLoop] = []
    stop = threading.Event()
    service = CoordinatorService(
        coord_cfg,
        secret,
        host=bind_host,
        port=bind_port,
        sink=sink,
        resume=resume,
        outer=c.outer_optimizer,
        outer_state=outer_state,
    )
    bundles.service = service

    async def serve() -> None:
        loop_box.append(asyncio.get_running_loop())
        try:
            port = await service.start()
        except BaseException as exc:
            ready.put(exc)
            raise
        ready.put(port)
        try:
            over_box.append(await service.wait())
        finally:
            await service.close()

    def service_main() -> None:
        try:
            import uvloop

            uvloop.run(serve())
        except BaseException:
            logger.exception("coordinator service failed")
        finally:
            stop.set()

    service_thread = threading.Thread(target=service_main, name="flodl-coord", daemon=True)
    service_thread.start()
    got = ready.get(timeout=60)
    if isinstance(got, BaseException):
        raise FlodlError(f"the coordinator failed to start: {got}") from got
    port = got
    if not all_local:
        # printed as well as logged: it must be seen even where logging is not configured
        warning = (
            f"coordinator listening on {bind_host}:{port} for ranks on other hosts: traffic is "
            "authenticated (HMAC) but not encrypted; tunnel it across untrusted networks"
        )
        logger.warning("%s", warning)
        print(f"flodl: warning: {warning}", file=sys.stderr, flush=True)  # noqa: T201
    slots = cluster.ranks()
    per_worker = {
        i: sum(1 for s in slots if s.worker_index == i) for i in range(len(cluster.workers))
    }
    cores = os.cpu_count() or 1
    prefix = os.environ.get(ENV_PREFIX_OUTPUT) == "1"
    flodl_env = {
        ENV_COORD: f"{bind_host}:{port}",
        ENV_WORLD: str(world),
        ENV_RUN_ID: coord_cfg.run_id,
        ENV_LAUNCHED: "1",
        ENV_FINAL_DIR: str(run_dir),
        ENV_STEM: job.save_path or str(run_dir / "run"),
    }
    if c.record_log is not None:  # rank-side records (chaos faults) go to the same tree
        flodl_env[RECORD_DIR_ENV] = c.record_log
    if c.chaos is not None:
        flodl_env[CHAOS_ENV] = c.chaos.to_env()
    inherited = {k: v for k, v in os.environ.items() if k != CLUSTER_ENV_VAR}
    procs: list[subprocess.Popen[bytes]] = []
    pumps: list[threading.Thread] = []
    for slot in slots:
        worker = cluster.workers[slot.worker_index]
        threads = max(1, cores // per_worker[slot.worker_index]) if slot.device == "cpu" else 1
        rank_env = {
            **cluster.worker_env(slot.worker_index),
            **flodl_env,
            ENV_RANK: str(slot.rank),
            ENV_DEVICE: slot.device,
            ENV_THREADS: str(threads),
        }
        pipe = subprocess.PIPE if prefix else None
        if worker.is_local(local_names):
            env = {**inherited, **rank_env, ENV_SECRET: secret.hex()}
            proc = subprocess.Popen(_child_argv(), env=env, stdout=pipe, stderr=pipe)
        else:
            from flodl.launch.ssh import spawn_ssh

            proc = spawn_ssh(worker, _child_argv(), rank_env, secret, stdout=pipe, stderr=pipe)
        procs.append(proc)
        if prefix:
            for stream, sink_file in ((proc.stdout, sys.stdout), (proc.stderr, sys.stderr)):
                pump = threading.Thread(
                    target=_pump, args=(stream, sink_file, f"[rank {slot.rank}] "), daemon=True
                )
                pump.start()
                pumps.append(pump)

    def kill_all() -> None:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        deadline = time.perf_counter() + 5.0
        for p in procs:
            try:
                p.wait(timeout=max(0.0, deadline - time.perf_counter()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    atexit.register(kill_all)
    if threading.current_thread() is threading.main_thread():
        # SIGTERM would end the launcher without atexit hooks and orphan the ranks: stop them
        # first, then exit as a SIGTERM'd process would.
        previous = signal.getsignal(signal.SIGTERM)

        def on_sigterm(signum: int, frame: Any) -> None:
            kill_all()
            if callable(previous):
                previous(signum, frame)
            raise SystemExit(128 + signum)

        signal.signal(signal.SIGTERM, on_sigterm)

    def watch(rank: int, proc: subprocess.Popen[bytes]) -> None:
        code = proc.wait()
        service.child_exited_threadsafe(rank, code)

    watchers = [
        threading.Thread(target=watch, args=(r, p), name=f"flodl-watch-{r}", daemon=True)
        for r, p in enumerate(procs)
    ]
    for t in watchers:
        t.start()

    def finish() -> None:
        error: BaseException | None = None
        state: TrainedState | None = None
        try:
            stop.wait()
            for t in watchers:
                t.join(timeout=30.0 * scale + 10.0)
            kill_all()
            for pump in pumps:
                pump.join(timeout=5.0)
            over = over_box[0] if over_box else None
            codes = [p.returncode for p in procs]
            state = _load_final(run_dir, codes)
            if over is None:
                error = FlodlError("the coordinator stopped without ending the run")
            elif not over.ok and over.save_reason is None:
                error = FlodlError(f"run failed: {over.reason} (rank exit codes {codes})")
            elif state is None:
                error = FlodlError(f"no rank delivered a final state (exit codes {codes})")
            elif over.save_reason is not None:
                state.save_reason = over.save_reason
        except BaseException as exc:  # noqa: BLE001 - delivered to join()
            error = exc
        finally:
            atexit.unregister(kill_all)
            if monitor is not None:
                monitor.close()  # the service stopped: every record is in; archive, stop
            shutil.rmtree(run_dir, ignore_errors=True)
        handle._finish(state, error)

    finisher = threading.Thread(target=finish, name="flodl-finish", daemon=True)
    finisher.start()

    def join_all() -> None:
        try:
            finisher.join()
        except KeyboardInterrupt:
            for p in procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGINT)
            kill_all()
            if loop_box and not loop_box[0].is_closed():
                loop_box[0].call_soon_threadsafe(_cancel_all, loop_box[0])
            raise

    handle._joiner = join_all
    return handle


def _pump(stream: Any, out: Any, prefix: str) -> None:
    """Copy a child's output line by line, each line prefixed with its rank."""
    try:
        for raw in iter(stream.readline, b""):
            out.write(prefix + raw.decode(errors="replace"))
            out.flush()
    finally:
        stream.close()


def _cancel_all(loop: asyncio.AbstractEventLoop) -> None:
    for task in asyncio.all_tasks(loop):
        task.cancel()


def _load_final(run_dir: Path, codes: list[int | None]) -> TrainedState | None:
    """The first delivered final state; ``replicas_agree`` says whether every rank that
    delivered one holds the same parameters (the consensus of the last reduce)."""
    states: list[TrainedState] = []
    for rank, code in enumerate(codes):
        path = run_dir / f"final.rank{rank}.pt"
        if code == 0 and path.exists():
            data: dict[str, Any] = torch.load(path, weights_only=True)
            states.append(
                TrainedState(list(data["params"]), list(data["buffers"]), data["save_reason"])
            )
    if not states:
        return None
    first = states[0]
    if len(states) > 1:
        first.replicas_agree = all(
            all(torch.equal(a, b) for a, b in zip(first.params, s.params, strict=True))
            for s in states[1:]
        )
    return first
