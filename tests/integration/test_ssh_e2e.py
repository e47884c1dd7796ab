"""ssh fan-out end to end: a throwaway ``sshd`` on 127.0.0.1, the real ``ssh`` client.

The fixture generates a host key and a client key in ``tmp_path``, writes an ``sshd_config``
that accepts only that client key, and runs ``sshd -D -e`` on a free loopback port. It is
skipped, with the reason, where ``sshd``/``ssh``/``ssh-keygen`` are missing (Debian:
``apt-get install -y openssh-server``) or sshd does not start. As root it creates sshd's
privilege-separation directory ``/run/sshd`` if missing (what the package's service does at
boot). sshd and every process under it are killed in teardown, which checks none is left.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from flodl.launch.cluster import SshSettings, Worker
from flodl.launch.ssh import EXIT_BAD_WORKER_PATH, spawn_ssh

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

REPO = Path(__file__).resolve().parents[2]
SECRET = bytes(range(0x40, 0x60))  # 32 bytes
SSHD_START_S = 10.0
PROBE = """\
import hashlib, json, os, sys
from flodl.launch.env import read_secret_from_stdin
secret = read_secret_from_stdin()
print("RESULT " + json.dumps({
    "sha256": hashlib.sha256(secret).hexdigest(),
    "value": os.environ.get("FLODL_TEST_VALUE"),
    "secret_stdin": os.environ.get("FLODL_SECRET_STDIN"),
    "secret_env": os.environ.get("FLODL_SECRET"),
    "cwd": os.getcwd(),
    "argv": sys.argv[1:],
}))
"""


@dataclass(frozen=True)
class Sshd:
    port: int
    user: str
    client_key: Path

    def worker(self, path: str | None = None, port: int | None = None) -> Worker:
        options = (
            "-F",
            "/dev/null",  # ignore this machine's ~/.ssh/config
            "-o",
            "StrictHostKeyChecking=no",
            "-o",
            "UserKnownHostsFile=/dev/null",
            "-o",
            "IdentitiesOnly=yes",
            "-o",
            "LogLevel=ERROR",
        )
        settings = SshSettings(
            port=port or self.port,
            user=self.user,
            identity_file=str(self.client_key),
            options=options,
        )
        return Worker(host="127.0.0.1", devices=("cpu",), path=path, ssh=settings)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (read from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    found: list[int] = []
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def keygen(path: Path) -> None:
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "flodl-test", "-f", str(path)],
        check=True,
        capture_output=True,
        timeout=30,
    )


def stop(proc: subprocess.Popen[bytes]) -> None:
    """Terminate sshd and everything below it; fail if anything survives.

    sshd's per-connection children are first given time to finish on their own (every client
    is done by now), so the listener reaps them: one killed first would leave its orphans as
    zombies for init to reap."""
    deadline = time.monotonic() + 5
    while [p for p in descendants(proc.pid) if alive(p)] and time.monotonic() < deadline:
        time.sleep(0.05)
    pids = descendants(proc.pid)
    for pid in [proc.pid, *pids]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=5)
    deadline = time.monotonic() + 5
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = [p for p in pids if alive(p)]
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    assert not left, f"sshd left processes behind: {left}"


@pytest.fixture
def sshd(tmp_path: Path) -> Iterator[Sshd]:
    daemon = shutil.which("sshd") or shutil.which("sshd", path="/usr/sbin:/usr/local/sbin")
    missing = [tool for tool in ("ssh", "ssh-keygen") if shutil.which(tool) is None]
    if daemon is None or missing:
        missing += [] if daemon else ["sshd"]
        pytest.skip(f"{', '.join(missing)} not installed (apt-get install -y openssh-server)")
    if os.geteuid() == 0:
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)
    host_key, client_key = tmp_path / "host_key", tmp_path / "client_key"
    keygen(host_key)
    keygen(client_key)
    authorized = tmp_path / "authorized_keys"
    authorized.write_text(client_key.with_suffix(".pub").read_text())
    authorized.chmod(0o600)
    port = free_port()
    config = tmp_path / "sshd_config"
    config.write_text(
        f"ListenAddress 127.0.0.1\n"
        f"Port {port}\n"
        f"HostKey {host_key}\n"
        f"AuthorizedKeysFile {authorized}\n"
        f"PidFile {tmp_path / 'sshd.pid'}\n"
        "PermitRootLogin prohibit-password\n"
        "PubkeyAuthentication yes\n"
        "PasswordAuthentication no\n"
        "KbdInteractiveAuthentication no\n"
        "UsePAM no\n"
        "StrictModes no\n"
        "PrintMotd no\n"
        "LogLevel ERROR\n"
    )
    check = subprocess.run(
        [daemon, "-t", "-f", str(config)], check=False, capture_output=True, text=True, timeout=30
    )
    if check.returncode != 0:
        pytest.skip(f"sshd rejects the test config: {check.stderr.strip() or check.stdout}")
    log = tmp_path / "sshd.log"
    with log.open("wb") as log_file:
        proc = subprocess.Popen(
            [daemon, "-D", "-e", "-f", str(config)],
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=log_file,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + SSHD_START_S
        while True:
            if proc.poll() is not None:
                pytest.skip(f"sshd exited with {proc.returncode}: {log.read_text().strip()}")
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    pytest.skip(f"sshd did not listen on 127.0.0.1:{port} within 10 s")
                time.sleep(0.05)
        yield Sshd(port=port, user=pwd.getpwuid(os.geteuid()).pw_name, client_key=client_key)
    finally:
        stop(proc)


def result_line(stdout: bytes) -> dict[str, object]:
    lines = [ln for ln in stdout.decode().splitlines() if ln.startswith("RESULT ")]
    assert len(lines) == 1, stdout
    got: dict[str, object] = json.loads(lines[0].removeprefix("RESULT "))
    return got


def test_remote_rank_gets_secret_env_and_path(sshd: Sshd, tmp_path: Path) -> None:
    workdir = tmp_path / "work dir 'q' $x `y` ;z"
    workdir.mkdir()
    value = 'it\'s $HOME `id` ; $(id) \\ "q" *'
    args = ["arg with space", "$HOME", "`x`;", "multi\nline", ""]
    env = {
        "FLODL_TEST_VALUE": value,
        "PYTHONPATH": str(REPO),
        "FLODL_SECRET": SECRET.hex(),  # must be dropped, not sent
    }
    proc = spawn_ssh(
        sshd.worker(path=str(workdir)),
        [sys.executable, "-c", PROBE, *args],
        env,
        SECRET,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    with contextlib.suppress(OSError):  # the ssh client may already be gone
        cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes()
        assert SECRET.hex().encode() not in cmdline
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err.decode()
    assert result_line(out) == {
        "sha256": hashlib.sha256(SECRET).hexdigest(),
        "value": value,
        "secret_stdin": "1",
        "secret_env": None,
        "cwd": str(workdir),
        "argv": args,
    }


def test_missing_worker_path_fails_clearly(sshd: Sshd, tmp_path: Path) -> None:
    missing = tmp_path / "no such checkout"
    proc = spawn_ssh(
        sshd.worker(path=str(missing)),
        [sys.executable, "-c", "print('should not run')"],
        {},
        SECRET,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == EXIT_BAD_WORKER_PATH
    assert out == b""
    assert f"flodl: worker 127.0.0.1: cannot enter its path {missing}" in err.decode()


def test_remote_exit_status_comes_back(sshd: Sshd) -> None:
    proc = spawn_ssh(
        sshd.worker(),
        [sys.executable, "-c", "import sys; sys.exit(23)"],
        {},
        SECRET,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 23, err.decode()


def test_unreachable_host_is_ssh_status_255(sshd: Sshd) -> None:
    closed = free_port()
    proc = spawn_ssh(
        sshd.worker(port=closed),
        ["true"],
        {},
        SECRET,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 255
    assert b"refused" in err.lower()


def two_host_cluster(tmp_path: Path, sshd: Sshd, repo: Path) -> Path:
    """A cluster file of this host (local exec) and an "other host" reached over ``sshd``."""
    options = ", ".join(
        f'"{o}"'
        for o in (
            "-F",
            "/dev/null",
            "-o",
            "StrictHostKeyChecking=no",
            "-o",
            "UserKnownHostsFile=/dev/null",
            "-o",
            "IdentitiesOnly=yes",
            "-o",
            "LogLevel=ERROR",
        )
    )
    yml = tmp_path / "fdl.cluster.yml"
    yml.write_text(
        "cluster:\n"
        "  controller: {host: 127.0.0.1, port: 0}\n"
        "  workers:\n"
        "    - host: localhost\n"
        "      devices: [cpu]\n"
        "    - host: sshbox\n"
        "      devices: [cpu]\n"
        f"      path: {repo}\n"
        f"      ssh: {{target: 127.0.0.1, port: {sshd.port}, user: {sshd.user},\n"
        f"            identity_file: {sshd.client_key}, options: [{options}]}}\n"
    )
    return yml


REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tests" / "integration" / "trainer_main.py"
LAUNCH = [sys.executable, "-m", "flodl", "launch", "--cluster"]
TRAIN = [sys.executable, str(SCRIPT), "--tag"]
KNOB = ["--heartbeat-timeout", "4"]


def launch(yml: Path, tag: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``flodl launch --cluster yml -- trainer_main.py --tag tag args…``, to its end."""
    return subprocess.run(
        [*LAUNCH, str(yml), "--", *TRAIN, tag, *args],
        capture_output=True,
        text=True,
        timeout=140,
        check=False,
        cwd=REPO,
    )


