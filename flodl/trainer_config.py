"""``TrainerConfig``: every knob of a run, and the one function that derives the coordinator's
configuration from it (docs/design.md §2c).

Each default is written once: the coordinator's in :mod:`flodl.config`, the deadlines in
:mod:`flodl.timeouts`, the shuffle seed in :mod:`flodl.sampling`.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from typing import Annotated, Any, Literal, Self

from pydantic import ConfigDict, Field, model_validator

from flodl.chaos import ChaosPlan
from flodl.config import (
    DEFAULT_BATCH_SIZE,
    CoordConfig,
    ElCheConfig,
    IntsNotBools,
    JobSpec,
    MaxFailure,
    OuterConfig,
    Reduction,
    validated,
)
from flodl.coord.metrics import REDUCTIONS
from flodl.launch.builder import ClusterBuilder
from flodl.launch.cluster import Cluster
from flodl.monitor.session import MonitorSession
from flodl.sampling import SHUFFLE_BASE_SEED
from flodl.timeouts import DEFAULT_HEARTBEAT_TIMEOUT_S, Timeouts
from flodl.wire.frames import EpochMetrics

__all__ = ["TrainerConfig", "job_spec", "coord_config", "monitor_session"]


class TrainerConfig(IntsNotBools):
    """Every knob of a run (the config-bag form of the builder). Validated at ``run()``."""

    model_config = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True)

    dataset: Any
    batch_size: Annotated[int, Field(ge=1)] = DEFAULT_BATCH_SIZE
    num_epochs: Annotated[int, Field(ge=1)] = 1
    elche: ElCheConfig = Field(default_factory=ElCheConfig)
    max_grad_norm: Annotated[float, Field(gt=0.0, allow_inf_nan=False)] | None = None
    scheduler_fn: Callable[[int], Callable[[int], float]] | None = None
    lr_scale_ratio: Annotated[float, Field(ge=0.0, allow_inf_nan=False)] = 1.0
    metrics_fn: Callable[[EpochMetrics], None] | None = None
    max_failure: MaxFailure | None = None
    respawn: Annotated[int, Field(ge=0, le=1000)] = 0
    """A launcher restarts a failed rank process up to this many times per rank (it rejoins;
    ``flodl launch --respawn N`` sets it for a cluster)."""
    heartbeat_timeout: Annotated[float, Field(gt=0.0, allow_inf_nan=False)] = (
        DEFAULT_HEARTBEAT_TIMEOUT_S
    )
    """Liveness timeout in seconds, before ``FLODL_NET_TIMEOUT_SCALE``: every other deadline of
    the run derives from it (:class:`~flodl.timeouts.Timeouts`)."""
    augment: Annotated[int, Field(ge=1)] = 1
    epoch_splits: Annotated[int, Field(ge=1)] = 1
    seed: int = SHUFFLE_BASE_SEED
    device: str = "auto"
    """``"auto"``: the GPUs ``nvidia-smi`` shows when torch is built with CUDA (two or more:
    one rank per GPU; one: that GPU, in process; with ``ranks``, one GPU per rank when there
    are enough, else the CPU), otherwise the CPU. ``"cpu"`` never uses a GPU; ``"cuda"``
    promotes like ``auto`` and shares the GPUs among more ``ranks`` than GPUs; ``"cuda:N"``
    is that GPU, in process."""
    ranks: Annotated[int, Field(ge=1, le=4096)] | None = None
    """Local ranks to launch on this host (``None``: one device, in process)."""
    local_devices: tuple[str | int, ...] | None = None
    """Local ranks, one per device (``cpu``, ``cuda:N`` or ``N``; CPU and GPU ranks may mix)."""
    cluster: Cluster | None = None
    """Hosts and devices to launch on (``ClusterBuilder`` / ``fdl.cluster.yml``)."""
    save_path: str | None = None
    """Bundle stem: checkpoints, ShutdownWithSave and the end of the run write
    ``<stem>.fdl``, ``<stem>.rank<N>.optim``, ``<stem>.meta.json`` (and ``<stem>.outer.fdl``);
    death records go to ``<stem>.rank<N>.death.json``."""
    resume_from: str | None = None
    """Bundle stem to resume from: any world size, but the same model, seed, batch size and
    epoch splits (docs/design.md §6, "Resume at another world size")."""
    checkpoint_every: Annotated[int, Field(ge=1)] | None = None
    """Save a bundle (and call ``checkpoint_fn``) after every n-th epoch."""
    checkpoint_at_epoch: Annotated[int, Field(ge=0)] | None = None
    """Save once, after this (0-based) epoch."""
    checkpoint_fn: Callable[[int, Any], None] | None = None
    """``checkpoint_fn(epoch, model)`` on the checkpoint role rank, with the consensus."""
    eval_dataset: Any = None
    eval_fn: Callable[[Any, Any], float] | None = None
    """``eval_fn(model, eval_dataset) -> metric`` on the eval role rank, with the consensus;
    after every ``eval_every``-th epoch (default every epoch) and always after the last one."""
    eval_result_fn: Callable[[int, float], None] | None = None
    """``eval_result_fn(epoch, metric)`` on the host, ``epoch`` 0-based as in ``EpochMetrics``;
    the final eval is the last epoch's (``num_epochs × epoch_splits − 1``)."""
    eval_every: Annotated[int, Field(ge=1)] | None = None
    epoch_fn: Callable[[int, Any], None] | None = None
    """``epoch_fn(epoch, model)`` on the epoch-callback role rank after each epoch."""
    epoch_callback_policy: Literal["fastest"] | Annotated[int, Field(ge=0)] = "fastest"
    """``EpochCallbackPolicy.Fastest`` (default) or ``EpochCallbackPolicy.Rank(n)``."""
    outer_optimizer: OuterConfig = Field(default_factory=OuterConfig)
    """``OuterAvg()`` (default), ``SlowMomentum(lr, mu)`` or ``NesterovMomentum(lr, mu)``."""
    reports_per_epoch: Annotated[int, Field(ge=1, le=1000)] | None = None
    """n sub-epoch node reports per epoch, one after each 1/n of its batches (off: one)."""
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
        if self.device not in ("auto", "cpu", "cuda") and not re.fullmatch(
            r"cuda:[0-9]+", self.device
        ):
            raise ValueError(
                f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {self.device!r}"
            )
        placed = [
            name
            for name, value in (
                ("ranks", self.ranks),
                ("local_devices", self.local_devices),
                ("cluster", self.cluster),
            )
            if value is not None
        ]
        if len(placed) > 1:
            raise ValueError(f"set one of ranks, local_devices and cluster, not {placed}")
        world: int | None = self.ranks or 1
        if self.local_devices is not None:
            world = ClusterBuilder.local_devices(self.local_devices).world_size
        elif self.cluster is not None:
            world = self.cluster.world_size if self.cluster.is_resolved else None
        if world is not None:
            self.check_world(world)
        if self.eval_fn is None and (self.eval_result_fn is not None or self.eval_every):
            raise ValueError("eval_result_fn / eval_every need an eval_fn")
        core = sorted(set(self.scalar_reductions) & set(REDUCTIONS))
        if core:
            raise ValueError(
                f"scalar_reduction: {core} are framework metrics with fixed reductions"
            )
        return self

    def check_world(self, world: int) -> None:
        """The settings that depend on the world size, once it is known (a cluster with
        ``devices: all`` knows it only once the launcher probed its hosts).

        Raises:
            ValueError: a setting does not fit ``world`` ranks.
        """
        ratios = self.elche.partition_ratios
        if ratios is not None and len(ratios) != world:
            raise ValueError(f"elche.partition_ratios has {len(ratios)} entries for {world} ranks")
        policy = self.epoch_callback_policy
        if isinstance(policy, int) and policy >= world:
            raise ValueError(
                f"epoch_callback_policy Rank({policy}) is out of range for {world} rank(s)"
            )


