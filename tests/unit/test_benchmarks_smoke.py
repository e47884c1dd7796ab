"""Cheap checks of the benchmark scripts' plumbing: argument parsing, bookkeeping, the suite's
summary extractors. Nothing here trains, spawns or times anything."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest


class FakeSlowdown:
    """Stands in for flodl.demo.Slowdown: sleeps nothing, pretends to have slept 2 ms."""

    def __init__(self) -> None:
        self.slept_s = 0.0

    def forward(self) -> Any:
        import contextlib

        @contextlib.contextmanager
        def block() -> Any:
            yield
            self.slept_s += 0.002

        return block()


def test_hetero_arguments_and_defaults(bench: Any) -> None:
    h = bench("bench_hetero")
    args = h.parse_args([])
    assert [r.name for r in args.rig_list] == ["x1", "x2", "x3", "mixed4", "micro-x3"]
    assert args.system_list == list(h.SYSTEMS) and "bound" in args.system_list
    assert args.rounds == 3 and args.samples == {"realistic": 24_000, "micro": 96_000}
    quick = h.parse_args(["--quick", "--rigs", "x3", "--systems", "ddp,cpu_cadence"])
    assert [r.name for r in quick.rig_list] == ["x3"]
    assert quick.system_list == ["cpu_cadence", "ddp"]  # suite order, whatever the input
    assert quick.rounds == 1 and quick.samples["realistic"] == 8_000
    assert h.RIGS["mixed4"].slow == {2: 2.0, 3: 3.0} and h.RIGS["mixed4"].world == 4
    for bad in (["--systems", "horovod"], ["--rigs", "x9"], ["--rounds", "0"]):
        with pytest.raises(SystemExit):
            h.parse_args(bad)
    assert h.round_order(["a", "b", "c"], 0) == ["a", "b", "c"]
    assert h.round_order(["a", "b", "c"], 1) == ["c", "b", "a"]


def test_hetero_medians_ratios_and_targets(bench: Any) -> None:
    h = bench("bench_hetero")

    def run(
        system: str, rnd: int, span: float, loss: float = 2.0, step_ms: float = 20.0
    ) -> dict[str, Any]:
        row = {"system": system, "rig": "x3", "round": rnd, "ok": True, "span_s": span}
        row |= {"total_s": span + 5, "loss": loss, "metric": 0.4, "syncs": 10}
        row |= {"cpu_ms_per_step": [step_ms, step_ms + 2.0], "load": {"other": 0.25 * rnd}}
        return row | {"steps": [30, 10], "idle": [0.1, 0.0]}

    def bound(rnd: int, span: float) -> dict[str, Any]:
        row = {"system": "bound", "rig": "x3", "round": rnd, "ok": True, "span_s": span}
        return row | {"total_s": 9, "cpu_ms_per_step": [20.0, None]}

    runs = [
        run("cpu_cadence", 0, 10.0, 2.01, step_ms=25.0),
        run("ddp", 0, 25.0, 2.0),
        run("torchft", 0, 20.0),
        bound(0, 9.0),
        run("cpu_cadence", 1, 12.0, 2.03),
        run("ddp", 1, 24.0, 2.0),
        run("torchft", 1, 22.0),
        bound(1, 9.6),
        {"system": "diloco", "rig": "x3", "round": 0, "ok": False, "error": "boom"},
    ]
    rows = {r["system"]: r for r in h.aggregate(runs)}
    cad = rows["cpu_cadence"]
    assert cad["span_s"] == pytest.approx(11.0) and cad["rounds"] == 2
    assert cad["vs_ddp"] == pytest.approx((2.5 + 2.0) / 2)  # per-round ratios, then the median
    assert cad["of_bound"] == pytest.approx((0.9 + 0.8) / 2)
    assert cad["of_bound_min"] == pytest.approx(0.8)
    assert cad["loss_vs_ddp"] == pytest.approx(0.01)
    assert not rows["diloco"]["ok"] and rows["diloco"]["error"] == "boom"
    goals = {t["check"]: t for t in h.targets(list(rows.values())) if t["system"] == "cpu_cadence"}
    assert goals["fraction of the balance bound (median; worst round)"]["met"] is False
    assert goals["speed vs DDP"]["met"] is False  # 2.25× < 2.5×
    assert goals["held-out loss vs DDP"]["met"] is True  # exactly +1 %
    text = h.markdown(
        {
            "command": "python benchmarks/bench_hetero.py",
            "date": "2026-12-03 12:00 UTC",
            "took_s": 60.0,
            "uptime_before": "up",
            "uptime_after": "up",
            "machine": {"cpus": 2},
            "versions": {"torch": "2.13.0", "torchft": None},
            "config": {
                "rounds": 2,
                "tasks": {"realistic": "big", "micro": "small"},
                "samples": {"realistic": 100, "micro": 400},
                "batch_size": 64,
                "threads": 1,
            },
            "rows": list(rows.values()),
            "runs": runs,
            "targets": h.targets(list(rows.values())),
        }
    )
    assert "| x3 | cpu_cadence | 11.0 (10.0–12.0) |" in text
    # the machine's speed per round: steps of 26 ms mean against the bound's 20 (a slow round)
    costs = {row[1]: row for row in h.step_cost_rows(runs)}
    # round 0: of bound 9 / 10 = 0.90, at the bound's step cost 0.90 × 1.30 = 1.17
    assert costs["cpu_cadence"] == [
        "x3",
        "cpu_cadence",
        "26.0 ms ×1.30 → 1.17",
        "21.0 ms ×1.05 → 0.84",
        "0.00/0.25",
    ]
    assert costs["bound"][2:4] == ["20.0 ms", "20.0 ms"]
    assert "diloco" not in costs  # it failed in every round: nothing measured, no row
    assert "load above 0.1 cores: x3 round 1 cpu_cadence (0.25), x3 round 1 ddp (0.25)" in text
    assert "| x3 | cpu_cadence | 26.0 ms ×1.30 → 1.17 | 21.0 ms ×1.05 → 0.84 | 0.00/0.25 |" in text
    assert "speed vs DDP 2.25× (target ≥ 2.5×): **not met**" in text


def test_step_record_round_trip_and_equal_split(bench: Any, tmp_path: Path) -> None:
    d = bench("_ddp")
    step = d.TimedStep(lambda m, b: b * 2, FakeSlowdown(), 3.0, tmp_path / "r.steps")
    assert step(None, 21) == 42
    step(None, 1)
    rec = d.read_step_record(tmp_path / "r.steps")
    assert rec is not None and rec["steps"] == 2
    assert rec["busy_s"] >= 2 * 0.002  # the sleeps count as busy; waits never do
    assert rec["busy_s"] - rec["cpu_s"] == pytest.approx(2 * 0.002)  # the sleeps alone
    assert rec["t0"] <= rec["t1"]
    assert d.read_step_record(tmp_path / "absent") is None
    parts = [d.equal_split(10, 3, r, epoch=0, seed=0) for r in range(3)]
    assert [len(p) for p in parts] == [4, 4, 4]  # padded like DistributedSampler
    assert set().union(*parts) == set(range(10))


def test_cpu_meter_counts_this_process_as_its_own_load(bench: Any) -> None:
    import time

    c = bench("_common")
    started = time.monotonic()
    meter = c.CpuMeter()
    end = time.process_time() + 0.3
    while time.process_time() < end:  # 0.3 s of CPU, in this process
        pass
    load = meter.stop()
    wall = time.monotonic() - started
    # the CPU this process spent counts as its own, however much of a core it got meanwhile
    # (mean cores × the stretch ≥ the CPU-seconds spent, less the clocks' granularity)
    assert load["own"] * wall >= 0.28
    if load["machine"] is not None:  # /proc/stat: Linux
        assert load["other"] is not None and load["other"] >= 0.0
        assert load["machine"] >= load["other"]


def test_recovery_arguments_and_stats(bench: Any) -> None:
    r = bench("bench_recovery")
    args = r.parse_args(["--quick"])
    assert args.trials == 1 and args.system_list == ["flodl", "torchft"]
    assert args.path_list == ["kill", "stop"]
    with pytest.raises(SystemExit):
        r.parse_args(["--paths", "sigsegv"])
    c = bench("_common")
    stats = c.median_stats([0.1, None, 0.3, 0.2])
    assert stats == {"median": 0.2, "min": 0.1, "max": 0.3, "n": 3}
    assert c.median_stats([None])["median"] is None
    assert r._ms_cell(stats) == "200 (100–300)"
    assert c.stats_cell(c.median_stats([None])) == "-"
    assert c.stats_cell(c.median_stats([1.5])) == "1.50"
    # a value that rounds to zero loses its sign; a negative one keeps it
    assert c.stats_cell(c.median_stats([-0.0004, -0.004]), ".0f", 1000.0) == "-2 (-4–0)"


def test_suite_plan_and_extractors(bench: Any) -> None:
    m = bench("benchmarks.__main__")
    names = m.discover()
    assert names[: len(m.SPECS)] == list(m.SPECS)
    assert sum(s.limit_s for s in m.SPECS.values()) <= m.SUITE_LIMIT_S
    hetero = {
        "targets": [
            {
                "rig": "x3",
                "system": "cpu_cadence",
                "check": "speed vs DDP",
                "value": 2.6,
                "target": "≥ 2.5×",
                "met": True,
            },
            {
                "rig": "x3",
                "system": "cpu_cadence",
                "check": "speed vs torchft LocalSGD",
                "value": None,
                "target": "≥ 2.4×",
                "met": None,
            },
        ]
    }
    rows = m._hetero(hetero)
    assert [row["met"] for row in rows] == [True, None]
    assert rows[0]["value"] == "2.60×" and rows[1]["value"] == "n/a"
    with pytest.raises(KeyError):
        m._hetero({"targets": []})
    coord = {
        "rows": [
            {"world": 8, "cycle_us": 300.0, "cycle_us_per_rank": 37.5},
            {"world": 4096, "cycle_us": 60_000.0, "cycle_us_per_rank": 14.6},
        ]
    }
    assert m._coord(coord)[0]["met"] is False
    reform = {
        "rows": [
            {"world": 64, "machine_ms": 0.2, "encode_ms": 0.3, "members": 63, "bytes": 9_000},
            {"world": 4096, "machine_ms": 11.0, "encode_ms": 16.0, "members": 4095, "bytes": 2**20},
        ]
    }
    [row] = m._reform(reform)
    assert row["met"] is None and "4,096 ranks" in row["metric"]
    assert row["value"] == "27.0 ms (3.9 µs per member encoded, 1.00 MiB sent)"
    row = {"world": 2, "mib": 64, "lane": "shm", "wire": "f32", "ratio_vs_gloo": 0.6}
    ablation = {**row, "lane": "tcp tag-first", "target_ratio": None, "target_met": None}
    reduce = {"rows": [{**row, "target_ratio": 1.0, "target_met": True}, ablation]}
    assert [r["met"] for r in m._reduce(reduce)] == [True]  # a JSON without the loop lag
    lag = {"mib": 256, "lag_p99_ms": 62.3, "target_p99_ms": 50.0, "target_met": False}
    rows = m._reduce({**reduce, "loop_lag": lag})
    assert [r["met"] for r in rows] == [True, False]
    assert rows[1]["value"] == "62.3 ms" and "256 MiB" in rows[1]["metric"]


def _elastic_tree() -> dict[str, list[dict[str, Any]]]:
    """A hand-made record tree: a report every 50 ms (one per batch, as ``reports_per_epoch``
    gives) and a reduce every 200 ms from t = 0; rank 1 dies at 0.95 s, says hello at 2.9 s, gets
    the consensus in the cycle at 3.0 s (weight 0), first reports steps at 3.2 s and has them
    averaged in the reduce at 3.4 s; throughput 300 before the kill, 200 while down, 330 after
    the fold."""
    root: list[dict[str, Any]] = []
    rank1: list[dict[str, Any]] = []
    for i in range(100):
        ts = 50.0 * i
        thr = 300.0 if ts < 1000 else 200.0 if ts < 3200 else 330.0
        data = {"syncs": i // 4 + 1, "throughput": thr, "steps": thr / 40}
        root.append({"ts": ts, "kind": "node", "data": data})
        steps = 0.0 if 1000 <= ts < 3200 else 2.5
        rank1.append({"ts": ts + 0.5, "kind": "node", "data": {"steps": steps}})
    root.insert(0, {"ts": -5.0, "kind": "meta", "data": {}})
    root.append({"ts": 4000.0, "kind": "epoch", "data": {"epoch": 0, "epoch_ms": 4000.0}})
    rank1.append({"ts": 1010.0, "kind": "event", "data": {"class": "rank_lost"}})
    rank1.append({"ts": 2900.0, "kind": "event", "data": {"class": "rank_rejoined"}})
    rejoined = {"rank": 1, "incarnation": 1, "down_s": 1.9, "consensus_s": 0.1, "world_size": 3}
    rank1.append({"ts": 3000.0, "kind": "rank_rejoined", "data": rejoined})
    rank1.sort(key=lambda r: r["ts"])
    return {"root": root, "root/rank1": rank1}


def test_elastic_fold_window_and_throughput(bench: Any) -> None:
    e = bench("bench_elastic")
    tree = _elastic_tree()
    assert len(e.root_reports(tree)) == 100  # the meta and epoch records are no reduces
    assert [r["ts"] for r in e.cycle_reports(e.root_reports(tree))][:3] == [200.0, 400.0, 600.0]
    fold = e.first_fold(tree, 1, after_ms=3000.0)
    # its first steps show in the report at 3.2 s; the reduce after them completes at 3.4 s
    assert fold is not None and fold["ts"] == 3400.0
    got = e.analyse_flodl(
        tree,
        victim=1,
        t_kill_ms=950.0,
        t_respawn_ms=2000.0,
        before_s=0.8,
        after_s=0.8,
        batch_size=10,
    )
    assert got["t_fold_s"] == pytest.approx(0.5)  # hello at 2.9 s → fold at 3.4 s
    assert got["window_s"] == pytest.approx(0.2)  # the reduce interval, not the report one
    assert got["target_s"] == pytest.approx(2.2) and got["met"] is True
    assert (got["down_s"], got["consensus_s"]) == (1.9, 0.1)
    assert got["throughput_before"] == pytest.approx(300.0) and got["reports_before"] == 16
    assert got["throughput_after"] == pytest.approx(330.0) and got["reports_after"] == 16
    assert got["throughput_ratio"] == pytest.approx(1.1)
    assert got["throughput_while_down"] == pytest.approx(200.0)
    # wall-clock: 16 reports of 7.5 steps × 10 samples in the 0.8 s since the report at 0.15 s
    assert got["wall_throughput_before"] == pytest.approx(1500.0)
    assert got["wall_throughput_ratio"] == pytest.approx(1.1)
    assert got["start_to_hello_s"] == pytest.approx(0.9)
    assert got["start_to_fold_s"] == pytest.approx(1.4)
    assert got["syncs_while_down"] == 15 - 5  # syncs 5 at 0.95 s, 15 at 2.9 s
    assert got["consensus_to_next_epoch_s"] == pytest.approx(1.0)
    # order pairing needs equal lengths; a missing rank record falls back to time pairing
    del tree["root/rank1"][0]
    pairs = e.paired_reports(tree, 1)
    assert pairs[0][1] is None and pairs[1][1]["ts"] == 50.5
    assert e.first_fold(tree, 1, after_ms=3000.0)["ts"] == 3400.0
    with pytest.raises(ValueError, match="rank_rejoined"):
        e.analyse_flodl(tree, victim=1, t_kill_ms=3500.0, t_respawn_ms=None, before_s=1, after_s=1)


def test_elastic_torchft_milestones_and_arguments(bench: Any) -> None:
    e = bench("bench_elastic")
    old = [{"ts": 50.0, "event": "commit", "committed": True}]  # the killed process's lines
    new = [
        {"ts": 1500.0, "event": "start"},
        {"ts": 2000.0, "event": "quorum", "healing": True},
        {"ts": 2100.0, "event": "commit", "committed": True},
        {"ts": 2300.0, "event": "quorum", "healing": False},
        {"ts": 2350.0, "event": "commit", "committed": False},
        {"ts": 2400.0, "event": "quorum", "healing": False},
        {"ts": 2500.0, "event": "commit", "committed": True},
    ]
    got = e.analyse_torchft(old + new, t_start_ms=1000.0)
    assert got["start_to_ready_s"] == pytest.approx(0.5)
    assert got["start_to_heal_s"] == pytest.approx(1.0)
    assert got["start_to_consensus_s"] == pytest.approx(1.1)
    assert got["start_to_fold_s"] == pytest.approx(1.5)
    assert got["failed_commits"] == 1
    assert e.analyse_torchft(old, t_start_ms=1000.0)["start_to_consensus_s"] is None
    args = e.parse_args(["--quick", "--modes", "cpu_sync,nccl_cadence"])
    assert args.trials == 1 and args.mode_list == ["cpu_sync", "nccl_cadence"]
    assert args.system_list == ["flodl", "torchft"] and args.lighthouse_list == ["cli", "py"]
    assert e.parse_args([]).trials == 2
    for bad in (["--modes", "gloo"], ["--systems", "horovod"], ["--trials", "0"]):
        with pytest.raises(SystemExit):
            e.parse_args(bad)
    rows = e.summarize(
        [
            {"system": "flodl", "mode": "cpu_sync", "ok": True, "met": True, "t_fold_s": 0.5},
            {"system": "flodl", "mode": "cpu_sync", "ok": False, "error": "boom"},
        ],
        ["cpu_sync"],
    )
    assert rows[0]["met"] is True and rows[0]["t_fold_s"]["n"] == 1
    assert rows[0]["dispatch"] == "epoch partitions" and rows[0]["errors"] == ["boom"]


def test_the_suite_writes_its_results_apart_from_a_scripts_own_run(
    bench: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A suite run (smoke sizes) writes its JSON under results/suite/: the file of a script's
    own full run, from which docs/benchmarks.md renders that script's section, is untouched."""
    m = bench("benchmarks.__main__")
    here = tmp_path / "benchmarks"
    here.mkdir()
    (here / "bench_fake.py").write_text(
        "import json, sys\n"
        "path = sys.argv[sys.argv.index('--json') + 1]\n"
        "open(path, 'w').write(json.dumps({'value': 2.5}))\n"
    )
    results = here / "results"
    results.mkdir()
    full = results / "bench_fake.json"
    full.write_text('{"value": 1.0}')  # the script's own (full) run
    for name, value in (("HERE", here), ("REPO", tmp_path), ("RESULTS", results)):
        monkeypatch.setattr(m, name, value)
    monkeypatch.setattr(m, "SUITE_RESULTS", results / "suite")
    headline = lambda d: [m._row("fake", str(d["value"]))]  # noqa: E731
    monkeypatch.setitem(m.SPECS, "bench_fake", m.Spec([], [], 30, headline))
    out = m.run_script("bench_fake", True, time.perf_counter() + 60)
    assert out["status"] == "ok" and out["rows"][0]["value"] == "2.5", out
    assert json.loads(full.read_text()) == {"value": 1.0}
    assert json.loads((results / "suite" / "bench_fake.json").read_text()) == {"value": 2.5}
    assert (results / "suite" / "bench_fake.log").exists()


