"""Configuration shared by the trainer, the coordinator and the launcher.

Pure module: frozen pydantic models with the original flodl 0.7 defaults
(flodl-spec.md §2.1, §11). Invalid values raise :class:`~flodl.errors.ConfigError` naming the
field (see :func:`validated`).
"""

from __future__ import annotations

import math
from enum import StrEnum
from typing import Annotated, Any, Literal, Self, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from flodl.errors import ConfigError

__all__ = [
    "Mode",
    "Policy",
    "Backend",
    "Reduction",
    "MODES",
    "ElCheConfig",
    "MaxFailure",
    "EpochCallbackPolicy",
    "CoordConfig",
    "validated",
    "DEFAULT_HEARTBEAT_TIMEOUT_S",
    "COORD_HEARTBEAT_INTERVAL_S",
]

Mode = Literal["nccl_sync", "nccl_cadence", "cpu_sync", "cpu_cadence", "cpu_async"]
Policy = Literal["sync", "cadence", "async"]
Backend = Literal["collective", "cpu"]


class Reduction(StrEnum):
    """How a user scalar combines across ranks and hosts (``scalar_reduction(name, …)``)."""

    SUM = "sum"
    MEAN = "mean"
    """Work-weighted mean (the default)."""
    MAX = "max"
    MIN = "min"


MODES: tuple[Mode, ...] = ("nccl_sync", "nccl_cadence", "cpu_sync", "cpu_cadence", "cpu_async")

DEFAULT_HEARTBEAT_TIMEOUT_S = 30.0
COORD_HEARTBEAT_INTERVAL_S = 1.0
"""Coordinator → rank heartbeat cadence (never scaled, as the original)."""

_POLICY: dict[str, Policy] = {
    "nccl_sync": "sync",
    "nccl_cadence": "cadence",
    "cpu_sync": "sync",
    "cpu_cadence": "cadence",
    "cpu_async": "async",
}


class _Config(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True)


_T = TypeVar("_T", bound=BaseModel)


def validated(cls: type[_T], **values: Any) -> _T:
    """Build ``cls(**values)``, turning a pydantic error into a :class:`ConfigError` that names
    the offending field(s)."""
    try:
        return cls(**values)
    except ValidationError as exc:
        parts = []
        for err in exc.errors():
            loc = ".".join(str(p) for p in err["loc"]) or cls.__name__
            parts.append(f"{loc}: {err['msg']}")
        raise ConfigError(f"invalid {cls.__name__}: " + "; ".join(parts)) from None