@pytest.mark.timeout(150)
def test_flodl_launch_runs_a_rank_over_ssh(sshd: Sshd, tmp_path: Path) -> None:
    """Tier 3 end to end: one rank by local exec, one on an "other host" reached over ssh."""
    yml = two_host_cluster(tmp_path, sshd, REPO)
    out = launch(yml, "ssh-e2e", "--ranks", "1", "--epochs", "2")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "DONE params=4 world=2" in out.stdout
    assert "[rank 1] process rank=1" in out.stdout  # printed by the rank on the ssh "host"


@pytest.mark.timeout(150)
def test_a_rank_over_ssh_that_fails_is_respawned_over_ssh_and_rejoins(
    sshd: Sshd, tmp_path: Path
) -> None:
    """``respawn`` with a rank on another host: the rank fails at its 5th step, its ssh
    session ends with its exit status, and the launcher starts it again over ssh (with
    ``FLODL_RESTART_COUNT=1``); the new incarnation rejoins and trains to the end (30 ms
    steps: the run lasts ≈ 11 s, long enough for the new process to start and say hello)."""
    yml = two_host_cluster(tmp_path, sshd, REPO)
    crash = ["--crash-rank", "1", "--crash-step", "5"]
    out = launch(yml, "ssh-respawn", "--epochs", "6", "--slow-ms", "30", "--respawn", "1", *crash)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "rank 1 exited with code 1: respawning it (1 of 1)" in out.stderr, out.stderr[-3000:]
    assert "[rank 1] process rank=1 restart=1" in out.stdout  # the new incarnation, over ssh
    rejoined = "[rank_rejoined] root/sshbox/rank1: rank 1 rejoined (incarnation 1)"
    assert rejoined in out.stdout, out.stdout[-3000:]
    assert "DONE params=4 world=2" in out.stdout