def test_suite_elastic_extractor(bench: Any) -> None:
    m = bench("benchmarks.__main__")
    assert "bench_elastic" in m.SPECS
    stat = {"median": 0.5, "min": 0.4, "max": 0.6, "n": 2}
    none = {"median": None, "min": None, "max": None, "n": 0}
    rows = m._elastic(
        {
            "rows": [
                {
                    "system": "flodl",
                    "mode": "cpu_cadence",
                    "t_fold_s": stat,
                    "target_s": {**stat, "min": 2.2},
                    "throughput_ratio": {**stat, "median": 0.97},
                    "start_to_consensus_s": {**stat, "median": 7.0},
                    "met": True,
                    "errors": [],
                },
                {
                    "system": "torchft",
                    "variant": "py",
                    "start_to_consensus_s": none,
                    "errors": ["torchft not importable"],
                },
            ]
        }
    )
    assert rows[0]["met"] is True and "0.60 s" in rows[0]["value"] and "0.97" in rows[0]["value"]
    assert rows[1]["value"].startswith("n/a") and "not importable" in rows[1]["note"]


def test_replay_summary_verdicts_and_suite_extractor(bench: Any) -> None:
    r = bench("bench_replay")
    m = bench("benchmarks.__main__")
    args = r.parse_args(["--quick"])
    assert args.rig_list == ["2r"] and args.samples == 24_000 and args.rounds == 1

    def run(mode: str, err: float | None, ok: bool = True) -> dict[str, Any]:
        row: dict[str, Any] = {"mode": mode, "rig": "2r", "round": 0, "ok": ok}
        if ok:
            row |= {"time_error": err, "share_error_pp": 1.0}
        return row

    runs = [
        run("cpu_cadence", 0.05),
        run("cpu_cadence", -0.12),
        run("cpu_async", 0.20),
        run("cpu_sync", 0.01),
        run("cpu_sync", None, ok=False),
    ]
    summary = r.summarize(runs, ["cpu_cadence", "cpu_async", "cpu_sync", "nccl_sync"])
    verdicts = {row["mode"]: row["met"] for row in summary["modes"]}
    # within on every run; one run over 15 %; a failed run leaves it open; no run at all
    assert verdicts == {
        "cpu_cadence": True,
        "cpu_async": False,
        "cpu_sync": None,
        "nccl_sync": None,
    }
    cadence = summary["modes"][0]
    assert cadence["worst_time_error"] == -0.12 and cadence["ok"] == 2
    assert summary["met"] is False and summary["max_abs_time_error"] == 0.20
    rows = m._replay({"target_time_error": 0.15, "summary": summary})
    assert [row["met"] for row in rows] == [True, False, None, None]
    assert rows[0]["value"] == "-12.0 % (2/2 runs)" and rows[3]["value"] == "n/a"
    assert "bench_replay" in m.SPECS
    with pytest.raises(KeyError):
        m._replay({"target_time_error": 0.15, "summary": {"modes": []}})


