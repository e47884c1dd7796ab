"""Tier 4: ranks started by an external launcher join a standalone ``flodl coord``."""

from __future__ import annotations

import os
import signal
import socket
import stat
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from flodl.config import MODES

pytestmark = pytest.mark.integration

HERE = Path(__file__).resolve().parent
JOIN = HERE / "join_main.py"


RUN_IDS: dict[str, str] = {}
"""Coordinator address → its run id (what the ranks put in FLODL_RUN_ID)."""
STARTS: dict[str, str] = {}
"""Coordinator address → the first line it printed (the run, its ranks, its core)."""


def start_coord(
    tmp: Path,
    *extra: str,
    env: dict[str, str] | None = None,
    verbose: bool = False,
    world: Sequence[str] = ("--world-size", "2"),
    dataset_len: int = 2048,
    job: Sequence[str] | None = None,
    cwd: Path | None = None,
) -> tuple[subprocess.Popen[str], str]:
    """``flodl coord`` with ``job`` as its job options (default: the dataset length and 2
    epochs, which the ranks of these tests train: assertions that hold), run in ``cwd``."""
    if job is None:
        job = ("--dataset-len", str(dataset_len), "--epochs", "2")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "flodl",
            *(["-v"] if verbose else []),
            "coord",
            *world,
            *job,
            "--secret-file",
            str(tmp / "secret"),
            *extra,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=cwd,
    )
    assert proc.stdout is not None
    first = proc.stdout.readline()
    second = proc.stdout.readline()
    assert "flodl coordinator" in first, (first, proc.stderr.read() if proc.stderr else "")
    address = second.split("FLODL_COORD=")[1].split()[0]
    # the ranks need the coordinator's (random) run id: it is on the same line
    RUN_IDS[address] = second.split("FLODL_RUN_ID=")[1].split()[0]
    STARTS[address] = first
    return proc, address


def flodl_env(
    address: str, tmp: Path, rank: int, base: Mapping[str, str] = os.environ, world: int = 2
) -> dict[str, str]:
    """``base`` plus what a rank needs to join the coordinator at ``address`` by hand."""
    return {
        **base,
        "FLODL_COORD": address,
        "FLODL_RUN_ID": RUN_IDS[address],
        "FLODL_SECRET_FILE": str(tmp / "secret"),
        "FLODL_RANK": str(rank),
        "FLODL_WORLD_SIZE": str(world),
    }


def reap(procs: Sequence[subprocess.Popen[Any]]) -> None:
    """Kill what is still running of ``procs`` and collect every one (pipes closed)."""
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.communicate(timeout=30)


def wait_for_training(coord: subprocess.Popen[str]) -> list[str]:
    """Read the (verbose) coordinator's log until its first epoch closes; the lines read."""
    assert coord.stderr is not None
    lines: list[str] = []
    while "epoch 0:" not in (line := coord.stderr.readline()):
        assert line, "the coordinator ended before its first epoch"
        lines.append(line)
    return lines


def stop(proc: subprocess.Popen[str]) -> tuple[str, str]:
    if proc.poll() is None:
        proc.kill()
    out, err = proc.communicate(timeout=30)
    return out, err


def identical(tmp: Path, world: int = 2) -> None:
    a = torch.load(tmp / "rank0.pt", weights_only=True)["params"]
    for r in range(1, world):
        b = torch.load(tmp / f"rank{r}.pt", weights_only=True)["params"]
        assert all(torch.allclose(x, y, atol=1e-6) for x, y in zip(a, b, strict=True)), r


