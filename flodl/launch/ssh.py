"""Fan-out over ssh: start a rank (or any flodl child) on a worker host with the system ``ssh``.

After docs/design.md §2c: the launcher reaches every remote worker with the system
``ssh`` client (so the user's keys, agent, ``~/.ssh/config`` and jump hosts all apply) and runs
one command there. This module builds that command and starts it; supervising the process
(exit codes, deaths reported to the coordinator) is the launcher's business.

Launcher side:

* :func:`ssh_command` returns the argv for ``ssh``::

      ssh -T -o BatchMode=yes -o ConnectTimeout=10 -o ServerAliveInterval=5
          -o ServerAliveCountMax=3 [-p PORT] [-l USER] [-i IDENTITY] [OPTIONS...] -- TARGET REMOTE

  ``REMOTE`` is one string for the remote login shell (which must be a POSIX shell: sh, dash,
  bash, zsh, ksh), every piece of it quoted with :func:`shlex.quote`::

      CDPATH= cd -- PATH || { printf '%s\\n' MESSAGE >&2 ; exit 78 ; } ;
      export K=V ... ;
      exec ARGV...                                                          (one line)

  The ``cd`` is left out when the worker has no ``path``; when the directory is missing the
  remote side prints which worker and path failed and exits with :data:`EXIT_BAD_WORKER_PATH`
  (78, ``EX_CONFIG``). A leading ``~/`` in the path means the remote ``$HOME``. A default
  ``-o`` option is left out when ``options`` sets the same option (ssh keeps the first value
  it reads, so the user's value would otherwise be ignored); ``-p`` is given only for a port
  other than 22, so ``~/.ssh/config`` can still choose one.
* :func:`spawn_ssh` starts that command and writes the run secret down its stdin.

The secret never travels in argv (argv is world-readable in ``ps`` on both machines, and ends
up in shell histories and logs): ``FLODL_SECRET`` is taken out of the exported environment and
``FLODL_SECRET_STDIN=1`` is exported instead; the launcher writes the secret as one hex line to
the ssh client's stdin, which ssh forwards to the remote command's stdin, then closes it.

Rank side: :func:`flodl.launch.env.read_secret_from_stdin` reads that line back (call it when
``FLODL_SECRET_STDIN`` is ``1``, before anything else reads stdin).

No tty is requested (``-T``; a tty would also echo the secret back). So a dead ssh client does
not kill the remote rank with SIGHUP: sshd just closes the session's pipes (a later write to
stdout or stderr may then fail with EPIPE). A remote rank thus outlives a dead ssh client only
until its coordinator-liveness watchdog fires (the liveness timeout plus its grace), and then
exits on its own. This is by design: the coordinator, not the ssh session, decides whether a
rank is alive, and a brief ssh hiccup does not have to kill a training run.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shlex
import subprocess
from collections.abc import Mapping, Sequence
from typing import IO, Any

from flodl.errors import ConfigError
from flodl.launch.cluster import DEFAULT_SSH_PORT, Worker
from flodl.launch.env import ENV_SECRET, ENV_SECRET_STDIN, MIN_SECRET_BYTES
from flodl.launch.gpus import QUERY, GpuInfo, parse_nvidia_smi

__all__ = [
    "ssh_command",
    "spawn_ssh",
    "ssh_gpus",
    "ssh_fetch",
    "ssh_remove",
    "EXIT_BAD_WORKER_PATH",
    "SSH_DEFAULT_OPTIONS",
]

logger = logging.getLogger(__name__)

EXIT_BAD_WORKER_PATH = 78
"""Remote exit status when the worker's ``path`` cannot be entered (sysexits ``EX_CONFIG``)."""
SSH_DEFAULT_OPTIONS: tuple[tuple[str, str], ...] = (
    ("BatchMode", "yes"),  # never prompt for a password or a host key: fail instead
    ("ConnectTimeout", "10"),
    ("ServerAliveInterval", "5"),  # notice a dead link in ~15 s
    ("ServerAliveCountMax", "3"),
)
"""``-o`` options every ssh call gets, unless the worker's ``ssh.options`` sets them."""

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_OPTION_KEY = re.compile(r"\s*([A-Za-z]+)")

_Redirect = int | IO[Any] | None


