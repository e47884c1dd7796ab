"""Cluster configuration: which hosts run ranks, on which devices, reached how.

Pure module (no processes, sockets, clocks or torch): frozen pydantic models (:class:`Cluster`,
:class:`Worker`, :class:`Controller`, :class:`SshSettings`), the rank slots, the user ``env``
rules and the validation-error messages, after the original (docs/design.md §2c). The fluent
:class:`~flodl.launch.builder.ClusterBuilder` and the ``fdl.cluster.yml`` reader
(:func:`~flodl.launch.cluster_file.load_cluster_yaml`,
:func:`~flodl.launch.cluster_file.parse_cluster_yaml`) build on these models: both apply the same
validation and produce equal :class:`Cluster` objects for the same content; every problem raises
:class:`~flodl.errors.ConfigError` naming the field path, e.g.
``fdl.cluster.yml: invalid cluster configuration: cluster.workers[1].devices[0]: ...``.

Rules:

* Ranks are never user-set (a ``ranks`` key is rejected): they are assigned sequentially by
  worker order, worker 0 owning ranks ``[0, N0)``, worker 1 the next ``N1``, and so on.
* Devices are ``cpu``, ``cuda:N`` or a bare CUDA index ``N`` (stored as ``cuda:N``), or the
  word ``all`` for every GPU of that host. ``all`` stays unresolved in the model until the
  launcher knows the host's GPU count (:meth:`Cluster.resolve_all`); rank assignment needs it
  resolved. CPU and CUDA devices may mix, and a GPU may be listed more than once (ranks that
  share it): the CPU averaging modes train any placement; which placements a collective mode
  refuses is :func:`flodl.placement.placement_problem`'s rule, applied by the launcher.
* ``nccl_socket_ifname`` is required on every worker with CUDA devices when CUDA ranks span
  hosts; the launcher exports it to that host's ranks as ``NCCL_SOCKET_IFNAME``.
* User ``env`` maps may not set what the launcher sets (:data:`RESERVED_ENV_KEYS`, any
  ``FLODL_INTERNAL_*`` key, the device visibility masks).
* Hosts are compared case-insensitively; ``localhost``, ``127.0.0.1`` and ``::1`` are one host
  (this machine). Which other names are this machine is the caller's knowledge (the launcher
  passes ``socket.gethostname()`` as ``local_names``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from collections.abc import Set as AbstractSet
from typing import Annotated, Any, Literal, NamedTuple, Self, get_args

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import ErrorDetails

from flodl.config import IntsNotBools
from flodl.errors import ConfigError
from flodl.placement import Placement, device_kind

__all__ = [
    "Cluster",
    "Worker",
    "Controller",
    "SshSettings",
    "RankSlot",
    "DeviceType",
    "CLUSTER_ENV_VAR",
    "NCCL_IFNAME_ENV",
    "DEFAULT_CONTROLLER_HOST",
    "DEFAULT_CONTROLLER_PORT",
    "DEFAULT_SSH_PORT",
    "LOOPBACK_NAMES",
    "RESERVED_ENV_PREFIX",
    "RESERVED_ENV_KEYS",
    "reserved_env_reason",
]

DeviceType = Literal["cpu", "cuda", "mixed"]

NCCL_IFNAME_ENV = "NCCL_SOCKET_IFNAME"
"""What a worker's ``nccl_socket_ifname`` is exported as to that host's ranks."""
CLUSTER_ENV_VAR = "FLODL_INTERNAL_FULL_CLUSTER_JSON"
"""The variable through which the launcher hands :meth:`Cluster.to_env_json` to children."""
DEFAULT_CONTROLLER_HOST = "127.0.0.1"
DEFAULT_CONTROLLER_PORT = 1337
DEFAULT_SSH_PORT = 22
LOOPBACK_NAMES: frozenset[str] = frozenset({"localhost", "127.0.0.1", "::1"})

RESERVED_ENV_PREFIX = "FLODL_INTERNAL_"
RESERVED_ENV_KEYS: frozenset[str] = frozenset(
    {
        "FLODL_RANK",
        "FLODL_WORLD_SIZE",
        "FLODL_COORD",
        "FLODL_SECRET",
        "FLODL_SECRET_FILE",
        "FLODL_SECRET_STDIN",
        "FLODL_RUN_ID",
    }
)
"""``FLODL_*`` variables the launcher sets for every rank child."""
_VISIBILITY_MASKS: frozenset[str] = frozenset(
    {"CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES"}
)

RANKS_REJECTED = "ranks are assigned by worker order; remove 'ranks'"
_CUDA_DEVICE = re.compile(r"(?:cuda:)?([0-9]+)")
_NULLABLE = frozenset({"controller", "workers"})
_THIS_MACHINE = "\x00this-machine"  # host identity shared by every name of this machine


class RankSlot(NamedTuple):
    """One rank of a resolved cluster: ``(rank, worker_index, device)``."""

    rank: int
    worker_index: int
    device: str


def reserved_env_reason(key: str) -> str | None:
    """Why a user ``env`` map may not set ``key``, or ``None`` when it may."""
    if key.startswith(RESERVED_ENV_PREFIX):
        return f"{key} is reserved: FLODL_INTERNAL_* variables belong to the launcher"
    if key in RESERVED_ENV_KEYS:
        return f"{key} is reserved: the launcher sets it for every rank"
    if key in _VISIBILITY_MASKS:
        return (
            f"{key} is reserved: each rank's device is one of its worker's devices (cuda:N "
            "counts the GPUs visible on that host), and a mask here would renumber them"
        )
    return None


class _FieldError(ValueError):
    """A validation problem at ``loc`` below the field (or model) being validated; the error
    formatter appends ``loc`` to pydantic's location so messages name the exact path."""

    def __init__(self, loc: tuple[str | int, ...], message: str) -> None:
        super().__init__(message)
        self.loc = loc
        self.message = message


