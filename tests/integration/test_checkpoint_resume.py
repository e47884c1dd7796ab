"""Checkpoints, resume and callbacks end to end: real launcher, real rank processes, real files.

Every run is ``callbacks_main.py`` (the user's script) in a subprocess; ranks log the sample ids
of every batch they train, so the tests can check per-epoch coverage against the bundle's meta.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from pathlib import Path

import pytest
from processes import left_running
from resume_runs import (
    BS,
    REPO,
    SCRIPT,
    done,
    final_matches_bundle,
    forget_run,
    metrics,
    rank_batches,
    run,
    split_epochs,
)

from flodl import checkpoint
from flodl.errors import CheckpointError

pytestmark = pytest.mark.integration


@pytest.mark.timeout(240)
def test_shutdown_with_save_then_resume_trains_each_uncovered_sample_once(tmp_path: Path) -> None:
    n, stem = 8192, tmp_path / "ck"
    common = ["--ranks", "3", "--epochs", "3", "--samples", str(n), "--max-anchor", "10"]
    # Run A: rank 2 fails mid-run; max_failure=1 ends the run with a save. Where its step
    # lands depends on the speeds this machine gives the ranks: try a few until it is mid-epoch.
    steps = (130, 100, 160, 115)
    for crash_step in steps:
        a = run(
            tmp_path,
            "a",
            *common,
            "--save",
            str(stem),
            "--max-failure-abs",
            "1",
            "--crash-rank",
            "2",
            "--crash-step",
            str(crash_step),
        )
        assert a.returncode == 0, a.stderr[-3000:]
        assert done(a.stdout)["save_reason"] == "max_failure_exceeded"
        meta = checkpoint.read_meta(stem, world_size=3)
        assert meta.save_reason == "max_failure_exceeded"
        assert meta.coverage is not None
        [interrupted] = meta.coverage.per_epoch
        e = interrupted.epoch
        todo = checkpoint.uncovered_samples(meta, n)  # the public map: checked against run B
        assert todo is not None
        # join() raised, naming the reason and the exact call that resumes
        [stopped] = [line for line in a.stdout.splitlines() if line.startswith("STOPPED ")]
        assert "training stopped (max_failure_exceeded): 1 of 3 ranks dead" in stopped, stopped
        resume_call = f".resume_from({str(stem)!r}) (epoch {e}, {len(todo)} samples of it still"
        assert resume_call in stopped, stopped
        if 0 < len(todo) < n:
            break
        forget_run(tmp_path, "a", stem)
    else:
        pytest.fail(f"the failure never landed mid-epoch (crash steps {steps})")
    assert meta.elche_state is not None and meta.elche_state["phase"] != "probe"
    assert checkpoint.load_model(stem).global_step == meta.global_step
    ma = [m for m in metrics(a.stdout) if m["epoch"] < e]
    trained_a = split_epochs(tmp_path / "a", ma, 3)
    for epoch in range(e):
        assert sorted(trained_a[epoch]) == list(range(n))  # finished epochs: exactly once
    # the public map of the rest: what run A trained of epoch e and the resume skips
    covered = checkpoint.covered_samples(meta, n)
    assert covered is not None and sorted(covered + todo) == list(range(n))
    in_e: Counter[int] = Counter()  # run A's batches past its finished epochs: epoch e's
    for r in range(3):
        before = sum(m["per_rank_samples"][r] for m in ma) // BS
        for ids in rank_batches(tmp_path / "a", r)[before:]:
            in_e.update(ids)
    assert not Counter(covered) - in_e  # every covered sample was trained by run A
    assert (tmp_path / "ck.rank2.death.json").exists()

    # Run B resumes: the interrupted epoch trains only its uncovered samples, once each.
    b = run(
        tmp_path,
        "b",
        *common,
        "--save",
        str(stem),
        "--resume",
        str(stem),
        "--out",
        str(tmp_path / "b.pt"),
    )
    assert b.returncode == 0, b.stderr[-3000:]
    assert done(b.stdout)["save_reason"] is None
    mb = metrics(b.stdout)
    assert [m["epoch"] for m in mb] == list(range(e, 3))
    trained_b = split_epochs(tmp_path / "b", mb, 3)
    assert sorted(trained_b[e]) == sorted(todo)  # the uncovered ranges, each sample once
    assert len(trained_b[e]) == len(set(trained_b[e]))
    for epoch in range(e + 1, 3):
        assert sorted(trained_b[epoch]) == list(range(n))
    end = checkpoint.read_meta(stem, world_size=3)
    assert end.epoch == 3 and end.coverage is not None and end.coverage.per_epoch == []
    assert end.global_step > meta.global_step
    assert end.elche_state is not None
    assert end.elche_state["calibration_count"] > meta.elche_state["calibration_count"]
    assert final_matches_bundle(tmp_path / "b.pt", stem)  # the end-of-run bundle = the result


def _wait_for(proc: subprocess.Popen[str], pattern: str, limit_s: float) -> list[str]:
    assert proc.stdout is not None
    lines: list[str] = []
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if re.search(pattern, line):
            return lines
    raise AssertionError(f"{pattern!r} not seen: {''.join(lines)[-2000:]}")


def _wait_for_meta_epoch(stem: Path, epoch: int, limit_s: float) -> None:
    """Poll the bundle's meta (written atomically) until it resumes at ``epoch`` or later."""
    deadline = time.monotonic() + limit_s
    while True:
        with contextlib.suppress(CheckpointError):
            if checkpoint.read_meta(stem, world_size=2).epoch >= epoch:
                return
        assert time.monotonic() < deadline, f"no checkpoint meta at epoch {epoch} in {limit_s} s"
        time.sleep(0.02)


