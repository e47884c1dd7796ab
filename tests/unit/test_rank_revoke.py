"""The rank's side of ``revoke_partition`` (docs/design.md §2, "Rejoin": a whole-epoch
partition re-split for a rank that joins mid-epoch), on the pure :class:`RankProtocol`."""

from __future__ import annotations

from flodl.rank.protocol import Answer, RankProtocol, Train
from flodl.wire.frames import (
    EpochPlan,
    ExtendPartition,
    Metrics,
    PartitionRevoked,
    RevokePartition,
    StartEpoch,
)

BS = 32


def rank_with(*slices: tuple[int, int]) -> RankProtocol:
    """Rank 1 of a Sync run holding ``(offset, size)`` slices of epoch 0, in samples."""
    proto = RankProtocol(1, BS, waits_for_update=False)
    (offset, size), *rest = slices
    proto.receive(StartEpoch(plan=EpochPlan(epoch=0, partition_offset=offset, partition_size=size)))
    for offset, size in rest:
        proto.receive(ExtendPartition(epoch=0, partition_offset=offset, partition_size=size))
    proto.broadcasted()
    return proto


def train(proto: RankProtocol, batches: int) -> list[Metrics]:
    out = []
    for _ in range(batches):
        assert isinstance(proto.next_action(), Train)
        batch = proto.trained(10.0, 1.0, 0.5)
        if batch.metrics is not None:  # the slice's report rides on its last batch
            out.append(batch.metrics)
    return out


def revoke(proto: RankProtocol, offset: int, size: int) -> tuple[int, list[Metrics]]:
    [answer] = proto.receive(RevokePartition(epoch=0, partition_offset=offset, partition_size=size))
    assert isinstance(answer, Answer)
    *frames, reply = answer.frames
    assert isinstance(reply, PartitionRevoked)
    assert (reply.rank, reply.epoch) == (1, 0)
    assert (reply.partition_offset, reply.partition_size) == (offset, size)  # it echoes the ask
    metrics = [m for m in frames if isinstance(m, Metrics)]
    assert metrics == frames
    return reply.revoked_size, metrics


def remaining(proto: RankProtocol) -> list[tuple[int, int]]:
    """What the rank will still train, as (first sample, end) per slice."""
    return [(s.offset + s.pos, s.offset + s.size) for s in proto.queue]


def test_an_untouched_tail_is_given_back_whole() -> None:
    proto = rank_with((0, 10 * BS))
    train(proto, 2)
    assert revoke(proto, 6 * BS, 4 * BS) == (4 * BS, [])
    assert remaining(proto) == [(2 * BS, 6 * BS)]
    assert len(train(proto, 4)) == 1  # the cut slice still ends with its metrics
    assert not proto.queue


def test_what_the_rank_already_started_stays_its_own() -> None:
    proto = rank_with((0, 10 * BS))
    train(proto, 7)  # it got further than the coordinator knew
    dropped, [m] = revoke(proto, 5 * BS, 5 * BS)
    assert dropped == 3 * BS and m.batches_processed == 7  # the slice ends where it stood
    assert remaining(proto) == []


def test_a_revoke_that_completes_the_slice_in_training_sends_its_metrics() -> None:
    proto = rank_with((0, 10 * BS), (20 * BS, 4 * BS))
    train(proto, 6)
    dropped, metrics = revoke(proto, 6 * BS, 4 * BS)
    assert dropped == 4 * BS
    [m] = metrics
    assert (m.epoch, m.batches_processed) == (0, 6)
    assert remaining(proto) == [(20 * BS, 24 * BS)]  # the extension is next
    dropped, metrics = revoke(proto, 20 * BS, 4 * BS)  # an untouched slice vanishes silently
    assert (dropped, metrics, remaining(proto)) == (4 * BS, [], [])


def test_a_range_the_rank_no_longer_holds_drops_nothing() -> None:
    proto = rank_with((0, 4 * BS))
    assert len(train(proto, 4)) == 1  # trained and gone
    assert revoke(proto, 2 * BS, 2 * BS) == (0, [])
    proto = rank_with((0, 4 * BS))
    assert revoke(proto, 1 * BS, 2 * BS) == (0, [])  # not the end of a slice
    assert remaining(proto) == [(0, 4 * BS)]
