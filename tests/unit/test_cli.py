"""The console script's basic contract: --version, --help, python -m flodl."""

from __future__ import annotations

import subprocess
import sys

import pytest

import flodl
from flodl.cli import main


def test_version_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"flodl {flodl.__version__}"


def test_no_command_prints_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 0
    assert "usage: flodl" in capsys.readouterr().out


def test_unknown_option_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--no-such-flag"])
    assert exc.value.code == 2
    assert "unrecognized arguments: --no-such-flag" in capsys.readouterr().err


def test_python_dash_m_is_the_same_entry() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "flodl", "--version"],
        capture_output=True, text=True, timeout=60, check=True,
    )
    assert out.stdout.strip() == f"flodl {flodl.__version__}"
