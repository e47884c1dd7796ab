"""Observability end to end: metrics, sub-epoch reports, the record log, alerts, progress lines,
and the CLI that reads records back, on real rank processes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from resume_runs import done, metrics, run

from flodl.monitor.records import RecordLog, read_tree

pytestmark = pytest.mark.integration


@pytest.mark.timeout(180)
def test_record_tree_reports_alerts_and_progress_of_a_three_rank_run(tmp_path: Path) -> None:
    rec = tmp_path / "records"
    out = run(
        tmp_path,
        "a",
        *("--ranks", "3", "--epochs", "2", "--samples", "4096"),
        *("--records", str(rec), "--reports", "4", "--progress", "--rows-sum"),
        *("--crash-rank", "2", "--crash-step", "30"),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert done(out.stdout)["save_reason"] is None
    tree = read_tree(rec)
    assert set(tree) == {"root", "root/rank0", "root/rank1", "root/rank2"}
    for f in ("root.log", "root/rank0.log", "root/rank1.log", "root/rank2.log"):
        assert (rec / f).is_file()
    # the meta record comes first and names every reduction, the user's scalar included
    meta = tree["root"][0]
    assert meta["kind"] == "meta" and meta["v"] == 1
    reductions = meta["data"]["reductions"]
    assert reductions["loss"] == "mean" and reductions["throughput"] == "sum"
    assert reductions["data_starve_ms"] == "max" and reductions["rows"] == "sum"
    assert meta["data"]["run"]["world_size"] == 3
    # sub-epoch reports: 4 per epoch at the root whatever the cadence window grew to (they
    # follow the trained batches, not the averaging rounds), each with the engine's numbers
    roots = [r for r in tree["root"] if r["kind"] == "node"]
    per_epoch: dict[int, int] = {}
    for r in roots:
        per_epoch[r["data"]["epoch"]] = per_epoch.get(r["data"]["epoch"], 0) + 1
        assert {"anchor", "batch_counts", "syncs", "heartbeat_age_s", "loss"} <= set(r["data"])
    assert per_epoch == {0: 4, 1: 4}, per_epoch
    # a rank's node always has its batch share; loss and throughput only when it trained in that
    # slice (a slice of 1 ms steps can pass while a loaded rank trains none: absent, not zero)
    rank_nodes = [r["data"] for r in tree["root/rank0"] if r["kind"] == "node"]
    assert any(d["steps"] > 0 for d in rank_nodes)
    for d in rank_nodes:
        assert "batch_share" in d
        trained = {"loss", "throughput"} <= set(d)
        assert trained if d["steps"] > 0 else not {"loss", "throughput"} & set(d), d
    # the root's steps are its children's in the same report
    kids = [[r["data"] for r in tree[f"root/rank{k}"] if r["kind"] == "node"] for k in range(3)]
    assert [r["data"]["steps"] for r in roots] == [
        sum(n) for n in zip(*[[d["steps"] for d in k] for k in kids], strict=True)
    ]
    # after its death rank 2 reports no loss or throughput: absent, not zero
    dead = tree["root/rank2"]
    lost = [r for r in dead if r["kind"] == "event"]
    assert [e["data"]["class"] for e in lost] == ["rank_lost"] and lost[0]["sev"] == "critical"
    after = [r["data"] for r in dead if r["kind"] == "node" and r["ts"] > lost[0]["ts"]]
    assert all("loss" not in d and "throughput" not in d for d in after)
    # the root throughput is the sum of its children's in the same report
    first = next(r["data"] for r in roots)
    assert first["throughput"] > 0
    # alerts are printed too; progress lines for every report
    assert "flodl [rank_lost] root/rank2: rank 2 declared dead" in out.stdout
    progress = [line for line in out.stdout.splitlines() if line.startswith("flodl ▏epoch")]
    assert len(progress) >= len(roots)
    assert "ETA" in progress[-1] and "2/2 100%" in progress[-1]
    # EpochMetrics: Reduction.SUM of a per-rank mean of 32 rows over the ranks that trained
    ms = metrics(out.stdout)
    assert ms[0]["scalars"]["rows"] == 32.0 * 3
    assert ms[1]["scalars"]["rows"] == 32.0 * sum(1 for s in ms[1]["per_rank_samples"] if s)
    # the CLI reads the same records back
    cli = subprocess.run(
        [sys.executable, "-m", "flodl", "records", "tail", str(rec), "--path", "root", "-n", "3"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert cli.returncode == 0, cli.stderr
    lines = [json.loads(line) for line in cli.stdout.splitlines()]
    assert lines == RecordLog.tail(rec, "root", 3) and len(lines) == 3
    bad = subprocess.run(
        [sys.executable, "-m", "flodl", "records", "tail", str(rec), "--path", "root/../etc"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert bad.returncode == 2 and "'..'" in bad.stderr
    # the replay reads the death back and replays it (docs/design.md §3, "Replay")
    lost_records = [r["data"] for r in dead if r["kind"] == "rank_lost"]
    assert [d["rank"] for d in lost_records] == [2]
    sim = subprocess.run(
        [sys.executable, "-m", "flodl", "sim", "--from-records", str(rec), "--json"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert sim.returncode == 0, sim.stderr
    replayed = json.loads(sim.stdout)
    assert replayed["recorded"]["rank_failures"] == 1
    assert replayed["error"]["epochs_compared"] == 2
    assert [a["advice"] for a in replayed["advice"]][2] == "gone"


@pytest.mark.timeout(120)
def test_a_read_only_record_directory_costs_records_not_the_run(tmp_path: Path) -> None:
    rec = tmp_path / "records"
    rec.mkdir()
    (rec / "root").write_text("a file where the node directory should be")
    out = run(
        tmp_path,
        "a",
        *("--ranks", "2", "--epochs", "2", "--samples", "2048", "--records", str(rec)),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert done(out.stdout)["save_reason"] is None
    assert [m["epoch"] for m in metrics(out.stdout)] == [0, 1]
    assert out.stderr.count("cannot write records") == 1  # warned once