@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", ["cpu_cadence", "nccl_cadence"])
def test_torchrun_ranks_join_a_standalone_coordinator(mode: str, tmp_path: Path) -> None:
    coord, address = start_coord(tmp_path, "--mode", mode)
    try:
        env = {
            **os.environ,
            "FLODL_COORD": address,
            "FLODL_RUN_ID": RUN_IDS[address],
            "FLODL_SECRET_FILE": str(tmp_path / "secret"),
        }
        run = subprocess.run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc-per-node",
                "2",
                str(JOIN),
                "--out",
                str(tmp_path),
                "--mode",
                mode,
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=150,
            check=False,
        )
        assert run.returncode == 0, run.stderr[-3000:]
        assert coord.wait(timeout=30) == 0
        out, _ = stop(coord)
        assert "run complete" in out
        identical(tmp_path)
        assert (tmp_path / "primary").read_text() == "0"
        # the secret is never printed
        secret = (tmp_path / "secret").read_text().strip()
        assert secret not in out
        assert stat.S_IMODE((tmp_path / "secret").stat().st_mode) == 0o600
    finally:
        stop(coord)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.mark.timeout(240)
def test_a_torchrun_elastic_restart_resumes_the_run_from_its_last_bundle(tmp_path: Path) -> None:
    """``torchrun --nnodes 1:3 --max-restarts 2``: a failing worker makes torchrun restart the
    whole worker group, so every rank is lost at once. ``flodl coord --max-restarts 1`` waits on
    its port, the restarted workers (``resume_from`` their ``save_path``) bring the job again,
    and the run resumes from its last committed bundle and completes."""
    stem = str(tmp_path / "ck")
    coord, address = start_coord(tmp_path, "--max-restarts", "1", job=())
    assert coord.stdout is not None
    env = {
        **os.environ,
        "FLODL_COORD": address,
        "FLODL_RUN_ID": RUN_IDS[address],
        "FLODL_SECRET_FILE": str(tmp_path / "secret"),
    }
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:3"]
    cmd += ["--nproc-per-node", "2", "--max-restarts", "2", "--rdzv-backend", "c10d"]
    cmd += ["--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", "flodl-test"]
    cmd += ["--rdzv-conf", "last_call_timeout=1", str(JOIN), "--out", str(tmp_path)]
    cmd += ["--epochs", "4", "--slow-ms", "20", "--save", stem, "--checkpoint-every", "1"]
    cmd += ["--resume-if-saved", "--fail-once", "1"]
    try:
        run = subprocess.run(
            cmd, env=env, capture_output=True, text=True, timeout=200, check=False, cwd=tmp_path
        )
        assert run.returncode == 0, run.stderr[-3000:]
        assert "rank 1: failing on purpose after a committed bundle" in run.stdout
        assert coord.wait(timeout=30) == 0
        out, _ = stop(coord)
    finally:
        stop(coord)
    lines = [ln for ln in out.splitlines() if ln.startswith("flodl coordinator: ")]
    defined = [ln for ln in lines if "job defined by rank" in ln]
    assert len(defined) == 2, out
    assert f"resuming from {stem}" in defined[1], out
    restart = [ln for ln in lines if "restart 1 of 1" in ln]
    assert len(restart) == 1, out
    assert f"to resume from the bundle {stem}" in restart[0], out
    assert lines[-1] == "flodl coordinator: run complete", out
    identical(tmp_path)


@pytest.mark.timeout(120)
def test_ranks_started_by_hand_join_with_flodl_variables(tmp_path: Path) -> None:
    coord, address = start_coord(tmp_path, "--mode", "cpu_cadence")
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for rank in range(2):
            env = flodl_env(address, tmp_path, rank)
            procs.append(
                subprocess.Popen([sys.executable, str(JOIN), "--out", str(tmp_path)], env=env)
            )
        assert [p.wait(timeout=100) for p in procs] == [0, 0]
        assert coord.wait(timeout=30) == 0
        identical(tmp_path)
    finally:
        reap(procs)
        stop(coord)