def result_head(command: str) -> dict[str, Any]:
    """What every result file opens with: the command, the date, the load, the machine."""
    return {
        "command": command,
        "date": "2026-12-03 12:00 UTC",
        "uptime_before": "a",
        "uptime_after": "b",
        "machine": {"cpus": 2, "python": "3.11"},
    }


def test_coord_verdicts_and_markdown(bench: Any) -> None:
    c = bench("bench_coord")
    rows = [
        {"world": w, "cycle_us": us, "cycle_us_per_rank": us / w, "batch_us": 3.5}
        | {"total_ms_per_cycle": 1.0, "one_off_ms": 2.0, "sim_rank_seconds_per_wall_s": 700}
        | {"closing_ms": 0.25 * w, "cycles": 24, "cycle_gc_us": us / 4}
        for w, us in ((8, 300.0), (64, 1_500.0), (4096, 120_000.0))
    ]
    v = c.verdicts(rows)
    assert v["met_cycle"] is False and v["cycle_ms_4096"] == pytest.approx(120.0)
    assert v["per_rank_growth_64_to_4096"] == pytest.approx((120_000 / 4096) / (1_500 / 64))
    assert v["met_linear"] is True
    data = result_head("python benchmarks/bench_coord.py --quick") | {"rows": rows, "verdicts": v}
    assert "gc.freeze()` after the input that starts training" in c.markdown(data)
    assert "(not applied in this run)" in c.markdown(data)  # a file from before the policy
    rows[-1]["frozen_objects"] = 81_392
    text = c.markdown(data)
    assert "(81,392 objects at 4,096 ranks)" in text  # the heap policy, from the result file
    assert "| 4,096 | 24 | 120,000 | 30,000 | 29.3 |" in text  # a quarter of it the collector's
    assert "| 1.0 | 1024.0 | 2 | 700 |" in text  # the closing cycle, apart from the steady ones
    assert "4096-rank cycle under 50 ms: 120.0 ms, **not met**" in text
    assert "| 700 | 120,000 |" in text  # a single run's row names its one cycle figure