# field types ----------------------------------------------------------------------------------


def _name(value: str) -> str:
    if not value:
        raise ValueError("must not be empty")
    if any(ch.isspace() or ch == "\x00" for ch in value):
        raise ValueError(f"{value!r} must not contain whitespace")
    if value.startswith("-"):
        raise ValueError(f"{value!r} must not start with '-' (ssh would read it as an option)")
    return value


def _text(value: str) -> str:
    if not value:
        raise ValueError("must not be empty")
    if "\x00" in value:
        raise ValueError("must not contain a NUL character")
    return value


_Name = Annotated[str, AfterValidator(_name)]
"""A host, user or interface name: non-empty, no whitespace, no leading ``-``."""
_Text = Annotated[str, AfterValidator(_text)]
_Port = Annotated[int, Field(strict=True, ge=0, le=65_535)]
_SshPort = Annotated[int, Field(strict=True, ge=1, le=65_535)]


def _normalize_device(index: int, raw: object) -> str:
    if isinstance(raw, int) and not isinstance(raw, bool) and raw >= 0:
        return f"cuda:{raw}"
    if isinstance(raw, str):
        if raw == "cpu":
            return raw
        match = _CUDA_DEVICE.fullmatch(raw)
        if match:
            return f"cuda:{int(match.group(1))}"
    raise _FieldError(
        (index,), f"{raw!r} is not a device: use 'cpu', 'cuda:N' or a CUDA index N (e.g. 0)"
    )


def _normalize_devices(value: Any) -> Any:
    if value == "all" and isinstance(value, str):
        return value
    if isinstance(value, str | bytes) or not isinstance(value, list | tuple):
        raise _FieldError(
            (), f"must be a list of devices (cpu, cuda:N or N) or 'all', got {kind_of(value)}"
        )
    if not value:
        raise _FieldError((), "must list at least one device (or be 'all')")
    return tuple(_normalize_device(index, raw) for index, raw in enumerate(value))


