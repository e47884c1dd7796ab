"""The README's examples run as documented on this machine."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


def run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        list(argv), cwd=REPO, capture_output=True, text=True, timeout=150, check=False
    )


@pytest.mark.timeout(160)
def test_single_cpu_example() -> None:
    out = run(sys.executable, "examples/single_cpu.py")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "epoch 2: loss" in out.stdout
    assert "done: 4 parameter tensors" in out.stdout


@pytest.mark.timeout(160)
def test_local_ranks_example() -> None:
    out = run(sys.executable, "examples/local_ranks.py", "--ranks", "2", "--epochs", "1")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "done: 4 parameter tensors, world 2" in out.stdout


@pytest.mark.timeout(160)
def test_standalone_coordinator_example() -> None:
    bindir = Path(sys.executable).parent
    env_path = f"{bindir}:{Path('/usr/bin')}:{Path('/bin')}"
    out = subprocess.run(
        ["bash", "examples/standalone_coord.sh"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=150,
        check=False,
        # a bare environment, as a user's shell; TMPDIR is the suite's (tests/conftest.py), where
        # torchrun leaves its log directory
        env={"PATH": env_path, "HOME": str(Path.home()), "TMPDIR": os.environ["TMPDIR"]},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "trained 4 parameter tensors with 2 ranks" in out.stdout


@pytest.mark.timeout(160)
def test_cluster_file_example_with_flodl_launch() -> None:
    env = {**os.environ, "FLODL_LOCAL_HOSTS": "node-a,node-b"}
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "flodl",
            "launch",
            "--cluster",
            "examples/fdl.cluster.yml",
            "--",
            sys.executable,
            "examples/local_ranks.py",
            "--ranks",
            "1",
            "--epochs",
            "1",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=150,
        check=False,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "done: 4 parameter tensors, world 3" in out.stdout


@pytest.mark.timeout(160)
def test_cooperative_worker_example_saves_and_resumes(tmp_path: Path) -> None:
    stem = str(tmp_path / "ckpt")
    first = run(sys.executable, "examples/cooperative_worker.py", "--epochs", "1", "--save", stem)
    assert first.returncode == 0, first.stderr[-2000:]
    assert "eval after epoch 0:" in first.stdout  # epochs are 0-based, the final eval too
    assert "done: 4 parameter tensors, world 2" in first.stdout
    again = run(
        sys.executable,
        "examples/cooperative_worker.py",
        *("--epochs", "2", "--save", stem, "--resume", stem),
    )
    assert again.returncode == 0, again.stderr[-2000:]
    assert "eval after epoch 1:" in again.stdout and "eval after epoch 0" not in again.stdout