def test_coord_verdicts_and_markdown_name_each_core_measured(bench: Any) -> None:
    """``--compiled``: both cores' rows, a core column, and each core's verdicts; the top-level
    verdicts stay the interpreted core's."""
    c = bench("bench_coord")
    rows = [
        {"world": w, "cycle_us": us, "cycle_us_per_rank": us / w, "batch_us": 3.5, "core": core}
        | {"total_ms_per_cycle": 1.0, "one_off_ms": 2.0, "sim_rank_seconds_per_wall_s": 700}
        | {"closing_ms": 1.0, "cycles": 24, "cycle_gc_us": 0.0}
        for core, scale in (("interpreted", 1.0), ("compiled", 0.4))
        for w, us in ((8, 300.0 * scale), (64, 1_500.0 * scale), (4096, 120_000.0 * scale))
    ]
    v = c.verdicts(rows)
    assert v["met_cycle"] is False and v["cycle_ms_4096"] == pytest.approx(120.0)
    assert v["by_core"]["compiled"]["met_cycle"] is True
    assert v["by_core"]["compiled"]["cycle_ms_4096"] == pytest.approx(48.0)
    text = c.markdown(
        result_head("python benchmarks/bench_coord.py --compiled") | {"rows": rows, "verdicts": v}
    )
    assert "| core | ranks | cycles |" in text and "| compiled | 4,096 | 24 | 48,000 |" in text
    assert "4096-rank cycle under 50 ms, interpreted core: 120.0 ms, **not met**" in text
    assert "4096-rank cycle under 50 ms, compiled core: 48.0 ms, **met**" in text
    assert "| compiled | 8 | 24 | 120 | 0 | 15.0 | 1.00× |" in text  # (per core, against its own 8)


