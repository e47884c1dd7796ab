"""Configuration shared by the trainer, the coordinator and the launcher.

Pure module: frozen pydantic models with the original flodl 0.7 defaults (docs/design.md §4).
Each default is written once, here. Invalid values raise :class:`~flodl.errors.ConfigError`
naming the field (see :func:`validated`).
"""

from __future__ import annotations

import math
import types
import typing
from enum import StrEnum
from typing import Annotated, Any, Literal, Self, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from flodl.errors import ConfigError
from flodl.modes import MODE_TRAITS, MODES, Backend, Mode, ModeTraits, Policy
from flodl.sampling import SHUFFLE_BASE_SEED
from flodl.timeouts import Timeouts

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
    "JobSpec",
    "OuterConfig",
    "validated",
    "IntsNotBools",
    "refuse_bool_int",
    "DEFAULT_BATCH_SIZE",
    "DEFAULT_MODE",
    "DEFAULT_ANCHOR",
    "DEFAULT_MAX_ANCHOR",
    "DEFAULT_OVERHEAD_TARGET",
]

DEFAULT_BATCH_SIZE = 32
DEFAULT_MODE: Mode = "nccl_cadence"
"""The mode of an ElChe config that names none (the original's default)."""
DEFAULT_ANCHOR = 10
"""ElChe's initial window, in batches of the slowest rank (the original's default)."""
DEFAULT_MAX_ANCHOR = 1000
"""The staleness cap on the anchor when none is configured."""
DEFAULT_OVERHEAD_TARGET = 0.05
"""The fixed-overhead fraction per window ElChe grows the window to reach."""


class Reduction(StrEnum):
    """How a user scalar combines across ranks and hosts (``scalar_reduction(name, …)``)."""

    SUM = "sum"
    MEAN = "mean"
    """Work-weighted mean (the default)."""
    MAX = "max"
    MIN = "min"


def _int_only(annotation: Any) -> bool:
    """Whether a field's annotation takes integers and no bool (``int``, ``int | None``,
    ``Annotated[int, …]``)."""
    args = typing.get_args(annotation) if typing.get_origin(annotation) is not None else ()
    if typing.get_origin(annotation) is Annotated:
        return _int_only(args[0])
    if args and typing.get_origin(annotation) in (typing.Union, types.UnionType):
        kinds = [_int_only(a) for a in args if a is not type(None)]
        return any(kinds) and bool not in args
    return annotation is int


_INT_FIELDS: dict[type[BaseModel], frozenset[str]] = {}


def refuse_bool_int(cls: type[BaseModel], value: Any, info: ValidationInfo) -> Any:
    """:class:`IntsNotBools`'s ``field_validator("*", mode="before")``: refuse a bool given for
    an integer field (pydantic's lax mode takes ``anchor: true`` as 1); returns ``value``.

    Raises:
        PydanticCustomError: a bool for an integer field (its location names the field).
    """
    if type(value) is not bool:
        return value
    fields = _INT_FIELDS.get(cls)
    if fields is None:
        fields = frozenset(n for n, f in cls.model_fields.items() if _int_only(f.annotation))
        _INT_FIELDS[cls] = fields
    if info.field_name in fields:
        raise PydanticCustomError(
            "int_not_bool", "must be an integer, got the bool {value}", {"value": str(value)}
        )
    return value


class IntsNotBools(BaseModel):
    """Base of every settings model: a bool given for an integer field is refused, naming the
    field (:func:`refuse_bool_int`)."""

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_ints(cls, value: Any, info: ValidationInfo) -> Any:
        return refuse_bool_int(cls, value, info)


