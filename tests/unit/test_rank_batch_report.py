"""A slice's report on the pure :class:`RankProtocol`: it rides on the slice's last ``batch``
(docs/design.md §1, protocol 8), with the sums of exactly that slice's batches."""

from __future__ import annotations

from flodl.rank.protocol import RankProtocol, Train
from flodl.wire.frames import Batch, EpochPlan, StartEpoch

BS = 32


def _trained(proto: RankProtocol, n: int, ms: float) -> list[Batch]:
    out = []
    for i in range(n):
        assert isinstance(proto.next_action(), Train)
        out.append(proto.trained(ms, 1.0, 0.5 + i, {"acc": [float(i), 1.0]}))
    return out


def test_only_the_last_batch_of_a_slice_carries_its_report() -> None:
    proto = RankProtocol(2, BS, waits_for_update=False)
    proto.receive(StartEpoch(plan=EpochPlan(epoch=0, partition_offset=0, partition_size=3 * BS)))
    proto.receive(StartEpoch(plan=EpochPlan(epoch=0, partition_offset=5 * BS, partition_size=BS)))
    proto.broadcasted()
    first = _trained(proto, 3, 10.0)
    assert [b.metrics is None for b in first] == [True, True, False]
    report = first[-1].metrics
    assert report is not None
    assert (report.rank, report.epoch, report.batches_processed) == (2, 0, 3)
    assert report.samples_processed == 3 * BS
    assert report.avg_loss == (0.5 + 1.5 + 2.5) / 3
    assert report.compute_only_ms == 30.0 and report.data_starve_ms == 3.0
    assert report.scalars == {"acc": (0.0 + 1.0 + 2.0, 3)}
    [last] = _trained(proto, 1, 20.0)  # the next slice starts its sums over
    assert last.metrics is not None and last.metrics.batches_processed == 1
    assert last.metrics.compute_only_ms == 20.0 and last.metrics.scalars == {"acc": (0.0, 1)}