@pytest.mark.timeout(180)
def test_the_ranks_bring_the_job_and_a_rank_with_another_is_refused(tmp_path: Path) -> None:
    """``flodl coord --world-size 2`` alone: the first rank's hello defines the job, a rank
    with another one is refused naming the field and both values, and nothing changed (the
    right rank then joins and the run trains); an option given to ``flodl coord`` is an
    assertion, and a first rank that breaks it defines nothing."""
    data_port = free_port()
    coord, address = start_coord(
        tmp_path, "--data-port", str(data_port), job=("--mode", "cpu_sync")
    )
    assert coord.stdout is not None
    procs: list[subprocess.Popen[str]] = []

    def rank(r: int, *args: str) -> subprocess.Popen[str]:
        cmd = [sys.executable, str(JOIN), "--out", str(tmp_path), "--samples", "1024", *args]
        proc = subprocess.Popen(
            cmd, env=flodl_env(address, tmp_path, r), stderr=subprocess.PIPE, text=True
        )
        procs.append(proc)
        return proc

    try:
        wrong_mode = rank(0, "--mode", "cpu_cadence", "--epochs", "1")
        assert wrong_mode.wait(timeout=100) != 0
        with pytest.raises(ConnectionRefusedError):  # no job yet: no data service either
            socket.create_connection(("127.0.0.1", data_port), timeout=5).close()
        assert (
            "--mode cpu_sync but rank 0 brings elche.mode 'cpu_cadence'"
            in (wrong_mode.communicate(timeout=30)[1])
        )
        first = rank(0, "--mode", "cpu_sync", "--epochs", "1")
        line = coord.stdout.readline()
        assert line.startswith("flodl coordinator: job defined by rank 0: cpu_sync, "), line
        assert "dataset_len 1024, batch_size 32, epochs 1" in line, line
        socket.create_connection(("127.0.0.1", data_port), timeout=5).close()  # --data-port
        other = rank(1, "--mode", "cpu_sync", "--epochs", "3")
        assert other.wait(timeout=100) != 0
        assert (
            "job num_epochs 3 differs from the first rank's 1" in other.communicate(timeout=30)[1]
        )
        second = rank(1, "--mode", "cpu_sync", "--epochs", "1")
        assert [first.wait(timeout=100), second.wait(timeout=100)] == [0, 0]
        assert coord.wait(timeout=30) == 0
        identical(tmp_path)
    finally:
        reap(procs)
        stop(coord)


@pytest.mark.timeout(150)
def test_a_standalone_coordinator_saves_bundles_and_resumes(tmp_path: Path) -> None:
    from flodl import checkpoint

    stem = str(tmp_path / "ck")

    def cohort(*args: str) -> None:
        procs = []
        for rank in range(2):
            env = flodl_env(address, tmp_path, rank)
            cmd = [sys.executable, str(JOIN), "--out", str(tmp_path), "--save", stem, *args]
            procs.append(subprocess.Popen(cmd, env=env))
        try:
            assert [p.wait(timeout=100) for p in procs] == [0, 0]
        finally:
            reap(procs)

    coord, address = start_coord(tmp_path, "--mode", "cpu_cadence", "--save-path", stem)
    try:
        cohort()
        assert coord.wait(timeout=30) == 0
    finally:
        stop(coord)
    meta = checkpoint.read_meta(stem, world_size=2)
    assert meta.epoch == 2 and meta.save_reason == "graceful_shutdown"
    saved = checkpoint.load_model(stem)
    final = torch.load(tmp_path / "rank0.pt", weights_only=True)["params"]
    assert all(torch.equal(a, b) for a, b in zip(saved.params, final, strict=True))
    # resume with 4 epochs: the coordinator seeds from the meta, the ranks from the files
    coord, address = start_coord(
        tmp_path,
        "--mode",
        "cpu_cadence",
        "--save-path",
        stem,
        "--resume-from",
        stem,
        "--epochs",
        "4",
    )
    try:
        cohort("--resume", stem, "--epochs", "4")
        assert coord.wait(timeout=30) == 0
    finally:
        stop(coord)
    end = checkpoint.read_meta(stem, world_size=2)
    assert end.epoch == 4 and end.global_step == 2 * meta.global_step