class _Config(IntsNotBools):
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
    """ElChe cadence knobs (docs/design.md §4). Use the presets: :meth:`nccl_cadence` (the
    default), :meth:`nccl_sync`, :meth:`cpu_sync`, :meth:`cpu_cadence`, :meth:`cpu_async`; a
    preset's settings are its row of :data:`flodl.modes.MODE_TRAITS`."""

    mode: Mode = DEFAULT_MODE
    anchor: Annotated[int, Field(ge=1, le=1_000_000)] = DEFAULT_ANCHOR
    max_anchor: Annotated[int, Field(ge=1)] | None = None
    """Staleness cap on the anchor; ``None`` means :data:`DEFAULT_MAX_ANCHOR` (1000)."""
    min_anchor: Annotated[int, Field(ge=1)] | None = None
    """Floor for auto-tune shrink; ``None`` means the initial anchor."""
    overhead_target: Annotated[float, Field(ge=0.01, le=0.5)] | None = None
    """Target fixed-overhead fraction per window; ``None`` means :data:`DEFAULT_OVERHEAD_TARGET`
    (0.05)."""
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
        if self.easgd_alpha is not None and not self.traits.elastic_blend:
            raise ValueError("easgd_alpha applies only to cpu_async (overwrite modes need 1.0)")
        if self.max_overshoot is not None and not self.traits.overshoot:
            raise ValueError("max_overshoot applies only to cpu_async")
        if self.partition_ratios is not None and len(self.partition_ratios) == 0:
            raise ValueError("partition_ratios must not be empty")
        return self

    # presets ---------------------------------------------------------------------------------
    @classmethod
    def nccl_sync(cls, **overrides: Any) -> ElCheConfig:
        return cls.preset("nccl_sync", **overrides)

    @classmethod
    def nccl_cadence(cls, **overrides: Any) -> ElCheConfig:
        return cls.preset("nccl_cadence", **overrides)

    @classmethod
    def cpu_sync(cls, **overrides: Any) -> ElCheConfig:
        return cls.preset("cpu_sync", **overrides)

    @classmethod
    def cpu_cadence(cls, **overrides: Any) -> ElCheConfig:
        return cls.preset("cpu_cadence", **overrides)

    @classmethod
    def cpu_async(cls, **overrides: Any) -> ElCheConfig:
        return cls.preset("cpu_async", **overrides)

    @classmethod
    def preset(cls, mode: str, **overrides: Any) -> ElCheConfig:
        """The preset of ``mode`` by name (e.g. from a command line)."""
        traits = MODE_TRAITS.get(mode)  # type: ignore[call-overload]
        if traits is None:
            raise ConfigError(f"unknown mode {mode!r}: expected one of {', '.join(MODES)}")
        return validated(cls, **{"mode": mode, **traits.preset, **overrides})

    # derived ---------------------------------------------------------------------------------
    @property
    def traits(self) -> ModeTraits:
        """What this mode does (:data:`flodl.modes.MODE_TRAITS`)."""
        return MODE_TRAITS[self.mode]

    @property
    def policy(self) -> Policy:
        return self.traits.policy

    @property
    def backend(self) -> Backend:
        return self.traits.backend

    @property
    def effective_max_anchor(self) -> int:
        return DEFAULT_MAX_ANCHOR if self.max_anchor is None else self.max_anchor

    @property
    def effective_min_anchor(self) -> int:
        return self.anchor if self.min_anchor is None else self.min_anchor

    @property
    def effective_overhead_target(self) -> float:
        return DEFAULT_OVERHEAD_TARGET if self.overhead_target is None else self.overhead_target

    @property
    def barrier_paced(self) -> bool:
        """Sync and Cadence never hand a rank a step across a reduce or epoch barrier."""
        return self.traits.barrier_paced


class EpochCallbackPolicy:
    """Which rank runs ``epoch_fn``, eval and ``checkpoint_fn`` (docs/design.md §2).

    ``EpochCallbackPolicy.Fastest`` (default): the live rank with the lowest smoothed ms/batch,
    elected at the first calibration and re-elected only when it dies.
    ``EpochCallbackPolicy.Rank(n)``: pinned to global rank ``n`` (checked against the world
    size at ``run()``); while ``n`` is dead or has not joined yet, every callback runs on the
    survivor ``Fastest`` would pick (a ``callback_roles_moved`` alert says so), and goes back
    to ``n`` once it has rejoined and holds the consensus.
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


class OuterConfig(_Config):
    """An outer optimizer's settings (use :class:`~flodl.outer.OuterAvg`,
    :class:`~flodl.outer.SlowMomentum` or :class:`~flodl.outer.NesterovMomentum`)."""

    kind: Literal["avg", "slow_momentum", "nesterov"] = "avg"
    lr: Annotated[float, Field(gt=0.0, le=10.0, allow_inf_nan=False)] = 1.0
    mu: Annotated[float, Field(ge=0.0, lt=1.0, allow_inf_nan=False)] = 0.0

    @property
    def is_identity(self) -> bool:
        return self.kind == "avg"

    @property
    def resets_inner(self) -> bool:
        """DiLoCo: the inner optimizer state is reset after every window."""
        return self.kind == "nesterov"


MAX_STEM_CHARS = 4096
"""The longest bundle stem a job description carries."""
MAX_SCALARS = 256
"""Most user scalars (``record_scalar`` names): declared reductions, or in one metrics frame."""


class _JobFields(_Config):
    """The fields a rank's own ``TrainerConfig`` decides, shared by :class:`JobSpec` (what a
    rank's hello describes) and :class:`CoordConfig` (what the coordinator runs)."""

    dataset_len: Annotated[int, Field(ge=1)]
    batch_size: Annotated[int, Field(ge=1)] = DEFAULT_BATCH_SIZE
    num_epochs: Annotated[int, Field(ge=1)] = 1
    augment: Annotated[int, Field(ge=1)] = 1
    epoch_splits: Annotated[int, Field(ge=1)] = 1
    seed: int = SHUFFLE_BASE_SEED
    elche: ElCheConfig = Field(default_factory=ElCheConfig)
    max_failure: MaxFailure | None = None
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
    scalar_reductions: dict[str, Reduction] = Field(default_factory=dict, max_length=MAX_SCALARS)
    """User scalar name → how it combines across ranks (default ``mean``)."""


