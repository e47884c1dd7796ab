"""A rank whose training step hangs while its bridge thread heartbeats (docs/design.md §2b,
"A hung training step"), on real processes: its step watchdog ends it with its stack and a
death record, the coordinator declares it dead, and the survivors finish the run with every
sample trained. Without the watchdog the run waited for it until the progress watchdog ended
it in ShutdownWithSave (``reduce_stall``)."""

from __future__ import annotations

import subprocess
import uuid
from pathlib import Path

import pytest
from processes import left_running
from resume_runs import done, metrics, run

from flodl import checkpoint
from flodl.monitor.records import read_tree

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

SAMPLES = 1024
STEP_SCALE = 0.1  # hb 3 s: a step hangs past 6 s; the progress watchdog would stop at 30 s
STOP_SCALE = 0.05
"""hb 1.5 s, stall ceiling 15 s: the callback test waits two ceilings, and its healthy ranks do
nothing but wait (the suite's other runs keep hb at 3 s or more)."""


def three_rank_run(
    tmp_path: Path, mode: str, *args: str, scale: float = STEP_SCALE
) -> subprocess.CompletedProcess[str]:
    """A 3-rank, 2-epoch run of ``mode`` with no respawn, that exits 0 and leaves no process."""
    tag = f"flodl-hung-{uuid.uuid4().hex}"
    out = run(
        tmp_path,
        "a",
        *("--ranks", "3", "--mode", mode, "--epochs", "2", "--samples", str(SAMPLES)),
        *("--respawn", "0", *args),
        tag=tag,
        timeout_scale=scale,
        limit_s=240,
    )
    assert left_running(tag, 30) == [], "a process of the run outlived it"
    assert out.returncode == 0, out.stderr[-4000:]
    return out


@pytest.mark.parametrize(
    ("mode", "loop"),
    [("cpu_cadence", "trainer"), ("nccl_sync", "trainer"), ("cpu_async", "worker")],
)
def test_a_rank_whose_step_hangs_leaves_the_run_and_the_others_finish_it(
    tmp_path: Path, mode: str, loop: str
) -> None:
    # (the worker: the user's own loop, whose step spans batches() to step())
    stem, records = tmp_path / "ck", tmp_path / "records"
    out = three_rank_run(
        tmp_path,
        mode,
        *("--save", str(stem), "--records", str(records)),
        *("--crash-rank", "1", "--crash-step", "5", "--crash-hang"),
        *(("--worker",) if loop == "worker" else ()),
    )
    assert done(out.stdout)["save_reason"] is None, out.stderr[-4000:]
    # the hung rank said why it left, with where its training thread was stuck
    assert "training step 5 hung" in out.stderr, out.stderr[-4000:]
    assert "in hang_forever" in out.stderr
    [death] = checkpoint.death_records(stem)
    assert death.rank == 1 and "training step 5 hung" in death.error
    assert "hang_forever" in death.error
    # both epochs closed with exact coverage (the coordinator checks each epoch's ledger when
    # it closes and records a coverage alert if it breaks); rank 1 trained nothing after it
    # left. (Epoch 0's per-rank samples count the slices the ranks reported: batches rank 1
    # trained and a sync committed before it hung are covered, but its slice never reported.)
    ms = metrics(out.stdout)
    assert [m["epoch"] for m in ms] == [0, 1]
    events = [r for recs in read_tree(records).values() for r in recs if r["kind"] == "event"]
    assert [r for r in events if r["data"]["class"] == "coverage"] == []
    assert [r["data"]["class"] for r in events].count("rank_lost") == 1
    assert sum(ms[1]["per_rank_samples"]) == SAMPLES and ms[1]["per_rank_samples"][1] == 0


def test_a_rank_stuck_in_a_callback_ends_the_run_at_the_ceilings_with_no_process_left(
    tmp_path: Path,
) -> None:
    # A hang outside a step (its epoch_fn never returns) has no reference length: the progress
    # watchdog stops the run at the stall ceiling, and the stuck rank, which never answers the
    # stop, is declared dead the stall ceiling after it; the run used to wait for it for good.
    out = three_rank_run(tmp_path, "cpu_cadence", "--epoch-fn-sleep", "100000", scale=STOP_SCALE)
    assert done(out.stdout)["save_reason"] == "reduce_stall", out.stderr[-4000:]
    assert "did not exit within 15 s of the stop" in out.stderr, out.stderr[-4000:]