def job_spec(
    c: TrainerConfig, *, dataset_len: int, save_path: str | None, resume_from: str | None
) -> JobSpec:
    """What a rank of ``c`` trains, as its ``hello`` describes it (``save_path`` and
    ``resume_from`` are the normalized bundle stems).

    Raises:
        ConfigError: the combination is invalid (the message names the field).
    """
    return validated(
        JobSpec,
        dataset_len=dataset_len,
        batch_size=c.batch_size,
        num_epochs=c.num_epochs,
        augment=c.augment,
        epoch_splits=c.epoch_splits,
        seed=c.seed,
        elche=c.elche,
        max_failure=c.max_failure,
        epoch_callback_policy=c.epoch_callback_policy,
        has_epoch_fn=c.epoch_fn is not None,
        has_checkpoint_fn=c.checkpoint_fn is not None,
        checkpoint_every=c.checkpoint_every,
        checkpoint_at_epoch=c.checkpoint_at_epoch,
        has_eval=c.eval_fn is not None,
        eval_every=c.eval_every,
        save_bundles=save_path is not None,
        reports_per_epoch=c.reports_per_epoch,
        scalar_reductions=c.scalar_reductions,
        outer=c.outer_optimizer,
        save_path=save_path,
        resume_from=resume_from,
    )


def coord_config(
    job: JobSpec,
    c: TrainerConfig,
    *,
    world_size: int,
    run_id: str,
    scale: float,
    hosts: tuple[str, ...] | None = None,
) -> CoordConfig:
    """The coordinator's configuration of a run of ``job`` (from :func:`job_spec`) on
    ``world_size`` ranks, with ``c``'s deadlines.

    Raises:
        ConfigError: the combination is invalid (the message names the field).
    """
    return CoordConfig.for_job(
        job,
        world_size=world_size,
        run_id=run_id,
        timeouts=Timeouts.derive(c.heartbeat_timeout, scale),
        hosts=hosts,
    )


def monitor_session(
    c: TrainerConfig,
    world: int,
    hosts: tuple[str, ...] | None,
    *,
    run_info: dict[str, Any],
) -> MonitorSession | None:
    """The run's monitoring session, or None when nothing observes the run (one device, no
    records, no dashboard, no terminal). A started dashboard prints its address."""
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
        sub_epoch_reports=c.reports_per_epoch is not None,
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
        print(f"flodl dashboard: {session.url}", flush=True)  # noqa: T201
    return session