def _coerce_env(value: Any) -> Any:
    """YAML users write ``OMP_NUM_THREADS: 4``: numbers become strings (booleans do not, since
    ``true`` vs ``True`` would be a guess)."""
    if value is None:
        return {}
    if isinstance(value, Mapping):
        return {
            key: str(val) if isinstance(val, int | float) and not isinstance(val, bool) else val
            for key, val in value.items()
        }
    return value


def _check_env(env: dict[str, str]) -> dict[str, str]:
    for key, val in env.items():
        if not key or "=" in key or "\x00" in key:
            raise _FieldError((key,), f"{key!r} is not a valid environment variable name")
        if "\x00" in val:
            raise _FieldError((key,), "value must not contain a NUL character")
        reason = reserved_env_reason(key)
        if reason is not None:
            raise _FieldError((key,), reason)
    return env


EnvMap = Annotated[dict[str, str], BeforeValidator(_coerce_env), AfterValidator(_check_env)]
"""A user ``env`` map (worker or cluster level): numbers coerced to strings, then checked."""


def _host_identity(host: str, local_names: AbstractSet[str] = frozenset()) -> str:
    name = host.lower()
    if name in LOOPBACK_NAMES or name in {n.lower() for n in local_names}:
        return _THIS_MACHINE
    return name


# models ---------------------------------------------------------------------------------------


