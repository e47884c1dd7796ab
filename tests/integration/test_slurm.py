"""SLURM end to end: ranks started by ``srun`` and ``sbatch`` on a real one-node cluster join a
standalone ``flodl coord``.

The cluster is the one ``.ci/slurm-up`` starts (Debian's slurm-wlm and munge; CI's ``.ci/run``
installs them and runs it). Every test is skipped, with the reason, where ``srun`` is not on
``PATH`` or ``sinfo`` does not answer or shows no idle node. The ranks are
``slurm_main.py`` (the test's) and ``examples/join_coordinator.py`` (the sbatch example's): each
finds its rank in ``SLURM_PROCID``/``SLURM_NTASKS``; nothing rank-specific is set by hand.

Every job a test starts is named with its tag (``--job-name``), and so are the coordinator it
starts (``--run-id``) and the rank processes (``--tag``): teardown cancels the jobs of that name,
kills the coordinator, and checks that no process is left, by its command line or by a
``SLURM_JOB_NAME`` of the tag in its environment (``/proc/<pid>/environ``: the job's tasks).
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import shutil
import stat
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from processes import processes_with
from test_standalone import reap

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
RANK = HERE / "slurm_main.py"
SBATCH = REPO / "examples" / "slurm" / "train.sbatch"
RETRY = REPO / "examples" / "slurm" / "retry_task.sh"
START_S = 60.0
"""Bound on the coordinator's start (import torch, listen) and on a job's end after the test."""
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"}
TERMINAL |= {"PREEMPTED", "BOOT_FAIL", "DEADLINE"}
RANK_VARS = ("FLODL_RANK", "FLODL_WORLD_SIZE", "RANK", "WORLD_SIZE", "LOCAL_RANK")
"""Launcher variables that outrank SLURM's (flodl.launch.env): never inherited by a job here."""


@functools.cache
def _missing() -> str | None:
    """Why there is no SLURM cluster to test with, or None (asked once a session: a missing
    slurmctld costs sinfo's whole timeout)."""
    for tool in ("srun", "sbatch", "sinfo", "scontrol", "scancel", "squeue"):
        if shutil.which(tool) is None:
            return f"no {tool} on PATH (Debian: apt-get install slurm-wlm munge, then .ci/slurm-up)"
    try:
        info = subprocess.run(
            ["sinfo", "-h", "-o", "%T %N"], capture_output=True, text=True, timeout=15, check=False
        )
    except subprocess.TimeoutExpired:
        return "sinfo does not answer within 15 s (no slurmctld? .ci/slurm-up starts one)"
    if info.returncode != 0:
        why = (info.stderr.strip().splitlines() or [f"exit {info.returncode}"])[-1]
        return f"sinfo does not answer: {why} (.ci/slurm-up starts a one-node cluster)"
    states = [line.strip() for line in info.stdout.splitlines() if line.strip()]
    if not any(s.startswith(("idle", "mixed")) for s in states):
        return f"sinfo shows no idle node (nodes: {'; '.join(states) or 'none'})"
    return None


def job_env(**extra: str) -> dict[str, str]:
    """The test's environment for a job: this interpreter's folder first on PATH (the job's
    ``python3``), no launcher rank variables nor an enclosing job's ``SLURM_*`` (a test run
    inside a job still gets jobs of its own), plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in RANK_VARS and not k.startswith("SLURM_")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return {**env, **extra}


def job_processes(tag: str) -> list[str]:
    """Live processes whose environment says they belong to a SLURM job named ``tag``."""
    needle = f"SLURM_JOB_NAME={tag}".encode()
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        with contextlib.suppress(OSError):
            if needle in environ.read_bytes().split(b"\0"):
                cmdline = (environ.parent / "cmdline").read_bytes().replace(b"\0", b" ")
                found.append(f"{environ.parent.name} {cmdline.decode(errors='replace')}")
    return found


def leftovers(tag: str, deadline_s: float = 15.0) -> list[str]:
    """The test's processes still alive after ``deadline_s`` (they exit on their own,
    promptly, once their job step ends)."""
    deadline = time.monotonic() + deadline_s
    while (left := processes_with(tag) + job_processes(tag)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


@dataclass
class Slurm:
    """One test's handle on the cluster: its tag, and the coordinators it started."""

    tag: str
    coords: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def jobs(self) -> list[str]:
        out = subprocess.run(
            ["squeue", "-h", "--name", self.tag, "-o", "%i"],
            capture_output=True,
            text=True,
            timeout=15,
            check=False,
        )
        return out.stdout.split()