def children_of(pid: int) -> list[int]:
    """The live direct children of ``pid`` (read from /proc)."""
    found: list[int] = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid and alive(int(entry)):
                found.append(int(entry))
    return found


@pytest.mark.timeout(150)
def test_a_rank_over_ssh_obeys_the_one_knob_of_its_coordinator(sshd: Sshd, tmp_path: Path) -> None:
    """Tier 3: ``heartbeat_timeout(4)`` under ``FLODL_NET_TIMEOUT_SCALE=0.5`` in the launcher's
    environment. The rank on the other host does not inherit that variable (ssh passes only
    the run's own), so by its own settings it would wait 4 s for a silent coordinator; it obeys
    the 2 s its coordinator sent in ``accept``. The launcher is frozen (its coordinator silent,
    its connections open): both ranks are lost after 2 s and say so in their death records."""
    from flodl import checkpoint

    yml = two_host_cluster(tmp_path, sshd, REPO)
    tag = f"ssh-knob-{os.getpid()}-{time.monotonic_ns()}"
    launch = subprocess.Popen(
        [*LAUNCH, str(yml), "--", *TRAIN, tag, "--ranks", "1", "--epochs", "500", *KNOB],
        cwd=tmp_path,
        env={**os.environ, "FLODL_NET_TIMEOUT_SCALE": "0.5", "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    launcher: int | None = None
    try:
        assert launch.stdout is not None
        while "epoch 0 loss" not in (line := launch.stdout.readline()):  # the cohort trains
            assert line, launch.stderr.read() if launch.stderr else ""
        (launcher,) = children_of(launch.pid)  # the script: the launcher and its coordinator
        frozen = {launch.pid, launcher}

        def ranks_alive() -> list[int]:  # the local rank, the ssh client, the remote rank
            return [p for p in tagged(tag) if p not in frozen]

        assert ranks_alive()
        os.kill(launcher, signal.SIGSTOP)
        deadline = time.monotonic() + 60
        while ranks_alive():  # the frozen launcher cannot report their exit
            assert time.monotonic() < deadline, ranks_alive()
            time.sleep(0.2)
        os.kill(launcher, signal.SIGCONT)
        _, err = launch.communicate(timeout=60)
    finally:
        if launcher is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(launcher, signal.SIGCONT)
        if launch.poll() is None:
            launch.kill()
            launch.communicate()
    assert launch.returncode != 0
    records = sorted(tmp_path.glob("flodl-runs/*/run.rank*.death.json"))
    assert [r.name for r in records] == ["run.rank0.death.json", "run.rank1.death.json"]
    for rank, record in enumerate(records):
        error = checkpoint.read_death_record(str(record.parent / "run"), rank).error
        assert "liveness timeout 2 s" in error, (rank, error)
    assert "liveness timeout 2 s" in err, err[-3000:]


def tagged(tag: str) -> list[int]:
    """The live processes whose command line holds ``tag``."""
    found: list[int] = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                line = Path(f"/proc/{entry}/cmdline").read_bytes()
            except OSError:
                continue
            if tag.encode() in line and alive(int(entry)):
                found.append(int(entry))
    return found


def remote_only_cluster(tmp_path: Path, sshd: Sshd, repo: Path) -> Path:
    """A cluster whose only worker is the "other host" (over ``sshd``): the launcher's host
    runs no rank, it only coordinates."""
    text = two_host_cluster(tmp_path, sshd, repo).read_text()
    local = "    - host: localhost\n      devices: [cpu]\n"
    assert local in text
    yml = tmp_path / "remote-only.yml"
    yml.write_text(text.replace(local, "").replace("devices: [cpu]", "devices: [cpu, cpu]"))
    return yml


@pytest.mark.timeout(150)
def test_a_launcher_that_runs_no_rank_still_receives_the_final_state(
    sshd: Sshd, tmp_path: Path
) -> None:
    """Both ranks run on the ssh "host"; each leaves its final state in a directory of its
    own host, and the launcher fetches the lowest rank's over ssh, then removes the directory
    there (it never reads the run directory it gave local ranks)."""
    before = set(Path("/tmp").glob("flodl-final-*"))
    yml = remote_only_cluster(tmp_path, sshd, REPO)
    out = launch(yml, "ssh-coord-only", "--ranks", "1", "--epochs", "2")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "DONE params=4 world=2" in out.stdout
    assert "[rank 0] process rank=0" in out.stdout and "[rank 1] process rank=1" in out.stdout
    assert set(Path("/tmp").glob("flodl-final-*")) == before  # removed on the worker host


def test_devices_all_is_probed_over_ssh_with_nvidia_smi(sshd: Sshd, tmp_path: Path) -> None:
    """``devices: all`` on an ssh host: the launcher runs nvidia-smi there, in the environment
    the host's ranks get (its ``env`` names where a fake nvidia-smi is), and assigns a rank
    per GPU it shows; a host where it cannot run is a ConfigError saying so."""
    import torch

    from flodl import ConfigError, TensorBatchDataset, TrainerConfig
    from flodl.launch.cluster import Cluster
    from flodl.launch.launcher import placed

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text(
        "#!/bin/sh\nprintf '0, GPU-a, NVIDIA L4, 23034\\n1, GPU-b, NVIDIA L4, 23034\\n'\n"
    )
    smi.chmod(0o755)
    worker = sshd.worker().model_dump()
    config = TrainerConfig(dataset=TensorBatchDataset(torch.zeros(64, 2)))

    def cluster(path: str) -> Cluster:
        box = {**worker, "host": "gpubox", "devices": "all", "env": {"PATH": path}}
        box["ssh"] = {**box["ssh"], "target": "127.0.0.1"}
        return Cluster.from_mapping({"workers": [box]})

    resolved = placed(config, cluster(f"{bin_dir}:/usr/bin:/bin"), frozenset())
    assert [s.device for s in resolved.ranks()] == ["cuda:0", "cuda:1"]
    with pytest.raises(ConfigError, match=r"probing the GPUs \(nvidia-smi\) on gpubox over ssh"):
        placed(config, cluster("/nonexistent"), frozenset())
