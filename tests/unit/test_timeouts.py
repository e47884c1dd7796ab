"""One knob: every deadline derives from the scaled heartbeat timeout (docs/reliability.md)."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from flodl.config import CoordConfig, validated
from flodl.coord.machine import Coordinator
from flodl.data import TensorBatchDataset
from flodl.errors import ConfigError
from flodl.launch.env import timeout_scale
from flodl.timeouts import DEFAULT_HEARTBEAT_TIMEOUT_S, HEARTBEAT_INTERVAL_S, Timeouts
from flodl.trainer_config import TrainerConfig, coord_config, job_spec
from flodl.wire.frames import Accept, Hello


@given(
    heartbeat=st.floats(0.05, 3600.0, allow_nan=False, allow_infinity=False),
    scale=st.floats(0.01, 100.0, allow_nan=False, allow_infinity=False),
)
def test_the_hierarchy_holds_for_every_knob(heartbeat: float, scale: float) -> None:
    t = Timeouts.derive(heartbeat, scale)
    hb = heartbeat * scale
    assert t.heartbeat_s == pytest.approx(hb)
    # a rank gives up a collective before its peers would declare it dead
    assert t.collective_s < t.heartbeat_s
    # re-forming waits for the slowest survivor to see the failure
    assert t.session_form_s == pytest.approx(2 * t.collective_s)
    assert t.hard_exit_grace_s >= 2.0 and t.hard_exit_grace_s >= t.heartbeat_s / 3
    assert t.join_s == pytest.approx(10 * hb)
    assert t.stall_ceiling_s >= 10 * hb and t.stall_ceiling_s >= 300 * scale
    assert t.data_io_s >= 4 * t.heartbeat_s
    assert t.handshake_s == pytest.approx(10 * scale)
    # a hung step: never judged sooner than twice a silent rank's timeout, and always before
    # the progress watchdog would end the run
    assert t.step_hang_floor_s == pytest.approx(2 * hb) and t.step_hang_floor_s > t.heartbeat_s
    assert t.step_hang_floor_s < t.step_hang_ceiling_s < t.stall_ceiling_s
    # the cadence: every second, or three heartbeats in every liveness window when shorter
    assert t.heartbeat_interval_s == min(HEARTBEAT_INTERVAL_S, t.heartbeat_s / 3)


def test_the_defaults_are_the_originals() -> None:
    t = Timeouts()
    assert (t.heartbeat_s, t.join_s, t.stall_ceiling_s) == (30.0, 300.0, 300.0)
    assert t.collective_s == 20.0 and t.hard_exit_grace_s == 10.0
    assert (t.step_hang_floor_s, t.step_hang_ceiling_s) == (60.0, 270.0)
    assert DEFAULT_HEARTBEAT_TIMEOUT_S == 30.0
    assert t.heartbeat_interval_s == HEARTBEAT_INTERVAL_S == 1.0


@pytest.mark.parametrize(("hb", "every"), [(30.0, 1.0), (3.0, 1.0), (1.5, 0.5), (0.6, 0.2)])
def test_heartbeats_come_every_second_or_three_times_a_timeout(hb: float, every: float) -> None:
    """The original's 1 s cadence, unscaled, down to a 3 s timeout; below it a third of the
    timeout, so a rank that only heartbeats is never one late beat from a false death."""
    assert Timeouts(hb).heartbeat_interval_s == pytest.approx(every)


@pytest.mark.parametrize(
    ("heartbeat", "scale", "match"),
    [
        (0.0, 1.0, "heartbeat timeout"),
        (float("inf"), 1.0, "heartbeat timeout"),
        (30.0, 0.001, "FLODL_NET_TIMEOUT_SCALE"),
        (30.0, float("nan"), "FLODL_NET_TIMEOUT_SCALE"),
    ],
)
def test_bad_knobs_are_config_errors(heartbeat: float, scale: float, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        Timeouts.derive(heartbeat, scale)


@pytest.mark.parametrize(("raw", "value"), [("", 1.0), ("0.25", 0.25), ("2", 2.0)])
def test_the_scale_comes_from_the_environment(
    raw: str, value: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FLODL_NET_TIMEOUT_SCALE", raw)
    assert timeout_scale() == value


@pytest.mark.parametrize("raw", ["fast", "0", "-1", "inf"])
def test_a_bad_scale_names_the_variable(raw: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLODL_NET_TIMEOUT_SCALE", raw)
    with pytest.raises(ConfigError, match="FLODL_NET_TIMEOUT_SCALE"):
        timeout_scale()


def test_the_launcher_derives_the_coordinators_deadlines_from_the_trainer_config() -> None:
    """Tiers 2 and 3: the Trainer's ``heartbeat_timeout`` and the launcher's scale."""
    data = TensorBatchDataset(torch.zeros(64, 2), torch.zeros(64))
    c = TrainerConfig(dataset=data, batch_size=8, heartbeat_timeout=12.0)
    job = job_spec(c, dataset_len=64, save_path=None, resume_from=None)
    cfg = coord_config(job, c, world_size=2, run_id="r", scale=0.5)
    assert cfg.timeouts == Timeouts(6.0, 0.5)
    assert (cfg.heartbeat_timeout_s, cfg.join_timeout_s, cfg.stall_ceiling_s) == (6.0, 60.0, 150.0)


def test_accept_carries_the_deadlines_the_ranks_obey() -> None:
    """Every tier: the coordinator sends its heartbeat timeout and scale at admission."""
    cfg = validated(CoordConfig, world_size=2, dataset_len=64, timeouts=Timeouts(4.0, 0.4))
    coord = Coordinator(cfg, random.Random(0))
    hello = Hello(run_id="run", rank=0, world_size=2, model_signature="a" * 64)
    (reply,) = coord.handle(hello, 0.0)
    accept = reply.frame  # type: ignore[union-attr]
    assert isinstance(accept, Accept)
    assert Timeouts(accept.heartbeat_timeout_s, accept.timeout_scale) == Timeouts(4.0, 0.4)