def test_coord_against_a_baseline_reports_each_core_and_size(bench: Any) -> None:
    """``--baseline REV``: this tree's median cycle over the baseline's, per core and size, in
    the JSON and the docs section, with the baseline's own figures."""
    c = bench("bench_coord")

    def rows(scale: float) -> list[dict[str, Any]]:
        return [
            {"world": w, "cycle_us": us * scale, "cycle_us_per_rank": us * scale / w}
            | {"core": core, "batch_us": 3.5, "total_ms_per_cycle": 1.0, "one_off_ms": 2.0}
            | {"sim_rank_seconds_per_wall_s": 700, "closing_ms": 1.0, "cycles": 24}
            | {"cycle_gc_us": 0.0, "cycle_us_runs": [us * scale], "batch_us_median": 4 * scale}
            for core, k in (("interpreted", 1.0), ("compiled", 0.5))
            for w, us in ((8, 300.0 * k), (64, 1_500.0 * k), (4096, 100_000.0 * k))
        ]

    this, base = rows(0.8), rows(1.0)
    compared = c.comparison(this, base)
    assert [(x["core"], x["world"]) for x in compared][-1] == ("compiled", 4096)
    assert all(x["ratio"] == pytest.approx(0.8) for x in compared)
    assert all(x["batch_ratio"] == pytest.approx(0.8) for x in compared)
    data = result_head("python benchmarks/bench_coord.py --compiled --baseline HEAD~1") | {
        "rows": this,
        "verdicts": c.verdicts(this),
        "baseline": {
            "rev": "HEAD~1",
            "commit": "0123456789abcdef",
            "rows": base,
            "verdicts": c.verdicts(base),
            "comparison": compared,
        },
    }
    text = c.markdown(data)
    assert "Against the baseline `HEAD~1` (commit `0123456789`)" in text
    assert "| compiled | 4,096 | 40,000 | 50,000 | 0.80× | 50,000 | 3.20 | 4.00 | 0.80× |" in text
    assert "- The baseline's interpreted core in this run: 4096-rank cycle 100.0 ms" in text
    assert "Against the baseline" not in c.markdown(data | {"baseline": None})