def ssh_command(
    worker: Worker,
    remote_argv: Sequence[str],
    env: Mapping[str, str],
    *,
    secret_via_stdin: bool = True,
) -> list[str]:
    """The argv that runs ``remote_argv`` on ``worker`` over the system ``ssh``.

    Args:
        worker: the host, its ``path`` (working directory there) and its ``ssh`` settings.
        remote_argv: the program and its arguments to ``exec`` on the worker.
        env: variables to export there (e.g. :meth:`Cluster.worker_env` plus the ``FLODL_*``
            rank variables). Exported in sorted order.
        secret_via_stdin: drop ``FLODL_SECRET`` and export ``FLODL_SECRET_STDIN=1`` (what
            :func:`spawn_ssh` does). With ``False`` the caller delivers the secret some other
            way and ``env`` must not hold ``FLODL_SECRET``.

    Raises:
        ConfigError: an empty ``remote_argv`` or one with a NUL character, an env name that is
            not a shell identifier, an env name or value with a NUL or newline, or
            ``FLODL_SECRET`` in ``env`` with ``secret_via_stdin=False``.
    """
    argv = _check_remote_argv(remote_argv)
    exported = _check_env(env)
    if secret_via_stdin:
        exported.pop(ENV_SECRET, None)
        exported[ENV_SECRET_STDIN] = "1"
    elif ENV_SECRET in exported:
        raise ConfigError(
            f"ssh to {worker.host}: {ENV_SECRET} may not be exported on the ssh command line "
            "(argv is visible in ps); send it on stdin (secret_via_stdin=True)"
        )
    command = ["ssh", "-T"]
    settings = worker.ssh
    user_options = settings.options if settings is not None else ()
    overridden = _option_keys(user_options)
    for key, value in SSH_DEFAULT_OPTIONS:
        if key.lower() not in overridden:
            command += ["-o", f"{key}={value}"]
    if settings is not None:
        if settings.port != DEFAULT_SSH_PORT:
            command += ["-p", str(settings.port)]
        if settings.user is not None:
            command += ["-l", settings.user]
        if settings.identity_file is not None:
            command += ["-i", os.path.expanduser(settings.identity_file)]
        command += list(user_options)
    command += ["--", worker.ssh_target, _remote_script(worker, argv, exported)]
    logger.debug("ssh command for %s: %s", worker.host, shlex.join(command))
    return command


def spawn_ssh(
    worker: Worker,
    remote_argv: Sequence[str],
    env: Mapping[str, str],
    secret: bytes,
    *,
    stdout: _Redirect = None,
    stderr: _Redirect = None,
) -> subprocess.Popen[bytes]:
    """Start ``remote_argv`` on ``worker`` over ssh and hand it ``secret`` on stdin.

    The command is :func:`ssh_command` (secret on stdin). The secret is written as one hex line,
    then stdin is closed; the returned process has ``stdin`` set to ``None``, so ``wait()`` and
    ``communicate()`` work as usual. ``stdout``/``stderr`` are passed to :class:`subprocess.Popen`
    (inherited by default). If ssh exits before taking the secret (e.g. the host is
    unreachable), the write error is ignored: the exit status says what happened.

    Raises:
        ConfigError: ``secret`` shorter than 16 bytes, or anything :func:`ssh_command` refuses.
    """
    if not isinstance(secret, bytes) or len(secret) < MIN_SECRET_BYTES:
        got = f"{len(secret)} bytes" if isinstance(secret, bytes) else type(secret).__name__
        raise ConfigError(f"the run secret must be at least {MIN_SECRET_BYTES} bytes, got {got}")
    command = ssh_command(worker, remote_argv, env, secret_via_stdin=True)
    proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=stdout, stderr=stderr)
    pipe = proc.stdin
    assert pipe is not None
    proc.stdin = None
    try:
        pipe.write(secret.hex().encode("ascii") + b"\n")
        pipe.flush()
    except BrokenPipeError:
        logger.debug("ssh to %s exited before reading the secret", worker.host)
    finally:
        with contextlib.suppress(BrokenPipeError):
            pipe.close()
    return proc


SSH_CALL_TIMEOUT_S = 60.0
"""How long a one-off ssh call (a GPU probe, a final-state fetch) may take."""


