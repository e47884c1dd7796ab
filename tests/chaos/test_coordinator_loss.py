"""Coordinator loss and slow-not-dead ranks, on real processes.

* SIGKILL of the launcher (which hosts the coordinator) at a seeded moment: every rank exits on
  its own (the bridge sees the loss, and its hard exit ends a rank stuck in a collective after
  the grace) with a death record that blames the coordinator, and a resume from the last epoch
  checkpoint finishes the run. How soon the ranks go is not timed here: the shell tests check
  that the bridge never gives up before its deadlines.
* A rank 10× slower than its peers for the whole run is absorbed by ElChe (a smaller share), not
  evicted: only a silent rank is declared dead.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from processes import left_running, signal_at_line

from flodl import checkpoint
from flodl.monitor.records import read_tree

pytestmark = [pytest.mark.integration]

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tests" / "integration" / "callbacks_main.py"
SCALE = 0.1  # liveness timeout 3 s
EXIT_WAIT_S = 90.0
"""Generous bound on the ranks' own exit after the kill (liveness 3 s + hard-exit grace)."""


@pytest.mark.timeout(400)
@pytest.mark.parametrize("mode", ["cpu_cadence", "nccl_cadence", "cpu_async"])
def test_killing_the_coordinator_stops_every_rank_and_the_run_resumes(
    mode: str, tmp_path: Path
) -> None:
    rng = random.Random(mode)
    stem, tag = tmp_path / "ck", f"flodl-chaos-{uuid.uuid4().hex}"
    args = [
        *("--ranks", "3", "--mode", mode, "--epochs", "30", "--samples", "2048"),
        *("--save", str(stem), "--checkpoint-every", "1", "--slow", "0:10,1:10,2:10"),
    ]
    scratch = tmp_path / "tmp"  # the launchers' run directories (tempfile) go here
    scratch.mkdir()
    env = {**os.environ, "FLODL_NET_TIMEOUT_SCALE": str(SCALE), "TMPDIR": str(scratch)}
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), "--tag", tag, "--log-dir", str(tmp_path / "a"), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        cwd=REPO,
        env=env,
    )
    pause = rng.uniform(0.0, 0.8)  # a seeded moment inside epoch 2 or 3
    signal_at_line(proc, 'METRICS {"epoch":1,', signal.SIGKILL, pause_s=pause, exit_within_s=10)
    left = left_running(tag, EXIT_WAIT_S)
    assert left == [], f"ranks still running {EXIT_WAIT_S:g} s after the kill"
    # the killed launcher could not remove its run directory; no rank wrote into it
    (killed,) = scratch.glob("flodl-*")
    assert list(killed.iterdir()) == []
    deaths = checkpoint.death_records(stem)
    assert {d.rank for d in deaths} == {0, 1, 2}, deaths
    assert all("coordinator" in d.error.lower() for d in deaths), [d.error for d in deaths]
    meta = checkpoint.read_meta(stem, world_size=3)
    resumed = subprocess.run(
        [
            *(sys.executable, str(SCRIPT), "--tag", tag, "--log-dir", str(tmp_path / "b")),
            *(*args, "--resume", str(stem)),
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=150,
        cwd=REPO,
        env=env,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert list(scratch.glob("flodl-*")) == [killed]  # the resumed run removed its own
    epochs = [
        json.loads(line[8:])["epoch"]
        for line in resumed.stdout.splitlines()
        if line.startswith("METRICS ")
    ]
    assert epochs == list(range(meta.epoch, 30))


@pytest.mark.timeout(180)
def test_a_rank_ten_times_slower_is_absorbed_not_evicted(tmp_path: Path) -> None:
    records = tmp_path / "records"
    out = subprocess.run(
        [
            *(sys.executable, str(SCRIPT), "--tag", f"flodl-chaos-{uuid.uuid4().hex}"),
            *("--log-dir", str(tmp_path / "a"), "--records", str(records)),
            *("--ranks", "3", "--mode", "cpu_cadence", "--epochs", "3", "--samples", "2048"),
            *("--slow", "0:3,1:30,2:3"),
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=150,
        cwd=REPO,
        env={**os.environ, "FLODL_NET_TIMEOUT_SCALE": str(SCALE)},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    tree = read_tree(records)
    events = [r for recs in tree.values() for r in recs if r["kind"] == "event"]
    assert [e["data"]["class"] for e in events if e["data"]["class"] == "rank_lost"] == []
    last = [
        json.loads(line[8:]) for line in out.stdout.splitlines() if line.startswith("METRICS ")
    ][-1]
    shares = last["per_rank_batch_share"]
    assert shares[1] < 0.5 * min(shares[0], shares[2]), shares  # it got a smaller share
    assert all(s > 0 for s in last["per_rank_samples"])  # and kept training