def test_coord_baseline_is_a_revision_of_this_repository(bench: Any, tmp_path: Path) -> None:
    c = bench("bench_coord")
    with pytest.raises(SystemExit, match="'no-such-rev' names no commit"):
        c.baseline_tree("no-such-rev", tmp_path / "x")
    assert not (tmp_path / "x").exists()
    commit = c.baseline_tree("HEAD", tmp_path / "head")
    assert len(commit) == 40 and (tmp_path / "head" / "flodl" / "coord" / "machine.py").is_file()


def test_coord_rows_are_the_median_run_of_each_size(bench: Any) -> None:
    c = bench("bench_coord")
    runs = [
        {"world": 4096, "cycle_us": us, "tag": us, "batch_us": b}
        for us, b in ((130_000.0, 5.0), (95_000.0, 7.5), (110_000.0, 9.0))
    ]
    row = c.median_run(runs)
    assert row["tag"] == 110_000.0 and row["repeats"] == 3  # the middle one, whole
    assert row["cycle_us_runs"] == [95_000.0, 110_000.0, 130_000.0]
    assert row["batch_us"] == 9.0 and row["batch_us_median"] == 7.5  # (not that run's)
    assert c.median_run(runs[:2])["tag"] == 95_000.0  # an even count: the lower middle
    # the batch figure is the median of every run's, whichever run has the median cycle
    assert c.median_run(runs[:2])["batch_us_median"] == 6.25
    assert c._runs_cell(row) == "95,000 · 110,000 · 130,000"


