"""Checkpoint bundles in the pure coordinator: request, commit by meta, writer failover.

Rule (docs/design.md §6): every live rank writes its optimizer state, the checkpoint role rank
also the model, under the save's tag; the coordinator writes the meta only once the model file
is on disk, so a meta always names a bundle that exists. A writer that fails or dies hands the
model file to the next live rank, at a stop too: the stop is held until the bundle commits.
"""

from __future__ import annotations

from typing import Any

from test_machine import Cluster, heartbeat_all, joined, make_config, of, sends

from flodl.config import MaxFailure
from flodl.coord.effects import Alert, BundleRequested, Send, WriteMeta
from flodl.coord.machine import Coordinator, RunPhase
from flodl.coord.resume import ResumeState
from flodl.wire.frames import (
    BundleSaved,
    Checkpoint,
    SaveConsensusModel,
    SetGlobalStep,
    Shutdown,
    ShutdownWithSave,
    StartEpoch,
)


def checkpointing(*, world_size: int, dataset_len: int) -> Cluster:
    """A joined cpu_cadence cohort that saves a bundle after each of its two epochs."""
    return joined(
        "cpu_cadence",
        world_size=world_size,
        dataset_len=dataset_len,
        save_bundles=True,
        checkpoint_every=1,
        num_epochs=2,
    )


def first_bundle(c: Cluster) -> list[Any]:
    """Run until the first bundle request; return its effects."""
    c.run(until=lambda: any(isinstance(e, BundleRequested) for e in c.trace))
    i = next(i for i, e in enumerate(c.trace) if isinstance(e, BundleRequested))
    return c.trace[i:]


def test_a_checkpoint_asks_every_rank_and_the_meta_waits_for_the_model() -> None:
    c = checkpointing(world_size=3, dataset_len=960)
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
    c = checkpointing(world_size=3, dataset_len=960)
    [(_, first)] = sends(first_bundle(c), SaveConsensusModel)[:1]
    retry = c.coord.handle(BundleSaved(rank=0, version=0, error="disk full"), c.clock.now)
    expected = SaveConsensusModel(
        target_rank=1,
        version=0,
        global_step=c.coord.global_step,
        sync_round=c.coord.sync_rounds,
        epoch=1,
        tag=first.tag,  # the same save, under the same tag
    )
    assert sends(retry, SaveConsensusModel) == [(1, expected)]
    assert of(retry, WriteMeta) == []
    # a late success from the failed writer is ignored; rank 1's death moves the job to 2
    assert of(c.coord.handle(BundleSaved(rank=0, version=0, model=True), 0.0), WriteMeta) == []
    moved = c.kill(1)
    assert [(r, f.target_rank) for r, f in sends(moved, SaveConsensusModel)] == [(2, 2)]
    # rank 2 answers every frame in order: the request first (its part), then the hand-over
    assert of(c.feed(BundleSaved(rank=2, version=0)), WriteMeta) == []
    [meta] = of(c.feed(BundleSaved(rank=2, version=0, model=True)), WriteMeta)
    assert meta.meta["epoch"] == 1


def test_every_writer_failing_alerts_and_leaves_the_previous_checkpoint() -> None:
    c = checkpointing(world_size=2, dataset_len=640)
    first_bundle(c)
    c.coord.handle(BundleSaved(rank=0, version=0, error="read-only"), 0.0)
    c.coord.handle(BundleSaved(rank=1, version=0), 0.0)  # its answer to the request: its part
    last = c.coord.handle(BundleSaved(rank=1, version=0, error="read-only"), 0.0)
    assert sends(last, SaveConsensusModel) == [] and of(last, WriteMeta) == []
    [alert] = [a for a in of(last, Alert) if a.cls == "checkpoint_failed"]
    assert "previous checkpoint" in alert.detail and "read-only" in alert.detail


def test_a_model_written_without_its_optimizer_state_still_commits_and_alerts() -> None:
    c = checkpointing(world_size=2, dataset_len=640)
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


def test_every_save_has_its_own_tag_and_the_meta_names_it() -> None:
    c = checkpointing(world_size=2, dataset_len=640)
    c.run()
    requests = [f for _, f in sends(c.trace, SaveConsensusModel)]
    tags = {f.version: f.tag for f in requests}
    assert len(set(tags.values())) == len(tags) >= 2  # a checkpoint and the end of the run
    assert all(f.tag == tags[f.version] for f in requests)  # every rank: the save's tag
    metas = of(c.trace, WriteMeta)
    assert [m.meta["bundle_tag"] for m in metas] == [tags[m.version] for m in metas]