class ElCheConfig(_Config):
    """ElChe cadence knobs (flodl-spec.md §11). Use the presets: :meth:`nccl_cadence` (the
    default), :meth:`nccl_sync`, :meth:`cpu_sync`, :meth:`cpu_cadence`, :meth:`cpu_async`."""

    mode: Mode = "nccl_cadence"
    anchor: Annotated[int, Field(ge=1, le=1_000_000)] = 10
    max_anchor: Annotated[int, Field(ge=1)] | None = None
    """Staleness cap on the anchor; ``None`` means 1000."""
    min_anchor: Annotated[int, Field(ge=1)] | None = None
    """Floor for auto-tune shrink; ``None`` means the initial anchor."""
    overhead_target: Annotated[float, Field(ge=0.01, le=0.5)] | None = None
    """Target fixed-overhead fraction per window; ``None`` means 0.05."""
    max_batch_diff: Annotated[int, Field(ge=0)] | None = None
    relax_up: bool = False
    partition_ratios: tuple[Annotated[float, Field(gt=0.0, allow_inf_nan=False)], ...] | None = None
    meta_controller: bool = True
    easgd_alpha: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    divergence_threshold: Annotated[float, Field(gt=0.0, allow_inf_nan=False)] | None = None
    no_divergence_guard: bool = False
    convergence_guard: Literal["trend", "msf", "none"] | None = None
    """Built-in guard by name; ``None`` applies the default precedence (TrendGuard)."""
    max_overshoot: Annotated[int, Field(ge=0)] | None = None
    gamma: Annotated[float, Field(ge=-4.0, le=4.0, allow_inf_nan=False)] = 1.0
    bf16_wire: bool = False

    @model_validator(mode="after")
    def _check(self) -> Self:
        if self.min_anchor is not None and self.min_anchor > self.effective_max_anchor:
            raise ValueError("min_anchor must not exceed max_anchor")
        if self.easgd_alpha is not None and self.policy != "async":
            raise ValueError("easgd_alpha applies only to cpu_async (overwrite modes need 1.0)")
        if self.max_overshoot is not None and self.policy != "async":
            raise ValueError("max_overshoot applies only to cpu_async")
        if self.partition_ratios is not None and len(self.partition_ratios) == 0:
            raise ValueError("partition_ratios must not be empty")
        return self

    # presets ---------------------------------------------------------------------------------
    @classmethod
    def nccl_sync(cls, **overrides: Any) -> ElCheConfig:
        return validated(cls, **{"mode": "nccl_sync", "anchor": 1, **overrides})

    @classmethod
    def nccl_cadence(cls, **overrides: Any) -> ElCheConfig:
        return validated(cls, **{"mode": "nccl_cadence", **overrides})

    @classmethod
    def cpu_sync(cls, **overrides: Any) -> ElCheConfig:
        return validated(cls, **{"mode": "cpu_sync", "anchor": 1, **overrides})

    @classmethod
    def cpu_cadence(cls, **overrides: Any) -> ElCheConfig:
        return validated(cls, **{"mode": "cpu_cadence", **overrides})

    @classmethod
    def cpu_async(cls, **overrides: Any) -> ElCheConfig:
        values = {"mode": "cpu_async", "easgd_alpha": 0.5, "overhead_target": 0.05}
        return validated(cls, **{**values, **overrides})

    @classmethod
    def preset(cls, mode: str, **overrides: Any) -> ElCheConfig:
        """The preset of ``mode`` by name (e.g. from a command line)."""
        if mode not in MODES:
            raise ConfigError(f"unknown mode {mode!r}: expected one of {', '.join(MODES)}")
        factory = getattr(cls, mode)
        result: ElCheConfig = factory(**overrides)
        return result

    # derived ---------------------------------------------------------------------------------
    @property
    def policy(self) -> Policy:
        return _POLICY[self.mode]

    @property
    def backend(self) -> Backend:
        return "cpu" if self.mode.startswith("cpu_") else "collective"

    @property
    def effective_max_anchor(self) -> int:
        return 1000 if self.max_anchor is None else self.max_anchor

    @property
    def effective_min_anchor(self) -> int:
        return self.anchor if self.min_anchor is None else self.min_anchor

    @property
    def effective_overhead_target(self) -> float:
        return 0.05 if self.overhead_target is None else self.overhead_target

    @property
    def barrier_paced(self) -> bool:
        """Sync and Cadence never hand a rank a step across a reduce or epoch barrier."""
        return self.policy != "async"


class EpochCallbackPolicy:
    """Which rank runs ``epoch_fn``, eval and ``checkpoint_fn`` (flodl-spec.md §6.7).

    ``EpochCallbackPolicy.Fastest`` (default): the live rank with the lowest smoothed ms/batch,
    elected at the first calibration and re-elected only when it dies.
    ``EpochCallbackPolicy.Rank(n)``: pinned to global rank ``n`` (checked against the world
    size at ``run()``); only the checkpoint role fails over while ``n`` is dead.
    """

    Fastest: Literal["fastest"] = "fastest"

    @staticmethod
    def Rank(n: int) -> int:
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ConfigError(f"EpochCallbackPolicy.Rank needs a rank >= 0, got {n!r}")
        return n


class MaxFailure(_Config):
    """How many rank deaths a run tolerates before ShutdownWithSave(``max_failure_exceeded``):
    ``absolute=n`` breaches at ``dead ≥ n``; ``percent=p`` at ``dead ≥ ceil(p · world_size)``."""

    absolute: Annotated[int, Field(ge=1)] | None = None
    percent: Annotated[float, Field(gt=0.0, le=1.0)] | None = None

    @model_validator(mode="after")
    def _one(self) -> Self:
        if (self.absolute is None) == (self.percent is None):
            raise ValueError("set exactly one of absolute or percent")
        return self

    def limit_for(self, world_size: int) -> int:
        if self.absolute is not None:
            return self.absolute
        assert self.percent is not None
        return max(1, math.ceil(self.percent * world_size - 1e-9))


