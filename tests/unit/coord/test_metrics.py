"""Epoch aggregation and sub-epoch window reports (docs/design.md §2, §7)."""

from __future__ import annotations

from typing import Any

import pytest

from flodl.coord.metrics import (
    EpochAggregator,
    ReportScheduler,
    WindowStats,
    node_paths,
    window_records,
)
from flodl.wire.frames import Metrics


def metrics(
    rank: int,
    *,
    loss: float,
    batches: int,
    samples: int | None = None,
    share_ms: float = 100.0,
    epoch: int = 0,
    scalars: dict[str, tuple[float, int]] | None = None,
    compute_ms: float = 0.0,
    starve_ms: float = 0.0,
) -> Metrics:
    return Metrics(
        rank=rank,
        epoch=epoch,
        avg_loss=loss,
        batches_processed=batches,
        samples_processed=32 * batches if samples is None else samples,
        epoch_ms=share_ms,
        share_complete_ms=share_ms,
        compute_only_ms=compute_ms,
        data_starve_ms=starve_ms,
        scalars=scalars or {},
    )


def finish(agg: EpochAggregator, epoch: int = 0, **kw: Any) -> Any:
    args: dict[str, Any] = {
        "epoch_ms": 1234.0,
        "batch_share": [1.0 / agg.world_size] * agg.world_size,
        "syncs": 3,
        "anchor": 10,
    }
    args.update(kw)
    return agg.finish(epoch, **args)


# --- EpochAggregator ------------------------------------------------------------------------


def test_avg_loss_is_batch_weighted() -> None:
    agg = EpochAggregator(2)
    agg.add(metrics(0, loss=1.0, batches=3))
    agg.add(metrics(1, loss=2.0, batches=1))
    m = finish(agg)
    assert m.avg_loss == pytest.approx(1.25)  # (1·3 + 2·1) / 4, not the plain mean 1.5
    assert m.per_rank_loss == [pytest.approx(1.0), pytest.approx(2.0)]


def test_progressive_chunks_are_summed_per_rank() -> None:
    agg = EpochAggregator(1)
    agg.add(metrics(0, loss=1.0, batches=2, share_ms=50.0, compute_ms=40.0, starve_ms=1.0))
    agg.add(metrics(0, loss=4.0, batches=1, share_ms=30.0, compute_ms=25.0, starve_ms=2.0))
    m = finish(agg)
    assert m.avg_loss == pytest.approx(2.0)  # (1·2 + 4·1) / 3
    assert m.per_rank_samples == [96]
    assert m.per_rank_share_complete_ms == [80.0]
    assert m.per_rank_compute_only_ms == [65.0]
    assert m.per_rank_data_starve_ms == [3.0]


def test_scalars_are_per_rank_means_then_batch_weighted() -> None:
    agg = EpochAggregator(2)
    agg.add(metrics(0, loss=1.0, batches=3, scalars={"acc": (3.0, 3)}))  # mean 1.0
    agg.add(metrics(1, loss=1.0, batches=1, scalars={"acc": (4.0, 2)}))  # mean 2.0
    m = finish(agg)
    assert m.per_rank == [{"acc": pytest.approx(1.0)}, {"acc": pytest.approx(2.0)}]
    assert m.scalars == {"acc": pytest.approx(1.25)}  # (1·3 + 2·1) / 4


def test_scalar_recorded_by_one_rank_only_is_weighted_by_that_rank() -> None:
    agg = EpochAggregator(2)
    agg.add(metrics(0, loss=1.0, batches=3, scalars={"lr": (0.3, 3)}))
    agg.add(metrics(1, loss=1.0, batches=5))
    m = finish(agg)
    assert m.scalars == {"lr": pytest.approx(0.1)}
    assert m.per_rank == [{"lr": pytest.approx(0.1)}, {}]