def test_startup_summary_is_the_median_against_torchrun(bench: Any) -> None:
    s = bench("bench_startup")

    def run(system: str, first: float) -> dict[str, Any]:
        return {"system": system, "ok": True} | {key: first for key, _ in s.COLUMNS}

    rows = s.summarize(
        [
            run("flodl", 9.0),
            run("flodl", 7.0),
            run("flodl", 8.0),
            run("torchrun_ddp", 4.0),
            {"system": "torchrun_ddp", "ok": False, "error": "exit 1"},
        ]
    )
    by = {r["system"]: r for r in rows}
    assert by["flodl"]["first_step_s"] == 8.0 and by["flodl"]["repeats"] == 3
    assert by["flodl"]["first_step_vs_torchrun"] == pytest.approx(2.0)
    assert by["torchrun_ddp"]["repeats"] == 1


def test_wire_markdown_states_every_verdict_from_the_figures(bench: Any) -> None:
    w = bench("bench_wire")
    frame = {"wire_bytes": 52, "encode_us": 2.0, "decode_us": 3.0, "codec_round_trip_us": 5.0}
    data = result_head("python benchmarks/bench_wire.py") | {
        "versions": {"msgpack": "1", "pydantic": "2", "uvloop": "0.2"},
        "codec": {
            "inner": 10,
            "rounds": 3,
            "target_ratio": 0.3,
            "frames": {
                "heartbeat": frame
                | {
                    "ratio": 0.13,
                    "codec_round_trips_per_s": 2e5,
                    "msgpack_round_trips_per_s": 1.5e6,
                },
                "batch": frame
                | {"ratio": 0.31, "codec_round_trips_per_s": 1e5, "msgpack_round_trips_per_s": 3e5},
            },
        },
        "loopback": {
            "frames": 200_000,
            "rounds": 3,
            "loops": {
                "uvloop": {"flodl_frames_per_s": 1.3e5, "raw_frames_per_s": 3.5e5, "ratio": 0.37}
            },
        },
        "tensor": {
            "mib": 64,
            "reps": 5,
            "torch": "2.13.0",
            "threads": 2,
            "target_decode_vs_memcpy": 0.5,
            "rows": {
                "f32": {
                    "encode_gbps": 7.7,
                    "decode_gbps": 5.7,
                    "round_trip_gbps": 3.3,
                    "memcpy_gbps": 22.0,
                    "decode_vs_memcpy": 0.26,
                    "mac_gbps": 15.4,
                    "decode_vs_mac": 0.37,
                }
            },
        },
    }
    text = w.markdown(data)
    assert (
        "| heartbeat | 52 | 200,000 | 1,500,000 | 0.13× | 5.00 (2.00 + 3.00) "
        "| ≥ 0.3× — **not met** |" in text
    )
    assert "| batch |" in text and "≥ 0.3× — **met** |" in text
    assert "| uvloop | 130,000 | 350,000 | 0.37× |" in text
    assert "Target f32 decode ≥ 0.5× memcpy: **not met** (0.26×)" in text
    assert "(200,000 frames, a heartbeat/batch mix, best of 3)" in text


