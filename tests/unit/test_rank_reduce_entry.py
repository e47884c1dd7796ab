"""Entering an averaging cycle on the pure :class:`RankProtocol`: which ranks report a
``snapshot_ready`` (docs/design.md §2, commit rule)."""

from __future__ import annotations

import pytest

from flodl.modes import MODES, traits_of
from flodl.rank.protocol import RankProtocol, Reduce, Train
from flodl.wire.frames import EpochPlan, RequestParams, SnapshotReady, StartEpoch, SyncNow

BS = 32


@pytest.mark.parametrize("mode", MODES)
def test_only_ranks_that_go_on_training_inside_a_cycle_report_their_snapshot(mode: str) -> None:
    traits = traits_of(mode)
    proto = RankProtocol(1, BS, waits_for_update=traits.waits_for_update)
    proto.receive(StartEpoch(plan=EpochPlan(epoch=0, partition_offset=0, partition_size=4 * BS)))
    proto.broadcasted()
    for _ in range(3):
        assert isinstance(proto.next_action(), Train)
        proto.trained(10.0, 1.0, 0.5)
    proto.receive(RequestParams(cycle=1) if traits.cpu_averaging else SyncNow(cycle=1))
    assert proto.next_action() == Reduce(1)
    frame, steps = proto.begin_reduce(1)
    assert steps == 3  # the window's steps: the reduce weight
    if mode in ("cpu_sync", "cpu_cadence"):
        # it trains nothing until the update: the coordinator's ledger holds the same counts
        assert frame is None
    else:  # Async and the collective modes train on (or redo a collective) before the ack
        assert frame == SnapshotReady(rank=1, cycle=1, step=3)
