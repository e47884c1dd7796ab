"""A rank whose training step hangs while its bridge thread heartbeats (docs/design.md §2b,
"A hung training step"), on real processes: its step watchdog ends it with its stack and a
death record, the coordinator declares it dead, and the survivors finish the run with every
sample trained. Without the watchdog the run waited for it until the progress watchdog ended
it in ShutdownWithSave (``reduce_stall``)."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
from processes import left_running
from resume_runs import done, metrics, run

from flodl import checkpoint

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

SAMPLES = 1024
SCALE = 0.05  # hb 1.5 s: a step hangs past 3 s; the progress watchdog would stop the run at 15 s


@pytest.mark.parametrize(
    ("mode", "loop"),
    [("cpu_cadence", "trainer"), ("nccl_sync", "trainer"), ("cpu_async", "worker")],
)
def test_a_rank_whose_step_hangs_leaves_the_run_and_the_others_finish_it(
    tmp_path: Path, mode: str, loop: str
) -> None:
    # (the worker: the user's own loop, whose step spans batches() to step())
    tag = f"flodl-hung-{uuid.uuid4().hex}"
    stem = tmp_path / "ck"
    out = run(
        tmp_path,
        "a",
        *("--ranks", "3", "--mode", mode, "--epochs", "2", "--samples", str(SAMPLES)),
        *("--save", str(stem), "--respawn", "0"),
        *("--crash-rank", "1", "--crash-step", "5", "--crash-hang"),
        *(("--worker",) if loop == "worker" else ()),
        tag=tag,
        timeout_scale=SCALE,
        limit_s=240,
    )
    assert left_running(tag, 30) == [], "a process of the run outlived it"
    assert out.returncode == 0, out.stderr[-4000:]
    assert done(out.stdout)["save_reason"] is None, out.stderr[-4000:]
    # the hung rank said why it left, with where its training thread was stuck
    assert "training step 5 hung" in out.stderr, out.stderr[-4000:]
    assert "in hang_forever" in out.stderr
    [death] = checkpoint.death_records(stem)
    assert death.rank == 1 and "training step 5 hung" in death.error
    assert "hang_forever" in death.error
    # the survivors trained every sample of both epochs, rank 1 nothing after it left
    ms = metrics(out.stdout)
    assert [m["epoch"] for m in ms] == [0, 1]
    assert all(sum(m["per_rank_samples"]) == SAMPLES for m in ms), ms
    assert ms[-1]["per_rank_samples"][1] == 0


def test_a_rank_stuck_in_a_callback_ends_the_run_at_the_ceilings_with_no_process_left(
    tmp_path: Path,
) -> None:
    # A hang outside a step (its epoch_fn never returns) has no reference length: the progress
    # watchdog stops the run at the stall ceiling, and the stuck rank, which never answers the
    # stop, is declared dead the stall ceiling after it; the run used to wait for it for good.
    tag = f"flodl-hung-{uuid.uuid4().hex}"
    out = run(
        tmp_path,
        "a",
        *("--ranks", "3", "--mode", "cpu_cadence", "--epochs", "2", "--samples", str(SAMPLES)),
        *("--respawn", "0", "--epoch-fn-sleep", "100000"),
        tag=tag,
        timeout_scale=SCALE,
        limit_s=240,
    )
    assert left_running(tag, 30) == [], "a process of the run outlived it"
    assert out.returncode == 0, out.stderr[-4000:]
    assert done(out.stdout)["save_reason"] == "reduce_stall", out.stderr[-4000:]
    assert "did not exit within 15 s of the stop" in out.stderr, out.stderr[-4000:]