def _one_off(worker: Worker, argv: Sequence[str], env: Mapping[str, str], what: str) -> bytes:
    """Run ``argv`` on ``worker`` over ssh to its end; its stdout.

    Raises:
        ConfigError: ssh or the command failed or timed out (the message says which and
            quotes the end of its stderr).
    """
    command = ssh_command(worker, argv, env, secret_via_stdin=False)
    try:
        done = subprocess.run(
            command,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=SSH_CALL_TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise ConfigError(
            f"{what} on {worker.host} over ssh took longer than {SSH_CALL_TIMEOUT_S:.0f} s"
        ) from None
    except OSError as exc:
        raise ConfigError(f"{what} on {worker.host}: cannot run ssh: {exc}") from None
    if done.returncode != 0:
        err = done.stderr.decode(errors="replace").strip()[-500:]
        raise ConfigError(
            f"{what} on {worker.host} over ssh failed (exit status {done.returncode})"
            + (f": {err}" if err else "")
        )
    return done.stdout


def ssh_gpus(worker: Worker, env: Mapping[str, str]) -> list[GpuInfo]:
    """The GPUs ``nvidia-smi`` shows on ``worker``, asked over ssh in the environment its
    ranks will have (``env``: the worker's env, whose ``PATH`` may name where nvidia-smi is).

    Raises:
        ConfigError: ssh or nvidia-smi failed (a host without nvidia-smi says so).
    """
    out = _one_off(worker, ["nvidia-smi", *QUERY], env, "probing the GPUs (nvidia-smi)")
    return parse_nvidia_smi(out.decode(errors="replace"))


def ssh_fetch(worker: Worker, path: str, *, remove: str | None = None) -> bytes:
    """The bytes of the file ``path`` on ``worker`` (``cat`` over ssh); then, if ``remove``
    is given, that directory is removed there (also when the file is missing).

    Raises:
        ConfigError: ssh failed or the file could not be read.
    """
    script = 'cat -- "$1"; status=$?; if [ -n "$2" ]; then rm -rf -- "$2"; fi; exit $status'
    argv = ["sh", "-c", script, "flodl-fetch", path, remove or ""]
    return _one_off(worker, argv, {}, f"fetching {path}")


def ssh_remove(worker: Worker, directory: str) -> None:
    """Remove ``directory`` on ``worker`` over ssh; a failure is logged, never raised (it
    only leaves a file behind)."""
    try:
        _one_off(worker, ["rm", "-rf", "--", directory], {}, f"removing {directory}")
    except ConfigError as exc:
        logger.warning("%s", exc)


# internals ------------------------------------------------------------------------------------


def _check_remote_argv(remote_argv: Sequence[str]) -> list[str]:
    if isinstance(remote_argv, str | bytes):
        raise ConfigError("the remote argv must be a sequence of strings, not one string")
    argv = list(remote_argv)
    if not argv:
        raise ConfigError("the remote argv is empty: give the program to run and its arguments")
    for index, arg in enumerate(argv):
        if not isinstance(arg, str):
            raise ConfigError(f"remote argv[{index}] must be a string, got {type(arg).__name__}")
        if "\x00" in arg:
            raise ConfigError(f"remote argv[{index}] contains a NUL character")
    if not argv[0] or argv[0].startswith("-"):
        raise ConfigError(f"remote argv[0] must name a program, got {argv[0]!r}")
    return argv


def _check_env(env: Mapping[str, str]) -> dict[str, str]:
    for key, value in env.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise ConfigError(f"env {key!r}: names and values must be strings")
    checked: dict[str, str] = {}
    for key in sorted(env):
        value = env[key]
        for what, text in (("name", key), ("value", value)):
            if "\x00" in text or "\n" in text or "\r" in text:
                raise ConfigError(f"env {key!r}: the {what} contains a NUL or newline character")
        if not _ENV_NAME.fullmatch(key):
            raise ConfigError(
                f"env {key!r} is not a shell variable name (letters, digits and _, not first a "
                "digit)"
            )
        checked[key] = value
    return checked


def _option_keys(options: Sequence[str]) -> set[str]:
    """Lower-cased names of the ``-o`` options in ``options`` (``-o K=V``, ``-oK=V``,
    ``-o "K V"``)."""
    keys: set[str] = set()
    expect_value = False
    for arg in options:
        if expect_value:
            value: str | None = arg
            expect_value = False
        elif arg == "-o":
            expect_value = True
            continue
        elif arg.startswith("-o"):
            value = arg[2:]
        else:
            value = None
        if value is not None:
            match = _OPTION_KEY.match(value)
            if match:
                keys.add(match.group(1).lower())
    return keys


def _remote_path(path: str) -> str:
    """``path`` for the remote shell: quoted, with a leading ``~`` / ``~/`` as ``$HOME``."""
    if path == "~":
        return '"$HOME"'
    if path.startswith("~/"):
        rest = path[2:]
        return '"$HOME"/' + shlex.quote(rest) if rest else '"$HOME"/'
    return shlex.quote(path)


def _remote_script(worker: Worker, argv: list[str], env: dict[str, str]) -> str:
    parts: list[str] = []
    if worker.path is not None:
        message = (
            f"flodl: worker {worker.host}: cannot enter its path {worker.path} (missing, not "
            "a directory, or not permitted); set path to the checkout on that host"
        )
        parts.append(
            f"CDPATH= cd -- {_remote_path(worker.path)} || "
            f"{{ printf '%s\\n' {shlex.quote(message)} >&2 ; exit {EXIT_BAD_WORKER_PATH} ; }} ;"
        )
    if env:
        exports = " ".join(shlex.quote(f"{key}={value}") for key, value in sorted(env.items()))
        parts.append(f"export {exports} ;")
    parts.append("exec " + " ".join(shlex.quote(arg) for arg in argv))
    return " ".join(parts)
