"""The run secret handed over the ways a scheduler can (docs/schedulers.md).

* ``flodl coord --secret-file`` given a Kubernetes secret volume's file: a symlink
  (``secret -> ..data/secret``, ``..data -> ..<timestamp>``) to a file of mode 0400; a rank
  whose ``FLODL_SECRET_FILE`` names that symlink joins and trains;
* in the same run, a rank given the secret only in its environment (``FLODL_SECRET``, as a
  ``secretKeyRef`` sets it: the file's text, trailing newline included) joins and trains;
* meanwhile, the secret is on no process's command line (``/proc/*/cmdline`` of every
  process, read once training is under way, when the coordinator and both ranks are running,
  and then until the ranks exit);
* the layout ``fsGroup`` gives (the kubelet adds 0440 to the file's mode) is refused by
  ``flodl coord``, with the ``chmod 600`` hint.
"""

from __future__ import annotations

import base64
import contextlib
import os
import stat
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from test_standalone import JOIN, flodl_env, identical, reap, start_coord, stop, wait_for_training

pytestmark = pytest.mark.integration

_SECRET_VARS = ("FLODL_SECRET", "FLODL_SECRET_FILE", "FLODL_SECRET_STDIN")


def kubelet_secret_volume(root: Path, text: str, mode: int) -> Path:
    """A secret volume as the kubelet writes one (key ``secret``); returns its mount point."""
    mount = root / "volume"
    stamp = mount / "..2025_01_01_00_00_00.123456789"
    stamp.mkdir(parents=True)
    (stamp / "secret").write_text(text)
    (stamp / "secret").chmod(mode)
    (mount / "..data").symlink_to(stamp.name)
    (mount / "secret").symlink_to("..data/secret")
    return mount


def forms(secret: bytes) -> list[str]:
    """The text forms of the secret a command line could carry."""
    return [
        secret.hex(),
        secret.hex().upper(),
        base64.b64encode(secret).decode(),
        base64.urlsafe_b64encode(secret).decode(),
    ]


def command_lines() -> dict[int, str]:
    """pid → command line of every process readable now."""
    table: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                table[int(entry.name)] = (
                    (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                )
    return table


def train_checking_command_lines(
    secret_dir: Path, out: Path, rank_env: Callable[[str, int], dict[str, str]]
) -> None:
    """A 2-rank ``cpu_cadence`` run of ``flodl coord --secret-file secret_dir/secret``, ranks
    with ``rank_env(address, rank)``; checks every command line while it trains, and that it
    ends complete with identical replicas."""
    coord, address = start_coord(secret_dir, "--mode", "cpu_cadence", "--epochs", "3", verbose=True)
    secret = bytes.fromhex((secret_dir / "secret").read_text())
    procs: list[subprocess.Popen[bytes]] = []
    seen: dict[int, set[str]] = {}  # every command line read, per pid (a zombie's is empty)

    def sample() -> dict[int, str]:
        table = command_lines()
        for pid, line in table.items():
            if line:
                seen.setdefault(pid, set()).add(line)
        return table

    try:
        cmd = [sys.executable, str(JOIN), "--out", str(out), "--epochs", "3", "--slow-ms", "20"]
        for rank in range(2):
            procs.append(subprocess.Popen(cmd, env=rank_env(address, rank)))
        sample()  # as they start
        wait_for_training(coord)  # the first epoch closed: every rank joined and trains
        first = sample()
        ours = [coord.pid, *(p.pid for p in procs)]
        alive = [pid for pid in ours if first.get(pid)]
        assert alive == ours, f"read while training: {alive} of {ours} (a process ended early)"
        assert str(JOIN) in first[procs[0].pid] and "coord" in first[coord.pid]
        while any(p.poll() is None for p in procs):
            sample()
            with contextlib.suppress(subprocess.TimeoutExpired):
                procs[0].wait(0.05)
        assert [p.wait(timeout=100) for p in procs] == [0, 0]
        assert coord.wait(timeout=30) == 0
        stdout, _ = stop(coord)
    finally:
        reap(procs)
        stop(coord)
    assert "run complete" in stdout
    identical(out)
    for pid, lines in seen.items():
        for line in lines:
            assert not any(form in line for form in forms(secret)), f"the secret is in {pid}'s argv"


@pytest.mark.timeout(120)
def test_ranks_join_with_a_kubernetes_secret_volume_file_or_the_secret_in_their_environment(
    tmp_path: Path,
) -> None:
    """One run: the coordinator and rank 0 read the secret through the symlinks of a secret
    volume (mode 0400); rank 1 has it only in ``FLODL_SECRET``, as a ``secretKeyRef`` sets it
    (the text of the file the Secret was made from, trailing newline included). Both join and
    train, and no process has the secret on its command line meanwhile."""
    secret = os.urandom(32)
    mount = kubelet_secret_volume(tmp_path, secret.hex() + "\n", 0o400)
    path = mount / "secret"
    assert path.is_symlink() and (mount / "..data").is_symlink()
    assert stat.S_IMODE(path.stat().st_mode) == 0o400  # the mode flodl coord checks
    out = tmp_path / "out"
    out.mkdir()

    def rank_env(address: str, rank: int) -> dict[str, str]:
        base = {k: v for k, v in os.environ.items() if k not in _SECRET_VARS}
        env = flodl_env(address, mount, rank, base)
        assert env["FLODL_SECRET_FILE"] == str(path)
        if rank == 1:  # the environment only
            del env["FLODL_SECRET_FILE"]
            env["FLODL_SECRET"] = path.read_text()
            assert env["FLODL_SECRET"] == secret.hex() + "\n"
        return env

    train_checking_command_lines(mount, out, rank_env)
    assert path.read_text() == secret.hex() + "\n"  # read, never rewritten
    assert stat.S_IMODE(path.stat().st_mode) == 0o400


def test_flodl_coord_refuses_the_secret_volume_fsgroup_makes(tmp_path: Path) -> None:
    """With ``fsGroup`` the kubelet adds 0440 to a read-only volume's files: 0400 → 0440."""
    mount = kubelet_secret_volume(tmp_path, os.urandom(32).hex() + "\n", 0o440)
    path = mount / "secret"
    run = subprocess.run(
        [
            *(sys.executable, "-m", "flodl", "coord", "--world-size", "2"),
            *("--dataset-len", "64", "--secret-file", str(path)),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={k: v for k, v in os.environ.items() if k not in _SECRET_VARS},
    )
    assert run.returncode == 2, run.stderr
    assert f"--secret-file {path} has mode 0o440: run 'chmod 600 {path}'" in run.stderr
    assert "Traceback" not in run.stderr
