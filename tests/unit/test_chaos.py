"""Chaos plans: seeded generation, transport through the environment, the in-rank hooks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flodl.chaos import CHAOS_ENV, RECORD_DIR_ENV, ChaosPlan, Fault, RankChaos, recovery_table
from flodl.errors import ConfigError
from flodl.monitor.records import RecordLog, make_record


def test_a_plan_is_deterministic_for_a_seed_and_hits_distinct_ranks() -> None:
    a = ChaosPlan.generate(world_size=8, kills=5, mtbf_s=2.0, seed=7, signals=["KILL", "STOP"])
    b = ChaosPlan.generate(world_size=8, kills=5, mtbf_s=2.0, seed=7, signals=["KILL", "STOP"])
    c = ChaosPlan.generate(world_size=8, kills=5, mtbf_s=2.0, seed=8, signals=["KILL", "STOP"])
    assert a == b and a != c
    assert len({f.rank for f in a.faults}) == 5
    times = [f.after_s for f in a.faults]
    assert all(t is not None and t > 0 for t in times)
    assert times == sorted(t for t in times if t is not None)
    assert {f.kind for f in a.faults} <= {"kill", "stop"}
    spared = ChaosPlan.generate(world_size=4, kills=3, mtbf_s=1.0, spare=[0])
    assert 0 not in {f.rank for f in spared.faults}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"kills": 5, "world_size": 4}, "distinct ranks"),
        ({"kills": 1, "world_size": 4, "mtbf_s": 0.0}, "--mtbf"),
        ({"kills": 1, "world_size": 4, "signals": ["HUP"]}, "unknown signal"),
    ],
)
def test_bad_plans_name_the_problem(kwargs: dict[str, object], message: str) -> None:
    values: dict[str, object] = {"mtbf_s": 1.0, **kwargs}
    with pytest.raises(ConfigError, match=message):
        ChaosPlan.generate(**values)  # type: ignore[arg-type]


def test_faults_validate_and_survive_the_environment() -> None:
    plan = ChaosPlan(
        (Fault("close_data", 1, step=3), Fault("stop", 2, after_s=1.5, duration_s=2.0)), seed=4
    )
    assert ChaosPlan.from_env(plan.to_env()) == plan
    assert plan.for_rank(1) == [Fault("close_data", 1, step=3)]
    for bad in ("{", "[]", json.dumps({"faults": [{"kind": "explode", "rank": 0, "step": 1}]})):
        with pytest.raises(ConfigError):
            ChaosPlan.from_env(bad)
    with pytest.raises(ConfigError, match="exactly one trigger"):
        Fault("kill", 0, step=1, after_s=1.0)
    with pytest.raises(ConfigError, match="exactly one trigger"):
        Fault("kill", 0, step=1, epoch=1)
    with pytest.raises(ConfigError, match="exactly one trigger"):
        Fault("kill", 0)
    with pytest.raises(ConfigError, match="fault epoch must be >= 0"):
        Fault("kill", 0, epoch=-1)
    by_epoch = ChaosPlan((Fault("kill_after_save", 1, epoch=2),), seed=0)
    assert ChaosPlan.from_env(by_epoch.to_env()) == by_epoch
    env = {CHAOS_ENV: plan.to_env()}
    assert RankChaos.from_environ(0, env) is None  # no fault for rank 0
    chaos = RankChaos.from_environ(1, env)
    assert chaos is not None and chaos.faults == [Fault("close_data", 1, step=3)]


def test_hooks_fire_each_fault_once_at_its_step(tmp_path: Path) -> None:
    cut: list[str] = []
    chaos = RankChaos(
        1,
        [Fault("close_control", 1, step=5), Fault("delay_reduce", 1, step=2, duration_s=0.0)],
        str(tmp_path),
        abort_control=lambda: cut.append("control"),
    )
    chaos.on_step(1)
    assert cut == [] and chaos._armed == {}
    chaos.on_step(2)  # arms the delay for the next reduce
    assert "delay_reduce" in chaos._armed
    chaos.before_reduce()
    assert chaos._armed == {}
    chaos.on_step(7)  # a trigger passed between checks still fires, once
    chaos.on_step(8)
    assert cut == ["control"] and chaos.faults == []
    recs = RecordLog.tail(tmp_path, "root/chaos", 10)
    assert [r["data"]["fault"] for r in recs] == ["delay_reduce", "close_control"]
    assert recs[1]["data"]["step"] == 7 and recs[1]["data"]["class"] == "chaos"


def test_a_fault_fires_in_the_incarnation_it_names_only() -> None:
    """A respawned rank reads the same plan: its first incarnation's faults do not fire again
    (a kill at step 10 would kill every respawn too); a fault may name a later incarnation."""
    plan = ChaosPlan(
        (Fault("kill", 1, step=10), Fault("stop", 1, step=3, duration_s=1.0, incarnation=1)),
        seed=2,
    )
    assert ChaosPlan.from_env(plan.to_env()) == plan
    env = {CHAOS_ENV: plan.to_env()}
    first = RankChaos.from_environ(1, env)
    assert first is not None and first.faults == [Fault("kill", 1, step=10)]
    second = RankChaos.from_environ(1, env, incarnation=1)
    assert second is not None and [f.kind for f in second.faults] == ["stop"]
    assert RankChaos.from_environ(1, env, incarnation=2) is None
    with pytest.raises(ConfigError, match="fault incarnation must be >= 0"):
        Fault("kill", 0, step=1, incarnation=-1)


def test_ack_faults_fire_around_the_next_sync_ack(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``delay_ack`` holds the next ack (before it is sent), ``kill_after_ack`` flushes the
    control connection and then kills (after it is sent); both once, at the next round."""
    calls: list[str] = []
    monkeypatch.setattr("flodl.chaos.time.sleep", lambda s: calls.append(f"sleep {s}"))
    monkeypatch.setattr("flodl.chaos.os.kill", lambda pid, sig: calls.append(f"kill {sig.name}"))
    chaos = RankChaos(
        2,
        [Fault("delay_ack", 2, step=4, duration_s=3.0), Fault("kill_after_ack", 2, step=6)],
        str(tmp_path),
        flush_control=lambda: calls.append("flush"),
    )
    chaos.before_ack()
    chaos.after_ack()
    assert calls == []  # nothing armed yet
    chaos.on_step(4)
    chaos.before_ack()
    chaos.after_ack()
    assert calls == ["sleep 3.0"]
    chaos.on_step(6)
    chaos.before_ack()
    assert calls == ["sleep 3.0"]
    chaos.after_ack()
    assert calls == ["sleep 3.0", "flush", "kill SIGKILL"]
    chaos.after_ack()  # once
    assert calls == ["sleep 3.0", "flush", "kill SIGKILL"]
    recs = RecordLog.tail(tmp_path, "root/chaos", 10)
    assert [r["data"]["fault"] for r in recs] == ["delay_ack", "kill_after_ack"]