def test_suite_startup_and_gpu_extractors(bench: Any) -> None:
    m = bench("benchmarks.__main__")
    rows = [
        {"system": "torchrun_ddp", "ok": True, "first_step_s": 3.4, "first_step_vs_torchrun": 1.0},
        {"system": "flodl", "ok": True, "first_step_s": 3.72, "first_step_vs_torchrun": 1.0941},
    ]
    (startup,) = m._startup({"rows": rows})
    assert startup["value"] == "1.09× (3.72 s)" and startup["met"] is None
    (none,) = m._gpu({"gpus": 0, "runs": {}})
    assert none["value"] == "nothing measured: 0 GPU(s) visible"
    (some,) = m._gpu({"gpus": 1, "runs": {"solo-gpu": {}, "mixed": {}}, "gpu_name": "NVIDIA H200"})
    assert some["value"] == "2 runs on NVIDIA H200"
    assert m._startup({"rows": rows[:1]})[0]["value"] == "n/a: flodl failed"  # no flodl row


def test_suite_extractors_say_what_failed(bench: Any) -> None:
    m = bench("benchmarks.__main__")
    failed = [{"system": "flodl", "ok": False, "error": "boom"}]
    (row,) = m._startup({"rows": failed})
    assert row["value"] == "n/a: flodl, torchrun_ddp failed"
    runs = {"solo-gpu": {"span_s": 1.0}, "mixed": {"error": "exit 1: boom"}}
    (gpu,) = m._gpu({"gpus": 1, "runs": runs, "gpu_name": "NVIDIA H200"})
    assert gpu["value"] == "1 runs on NVIDIA H200, 1 failed"
    demo = {
        "runs": [{"run": 0, "rc": 0, "wall_s": 40.0, "result": {"speedup": None}}],
        "verdict": {"target_s": 180.0, "max_wall_s": 40.0, "met": True},
    }
    assert m._demo(demo)[1]["value"] == "n/a"
