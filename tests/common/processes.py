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