def test_per_rank_throughput_is_samples_per_second_of_share_time() -> None:
    agg = EpochAggregator(2)
    agg.add(metrics(0, loss=1.0, batches=3, samples=96, share_ms=300.0))
    agg.add(metrics(1, loss=1.0, batches=2, samples=64, share_ms=800.0))
    m = finish(agg)
    assert m.per_rank_throughput == [pytest.approx(320.0), pytest.approx(80.0)]


def test_a_missing_rank_reports_zeros_and_none() -> None:
    agg = EpochAggregator(3)
    agg.add(metrics(0, loss=2.0, batches=4))
    agg.add(metrics(2, loss=1.0, batches=4))
    m = finish(agg)
    assert m.avg_loss == pytest.approx(1.5)
    assert m.per_rank_loss[1] is None
    assert m.per_rank_throughput[1] == 0.0
    assert m.per_rank_samples == [128, 0, 128]
    assert m.per_rank[1] == {}


def test_finish_passes_engine_fields_and_forgets_the_epoch() -> None:
    agg = EpochAggregator(2)
    agg.add(metrics(0, loss=1.0, batches=1, epoch=4))
    agg.add(metrics(1, loss=3.0, batches=1, epoch=5))
    m = finish(agg, 4, epoch_ms=777.0, batch_share=[0.6, 0.4], syncs=9, anchor=12, devices=[0, 1])
    assert (m.epoch, m.epoch_ms, m.syncs, m.anchor) == (4, 777.0, 9, 12)
    assert m.per_rank_batch_share == [0.6, 0.4]
    assert m.device_indices == [0, 1]
    assert m.per_rank_samples == [32, 0]  # epoch 5's frame stays with epoch 5
    again = finish(agg, 4)
    assert again.per_rank_samples == [0, 0] and again.avg_loss == 0.0
    assert again.device_indices == [None, None]
    assert finish(agg, 5).avg_loss == pytest.approx(3.0)


# --- WindowStats ----------------------------------------------------------------------------


def test_window_node_without_steps_omits_every_measured_metric() -> None:
    node = WindowStats().node(0.25)
    assert node == {"batch_share": 0.25, "steps": 0.0}


def test_window_node_reports_means_and_throughput() -> None:
    w = WindowStats()
    w.add(batch_ms=10.0, data_ms=2.0, loss=1.0, samples=32)
    w.add(batch_ms=20.0, data_ms=0.0, loss=3.0, samples=32)
    node = w.node(0.5)
    assert node["loss"] == pytest.approx(2.0)
    assert node["compute_only_ms"] == pytest.approx(15.0)
    assert node["data_starve_ms"] == pytest.approx(2.0)
    assert node["throughput"] == pytest.approx(1000.0 * 64 / 32.0)
    assert node["steps"] == 2.0 and node["batch_share"] == 0.5
    assert w.first_ms == 12.0


def test_a_reset_window_is_a_new_one() -> None:
    # the coordinator reuses a rank's window of two cycles ago for its next one
    w = WindowStats()
    w.add(batch_ms=10.0, data_ms=2.0, loss=1.0, samples=32)
    assert w.reset() is w
    assert w == WindowStats()
    w.add(batch_ms=4.0, data_ms=1.0, loss=2.0, samples=8)
    assert w.first_ms == 5.0 and w.steps == 1


def test_window_node_without_busy_time_omits_throughput() -> None:
    w = WindowStats()
    w.add(batch_ms=0.0, data_ms=0.0, loss=1.0, samples=32)
    node = w.node(1.0)
    assert "throughput" not in node
    assert node["loss"] == 1.0


# --- ReportScheduler ------------------------------------------------------------------------


def test_reports_disabled_never_fire() -> None:
    sched = ReportScheduler(None)
    assert not any(sched.due(0, done, 100) for done in range(0, 101, 5))


def test_reports_fire_at_each_slice_threshold_at_most_n_per_epoch() -> None:
    sched = ReportScheduler(4)
    fired = [
        done
        for done in (10, 24, 25, 30, 49, 50, 74, 80, 99, 100, 100, 100)
        if sched.due(0, done, 100)
    ]
    assert fired == [25, 50, 80, 100]


