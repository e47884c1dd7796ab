"""The console script's basic contract: --version, --help, python -m flodl."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

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
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert out.stdout.strip() == f"flodl {flodl.__version__}"


def test_sim_prints_every_requested_mode_next_to_solo(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(
        ["sim", "--speeds", "1,3", "--dataset-len", "6400", "--modes", "cpu_cadence,nccl_sync"]
    )
    assert rc == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line for line in out.splitlines()[2:]}
    assert set(rows) == {"solo", "ddp_lockstep", "cpu_cadence", "nccl_sync"}
    assert "2 ranks, ms/batch [10.0, 30.0]" in out
    # lock-step: 6400 / 2 ranks / batch 32 = 100 steps of the slow rank's 30 ms + 5 ms reduce
    lockstep = rows["ddp_lockstep"].split()
    assert lockstep[1] == "3.50" and lockstep[3] == "100"


def test_sim_json_is_machine_readable(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    rc = main(["sim", "--speeds", "1,1", "--dataset-len", "3200", "--modes", "cpu_async", "--json"])
    assert rc == 0
    data = json.loads(capsys.readouterr().out)
    assert set(data) == {"solo", "cpu_async", "ddp_lockstep"}
    assert data["ddp_lockstep"] == {"wall_s": 50 * (10 + 5) / 1000, "syncs": 50}
    assert data["cpu_async"]["ok"] is True
    assert data["cpu_async"]["syncs"] > 0


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--speeds", "1,x"], "non-numeric"),
        (["--speeds", "1,-2"], "finite number > 0"),
        (["--speeds", "1,,2"], "comma-separated"),
        (["--speeds", "1", "--modes", "cpu_fast"], "unknown ['cpu_fast']"),
        (["--speeds", "1", "--epochs", "0"], "--epochs must be >= 1"),
        (["--speeds", "1", "--base-ms", "nan"], "--base-ms must be a finite number > 0"),
    ],
)
def test_sim_rejects_bad_input_with_a_clear_message(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["sim", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("flodl sim: error:")
    assert message in err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--secret-file", "/proc/flodl/none"], "does not exist and cannot be created"),
        (["--world-size", "0"], "world_size 0 must be in 1..65536"),
        (["--mode", "warp"], "--mode 'warp': expected one of"),
        (["--outer", "adam"], "--outer 'adam': expected avg"),
        (["--port", "70000"], "--port 70000 must be in 0..65535"),
        (["--port", "29400", "--data-port", "29400"], "--port and --data-port are both 29400"),
        (["--max-restarts", "-1"], "--max-restarts -1 must be in 0..1000"),
    ],
    ids=["secret-unwritable", "world", "mode", "outer", "port", "same-ports", "restarts"],
)
def test_bad_coord_options_exit_2_naming_the_problem(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Every bad option of ``flodl coord`` is one line on stderr and exit 2, before anything
    listens (a read-only secret volume with the wrong key used to end in a traceback)."""
    base = {"--world-size": "2", "--secret-file": str(tmp_path / "secret")}
    for flag, value in zip(args[::2], args[1::2], strict=True):
        base[flag] = value
    argv = ["coord", *[x for pair in base.items() for x in pair]]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("flodl coord: error: "), err
    assert message in err


def test_the_demo_runs_its_default_epochs_and_its_help_says_how_many(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The parser leaves --epochs unset (it does not import the demo, which imports torch);
    the command then takes the demo's own default, and the help names that number."""
    import flodl.demo
    from flodl.demo.run import DEFAULT_EPOCHS, DemoOptions

    ran: list[DemoOptions] = []
    monkeypatch.setattr(flodl.demo, "run_demo", lambda options: ran.append(options))
    assert main(["demo", "--out", "unused"]) == 0
    assert main(["demo", "--out", "unused", "--epochs", "5"]) == 0
    assert [o.epochs for o in ran] == [DEFAULT_EPOCHS, 5]
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    assert f"(default {DEFAULT_EPOCHS})" in " ".join(capsys.readouterr().out.split())


def test_no_command_but_the_demo_imports_torch() -> None:
    """Building the parser, --help and a whole `flodl sim` stay clear of torch (about 2 s of
    start-up here): only the demo, the coordinator and the ranks need it."""
    code = (
        "import contextlib, io, sys\n"
        "from flodl.cli import main\n"
        "for argv in (['records', '--help'], ['demo', '--help'],"
        " ['sim', '--speeds', '1,2', '--dataset-len', '400']):\n"
        "    with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
        "        main(argv)\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.strip() == "[]", out.stderr
