"""Replaying a record log (docs/design.md §3, "Replay"): a simulated run's own records replay
to the same run, the what-ifs change what they say, bad logs are refused naming the gap, and
``flodl sim --from-records`` reads a record directory."""

from __future__ import annotations

import collections
import json
from pathlib import Path
from typing import Any

import pytest

from flodl.cli import main
from flodl.config import MODES
from flodl.errors import ConfigError
from flodl.monitor.records import RecordLog, make_record
from flodl.sim import Failure, SimCluster
from flodl.sim.replay import WhatIf, compare, failure_goodput, recorded_run, replay, what_ifs


def _tree(records: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    tree: dict[str, list[dict[str, Any]]] = collections.defaultdict(list)
    for r in records:
        tree[r["path"]].append(r)
    return dict(tree)


def _recorded(mode: str, **kw: Any) -> tuple[Any, dict[str, list[dict[str, Any]]]]:
    args: dict[str, Any] = {
        "dataset_len": 40_000,
        "batch_size": 32,
        "epochs": 2,
        "seed": 3,
        "reduce_ms": 4.0,
        "check_invariants": False,
        "keep_records": True,
    }
    args.update(kw)
    speeds = args.pop("speeds", [10.0, 14.0, 30.0])
    trace = SimCluster(len(speeds), mode, speeds, **args).run()
    assert trace.ok, trace.reason
    return trace, _tree(trace.records)


@pytest.mark.parametrize("mode", MODES)
def test_a_simulated_runs_records_replay_to_the_same_run(mode: str) -> None:
    trace, tree = _recorded(mode)
    run = recorded_run(tree)
    assert (run.mode, run.world_size, run.epochs, run.batch_size) == (mode, 3, 2, 32)
    assert [round(run.median_ms(r) / s, 1) for r, s in enumerate([10.0, 14.0, 30.0])] == [1.0] * 3
    assert run.epoch_syncs[-1] == trace.cycles
    error = compare(run, replay(run))
    assert error["epochs_compared"] == 2
    assert abs(error["time_error"]) < 0.05, error
    assert error["share_error_pp"] < 2.0, error
    assert abs(error["predicted_syncs"] - error["recorded_syncs"]) <= max(
        2, 0.1 * error["recorded_syncs"]
    )


def test_a_speed_that_changes_mid_run_is_replayed_as_it_changed() -> None:
    # rank 2 is 3× slower in the first half of the run only
    def slow_start(rank: int, t: float) -> float | None:
        return 30.0 if rank == 2 and t < 5 else None

    _, tree = _recorded("cpu_cadence", speeds=[10.0, 10.0, 10.0], speed_at=slow_start)
    run = recorded_run(tree)
    early = [ms for t, ms in run.speeds[2] if t < 4.5]
    late = [ms for t, ms in run.speeds[2] if t > 6.0]
    assert early and late and min(early) > 25.0 and max(late) < 12.0
    constant = replay(run, WhatIf(name="flat"), seed=3)
    error = compare(run, constant)
    assert abs(error["time_error"]) < 0.05, error


def test_faults_and_callbacks_are_read_and_replayed() -> None:
    failures = [Failure(1, 3.0, "kill"), Failure(1, 6.0, "rejoin")]
    trace, tree = _recorded("cpu_cadence", failures=failures, epoch_fn_ms=200.0)
    assert [d[1] for d in trace.deaths] == [1] and len(trace.rejoins) == 1
    run = recorded_run(tree)
    assert [(f.rank, f.kind) for f in run.faults] == [(1, "kill"), (1, "rejoin")]
    kill, rejoin = run.faults
    assert kill.at_s == pytest.approx(3.0, abs=0.05)
    assert rejoin.at_s == pytest.approx(6.0, abs=0.5)  # admitted after its hello's delay
    assert run.callback_ms_per_epoch == pytest.approx(200.0, rel=0.01)
    again = replay(run)
    assert [d[1] for d in again.deaths] == [1] and len(again.rejoins) == 1
    assert abs(compare(run, again)["time_error"]) < 0.05


def test_what_ifs_change_what_they_say() -> None:
    _, tree = _recorded("nccl_sync")
    run = recorded_run(tree)
    rows = {w.name: t for w, t in what_ifs(run, [])}
    assert set(rows) == {"replay", *(m for m in MODES if m != "nccl_sync")} | {
        f"drop rank {r}" for r in range(3)
    }
    assert len(rows["drop rank 1"].samples) == 2
    # lock-step equal counts wait for the 3× rank; cadence does not
    assert rows["nccl_cadence"].epoch_at[-1] < 0.8 * rows["replay"].epoch_at[-1]
    added = replay(run, WhatIf(name="add", add_ms=(10.0,), mode="cpu_cadence"))
    assert len(added.samples) == 4 and added.ok
    assert added.epoch_at[-1] < rows["cpu_cadence"].epoch_at[-1]
    capped = replay(run, WhatIf(name="cap", mode="cpu_cadence", elche={"max_anchor": 4}))
    assert capped.cycles > rows["cpu_cadence"].cycles
    with pytest.raises(ConfigError, match=r"drop rank 7: the run has ranks 0\.\.2"):
        replay(run, WhatIf(name="x", drop=(7,)))
    with pytest.raises(ConfigError, match="leaves no rank"):
        replay(run, WhatIf(name="x", drop=(0, 1, 2)))


def test_failure_goodput_compares_eviction_with_a_whole_job_restart() -> None:
    _, tree = _recorded("cpu_cadence")
    run = recorded_run(tree)
    base = replay(run)
    g = failure_goodput(run, base, 6.0, restart_s=30.0)
    assert g["flodl_failure_cost_s"] > 0
    assert g["job_restart_cost_s"] == pytest.approx(30.0 + base.epoch_at[-1] / 2, rel=1e-3)
    assert 0 < g["job_restart_goodput"] < g["flodl_goodput"] < 1
    with pytest.raises(ConfigError, match="failures-per-hour"):
        failure_goodput(run, base, -1.0)


def _without(tree: dict[str, list[dict[str, Any]]], kind: str) -> dict[str, list[dict[str, Any]]]:
    return {p: [r for r in rs if r["kind"] != kind] for p, rs in tree.items()}


def test_a_log_that_cannot_be_replayed_is_refused_naming_what_is_missing() -> None:
    _, tree = _recorded("cpu_cadence")
    with pytest.raises(ConfigError, match="no 'job' record"):
        recorded_run(_without(tree, "job"))
    with pytest.raises(ConfigError, match="no 'window' record"):
        recorded_run(_without(tree, "window"))
    with pytest.raises(ConfigError, match="no 'epoch' record"):
        recorded_run(_without(tree, "epoch"))
    two = {**tree, "root": [*tree["root"], next(r for r in tree["root"] if r["kind"] == "job")]}
    with pytest.raises(ConfigError, match="2 training segments"):
        recorded_run(two)
    bad = [dict(r) for r in tree["root"]]
    w = next(i for i, r in enumerate(bad) if r["kind"] == "window")
    bad[w] = {**bad[w], "data": {**bad[w]["data"], "ranks": [0, 1, 9]}}
    with pytest.raises(ConfigError, match="rank 9 of a world of 3"):
        recorded_run({**tree, "root": bad})
    bad[w] = {**bad[w], "data": {**bad[w]["data"], "ranks": [0, 1, 2], "t_s": "soon"}}
    with pytest.raises(ConfigError, match="window t_s: 'soon' is not a finite number"):
        recorded_run({**tree, "root": bad})


def _write_log(tree: dict[str, list[dict[str, Any]]], directory: Path) -> None:
    log = RecordLog(directory)
    for path, records in tree.items():
        for r in records:
            log.write(make_record(path, r["kind"], r["data"], ts_ms=int(r["ts"])))
    log.close()


def test_the_command_replays_a_record_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, tree = _recorded("cpu_sync")
    _write_log(tree, tmp_path / "rec")
    assert main(["sim", "--from-records", str(tmp_path / "rec"), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["recorded"]["mode"] == "cpu_sync" and out["recorded"]["world_size"] == 3
    assert abs(out["error"]["time_error"]) < 0.05
    assert out["what_ifs"][0]["name"] == "replay" and out["what_ifs"][0]["vs_replay"] == 1.0
    assert [a["advice"] for a in out["advice"]] == ["keep", "keep", "evict"]
    argv = ["sim", "--from-records", str(tmp_path / "rec"), "--modes", "cpu_cadence"]
    assert main([*argv, "--add-rank", "10", "--drop-rank", "2", "--failures-per-hour", "1"]) == 0
    table = capsys.readouterr().out
    for row in ("replay", "cpu_cadence", "add a 10 ms rank", "drop rank 2", "all of the above"):
        assert f"\n{row} " in table
    assert "rank failure(s) per hour" in table
    assert "rank 2: evict" in table and "without it" in table


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--from-records", "{tmp}/nothing"], "is not a record directory"),
        (["--speeds", "1,2", "--drop-rank", "1"], "--drop-rank is a what-if of --from-records"),
        (["--from-records", "{rec}", "--drop-rank", "5"], "--drop-rank 5: the run has ranks 0..2"),
        (["--from-records", "{rec}", "--add-rank", "0"], "--add-rank 0.0: expected ms"),
        (["--from-records", "{rec}", "--modes", "fast"], "--modes: unknown ['fast']"),
        (["--from-records", "{rec}", "--restart-s", "5"], "--restart-s goes with"),
        (["--from-records", "{rec}", "--overhead-target", "2"], "expected 0.01..0.5"),
    ],
)
def test_bad_replay_options_exit_2_naming_the_problem(
    argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, tree = _recorded("cpu_sync", dataset_len=8_000, epochs=1)
    _write_log(tree, tmp_path / "rec")
    argv = [a.format(tmp=tmp_path, rec=tmp_path / "rec") for a in argv]
    assert main(["sim", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("flodl sim: error: ") and message in err, err
