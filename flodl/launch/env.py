"""The ``FLODL_*`` environment protocol between a launcher and its ranks (docs/design.md §2c).

A rank is any process that finds its coordinator and its rank in the environment: flodl's own
launcher sets ``FLODL_RANK`` and the rest; torchrun (``RANK``/``WORLD_SIZE``) and SLURM
(``SLURM_PROCID``/``SLURM_NTASKS``) ranks add ``FLODL_COORD``, ``FLODL_SECRET_FILE`` and
``FLODL_RUN_ID`` (printed by ``flodl coord``). Every reader here raises
:class:`~flodl.errors.ConfigError` naming the variable.
"""

from __future__ import annotations

import math
import os
import re
import socket
import sys
from pathlib import Path

from flodl.errors import ConfigError
from flodl.timeouts import MIN_TIMEOUT_SCALE

__all__ = [
    "ENV_RANK",
    "ENV_WORLD",
    "ENV_COORD",
    "ENV_SECRET",
    "ENV_SECRET_FILE",
    "ENV_SECRET_STDIN",
    "ENV_RUN_ID",
    "ENV_DEVICE",
    "ENV_STEM",
    "ENV_THREADS",
    "ENV_LAUNCHED",
    "ENV_FINAL_DIR",
    "ENV_TIMEOUT_SCALE",
    "ENV_LOCAL_HOSTS",
    "ENV_PREFIX_OUTPUT",
    "timeout_scale",
    "local_host_names",
    "rank_env",
    "require_env",
    "coord_address",
    "read_secret",
    "read_secret_from_stdin",
    "MIN_SECRET_BYTES",
    "is_launched",
    "final_state_path",
    "death_stem",
    "respawn_limit",
]

ENV_RANK = "FLODL_RANK"
ENV_WORLD = "FLODL_WORLD_SIZE"
ENV_COORD = "FLODL_COORD"
ENV_SECRET = "FLODL_SECRET"
ENV_SECRET_FILE = "FLODL_SECRET_FILE"
ENV_SECRET_STDIN = "FLODL_SECRET_STDIN"
"""Exported as ``1`` to a remote child whose secret arrives on stdin (``flodl.launch.ssh``)."""
ENV_RUN_ID = "FLODL_RUN_ID"
ENV_DEVICE = "FLODL_DEVICE"
ENV_STEM = "FLODL_STEM"
ENV_THREADS = "FLODL_THREADS"
ENV_LAUNCHED = "FLODL_LAUNCHED"
ENV_FINAL_DIR = "FLODL_FINAL_DIR"
ENV_TIMEOUT_SCALE = "FLODL_NET_TIMEOUT_SCALE"
ENV_LOCAL_HOSTS = "FLODL_LOCAL_HOSTS"
ENV_PREFIX_OUTPUT = "FLODL_PREFIX_OUTPUT"
ENV_RESTART = "FLODL_RESTART_COUNT"
"""How many times the launcher restarted this rank's process (0, or absent, for the first),
for the user's script: flodl reads it nowhere, since a restarted rank rejoins the running run
as its next incarnation without it (the coordinator counts incarnations, docs/design.md §2,
"Rejoin")."""
ENV_RESPAWN = "FLODL_RESPAWN"
"""Set by ``flodl launch --respawn N`` for the launcher it runs (``TrainerConfig.respawn``)."""

MIN_SECRET_BYTES = 16
_MAX_SECRET_HEX = 1024
_HEX = re.compile(r"(?:[0-9a-fA-F]{2})*")

# (rank, world size) variables of the launchers flodl rides, in precedence order.
_RANK_SOURCES = (
    (ENV_RANK, ENV_WORLD),  # flodl's own launcher, or set by hand
    ("RANK", "WORLD_SIZE"),  # torchrun
    ("SLURM_PROCID", "SLURM_NTASKS"),  # srun
)


def timeout_scale() -> float:
    """``FLODL_NET_TIMEOUT_SCALE`` (≥ 0.01), scaling every network deadline; 1.0 if unset."""
    raw = os.environ.get(ENV_TIMEOUT_SCALE, "")
    if not raw:
        return 1.0
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{ENV_TIMEOUT_SCALE}={raw!r} is not a number") from None
    if not (value >= MIN_TIMEOUT_SCALE and math.isfinite(value)):
        raise ConfigError(
            f"{ENV_TIMEOUT_SCALE}={raw!r} must be a finite number >= {MIN_TIMEOUT_SCALE}"
        )
    return value


