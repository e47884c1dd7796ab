"""MonitorSession and the progress display: what records a run produces, and the lines."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

from flodl.monitor.hub import MAX_HISTORY
from flodl.monitor.progress import ProgressDisplay, format_eta, format_rate
from flodl.monitor.records import RecordLog, read_tree
from flodl.monitor.session import MonitorSession, framework_reductions
from flodl.wire.frames import EpochMetrics


def epoch_metrics(epoch: int, *, dead: int | None = None) -> EpochMetrics:
    samples = [640, 320, 0 if dead == 2 else 320]
    return EpochMetrics(
        epoch=epoch,
        avg_loss=1.0 / (epoch + 1),
        epoch_ms=1000.0,
        scalars={"acc": 0.5},
        per_rank=[{"acc": 0.4}, {"acc": 0.6}, {} if dead == 2 else {"acc": 0.5}],
        per_rank_loss=[0.9, 1.1, None if dead == 2 else 1.0],
        per_rank_throughput=[640.0, 320.0, 0.0 if dead == 2 else 320.0],
        per_rank_batch_share=[0.5, 0.25, 0.25],
        per_rank_samples=samples,
        per_rank_compute_only_ms=[900.0, 900.0, 0.0 if dead == 2 else 900.0],
        per_rank_data_starve_ms=[5.0, 9.0, 0.0],
        syncs=4 * (epoch + 1),
        anchor=10,
    )


def test_epoch_node_records_roll_up_with_the_declared_reductions(tmp_path: Path) -> None:
    lines: list[str] = []
    session = MonitorSession(
        world_size=3,
        total_epochs=2,
        batch_size=32,
        hosts=("a", "a", "b"),
        record_dir=tmp_path,
        scalar_reductions={"acc": "max"},
        run_info={"mode": "cpu_cadence"},
        printer=lines.append,
    )
    session.epoch(epoch_metrics(0), {"batch_counts": [20, 10, 10]})
    session.epoch(epoch_metrics(1, dead=2))
    session.alert("rank_lost", "root/b/rank2", "rank 2 declared dead", "critical")
    session.close()
    tree = read_tree(tmp_path)
    assert set(tree) == {"root", "root/a", "root/b", "root/a/rank0", "root/a/rank1", "root/b/rank2"}
    meta = tree["root"][0]
    assert meta["kind"] == "meta"
    assert meta["data"]["reductions"] == {**framework_reductions(), "acc": "max"}
    host_a = next(r["data"] for r in tree["root/a"] if r["kind"] == "node")
    assert host_a["throughput"] == 960.0  # sum
    assert host_a["acc"] == 0.6  # the declared max
    assert abs(host_a["loss"] - (0.9 * 20 + 1.1 * 10) / 30) < 1e-9  # work-weighted mean
    root_nodes = [r["data"] for r in tree["root"] if r["kind"] == "node"]
    assert root_nodes[0]["batch_counts"] == [20, 10, 10] and root_nodes[0]["loss"] == 1.0
    dead = [r["data"] for r in tree["root/b/rank2"] if r["kind"] == "node"][-1]
    assert "loss" not in dead and "throughput" not in dead and dead["steps"] == 0.0
    [event] = [r for r in tree["root/b/rank2"] if r["kind"] == "event"]
    assert event["data"] == {"class": "rank_lost", "detail": "rank 2 declared dead", "count": 1}
    assert lines == ["flodl [rank_lost] root/b/rank2: rank 2 declared dead"]
    epochs = [r["data"]["epoch"] for r in tree["root"] if r["kind"] == "epoch"]
    assert epochs == [0, 1]


def test_sub_epoch_reports_replace_the_epoch_node_records(tmp_path: Path) -> None:
    session = MonitorSession(
        world_size=2, total_epochs=1, record_dir=tmp_path, sub_epoch_reports=True
    )
    session.record("root/rank0", "node", {"loss": 1.0, "throughput": 10.0, "steps": 3.0})
    session.epoch(epoch_metrics(0))
    session.record("root/../x", "node", {})  # a malformed record is dropped, not raised
    session.close()
    kinds = [r["kind"] for r in RecordLog.tail(tmp_path, "root", 10)]
    assert kinds == ["meta", "epoch"]
    assert [r["kind"] for r in RecordLog.tail(tmp_path, "root/rank0", 10)] == ["node"]


def test_the_archive_is_written_at_close(tmp_path: Path) -> None:
    out = tmp_path / "d.html"
    session = MonitorSession(world_size=2, total_epochs=1, save_dashboard=out, theme="light")
    session.epoch(epoch_metrics(0))
    assert not out.exists()
    session.close()
    html = out.read_text()
    assert 'const ARCHIVE_THEME="light";' in html and "flodl-archive" in html
    session.close()  # idempotent


def test_the_archive_holds_the_run_records_a_long_run_pushed_out_of_the_main_ring(
    tmp_path: Path,
) -> None:
    """More root records than one history read returns: the archive still has the meta record,
    the run's evals and its last windows (the hub's kept records, not a history tail)."""
    out = tmp_path / "d.html"
    session = MonitorSession(world_size=2, total_epochs=1, save_dashboard=out)
    session.record("root", "eval", {"epoch": 0, "metric": 0.5, "rank": 0})
    for cycle in range(300):
        session.record("root", "window", {"cycle": cycle, "ranks": [0, 1]})
    for i in range(MAX_HISTORY + 10):
        session.record("root", "node", {"loss": 1.0, "i": i})
    session.close()
    m = re.search(r'id="flodl-archive">(.*?)</script>', out.read_text())
    assert m is not None
    kinds = [r["kind"] for r in json.loads(m[1])["records"]["root"]]
    assert kinds[0] == "meta" and kinds.count("eval") == 1 and kinds.count("window") > 20


def test_progress_lines() -> None:
    buf = io.StringIO()
    now = [0.0]
    p = ProgressDisplay(4, 2, out=buf, clock=lambda: now[0])
    p.on_node("root/rank0", {"throughput": 12345.0, "batch_share": 0.6})
    p.on_node("root/rank1", {"throughput": 800.0, "batch_share": 0.4})
    now[0] = 10.0
    p.on_node("root", {"epoch": 0, "epoch_progress": 0.5, "loss": 0.75, "syncs": 3, "anchor": 12})
    line = buf.getvalue().splitlines()[-1]
    assert line.startswith("flodl ▏epoch 1/4  12%")
    assert "loss 0.7500" in line and "r0 12.3k/s 60% · r1 800/s 40%" in line
    assert "syncs 3" in line and "anchor 12" in line and "ETA 1m10s" in line
    p.on_node("root/rank1", {"batch_share": 0.2})  # no throughput: not shown, not stale
    now[0] = 20.0
    p.on_epoch(0, 0.5, {"syncs": 5})
    line = buf.getvalue().splitlines()[-1]
    assert "epoch 2/4  25%" in line and "r1 — 20%" in line and "ETA 1m00s" in line
    assert p.lines == 2
    assert format_rate(950) == "950/s" and format_rate(4.1e6) == "4.1M/s"
    assert format_eta(None) == "—" and format_eta(3725) == "1h02m"


def test_progress_lines_show_the_live_ranks_drop_and_grow_back() -> None:
    buf = io.StringIO()
    p = ProgressDisplay(4, 3, out=buf, clock=lambda: 0.0)
    p.on_node("root", {"epoch": 0, "epoch_progress": 0.2, "ranks": 3})
    p.on_node("root", {"epoch": 0, "epoch_progress": 0.6, "ranks": 2})  # a rank died
    p.on_epoch(0, 0.5, {"ranks": 3})  # ... and rejoined
    shown = [line.split("ranks ")[1].split(" ")[0] for line in buf.getvalue().splitlines()]
    assert shown == ["3/3", "2/3", "3/3"]


def test_a_broken_terminal_costs_the_display_only() -> None:
    class Broken(io.StringIO):
        def write(self, s: str) -> int:
            raise OSError("EIO")

    p = ProgressDisplay(1, 1, out=Broken())
    p.on_epoch(0, 1.0, {})
    assert p.lines == 0
