"""Callbacks with roles, failover and the cooperative Worker, on real rank processes.

``callbacks_main.py`` is the user's script; callbacks append ``EPOCHFN rank=R epoch=E`` and
``CKPT rank=R epoch=E ok|fail`` lines to ``callbacks.log``, the host prints ``EVAL e metric``.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from resume_runs import (
    done,
    final_matches_bundle,
    metrics,
    run,
    split_epochs,
)

from flodl import checkpoint

pytestmark = pytest.mark.integration


def callback_lines(log_dir: Path, kind: str) -> list[tuple[int, int, str]]:
    """(rank, epoch, rest) of each ``kind`` line, in order."""
    path = log_dir / "callbacks.log"
    text = path.read_text() if path.exists() else ""
    found = re.findall(rf"^{kind} rank=(-?\d+) epoch=(\d+)\s*(\w*)$", text, re.MULTILINE)
    return [(int(r), int(e), rest) for r, e, rest in found]


def evals(stdout: str) -> list[tuple[int, float]]:
    found = re.findall(r"^EVAL (\d+) ([0-9.]+)$", stdout, re.MULTILINE)
    return [(int(e), float(v)) for e, v in found]


@pytest.mark.timeout(180)
def test_callbacks_fire_on_their_roles_and_a_failing_checkpoint_fails_over(
    tmp_path: Path,
) -> None:
    out = run(
        tmp_path,
        "a",
        "--ranks",
        "3",
        "--epochs",
        "3",
        "--samples",
        "4096",
        "--eval",
        "--ckpt-fn",
        "--ckpt-fail-rank",
        "0",
        "--checkpoint-every",
        "1",
        "--epoch-fn-sleep",
        "2",
        "--save",
        str(tmp_path / "ck"),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert done(out.stdout)["save_reason"] is None
    logs = tmp_path / "a"
    # eval after epochs 0 and 1 on the eval role, then the final eval: epoch 2's, tagged 2
    got = evals(out.stdout)
    assert [e for e, _ in got] == [0, 1, 2]
    assert got[-1][1] > 0.8  # it is the trained consensus being scored
    # epoch_fn once per epoch, on one rank once the roles are elected (sticky)
    fns = callback_lines(logs, "EPOCHFN")
    assert [e for _, e, _ in fns] == [0, 1, 2]
    assert len({r for r, e, _ in fns if e >= 1}) == 1
    # checkpoint_fn raises on rank 0: that version is retried on another rank and succeeds
    ckpts = callback_lines(logs, "CKPT")
    for epoch in range(3):
        this = [(r, ok) for r, e, ok in ckpts if e == epoch]
        assert this and this[-1][1] == "ok" and this[-1][0] != 0, ckpts
        assert all(ok == "fail" for r, ok in this[:-1])
    # the 2-second epoch_fn is not counted as the role rank being slow: its smoothed ms/batch
    # stays in line with the others' (equal ranks; counted, it would be ~100× theirs). Its
    # batch share may dip after an epoch end: that is the callback slack, by design.
    role = fns[-1][0]
    meta = checkpoint.read_meta(tmp_path / "ck", world_size=3)
    assert meta.elche_state is not None
    speeds = meta.elche_state["smoothed_ms_per_batch"]
    others = [s for r, s in enumerate(speeds) if r != role]
    assert speeds[role] < 5 * max(others), speeds


@pytest.mark.timeout(180)
def test_killing_the_role_rank_moves_every_role_to_a_survivor(tmp_path: Path) -> None:
    # rank 0 is the fastest (1 and 2 sleep 3 ms a step): the roles go to it at calibration;
    # then it fails in epoch 1 and the survivors carry on with the callbacks
    out = run(
        tmp_path,
        "a",
        "--ranks",
        "3",
        "--epochs",
        "4",
        "--samples",
        "2048",
        "--slow",
        "1:3,2:3",
        "--eval",
        "--ckpt-fn",
        "--checkpoint-every",
        "1",
        "--epoch-fn-sleep",
        "0",
        "--crash-rank",
        "0",
        "--crash-step",
        "60",
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert done(out.stdout)["save_reason"] is None
    logs = tmp_path / "a"
    fns = callback_lines(logs, "EPOCHFN")
    assert [e for _, e, _ in fns] == [0, 1, 2, 3]
    assert fns[0][0] == 0  # before the failure: the fastest rank
    assert all(r != 0 for r, e, _ in fns if e >= 2)
    ckpts = [(r, e) for r, e, ok in callback_lines(logs, "CKPT") if ok == "ok"]
    assert sorted({e for _, e in ckpts}) == [0, 1, 2, 3]
    assert all(r != 0 for r, e in ckpts if e >= 2)
    assert [e for e, _ in evals(out.stdout)] == [0, 1, 2, 3]


@pytest.mark.timeout(180)
def test_killing_a_pinned_role_rank_moves_every_role_to_a_survivor(
    tmp_path: Path,
) -> None:
    """``EpochCallbackPolicy.Rank(2)``: rank 2 runs every callback until it fails in epoch 1;
    then ``epoch_fn``, eval and ``checkpoint_fn`` all go on, on rank 1 (the fastest survivor:
    rank 0 sleeps 3 ms a step), to the end of the run (they used to stop for good, but for
    the checkpoint)."""
    out = run(
        tmp_path,
        "a",
        *("--ranks", "3", "--epochs", "4", "--samples", "2048", "--policy", "2"),
        *("--eval", "--ckpt-fn", "--checkpoint-every", "1", "--epoch-fn-sleep", "0"),
        # 5 steps after its epoch_fn of epoch 0: in epoch 1, however much of epoch 0 it trained
        *("--crash-rank", "2", "--crash-after-epoch-fn", "--crash-step", "5", "--slow", "0:3"),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert done(out.stdout)["save_reason"] is None
    assert "flodl [callback_roles_moved] root: pinned rank 2 died" in out.stdout
    logs = tmp_path / "a"
    fns = callback_lines(logs, "EPOCHFN")
    assert [e for _, e, _ in fns] == [0, 1, 2, 3]
    assert fns[0][0] == 2  # the pinned rank, while it lives
    assert all(r == 1 for r, e, _ in fns if e >= 2)
    ckpts = [(r, e) for r, e, ok in callback_lines(logs, "CKPT") if ok == "ok"]
    assert sorted({e for _, e in ckpts}) == [0, 1, 2, 3]
    assert all(r == 1 for r, e in ckpts if e >= 2)
    assert [e for e, _ in evals(out.stdout)] == [0, 1, 2, 3]


@pytest.mark.timeout(180)
def test_worker_tier_user_owned_loop_trains_every_sample_and_saves(tmp_path: Path) -> None:
    stem = tmp_path / "ck"
    out = run(
        tmp_path,
        "a",
        "--worker",
        "--ranks",
        "3",
        "--epochs",
        "2",
        "--samples",
        "2048",
        "--eval",
        "--save",
        str(stem),
        "--out",
        str(tmp_path / "final.pt"),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert done(out.stdout)["save_reason"] is None
    ms = metrics(out.stdout)
    assert [m["epoch"] for m in ms] == [0, 1]
    assert ms[0]["scalars"] == {"rows": 32.0}  # worker.record_scalar reaches EpochMetrics
    trained = split_epochs(tmp_path / "a", ms, 3)
    for epoch in (0, 1):
        assert sorted(trained[epoch]) == list(range(2048))
    assert [e for e, _ in evals(out.stdout)] == [0, 1]
    assert final_matches_bundle(tmp_path / "final.pt", stem)


@pytest.mark.timeout(180)
def test_a_worker_that_raises_writes_a_death_record_and_peers_go_on(tmp_path: Path) -> None:
    stem = tmp_path / "ck"
    out = run(
        tmp_path,
        "a",
        "--worker",
        "--ranks",
        "3",
        "--epochs",
        "2",
        "--samples",
        "2048",
        "--save",
        str(stem),
        "--crash-rank",
        "1",
        "--crash-step",
        "10",
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert done(out.stdout)["save_reason"] is None
    [death] = checkpoint.death_records(stem)
    assert death.rank == 1 and death.world_size == 3
    assert "injected failure on rank 1" in death.error
    ms = metrics(out.stdout)
    assert [m["epoch"] for m in ms] == [0, 1]
    assert ms[-1]["per_rank_samples"][1] == 0  # the dead rank trains nothing more


@pytest.mark.timeout(120)
def test_single_device_tier_checkpoints_resumes_and_runs_callbacks(tmp_path: Path) -> None:
    stem = tmp_path / "ck"
    common = ["--ranks", "1", "--samples", "1024", "--eval", "--ckpt-fn", "--epoch-fn-sleep", "0"]
    a = run(tmp_path, "a", *common, "--epochs", "2", "--save", str(stem), "--checkpoint-every", "1")
    assert a.returncode == 0, a.stderr[-3000:]
    assert [e for e, _ in evals(a.stdout)] == [0, 1]
    assert [e for _, e, _ in callback_lines(tmp_path / "a", "EPOCHFN")] == [0, 1]
    meta = checkpoint.read_meta(stem, world_size=1)
    assert meta.epoch == 2
    b = run(
        tmp_path,
        "b",
        *common,
        "--epochs",
        "4",
        "--save",
        str(stem),
        "--resume",
        str(stem),
        "--out",
        str(tmp_path / "b.pt"),
    )
    assert b.returncode == 0, b.stderr[-3000:]
    assert [m["epoch"] for m in metrics(b.stdout)] == [2, 3]
    assert [e for e, _ in evals(b.stdout)] == [2, 3]
    assert checkpoint.read_meta(stem, world_size=1).epoch == 4
    assert final_matches_bundle(tmp_path / "b.pt", stem)
    w = run(tmp_path, "w", *common, "--epochs", "1", "--worker")
    assert w.returncode == 0, w.stderr[-3000:]
    assert [m["epoch"] for m in metrics(w.stdout)] == [0]