class JobSpec(_JobFields):
    """What the ranks train: the part of a run's configuration that each rank's own
    ``TrainerConfig`` decides. Every rank sends it in its ``hello``; the first rank's defines
    the job of a standalone coordinator and every later rank must bring the same
    (docs/design.md §2c, "The ranks bring the job")."""

    outer: OuterConfig = Field(default_factory=OuterConfig)
    save_path: Annotated[str, Field(max_length=MAX_STEM_CHARS)] | None = None
    """The ranks' bundle stem, as they wrote it: where a standalone coordinator with no
    ``--save-path`` of its own writes the meta (a relative stem is read relative to the
    coordinator's working directory)."""
    resume_from: Annotated[str, Field(max_length=MAX_STEM_CHARS)] | None = None
    """The stem the ranks resume from, which such a coordinator reads."""

    def value(self, path: str) -> Any:
        """The value at a dotted field path (``"elche.mode"``)."""
        value: Any = self
        for name in path.split("."):
            value = getattr(value, name)
        return value

    def difference(self, other: JobSpec) -> tuple[str, Any, Any] | None:
        """The first field where ``other`` differs, as ``(dotted path, self's, other's)``, or
        None when both describe the same job."""
        return _difference(self, other, "")


def _difference(a: BaseModel, b: BaseModel, prefix: str) -> tuple[str, Any, Any] | None:
    for name in type(a).model_fields:
        x, y = getattr(a, name), getattr(b, name)
        if isinstance(x, BaseModel) and isinstance(y, BaseModel) and type(x) is type(y):
            found = _difference(x, y, f"{prefix}{name}.")
            if found is not None:
                return found
        elif x != y:
            return f"{prefix}{name}", x, y
    return None


class CoordConfig(_JobFields):
    """Everything the pure coordinator needs to run one job: the job's fields, and what only
    the coordinator decides."""

    world_size: Annotated[int, Field(ge=1, le=65_536)]
    """The run's ranks: every rank id is below it (with ``min_world_size``, the most ranks
    the run admits)."""
    min_world_size: Annotated[int, Field(ge=1, le=65_536)] | None = None
    """Training starts once this many ranks joined; the others may join while it trains
    (docs/design.md §2, "Late joins"). ``None``: ``world_size`` (every rank forms the run)."""
    timeouts: Timeouts = Field(default_factory=Timeouts)
    """Every deadline of the run, derived from the scaled heartbeat timeout."""
    progressive_dispatch: bool | None = None
    """``None``: automatic (Cadence/Async progressive, Sync whole-epoch partitions)."""
    run_id: str = "run"
    hosts: tuple[str, ...] | None = None
    """Host name per rank (for the record tree root → host → rank); ``None``: one host."""

    @model_validator(mode="after")
    def _check(self) -> Self:
        w = self.world_size
        if self.min_world_size is not None and self.min_world_size > w:
            raise ValueError(
                f"min_world_size {self.min_world_size} is above the maximum world size {w}"
            )
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

    @classmethod
    def for_job(
        cls,
        job: JobSpec,
        *,
        world_size: int,
        run_id: str,
        timeouts: Timeouts,
        min_world_size: int | None = None,
        hosts: tuple[str, ...] | None = None,
    ) -> CoordConfig:
        """The coordinator's configuration of ``job`` on ``world_size`` ranks: the one place
        a job description becomes a run (the launcher and ``flodl coord`` both call it).

        Raises:
            ConfigError: the combination is invalid (the message names the field).
        """
        fields = {n: getattr(job, n) for n in _JobFields.model_fields}
        return validated(
            cls,
            **fields,
            world_size=world_size,
            min_world_size=min_world_size,
            run_id=run_id,
            timeouts=timeouts,
            hosts=hosts,
        )

    def job_spec(self) -> JobSpec:
        """This run's job as a rank describes it (plain averaging, no bundle stems)."""
        return JobSpec(**{n: getattr(self, n) for n in _JobFields.model_fields})

    @property
    def index_space(self) -> int:
        return self.dataset_len * self.augment

    @property
    def forming_size(self) -> int:
        """How many ranks must join before training starts."""
        return self.world_size if self.min_world_size is None else self.min_world_size

    @property
    def total_epochs(self) -> int:
        """Epochs the run executes (``num_epochs × epoch_splits``)."""
        return self.num_epochs * self.epoch_splits

    @property
    def progressive(self) -> bool:
        if self.progressive_dispatch is not None:
            return self.progressive_dispatch
        return self.elche.traits.progressive

    @property
    def heartbeat_timeout_s(self) -> float:
        """The liveness timeout (scaled)."""
        return self.timeouts.heartbeat_s

    @property
    def join_timeout_s(self) -> float:
        """Cohort formation deadline: ``10 × heartbeat timeout``."""
        return self.timeouts.join_s

    @property
    def stall_ceiling_s(self) -> float:
        """Hard ceiling of a pending averaging cycle: ``max(10 × heartbeat timeout, 300 s)``
        (the floor scaled like every network deadline)."""
        return self.timeouts.stall_ceiling_s

    @property
    def effective_eval_every(self) -> int | None:
        if not self.has_eval:
            return None
        return 1 if self.eval_every is None else self.eval_every