def respawn_limit(configured: int) -> int:
    """The respawns a launcher allows per rank: ``FLODL_RESPAWN`` (``flodl launch
    --respawn N``) when set, else ``configured`` (``TrainerConfig.respawn``).

    Raises:
        ConfigError: ``FLODL_RESPAWN`` is not an integer in 0..1000.
    """
    raw = os.environ.get(ENV_RESPAWN, "")
    if not raw:
        return configured
    if not raw.isdigit() or int(raw) > 1000:
        raise ConfigError(f"{ENV_RESPAWN}={raw!r} must be an integer in 0..1000")
    return int(raw)


def local_host_names() -> frozenset[str]:
    """Names of this machine: its hostname, FQDN and ``FLODL_LOCAL_HOSTS`` (comma-separated
    aliases, e.g. names that resolve here); loopback names are always local."""
    names = {socket.gethostname(), socket.getfqdn()}
    names |= {n.strip() for n in os.environ.get(ENV_LOCAL_HOSTS, "").split(",") if n.strip()}
    return frozenset(n for n in names if n)


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


def require_env(name: str) -> str:
    """The value of ``name``; a rank cannot run without it."""
    value = os.environ.get(name)
    if value is None or value == "":
        raise ConfigError(f"this process is a rank but {name} is missing from the environment")
    return value


def coord_address() -> tuple[str, int]:
    """``FLODL_COORD`` as ``(host, port)`` (an IPv6 host may be bracketed)."""
    raw = require_env(ENV_COORD)
    host, _, port = raw.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65_536:
        raise ConfigError(f"{ENV_COORD} must be host:port, got {raw!r}")
    return host.strip("[]"), int(port)


def read_secret() -> bytes:
    """The run secret: from stdin (a rank started over ssh), ``FLODL_SECRET`` (hex) or the
    0600 file ``FLODL_SECRET_FILE`` names."""
    if os.environ.get(ENV_SECRET_STDIN) == "1":  # a rank started over ssh
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


def is_launched() -> bool:
    """This rank was spawned by flodl's own launcher (it exits after ``run()``)."""
    return os.environ.get(ENV_LAUNCHED) == "1"


def read_secret_from_stdin() -> bytes:
    """Read the run secret that :func:`flodl.launch.ssh.spawn_ssh` sent: one hex line on
    ``sys.stdin``.

    Raises:
        ConfigError: stdin is closed or empty, or the line is not hex, or it decodes to fewer
            than 16 bytes.
    """
    stream = sys.stdin
    if stream is None:
        raise ConfigError(
            f"{ENV_SECRET_STDIN}=1 but this process has no stdin to read the run secret from"
        )
    line = stream.readline(_MAX_SECRET_HEX + 2)
    if not line:
        raise ConfigError(
            f"{ENV_SECRET_STDIN}=1 but stdin ended before the run secret arrived (the launcher "
            "writes it as one hex line)"
        )
    if len(line) > _MAX_SECRET_HEX and not line.endswith("\n"):
        raise ConfigError(
            f"the run secret on stdin is longer than {_MAX_SECRET_HEX} hex digits: not a secret"
        )
    text = line.strip()
    if not _HEX.fullmatch(text):
        raise ConfigError(
            f"the run secret on stdin must be one line of hex digits (an even number of them), "
            f"got {len(text)} characters that are not"
        )
    secret = bytes.fromhex(text)
    if len(secret) < MIN_SECRET_BYTES:
        raise ConfigError(
            f"the run secret on stdin is {len(secret)} bytes; at least {MIN_SECRET_BYTES} are "
            "required"
        )
    return secret


def final_state_path(run_dir: str | os.PathLike[str], rank: int) -> Path:
    """Where a launched rank leaves its final state for the launcher (``FLODL_FINAL_DIR``)."""
    return Path(run_dir) / f"final.rank{rank}.pt"


def death_stem(run_id: str, save_path: str | None) -> str:
    """Where a rank that dies writes ``<stem>.rank<N>.death.json``: the launcher's choice
    (``FLODL_STEM``), else the run's ``save_path`` (next to its bundles), else
    ``flodl-runs/<run id>/run`` under the current directory. Nothing is written there unless a
    rank dies."""
    chosen = os.environ.get(ENV_STEM)
    if chosen:
        return chosen
    if save_path:
        return save_path
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", run_id)[:64] or "run"
    return str(Path.cwd() / "flodl-runs" / safe / "run")
