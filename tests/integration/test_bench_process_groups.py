"""``benchmarks/_common.run_in_group``, which the suite (``python -m benchmarks``), bench_demo and
bench_replay run their jobs with: a job past its limit is killed with every process it started,
so no rank of a killed run outlives it to compete with the next measurement."""

from __future__ import annotations

import importlib
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

pytestmark = pytest.mark.integration

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture
def common(monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    yield importlib.import_module("_common")
    sys.modules.pop("_common", None)


def _gone(pid: int) -> bool:
    """Killed: reaped, or a zombie awaiting its new parent's wait()."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def job(pid_file: Path, then: str) -> list[str]:
    """A job that starts a child sleeping for a minute, writes its pid, then runs ``then``."""
    script = (
        "import subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
        f"{then}\n"
    )
    return [sys.executable, "-c", script]


@pytest.mark.timeout(60)
def test_a_job_past_its_limit_is_killed_with_its_children(
    common: ModuleType, tmp_path: Path
) -> None:
    pid_file = tmp_path / "child.pid"
    code, out, _ = common.run_in_group(
        job(pid_file, "time.sleep(60)"), 3.0, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    assert code is None and out == b""
    child = int(pid_file.read_text())
    assert common.wait_for(lambda: _gone(child), 10.0), "the job's child outlived its kill"


@pytest.mark.timeout(60)
def test_a_finished_job_gives_its_status_and_output_and_leaves_no_straggler(
    common: ModuleType, tmp_path: Path
) -> None:
    pid_file = tmp_path / "child.pid"
    code, out, err = common.run_in_group(
        job(pid_file, "print('done', flush=True); raise SystemExit(3)"),
        30.0,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert (code, out, err) == (3, b"done\n", b"")
    child = int(pid_file.read_text())
    assert common.wait_for(lambda: _gone(child), 10.0), "a straggler outlived its finished job"
