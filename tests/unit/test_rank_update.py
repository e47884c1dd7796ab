"""The end of a CPU cycle on the pure :class:`RankProtocol`: the ``update`` carries the run's
global step, which sets the LR schedule's step as ``set_global_step`` does (docs/design.md §2,
message catalog)."""

from __future__ import annotations

from flodl.rank.protocol import RankProtocol, Reduce, Train, Wait
from flodl.wire.frames import EpochPlan, RequestParams, SetGlobalStep, StartEpoch, Update

BS = 32


def _after_a_cpu_reduce(steps: int) -> RankProtocol:
    proto = RankProtocol(0, BS, waits_for_update=True)
    proto.receive(StartEpoch(plan=EpochPlan(epoch=0, partition_offset=0, partition_size=8 * BS)))
    proto.broadcasted()
    for _ in range(steps):
        assert isinstance(proto.next_action(), Train)
        proto.trained(10.0, 1.0, 0.5)
    proto.receive(RequestParams(cycle=1))
    assert proto.next_action() == Reduce(1)
    proto.begin_reduce(1)
    proto.end_reduce(1)
    assert proto.next_action() == Wait()  # it waits for the update
    return proto


def test_an_update_with_the_global_step_sets_the_lr_step_and_releases_the_rank() -> None:
    proto = _after_a_cpu_reduce(3)
    assert proto.lr_step() == 3  # local progress only, so far
    proto.receive(Update(version=1, next_plan=None, global_step=20))
    assert proto.lr_step() == 20  # the cluster's step; local progress starts over
    assert isinstance(proto.next_action(), Train)
    proto.trained(10.0, 1.0, 0.5)
    assert proto.lr_step() == 21


def test_the_folded_step_matches_a_separate_set_global_step() -> None:
    folded = _after_a_cpu_reduce(3)
    folded.receive(Update(version=1, next_plan=None, global_step=20))
    separate = _after_a_cpu_reduce(3)
    separate.receive(Update(version=1, next_plan=None))
    separate.receive(SetGlobalStep(global_step=20))
    assert folded.lr_step() == separate.lr_step() == 20
    assert folded.next_action() == separate.next_action()


def test_an_update_without_a_step_leaves_the_lr_step() -> None:
    proto = _after_a_cpu_reduce(3)
    proto.receive(Update(version=1, next_plan=None))
    assert proto.lr_step() == 3