class CoordConfig(_Config):
    """Everything the pure coordinator needs to run one job."""

    world_size: Annotated[int, Field(ge=1, le=65_536)]
    dataset_len: Annotated[int, Field(ge=1)]
    batch_size: Annotated[int, Field(ge=1)] = 32
    num_epochs: Annotated[int, Field(ge=1)] = 1
    augment: Annotated[int, Field(ge=1)] = 1
    epoch_splits: Annotated[int, Field(ge=1)] = 1
    seed: int = 42
    elche: ElCheConfig = Field(default_factory=ElCheConfig)
    heartbeat_timeout_s: Annotated[float, Field(gt=0.0, allow_inf_nan=False)] = (
        DEFAULT_HEARTBEAT_TIMEOUT_S
    )
    """Already scaled by ``FLODL_NET_TIMEOUT_SCALE`` where that applies."""
    join_timeout_s: Annotated[float, Field(gt=0.0, allow_inf_nan=False)] = 300.0
    stall_floor_s: Annotated[float, Field(gt=0.0, allow_inf_nan=False)] = 300.0
    """Floor of the reduce-stall ceiling (scaled like every network deadline)."""
    max_failure: MaxFailure | None = None
    progressive_dispatch: bool | None = None
    """``None``: automatic (Cadence/Async progressive, Sync whole-epoch partitions)."""
    epoch_callback_policy: Literal["fastest"] | Annotated[int, Field(ge=0)] = "fastest"
    has_epoch_fn: bool = False
    has_checkpoint_fn: bool = False
    checkpoint_every: Annotated[int, Field(ge=1)] | None = None
    checkpoint_at_epoch: Annotated[int, Field(ge=0)] | None = None
    has_eval: bool = False
    save_bundles: bool = False
    """A ``save_path`` is set: checkpoints, ShutdownWithSave and the end of the run write a
    bundle (model, optimizer states, meta)."""
    eval_every: Annotated[int, Field(ge=1)] | None = None
    reports_per_epoch: Annotated[int, Field(ge=1, le=1000)] | None = None
    scalar_reductions: dict[str, Reduction] = Field(default_factory=dict)
    """User scalar name → how it combines across ranks (default ``mean``)."""
    run_id: str = "run"
    hosts: tuple[str, ...] | None = None
    """Host name per rank (for the record tree root → host → rank); ``None``: one host."""

    @model_validator(mode="after")
    def _check(self) -> Self:
        w = self.world_size
        if isinstance(self.epoch_callback_policy, int) and self.epoch_callback_policy >= w:
            raise ValueError(
                f"epoch_callback_policy Rank({self.epoch_callback_policy}) is out of range for "
                f"world_size {w}"
            )
        ratios = self.elche.partition_ratios
        if ratios is not None and len(ratios) != w:
            raise ValueError(f"partition_ratios has {len(ratios)} entries for world_size {w}")
        if self.hosts is not None and len(self.hosts) != w:
            raise ValueError(f"hosts has {len(self.hosts)} entries for world_size {w}")
        if self.index_space // self.epoch_splits < self.batch_size:
            raise ValueError(
                f"an epoch has fewer samples ({self.index_space // self.epoch_splits}) than "
                f"one batch ({self.batch_size})"
            )
        return self

    @property
    def index_space(self) -> int:
        return self.dataset_len * self.augment

    @property
    def total_epochs(self) -> int:
        """Epochs the run executes (``num_epochs × epoch_splits``)."""
        return self.num_epochs * self.epoch_splits

    @property
    def progressive(self) -> bool:
        if self.progressive_dispatch is not None:
            return self.progressive_dispatch
        return self.elche.policy != "sync"

    @property
    def stall_ceiling_s(self) -> float:
        """Hard ceiling of a pending averaging cycle: ``max(10 × heartbeat timeout, 300 s)``."""
        return max(10.0 * self.heartbeat_timeout_s, self.stall_floor_s)

    @property
    def effective_eval_every(self) -> int | None:
        if not self.has_eval:
            return None
        return 1 if self.eval_every is None else self.eval_every
