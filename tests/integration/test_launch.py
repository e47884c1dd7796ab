"""``flodl launch --cluster fdl.cluster.yml -- python train.py``: two "hosts" that are this
machine (named in FLODL_LOCAL_HOSTS, so reached by local exec), three ranks."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from processes import processes_with

pytestmark = pytest.mark.integration

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "trainer_main.py"
REPO = HERE.parents[1]

TWO_HOSTS = """
cluster:
  controller: {host: 127.0.0.1, port: 0}
  workers:
    - host: host-a
      devices: [cpu]
    - host: host-b
      devices: [cpu, cpu]
      env: {FLODL_TEST_MARK: on-host-b}
"""


def launch(
    yml: Path, *cmd: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "FLODL_LOCAL_HOSTS": "host-a,host-b", **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "flodl", "launch", "--cluster", str(yml), "--", *cmd],
        capture_output=True,
        text=True,
        timeout=150,
        check=False,
        cwd=REPO,
        env=env,
    )


@pytest.mark.timeout(160)
def test_launch_a_two_host_cluster_by_local_exec(tmp_path: Path) -> None:
    yml = tmp_path / "fdl.cluster.yml"
    yml.write_text(TWO_HOSTS)
    tag = f"flodl-test-{uuid.uuid4().hex}"
    out = launch(yml, sys.executable, str(SCRIPT), "--tag", tag, "--ranks", "1", "--epochs", "2")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "DONE params=4 world=3" in out.stdout
    assert "sigterm-restored=True" in out.stdout  # the launcher's SIGTERM handler is gone
    for rank in range(3):  # every rank's output arrives prefixed with its rank
        assert f"[rank {rank}] process rank={rank}" in out.stdout


def test_launch_refuses_a_bad_cluster_file_naming_the_problem(tmp_path: Path) -> None:
    yml = tmp_path / "fdl.cluster.yml"
    yml.write_text("cluster:\n  workers:\n    - host: a\n      devices: [cpu]\n      ranks: [0]\n")
    out = launch(yml, sys.executable, "-c", "print('never runs')")
    assert out.returncode == 2
    assert "ranks are assigned by worker order" in out.stderr
    assert "never runs" not in out.stdout


def test_launch_without_a_command_is_a_usage_error(tmp_path: Path) -> None:
    yml = tmp_path / "fdl.cluster.yml"
    yml.write_text(TWO_HOSTS)
    out = launch(yml)
    assert out.returncode == 2
    assert "give the command to run" in out.stderr


@pytest.mark.timeout(160)
def test_a_rank_that_cannot_be_started_fails_the_launch_and_stops_the_others(
    tmp_path: Path,
) -> None:
    # host-b is remote here and there is no ssh on PATH: rank 0 (host-a) is already running
    # when rank 1's start fails; the launcher must stop it and the coordinator, remove its run
    # directory, and say which rank could not start and why
    yml = tmp_path / "fdl.cluster.yml"
    yml.write_text(TWO_HOSTS)
    empty, scratch = tmp_path / "bin", tmp_path / "tmp"
    empty.mkdir()
    scratch.mkdir()
    tag = f"flodl-test-{uuid.uuid4().hex}"
    env = {"FLODL_LOCAL_HOSTS": "host-a", "PATH": str(empty), "TMPDIR": str(scratch)}
    cmd = (sys.executable, str(SCRIPT), "--tag", tag, "--ranks", "1", "--epochs", "2")
    out = launch(yml, *cmd, env=env)
    assert out.returncode != 0
    assert "could not start rank 1 on host-b (over ssh)" in out.stderr, out.stderr[-3000:]
    assert "'ssh'" in out.stderr  # the missing program, named
    assert processes_with(tag) == []  # rank 0 was stopped before the launcher returned
    assert list(scratch.glob("flodl-*")) == []  # no run directory left behind


HANGING_START = """
import asyncio, signal, sys, threading
sys.path.insert(0, {here!r})
import flodl.launch.launcher as launcher
from flodl.service.coordinator import CoordinatorService
from tiny_job import train

async def never(self):
    await asyncio.sleep(3600)

CoordinatorService.start = never  # the coordinator thread never starts listening
launcher.SERVICE_START_S = 0.5
try:
    train(lambda m, b: m(b[0]).sum(), samples=256, epochs=1, mode="cpu_cadence", ranks=2)
except Exception as exc:
    print("ERROR", type(exc).__name__, exc)
print("THREADS", sorted(t.name for t in threading.enumerate()))
print("SIGTERM", signal.getsignal(signal.SIGTERM) is signal.SIG_DFL)
"""


@pytest.mark.timeout(60)
def test_a_coordinator_that_does_not_start_fails_the_run_naming_it(tmp_path: Path) -> None:
    script, scratch = tmp_path / "hang.py", tmp_path / "tmp"
    script.write_text(HANGING_START.format(here=str(HERE)))
    scratch.mkdir()
    out = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=50,
        check=False,
        cwd=REPO,
        env={**os.environ, "TMPDIR": str(scratch)},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "ERROR FlodlError the coordinator did not start listening within 0.5 s" in out.stdout
    assert "flodl-coord" not in out.stdout  # its thread was stopped, not left behind
    assert list(scratch.glob("flodl-*")) == []  # nor its run directory
    assert "SIGTERM True" in out.stdout  # nor its SIGTERM handler