class _Model(IntsNotBools):
    model_config = ConfigDict(frozen=True, extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _reject_ranks(cls, data: Any) -> Any:
        if isinstance(data, Mapping) and "ranks" in data:
            raise _FieldError(("ranks",), RANKS_REJECTED)
        return data


class SshSettings(_Model):
    """How the launcher reaches a worker host with the system ``ssh``."""

    target: _Name | None = None
    """ssh destination (``host`` or ``user@host``); ``None``: the worker's ``host``."""
    port: _SshPort = DEFAULT_SSH_PORT
    user: _Name | None = None
    identity_file: _Text | None = None
    """Private key path as written (``~`` is expanded by the launcher, on its machine)."""
    options: tuple[_Text, ...] = ()
    """Extra ``ssh`` arguments, passed as given (e.g. ``["-o", "BatchMode=yes"]``)."""


class Worker(_Model):
    """One host and the devices it runs ranks on (YAML: one entry of ``workers:``)."""

    host: _Name
    """Identity of the host, and the default ssh target."""
    devices: tuple[str, ...] | Literal["all"]
    """``cpu`` / ``cuda:N`` per rank (several ``cpu`` entries = several CPU ranks), or ``all``.
    YAML also accepts the original's key ``local_devices``."""
    path: _Text | None = None
    """Working directory on this host (the checkout); ``None``: the launcher's."""
    ssh: SshSettings | None = None
    env: EnvMap = Field(default_factory=dict)
    """Extra environment for this host's rank children (over the cluster ``env``)."""
    nccl_socket_ifname: _Name | None = None
    """``NCCL_SOCKET_IFNAME`` for this host; required when CUDA ranks span hosts."""

    @model_validator(mode="before")
    @classmethod
    def _local_devices_alias(cls, data: Any) -> Any:
        if isinstance(data, Mapping) and "local_devices" in data:
            if "devices" in data:
                raise _FieldError(("local_devices",), "give devices or local_devices, not both")
            return {("devices" if k == "local_devices" else k): v for k, v in data.items()}
        return data

    @field_validator("devices", mode="before")
    @classmethod
    def _devices(cls, value: Any) -> Any:
        return _normalize_devices(value)

    @model_validator(mode="after")
    def _one_ifname(self) -> Self:
        given = self.env.get(NCCL_IFNAME_ENV)
        if self.nccl_socket_ifname is not None and given not in (None, self.nccl_socket_ifname):
            raise _FieldError(
                ("env", NCCL_IFNAME_ENV),
                f"contradicts nccl_socket_ifname {self.nccl_socket_ifname!r} (the launcher "
                f"exports that as {NCCL_IFNAME_ENV}); set one of them",
            )
        return self

    @property
    def is_resolved(self) -> bool:
        """Whether ``devices`` is a concrete list (not ``all``)."""
        return self.devices != "all"

    @property
    def device_type(self) -> DeviceType:
        """``cpu``, ``cuda`` (``all`` too) or ``mixed``."""
        if self.devices == "all":
            return "cuda"
        kinds = {device_kind(d) for d in self.devices}
        return "mixed" if len(kinds) > 1 else kinds.pop()

    @property
    def has_cuda(self) -> bool:
        return self.device_type != "cpu"

    @property
    def ssh_target(self) -> str:
        """What to hand ``ssh`` as the destination."""
        if self.ssh is not None and self.ssh.target is not None:
            return self.ssh.target
        return self.host

    def is_local(self, local_names: AbstractSet[str] = frozenset()) -> bool:
        """Whether this worker is this machine: a loopback name or one of ``local_names``
        (e.g. ``{socket.gethostname()}``), compared case-insensitively."""
        return _host_identity(self.host, local_names) == _THIS_MACHINE


class Controller(_Model):
    """Where the launcher binds its controller port (the rendezvous and control mux)."""

    host: _Name = DEFAULT_CONTROLLER_HOST
    """The address ranks dial; must reach this machine from every worker."""
    port: _Port = DEFAULT_CONTROLLER_PORT
    """TCP port; 0 lets the OS choose (single-host runs only)."""
    path: _Text | None = None
    """Working directory of the launcher; ``None``: its current directory."""


class Cluster(_Model):
    """A validated cluster: the controller, the workers in rank order, the cluster-wide env.

    Build one with :class:`ClusterBuilder`, :func:`load_cluster_yaml`,
    :func:`parse_cluster_yaml`, :meth:`from_mapping` or :meth:`from_env_json` (these raise
    :class:`~flodl.errors.ConfigError`; calling the constructor directly raises pydantic's
    ``ValidationError``).
    """

    controller: Controller = Field(default_factory=Controller)
    workers: tuple[Worker, ...] = ()
    env: EnvMap = Field(default_factory=dict)
    """Environment for every rank child (a worker's ``env`` overrides it)."""

    @model_validator(mode="before")
    @classmethod
    def _null_sections(cls, data: Any) -> Any:
        # ``controller:`` or ``workers:`` with nothing under it in YAML is null: the default.
        if isinstance(data, Mapping):
            return {k: v for k, v in data.items() if not (k in _NULLABLE and v is None)}
        return data

    @model_validator(mode="after")
    def _check(self) -> Self:
        workers = self.workers
        if not workers:
            raise _FieldError(
                ("workers",), "at least one worker is required (an entry with host and devices)"
            )
        seen: dict[str, int] = {}
        for index, worker in enumerate(workers):
            identity = _host_identity(worker.host)
            if identity in seen:
                first = seen[identity]
                raise _FieldError(
                    ("workers", index, "host"),
                    f"duplicate host {worker.host!r} (same host as workers[{first}]: "
                    f"{workers[first].host!r}); list each host once, with all its devices",
                )
            seen[identity] = index
        if sum(worker.has_cuda for worker in workers) > 1:
            for index, worker in enumerate(workers):
                if worker.has_cuda and worker.nccl_socket_ifname is None:
                    raise _FieldError(
                        ("workers", index),
                        "nccl_socket_ifname is required when CUDA ranks span hosts (name the "
                        "network interface NCCL should use on this host, e.g. eth0)",
                    )
        return self

    # construction -----------------------------------------------------------------------------
    @classmethod
    def from_mapping(cls, data: Any, *, source: str = "<mapping>", root: str = "") -> Self:
        """Validate ``data`` (the body under YAML's ``cluster:``).

        Args:
            data: a mapping with ``controller``, ``workers`` and ``env``.
            source: names the origin in error messages (a file path, ``ClusterBuilder``).
            root: prefix of field paths in error messages (``"cluster"`` for YAML).

        Raises:
            ConfigError: naming every invalid field path.
        """
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise ConfigError(_format_errors(exc, source=source, root=root)) from None

    @classmethod
    def from_env_json(cls, text: str | bytes) -> Self:
        """Inverse of :meth:`to_env_json`.

        Raises:
            ConfigError: the text is not a valid cluster JSON.
        """
        try:
            return cls.model_validate_json(text)
        except ValidationError as exc:
            raise ConfigError(_format_errors(exc, source="cluster JSON", root="")) from None

    def to_env_json(self) -> str:
        """Compact JSON for :data:`CLUSTER_ENV_VAR` (the launcher → children hand-off)."""
        return self.model_dump_json()

    # derived ----------------------------------------------------------------------------------
    @property
    def is_resolved(self) -> bool:
        """Whether no worker has ``devices: all`` left."""
        return all(worker.is_resolved for worker in self.workers)

    @property
    def device_type(self) -> DeviceType:
        """``cpu``, ``cuda`` or ``mixed`` (CPU and CUDA ranks in one run)."""
        kinds = {worker.device_type for worker in self.workers}
        return kinds.pop() if len(kinds) == 1 else "mixed"

    @property
    def world_size(self) -> int:
        """Number of ranks.

        Raises:
            ConfigError: a worker's devices are still ``all``.
        """
        return len(self.ranks())

    def ranks(self) -> list[RankSlot]:
        """Every rank in order: worker 0's devices first, then worker 1's, and so on.

        Raises:
            ConfigError: a worker's devices are still ``all`` (see :meth:`resolve_all`).
        """
        slots: list[RankSlot] = []
        for index, worker in enumerate(self.workers):
            if worker.devices == "all":
                raise ConfigError(
                    f"workers[{index}].devices is 'all' on {worker.host!r}: resolve it with "
                    "Cluster.resolve_all({host: gpu_count}) before ranks are assigned"
                )
            for device in worker.devices:
                slots.append(RankSlot(len(slots), index, device))
        return slots

    def placements(self, local_names: AbstractSet[str] = frozenset()) -> list[Placement]:
        """Every rank's :class:`~flodl.placement.Placement` (hosts by identity, so every name
        of this machine is one host).

        Raises:
            ConfigError: a worker's devices are still ``all``.
        """
        return [
            Placement(
                slot.rank,
                _host_identity(self.workers[slot.worker_index].host, local_names),
                slot.device,
            )
            for slot in self.ranks()
        ]

    def ranks_of(self, worker_index: int) -> range:
        """The global ranks owned by ``workers[worker_index]``."""
        owned = [slot.rank for slot in self.ranks() if slot.worker_index == worker_index]
        if not owned:
            raise IndexError(f"no worker {worker_index} (the cluster has {len(self.workers)})")
        return range(owned[0], owned[-1] + 1)

    def rank_hosts(self) -> tuple[str, ...]:
        """The host of each rank, indexed by rank."""
        return tuple(self.workers[slot.worker_index].host for slot in self.ranks())

    def worker_env(self, worker_index: int) -> dict[str, str]:
        """Cluster ``env`` overlaid with the worker's own, and ``NCCL_SOCKET_IFNAME`` from
        the worker's ``nccl_socket_ifname``."""
        worker = self.workers[worker_index]
        env = {**self.env, **worker.env}
        if worker.nccl_socket_ifname is not None:
            env[NCCL_IFNAME_ENV] = worker.nccl_socket_ifname
        return env

    def is_local(self, local_names: AbstractSet[str] = frozenset()) -> bool:
        """Whether every worker is this machine (see :meth:`Worker.is_local`)."""
        return all(worker.is_local(local_names) for worker in self.workers)

    def spans_hosts(self, local_names: AbstractSet[str] = frozenset()) -> bool:
        """Whether the workers are more than one machine (every name of this machine, loopback
        or in ``local_names``, counts as one)."""
        return len({_host_identity(w.host, local_names) for w in self.workers}) > 1

    def resolve_all(self, gpu_counts: Mapping[str, int]) -> Cluster:
        """Replace every ``devices: all`` by ``cuda:0 … cuda:(n-1)``, ``n`` being
        ``gpu_counts[worker.host]`` (the launcher's ``nvidia-smi`` probe of that host).

        Raises:
            ConfigError: a host with ``all`` has no count, or a count below 1.
        """
        workers: list[dict[str, Any]] = []
        for index, worker in enumerate(self.workers):
            data = worker.model_dump()
            if worker.devices == "all":
                count = gpu_counts.get(worker.host)
                if count is None:
                    raise ConfigError(
                        f"workers[{index}].devices is 'all' but no GPU count was given for "
                        f"{worker.host!r}"
                    )
                if isinstance(count, bool) or not isinstance(count, int) or count < 1:
                    raise ConfigError(
                        f"workers[{index}].devices is 'all' but {worker.host!r} has no GPUs "
                        f"(count {count!r}); list cpu devices instead"
                    )
                data["devices"] = [f"cuda:{i}" for i in range(count)]
            workers.append(data)
        body = {"controller": self.controller.model_dump(), "workers": workers, "env": self.env}
        return Cluster.from_mapping(body, source="resolve_all")


# error messages -------------------------------------------------------------------------------


def kind_of(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, Mapping):
        return "a mapping"
    if isinstance(value, list | tuple):
        return "a list"
    return type(value).__name__


def _render_path(root: str, loc: Iterable[str | int]) -> str:
    path = root
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        else:
            path = f"{path}.{part}" if path else str(part)
    return path or "cluster"


def _model_in(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in get_args(annotation):
        found = _model_in(arg)
        if found is not None:
            return found
    return None


def _model_at(loc: tuple[str | int, ...]) -> type[BaseModel] | None:
    model: type[BaseModel] | None = Cluster
    for part in loc:
        if isinstance(part, int):
            continue
        if model is None or part not in model.model_fields:
            return None
        model = _model_in(model.model_fields[part].annotation)
    return model


_EXPECTED: dict[str, str] = {
    "model_type": "a mapping",
    "model_attributes_type": "a mapping",
    "dict_type": "a mapping",
    "tuple_type": "a list",
    "list_type": "a list",
    "string_type": "a string",
    "int_type": "an integer",
}


def _describe(err: ErrorDetails, root: str) -> str:
    loc: tuple[str | int, ...] = tuple(err["loc"])
    kind = err["type"]
    cause = (err.get("ctx") or {}).get("error")
    if isinstance(cause, _FieldError):
        loc += cause.loc
        message = cause.message
    elif kind == "value_error" and isinstance(cause, ValueError):
        message = str(cause)
    elif kind == "extra_forbidden":
        model = _model_at(loc[:-1])
        expected = f" (expected one of: {', '.join(model.model_fields)})" if model else ""
        message = f"unknown key {loc[-1]!r}{expected}"
    elif kind == "missing":
        message = "required key is missing"
    elif kind in _EXPECTED:
        message = f"must be {_EXPECTED[kind]}, got {kind_of(err['input'])}"
        if not isinstance(err["input"], Mapping | list | tuple):
            message += f" {err['input']!r:.60}"
    else:
        value = err.get("input")
        got = "" if isinstance(value, Mapping | list | tuple) else f" (got {value!r:.60})"
        message = f"{err['msg']}{got}"
    return f"{_render_path(root, loc)}: {message}"


def _format_errors(exc: ValidationError, *, source: str, root: str) -> str:
    details = "; ".join(_describe(err, root) for err in exc.errors())
    return f"{source}: invalid cluster configuration: {details}"
