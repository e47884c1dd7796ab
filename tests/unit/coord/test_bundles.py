"""Checkpoint bundles in the pure coordinator: request, commit by meta, writer failover.

Rule (DESIGN.md §7, flodl-spec.md §8): every live rank writes its optimizer state, the
checkpoint role rank also the model; the coordinator writes the meta only once the model file
is on disk, so a meta always names a bundle that exists. A writer that fails or dies hands the
model file to the next live rank.
"""

from __future__ import annotations

from typing import Any

from test_machine import Cluster, joined, make_config, of, sends

from flodl.coord.effects import Alert, BundleRequested, Send, WriteMeta
from flodl.coord.machine import Coordinator
from flodl.coord.resume import ResumeState
from flodl.wire.frames import (
    BundleSaved,
    Checkpoint,
    SaveConsensusModel,
    SetGlobalStep,
    Shutdown,
    StartEpoch,
)


def first_bundle(c: Cluster) -> list[Any]:
    """Run until the first bundle request; return its effects."""
    c.run(until=lambda: any(isinstance(e, BundleRequested) for e in c.trace))
    i = next(i for i, e in enumerate(c.trace) if isinstance(e, BundleRequested))
    return c.trace[i:]


def test_a_checkpoint_asks_every_rank_and_the_meta_waits_for_the_model() -> None:
    c = joined(
        "cpu_cadence",
        world_size=3,
        dataset_len=960,
        save_bundles=True,
        checkpoint_every=1,
        num_epochs=2,
    )
    effects = first_bundle(c)
    req = sends(effects, SaveConsensusModel)
    assert sorted(r for r, _ in req) == [0, 1, 2]
    frame = req[0][1]
    assert {f.version for _, f in req} == {0} and {f.target_rank for _, f in req} == {0}
    assert frame.epoch == 1 and frame.global_step == c.coord.global_step
    assert of(effects, WriteMeta) == []
    # non-writers' parts do not commit anything
    assert of(c.coord.handle(BundleSaved(rank=1, version=0), c.clock.now), WriteMeta) == []
    done = c.coord.handle(BundleSaved(rank=0, version=0, model=True), c.clock.now)
    [meta] = of(done, WriteMeta)
    assert meta.version == 0 and meta.meta["epoch"] == 1
    assert meta.meta["coverage"]["per_epoch"] == [
        {"epoch": 1, "total_samples": 960, "uncovered_ranges": [[0, 960]]}
    ]
    assert "checkpoint after epoch 0" in meta.reason


def test_a_writer_that_fails_hands_the_model_file_to_the_next_live_rank() -> None:
    c = joined(
        "cpu_cadence",
        world_size=3,
        dataset_len=960,
        save_bundles=True,
        checkpoint_every=1,
        num_epochs=2,
    )
    first_bundle(c)
    retry = c.coord.handle(BundleSaved(rank=0, version=0, error="disk full"), c.clock.now)
    expected = SaveConsensusModel(
        target_rank=1,
        version=0,
        global_step=c.coord.global_step,
        sync_round=c.coord.sync_rounds,
        epoch=1,
    )
    assert sends(retry, SaveConsensusModel) == [(1, expected)]
    assert of(retry, WriteMeta) == []
    # a late success from the failed writer is ignored; rank 1's death moves the job to 2
    assert of(c.coord.handle(BundleSaved(rank=0, version=0, model=True), 0.0), WriteMeta) == []
    moved = c.kill(1)
    assert [(r, f.target_rank) for r, f in sends(moved, SaveConsensusModel)] == [(2, 2)]
    [meta] = of(c.feed(BundleSaved(rank=2, version=0, model=True)), WriteMeta)
    assert meta.meta["epoch"] == 1


def test_every_writer_failing_alerts_and_leaves_the_previous_checkpoint() -> None:
    c = joined(
        "cpu_cadence",
        world_size=2,
        dataset_len=640,
        save_bundles=True,
        checkpoint_every=1,
        num_epochs=2,
    )
    first_bundle(c)
    c.coord.handle(BundleSaved(rank=0, version=0, error="read-only"), 0.0)
    last = c.coord.handle(BundleSaved(rank=1, version=0, error="read-only"), 0.0)
    assert sends(last, SaveConsensusModel) == [] and of(last, WriteMeta) == []
    [alert] = [a for a in of(last, Alert) if a.cls == "checkpoint_failed"]
    assert "previous checkpoint" in alert.detail and "read-only" in alert.detail


def test_a_model_written_without_its_optimizer_state_still_commits_and_alerts() -> None:
    c = joined(
        "cpu_cadence",
        world_size=2,
        dataset_len=640,
        save_bundles=True,
        checkpoint_every=1,
        num_epochs=2,
    )
    first_bundle(c)
    out = c.coord.handle(BundleSaved(rank=0, version=0, model=True, error="optim: EIO"), 0.0)
    assert len(of(out, WriteMeta)) == 1
    assert any("optimizer state" in a.detail for a in of(out, Alert))
    other = c.coord.handle(BundleSaved(rank=1, version=0, error="optim: EIO"), 0.0)
    assert [a.cls for a in of(other, Alert)] == ["checkpoint_failed"]


def test_the_end_of_the_run_saves_before_shutdown_and_without_save_path_nothing() -> None:
    c = joined("cpu_cadence", save_bundles=True)
    c.run()
    kinds = [type(e.frame) for e in c.trace if isinstance(e, Send) and e.rank == 0]
    assert kinds.index(SaveConsensusModel) < kinds.index(Shutdown)
    assert [m.reason for m in of(c.trace, WriteMeta)] == ["end of run"]
    plain = joined("cpu_cadence", checkpoint_every=1, has_checkpoint_fn=True, num_epochs=2)
    plain.run()
    assert sends(plain.trace, SaveConsensusModel) == [] and of(plain.trace, WriteMeta) == []
    assert [f.version for _, f in sends(plain.trace, Checkpoint)] == [0, 1]  # checkpoint_fn


def test_a_resumed_coordinator_tells_ranks_the_global_step_before_any_work() -> None:
    config = make_config("cpu_cadence", world_size=2, dataset_len=640, num_epochs=3)
    coord = Coordinator(config, resume=ResumeState(epoch=1, global_step=40, sync_round=4))
    c = Cluster(config)
    c.coord = coord
    c.join()
    frames = [e.frame for e in c.trace if isinstance(e, Send) and e.rank == 0]
    first_step = next(i for i, f in enumerate(frames) if isinstance(f, SetGlobalStep))
    first_work = next(i for i, f in enumerate(frames) if isinstance(f, StartEpoch))
    assert frames[first_step] == SetGlobalStep(global_step=40) and first_step < first_work
    assert all(f.plan.epoch == 1 for f in frames if isinstance(f, StartEpoch))