def test_a_world_readable_secret_file_is_refused(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("00" * 32)
    secret.chmod(0o644)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "flodl",
            "coord",
            "--world-size",
            "2",
            "--dataset-len",
            "64",
            "--secret-file",
            str(secret),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 2
    assert f"chmod 600 {secret}" in out.stderr


def test_bad_coordinator_options_fail_with_the_field_named(tmp_path: Path) -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "flodl",
            "coord",
            "--world-size",
            "0",
            "--dataset-len",
            "64",
            "--secret-file",
            str(tmp_path / "s"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 2
    assert "world_size" in out.stderr


@pytest.mark.timeout(150)
@pytest.mark.parametrize(
    ("scale", "hb"), [(None, 10.0), ("0.3", 3.0)], ids=["hb10", "hb10-scale0.3"]
)
def test_ranks_obey_the_standalone_coordinators_timeouts(
    scale: str | None, hb: float, tmp_path: Path
) -> None:
    """``flodl coord --heartbeat-timeout 10`` (scaled by its own FLODL_NET_TIMEOUT_SCALE) rules
    the ranks' deadlines: ranks configured with the default 30 s, and no scale, lose a silent
    coordinator after its timeout, not theirs, and say so in their death records, which a rank
    of this tier writes under ``flodl-runs/<run id>/`` when it has no save_path."""
    from flodl import checkpoint

    coord_env = {k: v for k, v in os.environ.items() if k != "FLODL_NET_TIMEOUT_SCALE"}
    if scale is not None:
        coord_env["FLODL_NET_TIMEOUT_SCALE"] = scale
    coord, address = start_coord(
        tmp_path,
        *("--mode", "cpu_cadence", "--heartbeat-timeout", "10", "--epochs", "500"),
        env=coord_env,
        verbose=True,
    )
    rank_env = {k: v for k, v in os.environ.items() if k != "FLODL_NET_TIMEOUT_SCALE"}
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for rank in range(2):
            env = flodl_env(address, tmp_path, rank, rank_env)
            cmd = [sys.executable, str(JOIN), "--out", str(tmp_path), "--epochs", "500"]
            with (tmp_path / f"rank{rank}.stderr").open("wb") as err:
                procs.append(subprocess.Popen(cmd, env=env, stderr=err, cwd=tmp_path))
        wait_for_training(coord)
        coord.send_signal(signal.SIGSTOP)  # silent, connections still open
        codes = [p.wait(timeout=120) for p in procs]
        assert all(code != 0 for code in codes)
        # no save_path, no FLODL_STEM: the documented default place, under the rank's cwd
        stem = tmp_path / "flodl-runs" / RUN_IDS[address] / "run"
        for rank in range(2):
            record = checkpoint.read_death_record(str(stem), rank)
            assert f"liveness timeout {hb:g} s" in record.error, record.error
            # a rank of this tier trains inside run(), which raises what ended it
            err_lines = (tmp_path / f"rank{rank}.stderr").read_text().strip().splitlines()
            assert err_lines[-1].startswith("flodl.errors.CoordinatorLost: "), err_lines[-5:]
            assert "return Trainer.run(" in "\n".join(err_lines), err_lines[-12:]  # tiny_job
    finally:
        coord.send_signal(signal.SIGCONT)
        reap(procs)
        stop(coord)


@pytest.mark.timeout(240)
def test_a_stopped_standalone_run_says_so_and_how_to_resume(tmp_path: Path) -> None:
    """A lone collective survivor stops the run (ShutdownWithSave ``single_survivor``): the
    coordinator exits 1 with one line naming the reason and the command that resumes from the
    stop's bundle; the survivor's ``join()`` raises TrainingStopped with the Trainer's call.
    The coordinator's process froze its heap once the run trained and gave it back at the
    end (docs/design.md §2, "Coordinator cost")."""
    stem = str(tmp_path / "ck")
    coord, address = start_coord(
        tmp_path,
        *("--mode", "nccl_cadence", "--epochs", "500", "--save-path", stem),
        verbose=True,
    )
    procs: list[subprocess.Popen[str]] = []
    try:
        for rank in range(2):
            env = flodl_env(address, tmp_path, rank)
            cmd = [sys.executable, str(JOIN), "--out", str(tmp_path), "--epochs", "500"]
            cmd += ["--mode", "nccl_cadence", "--save", stem]
            procs.append(
                subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
            )
        before = wait_for_training(coord)
        procs[1].kill()
        assert procs[0].wait(timeout=120) == 1
        _, survivor = procs[0].communicate(timeout=30)
        assert coord.wait(timeout=60) == 1
        _, err = coord.communicate(timeout=30)
    finally:
        reap(procs)
        stop(coord)
    assert [ln for ln in before if "heap frozen for the run (" in ln], before
    assert "heap unfrozen: the run is over" in err, err[-3000:]
    lines = [ln for ln in err.splitlines() if ln.startswith("flodl coord: ")]
    assert len(lines) == 1, err[-3000:]
    assert lines[0].startswith("flodl coord: training stopped (single_survivor): ")
    assert (
        f"the ranks with resume_from={stem!r} (or `flodl coord ... --resume-from {stem}`)"
        in (lines[0])
    )
    assert "samples of it still to train" in lines[0]
    last = survivor.strip().splitlines()[-1].removeprefix("[rank0]: ")  # torch's prefix
    assert last.startswith("flodl.errors.TrainingStopped: training stopped (single_survivor)")
    assert f".resume_from({stem!r})" in last


LATE_JOIN_EPOCHS = 10
"""About 1 s an epoch for two ranks at 30 ms a step: the late rank starts when the first closes
and needs the rest to start, join, take the consensus and train some. With 6 (about 5 s left)
a CI run under load once saw it join and get no work before the end."""


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", MODES)
def test_a_rank_started_after_the_minimum_world_size_joins_the_running_run(
    mode: str, tmp_path: Path
) -> None:
    coord, address = start_coord(
        tmp_path,
        *("--mode", mode, "--epochs", str(LATE_JOIN_EPOCHS)),
        world=("--min-world-size", "2", "--max-world-size", "3"),
        verbose=True,
    )
    procs: list[subprocess.Popen[bytes]] = []
    rank_args = [str(JOIN), "--out", str(tmp_path), "--mode", mode]
    rank_args += ["--epochs", str(LATE_JOIN_EPOCHS)]
    rank_args += ["--slow-ms", "30"]
    try:
        for rank in range(2):
            env = flodl_env(address, tmp_path, rank, world=3)
            procs.append(subprocess.Popen([sys.executable, *rank_args], env=env))
        wait_for_training(coord)  # the first epoch closed with two ranks
        procs.append(
            subprocess.Popen(
                [sys.executable, *rank_args], env=flodl_env(address, tmp_path, 2, world=3)
            )
        )
        if mode == "cpu_cadence":  # (the refusal is the same in every mode)
            # a join of another run is refused with the reason, and changes nothing in this one
            stranger = subprocess.run(
                [sys.executable, *rank_args],
                env={**flodl_env(address, tmp_path, 2, world=3), "FLODL_RUN_ID": "run-other"},
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
            )
            assert stranger.returncode != 0
            assert "run id 'run-other' does not match this run" in stranger.stderr, stranger.stderr
        assert [p.wait(timeout=150) for p in procs] == [0, 0, 0]
        assert coord.wait(timeout=30) == 0
        out, err = stop(coord)
        assert "run complete" in out
        assert "[rank_joined] root/rank2: rank 2 joined" in err, err[-3000:]
        assert "[coverage]" not in err  # every epoch's ledger audited exact when it closed
        identical(tmp_path, 3)  # the late rank took part in the final reduce
        steps = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True)["steps"] for r in range(3)]
        assert 0 < steps[2] < min(steps[:2]), steps  # it trained, from the middle of the run
    finally:
        reap(procs)
        stop(coord)


def test_min_and_max_world_sizes_are_checked(tmp_path: Path) -> None:
    secret = ["--secret-file", str(tmp_path / "secret")]
    for args, message in (
        (["--min-world-size", "3", "--max-world-size", "2"], "must be in 1..--max-world-size"),
        (["--world-size", "2", "--max-world-size", "3"], "not both"),
        (["--min-world-size", "2"], "give --world-size N, or --max-world-size N"),
    ):
        run = subprocess.run(
            [sys.executable, "-m", "flodl", "coord", *args, *secret, "--dataset-len", "64"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert run.returncode == 2 and message in run.stderr, (args, run.stderr)
