"""The fluent :class:`ClusterBuilder`: the same fields and validation as ``fdl.cluster.yml``,
built in code, and the local shortcuts the launcher synthesizes.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Any, Literal, NoReturn, Self

from flodl.errors import ConfigError
from flodl.launch.cluster import (
    DEFAULT_CONTROLLER_HOST,
    DEFAULT_CONTROLLER_PORT,
    RANKS_REJECTED,
    Cluster,
)

__all__ = ["ClusterBuilder"]

_Section = Literal["controller", "worker"]
_OPENERS: dict[str, str] = {"controller": "controller(host)", "worker": "host(name)"}


class ClusterBuilder:
    """Fluent mirror of ``fdl.cluster.yml`` (same fields, same validation, equal result)::

        cluster = (
            ClusterBuilder()
            .controller("10.0.0.1").port(1337).path("/opt/run").done()
            .host("node-a").devices([0, 1]).nccl_socket_ifname("eth0")
                .ssh("me@node-a").ssh_port(2222).ssh_identity_file("~/.ssh/id").done()
            .host("node-b").devices(["cuda:0"]).nccl_socket_ifname("eth0").done()
            .env("OMP_NUM_THREADS", "4")
            .build()
        )

    ``controller(host)`` and ``host(name)`` open a section that ``done()`` closes; setters
    apply to the open section (``env`` with none open sets the cluster-wide env). Misuse
    raises :class:`~flodl.errors.ConfigError` saying what to call instead. Not thread-safe.
    """

    def __init__(self) -> None:
        self._controller: dict[str, Any] | None = None
        self._workers: list[dict[str, Any]] = []
        self._env: dict[str, Any] = {}
        self._open: Literal["controller", "worker"] | None = None

    # shortcuts --------------------------------------------------------------------------------
    @classmethod
    def local(
        cls,
        ranks: int,
        device: str = "cpu",
        *,
        port: int = DEFAULT_CONTROLLER_PORT,
        gpus: int | None = None,
    ) -> Cluster:
        """One worker on ``127.0.0.1`` with ``ranks`` devices: ``ranks × cpu`` for
        ``device="cpu"``; for ``device="cuda"``, ``cuda:0 … cuda:(ranks-1)``, or with ``gpus``
        (the GPUs visible) rank ``i`` on ``cuda:(i mod gpus)``, so more ranks than GPUs share
        them; loopback controller on ``port``.

        Raises:
            ConfigError: ``ranks`` or ``gpus`` below 1, or ``device`` not ``cpu``/``cuda``.
        """
        if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
            raise ConfigError(f"ClusterBuilder.local: ranks must be an integer ≥ 1, got {ranks!r}")
        if gpus is not None and (isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1):
            raise ConfigError(f"ClusterBuilder.local: gpus must be an integer ≥ 1, got {gpus!r}")
        if device == "cpu":
            devices = ["cpu"] * ranks
        elif device == "cuda":
            devices = [f"cuda:{i % (gpus or ranks)}" for i in range(ranks)]
        else:
            raise ConfigError(
                f"ClusterBuilder.local: device must be 'cpu' or 'cuda', got {device!r}"
            )
        return cls.local_devices(devices, port=port)

    @classmethod
    def local_devices(
        cls, devices: Iterable[str | int], *, port: int = DEFAULT_CONTROLLER_PORT
    ) -> Cluster:
        """One worker on ``127.0.0.1``, one rank per entry of ``devices`` (``cpu``,
        ``cuda:N`` or ``N``; CPU and GPU ranks may mix, and a GPU may be listed more than
        once), loopback controller on ``port``.

        Raises:
            ConfigError: an entry is not a device, or ``devices`` is empty.
        """
        builder = cls().controller(DEFAULT_CONTROLLER_HOST).port(port).done()
        return builder.host(DEFAULT_CONTROLLER_HOST).devices(devices).done().build()

    @classmethod
    def all_local_gpus(cls, count: int) -> Cluster:
        """One worker on ``127.0.0.1`` owning ``count`` GPUs (the launcher passes the
        ``nvidia-smi`` count), loopback controller: what auto-promote synthesizes.

        Raises:
            ConfigError: ``count`` below 1.
        """
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ConfigError(
                f"ClusterBuilder.all_local_gpus: no GPUs to use (count {count!r}); use "
                "ClusterBuilder.local(n) for CPU ranks"
            )
        return cls.local(count, "cuda")

    # sections ---------------------------------------------------------------------------------
    def controller(self, host: str) -> Self:
        """Open the controller section (its ``port``/``path`` follow, then ``done()``)."""
        self._require_closed("controller()")
        if self._controller is not None:
            raise self._misuse("controller() was already called: a cluster has one controller")
        self._controller = {"host": host}
        self._open = "controller"
        return self

    def host(self, host: str) -> Self:
        """Open a worker section for ``host`` (its settings follow, then ``done()``)."""
        self._require_closed("host()")
        self._workers.append({"host": host})
        self._open = "worker"
        return self

    def done(self) -> Self:
        """Close the open controller or worker section."""
        if self._open is None:
            raise self._misuse(
                "done() has nothing to close: call controller(host) or host(name) first"
            )
        self._open = None
        return self

    def build(self) -> Cluster:
        """Validate and return the :class:`Cluster`.

        Raises:
            ConfigError: a section is still open, or the configuration is invalid.
        """
        if self._open is not None:
            raise self._misuse(f"build() while {self._open_name()} is open: call done() first")
        data: dict[str, Any] = {"workers": self._workers}
        if self._controller is not None:
            data["controller"] = self._controller
        if self._env:
            data["env"] = self._env
        return Cluster.from_mapping(copy.deepcopy(data), source="ClusterBuilder")

    # controller settings ----------------------------------------------------------------------
    def port(self, port: int) -> Self:
        """Controller port (0..65535; 0 lets the OS choose)."""
        self._section("port()", "controller")["port"] = port
        return self

    def path(self, path: str) -> Self:
        """Working directory of the open controller or worker."""
        self._section("path()", "controller", "worker")["path"] = path
        return self

    # worker settings --------------------------------------------------------------------------
    def devices(self, devices: Iterable[str | int] | Literal["all"]) -> Self:
        """The open worker's devices: ``cpu`` / ``cuda:N`` / ``N`` entries, or ``"all"``."""
        worker = self._section("devices()", "worker")
        worker["devices"] = devices if isinstance(devices, str) else list(devices)
        return self

    def ranks(self, ranks: Iterable[int]) -> NoReturn:
        """Not supported (the original's builder had it): ranks follow worker order.

        Raises:
            ConfigError: always.
        """
        del ranks
        raise self._misuse(f"ranks() is not supported: {RANKS_REJECTED}")

    def nccl_socket_ifname(self, name: str) -> Self:
        """Network interface NCCL uses on the open worker (required when CUDA spans hosts)."""
        self._section("nccl_socket_ifname()", "worker")["nccl_socket_ifname"] = name
        return self

    def ssh(self, target: str) -> Self:
        """ssh destination of the open worker (``host`` or ``user@host``)."""
        self._ssh("ssh()")["target"] = target
        return self

    def ssh_port(self, port: int) -> Self:
        self._ssh("ssh_port()")["port"] = port
        return self

    def ssh_user(self, user: str) -> Self:
        self._ssh("ssh_user()")["user"] = user
        return self

    def ssh_identity_file(self, path: str) -> Self:
        self._ssh("ssh_identity_file()")["identity_file"] = path
        return self

    def ssh_options(self, options: Iterable[str]) -> Self:
        """Extra ``ssh`` arguments for the open worker (replaces earlier ones)."""
        self._ssh("ssh_options()")["options"] = list(options)
        return self

    def env(self, key: str, value: str) -> Self:
        """Set ``key=value`` in the open worker's env, or with no section open, in the
        cluster-wide env."""
        if self._open is None:
            self._env[key] = value
        elif self._open == "controller":
            raise self._misuse(
                "env() does not apply to controller(): call done() first (env() then sets the "
                "cluster env), or set it on a worker after host(name)"
            )
        else:
            self._workers[-1].setdefault("env", {})[key] = value
        return self

    # internals --------------------------------------------------------------------------------
    def _misuse(self, message: str) -> ConfigError:
        return ConfigError(f"ClusterBuilder: {message}")

    def _open_name(self) -> str:
        if self._open == "controller":
            return "controller()"
        return f"worker {self._workers[-1]['host']!r}"

    def _require_closed(self, method: str) -> None:
        if self._open is not None:
            raise self._misuse(
                f"{method} while {self._open_name()} is open: call done() to close it first"
            )

    def _section(self, method: str, *allowed: _Section) -> dict[str, Any]:
        if self._open == "controller" and "controller" in allowed:
            assert self._controller is not None
            return self._controller
        if self._open == "worker" and "worker" in allowed:
            return self._workers[-1]
        noun = " or ".join(allowed)
        opener = " or ".join(_OPENERS[section] for section in allowed)
        if self._open is None:
            raise self._misuse(f"{method} needs an open {noun}: call {opener} first")
        raise self._misuse(
            f"{method} does not apply to {self._open_name()}: call done(), then {opener}"
        )

    def _ssh(self, method: str) -> dict[str, Any]:
        worker = self._section(method, "worker")
        ssh: dict[str, Any] = worker.setdefault("ssh", {})
        return ssh