def test_a_stop_bundle_fails_over_before_the_ranks_are_told_to_stop() -> None:
    """ShutdownWithSave: the stop frame is held until the bundle commits, so a writer that
    fails hands the save to a survivor that is still there to take it."""
    c = joined(
        "cpu_cadence",
        world_size=3,
        dataset_len=3200,
        max_failure=MaxFailure(absolute=1),
        save_bundles=True,
    )
    effects = c.kill(1)
    [(writer, frame)] = [
        (r, f) for r, f in sends(effects, SaveConsensusModel) if r == f.target_rank
    ]
    assert sends(effects, ShutdownWithSave) == []
    retry = c.feed(BundleSaved(rank=writer, version=frame.version, error="disk full"))
    [(nxt, again)] = sends(retry, SaveConsensusModel)
    assert nxt != writer and again.target_rank == nxt and again.tag == frame.tag
    assert sends(retry, ShutdownWithSave) == []
    assert of(c.feed(BundleSaved(rank=nxt, version=frame.version)), WriteMeta) == []  # its part
    done = c.feed(BundleSaved(rank=nxt, version=frame.version, model=True))
    assert [m.meta["save_reason"] for m in of(done, WriteMeta)] == ["max_failure_exceeded"]
    assert sorted(r for r, _ in sends(done, ShutdownWithSave)) == [0, 2]


def test_an_end_of_run_bundle_fails_over_when_its_writer_dies() -> None:
    c = joined("cpu_cadence", world_size=3, dataset_len=960, save_bundles=True)
    c.run(until=lambda: c.coord.phase is RunPhase.SHUTDOWN)
    [(_, frame)] = sends(c.trace, SaveConsensusModel)[:1]
    writer = frame.target_rank
    assert sends(c.trace, Shutdown) == []  # held for the end-of-run bundle
    moved = c.kill(writer)
    [(nxt, again)] = [(r, f) for r, f in sends(moved, SaveConsensusModel)]
    assert again.target_rank == nxt != writer and again.tag == frame.tag
    assert of(c.feed(BundleSaved(rank=nxt, version=frame.version)), WriteMeta) == []  # its part
    done = c.feed(BundleSaved(rank=nxt, version=frame.version, model=True))
    assert [m.reason for m in of(done, WriteMeta)] == ["end of run"]
    assert sorted(r for r, _ in sends(done, Shutdown)) == sorted({0, 1, 2} - {writer})


def test_a_stop_bundle_nobody_answers_is_abandoned_at_the_stall_ceiling() -> None:
    c = joined("cpu_cadence", world_size=2, dataset_len=640, save_bundles=True)
    c.run(until=lambda: c.coord.phase is RunPhase.SHUTDOWN)
    stopped_at = c.clock.now
    while c.clock.now < stopped_at + 299.0:  # the ranks heartbeat, the writer never answers
        c.clock.advance(1.0)
        heartbeat_all(c, (0, 1))
        assert sends(c.tick(), Shutdown) == []
    c.clock.advance_to(stopped_at + 300.0)
    heartbeat_all(c, (0, 1))
    late = c.tick()
    [alert] = [a for a in of(late, Alert) if a.cls == "checkpoint_failed"]
    assert "not committed within 300 s of the stop" in alert.detail
    assert "previous checkpoint" in alert.detail
    assert sorted(r for r, _ in sends(late, Shutdown)) == [0, 1]


def test_a_writer_whose_death_exceeds_max_failure_hands_its_save_over_before_the_stop() -> None:
    # The death that ends the run (max_failure) came before the callbacks' failover: the save
    # the dead rank was writing kept its target, the stop waited for it until the stall ceiling
    # (found by the chaos suite: 60 s of a 4-rank run at scale 0.2), and it was then abandoned.
    c = joined(
        "cpu_cadence",
        world_size=3,
        dataset_len=960,
        save_bundles=True,
        checkpoint_every=1,
        num_epochs=2,
        max_failure=MaxFailure(absolute=1),
    )
    [(_, first)] = sends(first_bundle(c), SaveConsensusModel)[:1]
    writer = first.target_rank
    moved = c.kill(writer)
    handed = [f for _, f in sends(moved, SaveConsensusModel) if f.version == first.version]
    assert handed and {f.target_rank for f in handed} != {writer}
    assert {f.tag for f in handed} == {first.tag}  # the same save, under the same tag
    assert sends(moved, ShutdownWithSave) == []  # held until the bundles commit
    c.run()  # the survivors answer; no time passes
    metas = of(c.trace, WriteMeta)
    assert [m.version for m in metas] == [first.version, first.version + 1]
    assert metas[-1].meta["save_reason"] == "max_failure_exceeded"
    stops = sends(c.trace, ShutdownWithSave)
    assert sorted(r for r, _ in stops) == sorted({0, 1, 2} - {writer})
    assert [a for a in of(c.trace, Alert) if a.cls == "checkpoint_failed"] == []


def test_a_rank_handed_the_save_before_it_answered_the_request_is_no_failed_writer() -> None:
    # Every rank answers every frame, in order. A rank handed the model file (its writer died)
    # before it answered the request answers the request first, as a part (no model): that
    # answer used to count as the new writer failing, and the save went on to the next rank
    # and, with none left, was abandoned.
    c = checkpointing(world_size=3, dataset_len=960)
    [(_, first)] = sends(first_bundle(c), SaveConsensusModel)[:1]
    moved = c.kill(first.target_rank)  # before any rank answered the request
    assert [f.target_rank for _, f in sends(moved, SaveConsensusModel)] != []
    c.run()
    assert [a for a in of(c.trace, Alert) if a.cls == "checkpoint_failed"] == []
    assert first.version in [m.version for m in of(c.trace, WriteMeta)]