def test_reports_catch_up_one_per_boundary_and_cap_at_n() -> None:
    sched = ReportScheduler(3)
    assert [sched.due(0, 90, 90) for _ in range(5)] == [True, True, True, False, False]


def test_reports_reset_per_epoch() -> None:
    sched = ReportScheduler(2)
    assert sched.due(0, 50, 100) and sched.due(0, 100, 100)
    assert not sched.due(0, 100, 100)
    assert not sched.due(1, 49, 100)
    assert sched.due(1, 50, 100)


def test_reports_skip_an_empty_epoch() -> None:
    assert ReportScheduler(2).due(0, 0, 0) is False


# --- record tree ----------------------------------------------------------------------------


def test_node_paths_on_one_host_and_on_many() -> None:
    assert node_paths(2, None) == ["root/rank0", "root/rank1"]
    assert node_paths(2, ("a", "a")) == ["root/rank0", "root/rank1"]
    assert node_paths(3, ("a", "b", "a")) == ["root/a/rank0", "root/b/rank1", "root/a/rank2"]


def test_window_records_tree_root_host_rank() -> None:
    paths = node_paths(3, ("a", "a", "b"))
    nodes = {
        0: {"loss": 1.0, "throughput": 100.0, "data_starve_ms": 5.0, "steps": 3.0},
        1: {"loss": 2.0, "throughput": 50.0, "data_starve_ms": 9.0, "steps": 1.0},
        2: {"loss": 4.0, "throughput": 10.0, "data_starve_ms": 1.0, "steps": 4.0},
    }
    records = window_records(nodes, paths, {"anchor": 10, "sync_ms": 4.5})
    assert [p for p, _ in records] == [
        "root/a/rank0",
        "root/a/rank1",
        "root/b/rank2",
        "root/a",
        "root/b",
        "root",
    ]
    tree = dict(records)
    host_a = tree["root/a"]
    assert host_a["loss"] == pytest.approx(1.25)  # work-weighted: (1·3 + 2·1) / 4
    assert host_a["throughput"] == pytest.approx(150.0)
    assert host_a["data_starve_ms"] == 9.0
    assert host_a["steps"] == 4.0
    root = tree["root"]
    assert root["loss"] == pytest.approx((1.25 * 4 + 4.0 * 4) / 8)
    assert root["throughput"] == pytest.approx(160.0)
    assert root["data_starve_ms"] == 9.0
    assert root["anchor"] == 10 and root["sync_ms"] == 4.5


def test_window_records_one_host_is_root_then_ranks() -> None:
    paths = node_paths(2, None)
    nodes = {
        0: {"loss": 2.0, "compute_only_ms": 10.0, "throughput": 30.0, "steps": 1.0},
        1: {"batch_share": 0.0, "steps": 0.0},  # measured nothing: no loss, no throughput
    }
    records = window_records(nodes, paths, {"anchor": 7})
    assert [p for p, _ in records] == ["root/rank0", "root/rank1", "root"]
    root = dict(records)["root"]
    assert root["loss"] == 2.0  # the unmeasured rank is absent, not a zero
    assert root["compute_only_ms"] == 10.0
    assert root["throughput"] == 30.0
    assert "data_starve_ms" not in root
    assert root["anchor"] == 7
    assert dict(records)["root/rank1"] == {"batch_share": 0.0, "steps": 0.0}


def test_window_records_are_copies() -> None:
    node = {"loss": 1.0, "steps": 1.0}
    records = window_records({0: node}, ["root/rank0"], {})
    records[0][1]["loss"] = 99.0
    assert node["loss"] == 1.0


def test_reports_count_two_open_epochs_apart_and_forget_a_closed_one() -> None:
    sched = ReportScheduler(2)
    assert sched.due(0, 50, 100)
    assert sched.due(1, 50, 100)  # epoch 1's batches do not reset epoch 0's count
    assert sched.due(0, 100, 100) and not sched.due(0, 100, 100)
    sched.forget(0)
    assert sched.due(0, 50, 100)  # a forgotten epoch starts over
