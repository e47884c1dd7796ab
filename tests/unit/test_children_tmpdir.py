"""The suite's own hygiene (tests/conftest.py): a process a test starts keeps its temporary
files inside the session's pytest temporary directory, never in the system's, so that what a
child cannot remove (torchrun's log directory, the run directory of a launcher crashed on
purpose) does not pile up in /tmp from run to run."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest


def test_a_child_process_puts_its_temporary_files_under_the_sessions_basetemp(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    done = subprocess.run(
        [sys.executable, "-c", "import tempfile; print(tempfile.mkdtemp(prefix='flodl-'))"],
        capture_output=True,
        text=True,
        check=True,
        env=dict(os.environ),
    )
    made = Path(done.stdout.strip())
    try:
        assert made.is_relative_to(tmp_path_factory.getbasetemp())
        assert made.parent != Path(tempfile.gettempdir())  # (the system's, this process's own)
    finally:
        made.rmdir()
