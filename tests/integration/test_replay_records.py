"""``flodl sim --from-records`` on a real run: rank processes write the record log, the replay
reads it back, reports its error and the what-ifs, and the records hold what it read."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from flodl.monitor.records import read_tree

pytestmark = pytest.mark.integration

HERE = Path(__file__).resolve().parent


@pytest.mark.timeout(240)
def test_a_real_runs_records_replay_with_error_what_ifs_and_advice(tmp_path: Path) -> None:
    rec = tmp_path / "records"
    job = subprocess.run(
        [sys.executable, str(HERE / "replay_main.py"), "cpu_cadence", str(rec)],
        capture_output=True,
        text=True,
        timeout=200,
        check=False,
    )
    assert job.returncode == 0, job.stdout[-2000:] + job.stderr[-3000:]
    tree = read_tree(rec)
    root = tree["root"]
    kinds = {r["kind"] for r in root}
    assert {"job", "window", "contribution", "epoch", "eval"} <= kinds, kinds
    callbacks = [r for p, rs in tree.items() if p != "root" for r in rs if r["kind"] == "callback"]
    assert callbacks and {c["data"]["fn"] for c in callbacks} == {"eval"}
    sim = subprocess.run(
        [sys.executable, "-m", "flodl", "sim", "--from-records", str(rec), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert sim.returncode == 0, sim.stderr[-3000:]
    out = json.loads(sim.stdout)
    recorded = out["recorded"]
    assert (recorded["mode"], recorded["world_size"], recorded["epochs"]) == ("cpu_cadence", 2, 2)
    assert recorded["rank_failures"] == 0 and recorded["unknown_speed"] == []
    # the slowed rank is measured slower than the other: 3× its compute, but the ranks share 2
    # cores, so the fast rank's wall-clock batch also holds its waits for a core while the slow
    # one sleeps (1.45× was measured with one more busy process on the machine)
    fast, slow = recorded["median_ms_per_batch"]
    assert slow > 1.25 * fast
    error = out["error"]
    assert error["epochs_compared"] == 2
    epochs = [r["data"] for r in root if r["kind"] == "epoch"]
    assert error["recorded_s"] == pytest.approx(epochs[-1]["t_s"], abs=1e-3)
    assert error["recorded_syncs"] == epochs[-1]["syncs"]
    steps = [0, 0]
    for w in (r["data"] for r in root if r["kind"] == "window"):
        for rank, n in zip(w["ranks"], w["steps"], strict=True):
            steps[rank] += n
    assert error["recorded_shares"] == [round(s / sum(steps), 4) for s in steps]
    assert error["predicted_s"] > 0 and len(error["predicted_shares"]) == 2
    names = [w["name"] for w in out["what_ifs"]]
    modes = ["nccl_sync", "nccl_cadence", "cpu_sync", "cpu_async"]
    assert names == ["replay", *modes, "drop rank 0", "drop rank 1"]
    assert all(w["ok"] for w in out["what_ifs"])
    last = [r["data"] for r in root if r["kind"] == "contribution"][-1]["ranks"]
    assert out["advice"] == last
    assert {a["advice"] for a in out["advice"]} <= {"keep", "cpu_async", "evict"}
    assert [a["samples"] for a in out["advice"]] == [128 * n for n in steps]
