"""A native crash in a run's processes prints their Python stacks (docs/design.md §8, "Crash
traces"), on real processes: a rank that segfaults in its training step, and the launcher
(which hosts the coordinator and the reduce server) killed by SIGSEGV while the ranks train.
Without the trace either would die with nothing said but its signal."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from processes import left_running, signal_at_line

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tests" / "integration" / "callbacks_main.py"
EXIT_WAIT_S = 90.0
FATAL = "Fatal Python error: Segmentation fault"


def start(tmp_path: Path, tag: str, *args: str) -> subprocess.Popen[str]:
    """The run, its stderr (the ranks' too: they inherit it) to ``tmp_path / "stderr"``, its
    stdout a pipe to read while it trains."""
    with (tmp_path / "stderr").open("w") as err:
        return subprocess.Popen(
            [sys.executable, str(SCRIPT), "--tag", tag, "--log-dir", str(tmp_path / "logs"), *args],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            cwd=REPO,
            env={**os.environ, "FLODL_NET_TIMEOUT_SCALE": "0.1"},
        )


def stacks(text: str) -> list[str]:
    """The frames of flodl's code in a faulthandler dump."""
    return [
        line for line in text.splitlines() if line.strip().startswith("File ") and "flodl" in line
    ]


def test_a_rank_that_segfaults_prints_its_stacks_and_the_run_goes_on(tmp_path: Path) -> None:
    tag = f"flodl-crash-{uuid.uuid4().hex}"
    done = subprocess.run(
        [
            *(sys.executable, str(SCRIPT), "--tag", tag, "--log-dir", str(tmp_path / "logs")),
            *("--ranks", "3", "--mode", "cpu_cadence", "--epochs", "2", "--samples", "1024"),
            *("--crash-rank", "1", "--crash-step", "5", "--crash-segv"),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=REPO,
        check=False,
    )
    assert left_running(tag, EXIT_WAIT_S) == []
    err = done.stderr
    assert FATAL in err, err[-3000:]
    dump = err[err.index(FATAL) :]
    assert any("callbacks_main.py" in line for line in dump.splitlines()), dump[:3000]
    assert stacks(dump), dump[:3000]  # (the rank's own frames: its training step under flodl)
    assert done.returncode == 0, err[-3000:]  # the survivors finished the run
    assert "DONE " in done.stdout


def test_the_launcher_killed_by_sigsegv_prints_its_stacks_and_the_ranks_exit(
    tmp_path: Path,
) -> None:
    tag = f"flodl-crash-{uuid.uuid4().hex}"
    proc = start(
        tmp_path,
        tag,
        *("--ranks", "2", "--mode", "cpu_cadence", "--epochs", "30", "--samples", "2048"),
        *("--slow", "0:10,1:10"),
    )
    assert signal_at_line(proc, "METRICS ", signal.SIGSEGV) == -signal.SIGSEGV
    assert left_running(tag, EXIT_WAIT_S) == [], "ranks outlived their crashed launcher"
    err = (tmp_path / "stderr").read_text()
    assert FATAL in err, err[-3000:]
    dump = err[err.index(FATAL) :]
    # every thread: the service's, the reduce server's, the watchers' and the user's main one
    assert dump.count("Thread 0x") >= 3, dump[:3000]
    assert stacks(dump), dump[:3000]


def test_the_handler_is_the_runs_while_they_last_and_a_users_is_left_alone() -> None:
    code = """if True:
        import faulthandler
        from flodl.launch import crash_trace
        a = crash_trace.enable()
        b = crash_trace.enable()  # (two launchers in one interpreter)
        assert a and b and faulthandler.is_enabled()
        crash_trace.disable(a)
        assert faulthandler.is_enabled(), "the second run still holds it"
        crash_trace.disable(b)
        assert not faulthandler.is_enabled(), "the last run turned it off"
        faulthandler.enable()  # the user's own
        mine = crash_trace.enable()
        assert not mine
        crash_trace.disable(mine)
        assert faulthandler.is_enabled(), "a user's handler was turned off"
        """
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
