"""A save killed between any two of its writes leaves a bundle that resumes.

A real 3-rank run saves a bundle after every epoch; a fault hits its second save at one point:
between the writer's optimizer state and its model file, after a rank's part is on disk but
before it reports it, or — the coordinator itself — after the model file is on disk and before
the meta can commit it. In every case the bundle on disk must name files that exist and belong
together, and a run resumed from it must finish every epoch with nothing left uncovered.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from processes import left_running
from test_chaos_suite import done_line, run_script

from flodl import checkpoint
from flodl.chaos import ChaosPlan, Fault

pytestmark = [pytest.mark.integration]

EPOCHS = 4
WRITER = 1  # the checkpoint role is pinned to rank 1 (--policy 1)
ARMED_AT = 1
"""The epoch whose first step arms the fault: it fires at the next save, the one after epoch
1 (epoch 0's save reached the rank before any batch of epoch 1). A step count would depend on
how the batches were split: at step 25, meant for epoch 1, a writer that trained 25 of epoch
0's 64 batches had its first save killed."""
CASES = [
    pytest.param("kill_in_checkpoint", WRITER, id="writer-killed-before-the-model"),
    pytest.param("kill_after_save", WRITER, id="writer-killed-after-the-model"),
    pytest.param("kill_after_save", 0, id="rank-killed-after-its-optimizer-state"),
    pytest.param("kill_coordinator_in_save", WRITER, id="coordinator-killed-before-the-meta"),
]


def run(tmp: Path, name: str, *args: str) -> subprocess.CompletedProcess[str]:
    out, tag = run_script(tmp, name, list(args), timeout_s=240)
    # ranks that lost their coordinator exit on their own
    assert left_running(tag, 60) == [], "a process of the run outlived it"
    return out


@pytest.mark.timeout(420)
@pytest.mark.parametrize(("fault", "rank"), CASES)
def test_a_save_killed_between_two_writes_leaves_a_bundle_that_resumes(
    fault: str, rank: int, tmp_path: Path
) -> None:
    stem = tmp_path / "ck"
    common = ["--ranks", "3", "--mode", "cpu_cadence", "--policy", str(WRITER)]
    common += ["--save", str(stem), "--checkpoint-every", "1", "--slow", "0:3,1:3,2:3"]
    plan = ChaosPlan((Fault(fault, rank, epoch=ARMED_AT),), seed=0)
    first = run(tmp_path, "run", *common, "--epochs", str(EPOCHS), "--chaos", plan.to_env())
    left = list((tmp_path / "run.tmp").glob("flodl-*"))  # the launcher's run directory
    if fault == "kill_coordinator_in_save":
        assert first.returncode != 0  # the launcher, and with it the coordinator, is gone
        (run_dir,) = left  # a killed launcher cannot remove it; no rank wrote into it
        assert list(run_dir.iterdir()) == []
    else:
        assert first.returncode == 0, first.stderr[-3000:]  # the save failed over
        assert left == []
    meta = checkpoint.read_meta(stem, world_size=3)
    model = checkpoint.load_model(stem)  # the files the meta names, nothing else
    assert model.global_step == meta.global_step, (model.path, meta.bundle_tag)
    for r in range(3):
        optim = checkpoint.load_optim(stem, r)
        assert optim is None or optim.global_step == meta.global_step
    if fault == "kill_coordinator_in_save":
        assert meta.epoch == 1  # the first save is the resume point, the second never committed
    more = str(EPOCHS + 1)  # a completed run goes on for one more epoch
    resumed = run(tmp_path, "resume", *common, "--epochs", more, "--resume", str(stem))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert done_line(resumed.stdout)["save_reason"] is None
    end = checkpoint.read_meta(stem, world_size=3)
    assert end.epoch == EPOCHS + 1
    assert end.coverage is not None and end.coverage.per_epoch == []
    # only the committed save's files are left
    tagged = sorted(p.name for p in tmp_path.glob("ck.b*"))
    assert tagged and all(name.startswith(f"ck.{end.bundle_tag}.") for name in tagged), tagged
