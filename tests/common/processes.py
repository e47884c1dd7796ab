"""Which processes of a test's run are still running: shared by the integration and chaos
tests (``tests/common`` is on the import path: pytest's ``pythonpath`` and mypy's
``mypy_path`` in pyproject.toml)."""

from __future__ import annotations

import subprocess
import time


def processes_with(tag: str) -> list[str]:
    """Processes whose command line holds ``tag`` (a run's ``--tag``)."""
    out = subprocess.run(
        ["ps", "-ww", "-eo", "pid,args"], check=True, capture_output=True, text=True
    )
    return [line for line in out.stdout.splitlines() if tag in line and "ps -ww" not in line]


def left_running(tag: str, within_s: float) -> list[str]:
    """The processes of the run tagged ``tag`` still running after up to ``within_s`` for
    them to exit on their own (checked every 0.2 s; the first empty check ends the wait)."""
    deadline = time.monotonic() + within_s
    while (left := processes_with(tag)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def signal_at_line(
    proc: subprocess.Popen[str],
    prefix: str,
    sig: int,
    *,
    pause_s: float = 0.0,
    within_s: float = 120.0,
    exit_within_s: float = 30.0,
) -> int:
    """Read ``proc``'s stdout until a line starting with ``prefix``, wait ``pause_s``, send it
    ``sig`` and return its exit status. Fails if it ended before; it never outlives the call
    (killed on any failure), and its stdout is closed."""
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line or line.startswith(prefix):
                break
        time.sleep(pause_s)
        assert proc.poll() is None, f"the run ended before it could be sent signal {sig}"
        proc.send_signal(sig)
        return proc.wait(timeout=exit_within_s)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        assert proc.stdout is not None
        proc.stdout.close()