@pytest.fixture
def slurm() -> Iterator[Slurm]:
    if (why := _missing()) is not None:
        pytest.skip(why)
    handle = Slurm(f"flodl-test-{uuid.uuid4().hex}")
    try:
        yield handle
    finally:
        subprocess.run(["scancel", "--name", handle.tag], timeout=15, check=False)
        reap(handle.coords)
        deadline = time.monotonic() + START_S
        while handle.jobs() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert handle.jobs() == [], "a job of the test outlived it"
        assert leftovers(handle.tag) == [], "a process of the test outlived it"


@dataclass(frozen=True)
class Coord:
    """A ``flodl -v coord`` started by the test; its output is in ``out`` / ``err``."""

    proc: subprocess.Popen[bytes]
    address: str
    run_id: str
    secret: Path
    out: Path
    err: Path

    def env(self) -> dict[str, str]:
        """What every task of the step gets, once (no rank: SLURM gives each its own)."""
        return job_env(
            FLODL_COORD=self.address, FLODL_RUN_ID=self.run_id, FLODL_SECRET_FILE=str(self.secret)
        )

    def wait(self, timeout: float = 30.0) -> tuple[int, str, str]:
        code = self.proc.wait(timeout=timeout)
        return code, self.out.read_text(), self.err.read_text()


def start_coord(slurm: Slurm, tmp: Path, *job: str) -> Coord:
    """``flodl -v coord --world-size 3 ...`` on 127.0.0.1 with the tag as run id; returns once it
    printed where it listens (``START_S`` at most)."""
    out, err, secret = tmp / "coord.out", tmp / "coord.err", tmp / "secret"
    cmd = [sys.executable, "-m", "flodl", "-v", "coord", "--world-size", "3"]
    cmd += ["--host", "127.0.0.1", "--port", "0", "--run-id", slurm.tag, "--mode", "cpu_cadence"]
    cmd += ["--secret-file", str(secret), *job]
    with out.open("wb") as o, err.open("wb") as e:
        proc = subprocess.Popen(cmd, stdout=o, stderr=e, cwd=tmp)
    slurm.coords.append(proc)
    deadline = time.monotonic() + START_S
    while "FLODL_COORD=" not in (text := out.read_text()):
        assert proc.poll() is None, f"flodl coord exited {proc.returncode}: {err.read_text()}"
        assert time.monotonic() < deadline, f"flodl coord not listening after {START_S:g} s"
        time.sleep(0.05)
    address = text.split("FLODL_COORD=")[1].split()[0]
    assert text.split("FLODL_RUN_ID=")[1].split()[0] == slurm.tag
    return Coord(proc, address, slurm.tag, secret, out, err)


def srun(
    slurm: Slurm, coord: Coord, *cmd: str, limit_s: float = 90
) -> subprocess.CompletedProcess[str]:
    """``srun -n 3`` of ``cmd`` as one step of a job named with the test's tag."""
    return subprocess.run(
        ["srun", f"--job-name={slurm.tag}", "-n", "3", "--kill-on-bad-exit=0", *cmd],
        env=coord.env(),
        capture_output=True,
        text=True,
        timeout=limit_s,
        check=False,
    )


def scontrol_job(job_id: str) -> dict[str, str]:
    """``scontrol show job`` as fields (empty once the job left slurmctld's memory)."""
    out = subprocess.run(
        ["scontrol", "show", "job", "-o", job_id],
        capture_output=True,
        text=True,
        timeout=15,
        check=False,
    )
    return dict(kv.split("=", 1) for kv in out.stdout.split() if "=" in kv)


def test_srun_ranks_join_a_standalone_coordinator(slurm: Slurm, tmp_path: Path) -> None:
    """``srun -n 3 python slurm_main.py``: three tasks, their ranks from SLURM_PROCID and
    SLURM_NTASKS, train one epoch with the coordinator, and everything exits 0."""
    coord = start_coord(slurm, tmp_path, "--dataset-len", "1024", "--epochs", "1")
    run = srun(slurm, coord, sys.executable, str(RANK), "--out", str(tmp_path), "--tag", slurm.tag)
    assert run.returncode == 0, run.stderr[-3000:]
    code, out, err = coord.wait()
    assert code == 0, err[-3000:]
    assert "flodl coordinator: run complete" in out
    # it saw three ranks, one per task
    for rank in range(3):
        assert f"rank {rank} connected to the reduce server" in err, err[-3000:]
        assert (tmp_path / f"rank{rank}.0.json").exists(), rank
    assert "epoch 0:" in err
    secret = coord.secret.read_text().strip()
    assert secret not in out + err + run.stdout + run.stderr
    assert leftovers(slurm.tag) == [], "a process of the run outlived it"