def test_an_epoch_trigger_arms_at_the_first_step_of_that_epoch(tmp_path: Path) -> None:
    """However many steps the rank took in the epochs before (its share of each depends on
    the split), an epoch fault arms at its first step of that epoch or a later one, and never
    in the initial broadcast (no epoch yet)."""
    chaos = RankChaos(1, [Fault("kill_after_save", 1, epoch=1)], str(tmp_path))
    chaos.begin()  # the initial broadcast: step 0, no epoch
    for step in range(1, 40):  # a long epoch 0 on this rank
        chaos.on_step(step, 0)
    assert chaos._armed == {} and len(chaos.faults) == 1
    chaos.on_step(40, 1)
    assert "kill_after_save" in chaos._armed and chaos.faults == []
    late = RankChaos(1, [Fault("kill_in_checkpoint", 1, epoch=1)], str(tmp_path))
    late.on_step(3, 2)  # a rank that joined later, at epoch 2, still arms
    assert "kill_in_checkpoint" in late._armed


def test_the_recovery_table_joins_faults_with_the_coordinators_records(tmp_path: Path) -> None:
    with RecordLog(tmp_path) as log:
        log.write(make_record("root", "meta", {"reductions": {}, "run": {}}, ts_ms=900))
        fault = {"class": "chaos", "detail": "", "count": 1, "fault": "kill", "rank": 2}
        log.write(make_record("root/chaos", "event", {**fault, "step": 9}, ts_ms=1000))
        stop = {**fault, "fault": "stop", "rank": 1, "step": 4}
        log.write(make_record("root/chaos", "event", stop, ts_ms=1100))
        lost = {"class": "rank_lost", "detail": "x", "count": 1}
        log.write(make_record("root/rank2", "event", lost, sev="critical", ts_ms=1030))
        back = {"after_deaths": [2], "syncs": 7}
        log.write(make_record("root", "recovered", back, ts_ms=1250))
    rows = recovery_table(tmp_path)
    assert rows == [
        {"fault": "kill", "rank": 2, "step": 9, "t_detect_s": 0.03, "t_resume_s": 0.25},
        {"fault": "stop", "rank": 1, "step": 4, "t_detect_s": None, "t_resume_s": None},
    ]
    assert RECORD_DIR_ENV == "FLODL_RECORD_LOG"