@pytest.mark.timeout(240)
def test_sigkill_of_the_launcher_then_resume_from_the_last_epoch_checkpoint(
    tmp_path: Path,
) -> None:
    n, stem, tag = 4096, tmp_path / "ck", f"flodl-test-{uuid.uuid4().hex}"
    args = ["--ranks", "2", "--epochs", "4", "--samples", str(n), "--save", str(stem)]
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    proc = subprocess.Popen(
        [
            *(sys.executable, str(SCRIPT), "--tag", tag, "--log-dir", str(tmp_path / "a")),
            *(*args, "--checkpoint-every", "1", "--slow", "0:3,1:3"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        cwd=REPO,
        # the launcher's run directory (tempfile) goes where this test can see and remove it
        env={**os.environ, "FLODL_NET_TIMEOUT_SCALE": "0.1", "TMPDIR": str(scratch)},
    )
    try:
        seen = _wait_for(proc, r'^METRICS \{"epoch":1,', 120)
        _wait_for_meta_epoch(stem, 2, 60)  # the checkpoint after epoch 1 landed
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
        assert proc.stdout is not None
        proc.stdout.close()
    # the ranks notice their coordinator is gone and exit on their own (liveness timeout)
    assert left_running(tag, 30) == []
    # a SIGKILLed launcher cannot remove its run directory; no rank delivered a final state
    # into it (docs/design.md §2, "Launcher")
    (run_dir,) = scratch.glob("flodl-*")
    assert list(run_dir.iterdir()) == []
    deaths = checkpoint.death_records(stem)
    assert {d.rank for d in deaths} <= {0, 1}
    assert all("coordinator" in d.error for d in deaths)
    meta = checkpoint.read_meta(stem, world_size=2)
    assert meta.epoch >= 2  # the checkpoints after epochs 0 and 1 at least
    finished = [json.loads(s[8:])["epoch"] for s in seen if s.startswith("METRICS ")]
    assert meta.epoch <= max(finished) + 2
    b = run(tmp_path, "b", *args, "--resume", str(stem), "--out", str(tmp_path / "b.pt"))
    assert b.returncode == 0, b.stderr[-3000:]
    mb = metrics(b.stdout)
    assert [m["epoch"] for m in mb] == list(range(meta.epoch, 4))
    trained = split_epochs(tmp_path / "b", mb, 2)
    for epoch in range(meta.epoch, 4):
        assert sorted(trained[epoch]) == list(range(n))
    assert final_matches_bundle(tmp_path / "b.pt", stem)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", ["cpu_cadence", "nccl_cadence"])
def test_outer_momentum_is_checkpointed_and_restored(mode: str, tmp_path: Path) -> None:
    # CPU modes: the coordinator holds and saves the outer state; collective: the writer rank
    stem = tmp_path / "ck"
    common = ["--ranks", "2", "--samples", "2048", "--mode", mode, "--outer", "slow"]
    a = run(tmp_path, "a", *common, "--epochs", "1", "--save", str(stem))
    assert a.returncode == 0, a.stderr[-3000:]
    meta = checkpoint.read_meta(stem, world_size=2)
    outer = checkpoint.load_outer(stem)
    assert outer is not None and outer.global_step == meta.global_step
    assert set(outer.state) == {"prev", "velocity"}
    assert any(float(v.abs().sum()) > 0 for v in outer.state["velocity"])  # real momentum
    b = run(tmp_path, "b", *common, "--epochs", "2", "--save", str(stem), "--resume", str(stem))
    assert b.returncode == 0, b.stderr[-3000:]
    assert "zero momentum" not in b.stderr  # restored, not restarted
    assert [m["epoch"] for m in metrics(b.stdout)] == [1]
    assert checkpoint.load_outer(stem) is not None


@pytest.mark.timeout(150)
def test_a_stop_without_a_save_path_says_so_and_the_dead_rank_left_its_record(
    tmp_path: Path,
) -> None:
    """A lone collective survivor stops the run; without a save_path join() says there is no
    bundle, and the dead rank's death record is in the documented default place, under the
    launcher's current directory."""
    out = subprocess.run(
        [
            *(sys.executable, str(SCRIPT), "--tag", f"flodl-test-{uuid.uuid4().hex}"),
            *("--log-dir", str(tmp_path / "logs"), "--ranks", "2", "--mode", "nccl_cadence"),
            *("--crash-rank", "1", "--crash-step", "5"),
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={**os.environ, "FLODL_NET_TIMEOUT_SCALE": "0.2", "PYTHONPATH": str(REPO)},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    [stopped] = [line for line in out.stdout.splitlines() if line.startswith("STOPPED ")]
    assert "training stopped (single_survivor)" in stopped
    assert "no bundle to resume from (set save_path to save one at a stop)" in stopped
    [record] = list(tmp_path.glob("flodl-runs/*/run.rank1.death.json"))
    death = checkpoint.read_death_record(record)
    assert death.rank == 1 and "injected failure on rank 1" in death.error