def test_the_sbatch_example_trains(slurm: Slurm, tmp_path: Path) -> None:
    """``sbatch examples/slurm/train.sbatch``: the job starts the coordinator on its first node,
    srun's its three ranks, and ends COMPLETED with exit 0 and the trained run in its output.

    The job's end is read with ``scontrol show job`` every 0.2 s: ``sbatch --wait`` polls at a
    growing interval and returned ~30 s after a 13 s job ended."""
    runs, output = tmp_path / "runs", tmp_path / "job.out"
    sub = subprocess.run(
        ["sbatch", "--parsable", f"--job-name={slurm.tag}", f"--output={output}", str(SBATCH)],
        env=job_env(RUN_DIR=str(runs), EPOCHS="1"),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert sub.returncode == 0, sub.stderr
    job_id = sub.stdout.strip().split(";")[0]
    deadline = time.monotonic() + 90
    while (job := scontrol_job(job_id)).get("JobState") not in TERMINAL:
        assert job, f"job {job_id} vanished from slurmctld before it ended"
        assert time.monotonic() < deadline, f"job {job_id} still {job.get('JobState')} after 90 s"
        time.sleep(0.2)
    text = output.read_text()
    assert (job["JobState"], job["ExitCode"]) == ("COMPLETED", "0:0"), text[-3000:]
    assert f"flodl job {job_id}: coordinator at " in text
    assert "trained 4 parameter tensors with 3 ranks" in text  # the primary rank's report
    assert "flodl coordinator: run complete" in text  # the coordinator's log, copied in
    assert f"flodl job {job_id}: ranks exited 0, coordinator 0" in text
    # the secret lived in a 0600 file in the job's 0700 directory, is gone, and was never shown
    job_dir = runs / job_id
    assert stat.S_IMODE(job_dir.stat().st_mode) == 0o700
    assert not (job_dir / "secret").exists()
    assert f"FLODL_SECRET_FILE={job_dir / 'secret'}" in text
    assert re.search(r"[0-9a-f]{64}", text + SBATCH.read_text()) is None
    assert leftovers(slurm.tag) == [], "a process of the job outlived it"


def test_a_crashed_task_is_restarted_in_place_and_its_rank_rejoins(
    slurm: Slurm, tmp_path: Path
) -> None:
    """Rank 2's task crashes (``os._exit(1)`` at its 5th step, first incarnation only);
    ``retry_task.sh`` (the sbatch example's) starts it again inside the same srun step (with
    FLODL_RESTART_COUNT=1, which the script reads to crash only once), and the coordinator,
    whose run is still going, admits it as rank 2's incarnation 1. The other ranks hold from
    the crash until the new process started (see slurm_main.py), so the rejoin does not race
    the end of the run."""
    coord = start_coord(slurm, tmp_path, "--dataset-len", "2048", "--epochs", "2")
    run = srun(
        slurm,
        coord,
        *(str(RETRY), sys.executable, str(RANK), "--out", str(tmp_path), "--tag", slurm.tag),
        *("--epochs", "2", "--samples", "2048", "--slow-ms", "20"),
        *("--crash-rank", "2", "--crash-step", "5"),
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "flodl task 2: attempt 0 exited 1" in run.stderr, run.stderr[-3000:]
    assert "attempt 1 exited" not in run.stderr
    code, out, err = coord.wait()
    assert code == 0, err[-3000:]
    assert "flodl coordinator: run complete" in out
    events = re.findall(r"\[(rank_lost|rank_rejoined)\] root/rank(\d+): (.*)", err)
    assert [(e, r) for e, r, _ in events] == [("rank_lost", "2"), ("rank_rejoined", "2")], err
    assert events[1][2].startswith("rank 2 rejoined (incarnation 1)"), events
    # ranks 0 and 1 ran once; rank 2's first incarnation never finished, its second one did
    done = sorted(p.name for p in tmp_path.glob("rank*.json"))
    assert done == ["rank0.0.json", "rank1.0.json", "rank2.1.json"], done
    assert leftovers(slurm.tag) == [], "a process of the run outlived it"
