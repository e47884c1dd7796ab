"""The simulator's invariant checks (``flodl.sim.invariants``): each names the first violation
it finds, and ``SimCluster.run`` raises it; a coordinator that sends a frame validation would
refuse or change is caught in the run that sends it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from flodl.coord.effects import Effect, Send
from flodl.coord.machine import Coordinator
from flodl.coord.outbound import built_plan, built_start_epoch
from flodl.errors import InvariantViolation
from flodl.sim import SimCluster
from flodl.sim.invariants import frame_violation
from flodl.wire.frames import EpochPlan, StartEpoch, Update


def test_a_frame_validation_accepts_unchanged_is_no_violation() -> None:
    assert frame_violation(built_start_epoch(built_plan(1, 64, 32))) is None
    assert frame_violation(Update(version=3, next_plan=None, global_step=7)) is None


def test_a_frame_validation_refuses_is_named() -> None:
    bad = StartEpoch.model_construct(
        plan=EpochPlan.model_construct(epoch=0, partition_offset=0, partition_size=-1)
    )
    problem = frame_violation(bad)
    assert problem is not None
    assert problem.startswith("the coordinator sent an invalid start_epoch frame")
    assert "partition_size" in problem


def test_a_field_of_the_wrong_type_is_named() -> None:
    # lax validation would read the string as 3; as sent it is not the frame a rank reads
    as_text: Any = "3"
    wrong = Update.model_construct(version=as_text, next_plan=None, global_step=None)
    problem = frame_violation(wrong)
    assert problem is not None
    assert problem.startswith("the coordinator sent a update frame with a field of the wrong type")
    assert "version" in problem


class _OtherPlan(EpochPlan):
    """An EpochPlan of another class: it dumps as an EpochPlan and comes back as one."""


def test_a_frame_validation_changes_is_named() -> None:
    changed = Update.model_construct(
        version=3, next_plan=_OtherPlan(epoch=0, partition_offset=0, partition_size=4)
    )
    problem = frame_violation(changed)
    assert problem is not None and problem.startswith("update frame changes under validation")


def _finished(mode: str = "cpu_cadence") -> SimCluster:
    sim = SimCluster(2, mode, [10.0, 10.0], dataset_len=640, batch_size=32, epochs=1, seed=1)
    assert sim.run().ok
    return sim


def test_a_finished_run_violates_nothing() -> None:
    assert _finished().violation() is None


def test_a_rank_failure_without_a_fault_is_named_first() -> None:
    sim = _finished()
    sim.trace.rank_failures.append((1.25, 1, "reduce round 3 timed out (120 s)"))
    sim.trace.coverage_ok[0] = False
    assert sim.violation() == (
        "rank 1 failed without a fault at 1.2500 s: reduce round 3 timed out (120 s)"
    )


def test_an_epoch_closed_without_exact_coverage_is_named() -> None:
    sim = _finished()
    sim.trace.coverage_ok[0] = False
    assert sim.violation() == "an epoch closed without exact coverage"


class _Corrupting:
    """The coordinator, with every frame of ``kind`` it sends replaced by ``corrupt(frame)``:
    a wrapper on the simulator's side, since the compiled core's calls cannot be patched."""

    def __init__(self, coord: Coordinator, kind: str, corrupt: Callable[[Any], Any]) -> None:
        self._coord, self._kind, self._corrupt = coord, kind, corrupt

    def __getattr__(self, name: str) -> Any:
        return getattr(self._coord, name)

    def handle(self, event: Any, now: float) -> list[Effect]:
        return [
            Send(e.rank, self._corrupt(e.frame))
            if isinstance(e, Send) and e.frame.kind == self._kind
            else e
            for e in self._coord.handle(event, now)
        ]


def _corrupted_run(mode: str, kind: str, corrupt: Callable[[Any], Any]) -> SimCluster:
    sim = SimCluster(2, mode, [10.0, 10.0], dataset_len=640, batch_size=32, epochs=1, seed=1)
    sim.coord = _Corrupting(sim.coord, kind, corrupt)  # type: ignore[assignment]
    return sim


@pytest.mark.parametrize("mode", ["cpu_cadence", "nccl_cadence"])
def test_a_run_whose_coordinator_sends_an_invalid_plan_stops_naming_it(mode: str) -> None:
    def negative(frame: StartEpoch) -> StartEpoch:
        plan = frame.plan
        bad = EpochPlan.model_construct(
            epoch=plan.epoch, partition_offset=plan.partition_offset, partition_size=-1
        )
        return StartEpoch.model_construct(plan=bad)

    sim = _corrupted_run(mode, "start_epoch", negative)
    with pytest.raises(InvariantViolation, match="the coordinator sent an invalid start_epoch"):
        sim.run()


def test_a_run_whose_coordinator_sends_a_mistyped_update_stops_naming_it() -> None:
    def mistyped(frame: Update) -> Update:
        as_text: Any = str(frame.version)  # the bug planted: a string where the model says int
        return Update.model_construct(
            version=as_text, next_plan=frame.next_plan, global_step=frame.global_step
        )

    sim = _corrupted_run("cpu_cadence", "update", mistyped)
    with pytest.raises(InvariantViolation, match="update frame with a field of the wrong type"):
        sim.run()
