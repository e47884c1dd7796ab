"""The ranks bring the job (docs/design.md §2c): the job description in every hello, the
first one defining a standalone coordinator's run, the command line's options as assertions,
every later rank checked against the first."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from flodl.config import (
    CoordConfig,
    ElCheConfig,
    JobSpec,
    OuterConfig,
    validated,
)
from flodl.coord.effects import RefusePeer, Reply
from flodl.coord.machine import Coordinator
from flodl.service.standalone import Assertion, DefinedJob, JobTerms, define_job
from flodl.timeouts import Timeouts
from flodl.wire.frames import PROTOCOL_VERSION, Accept, Hello, Reject

SIG = "a" * 64
JOB = JobSpec(dataset_len=2048, batch_size=32, num_epochs=2, elche=ElCheConfig.cpu_cadence())
TERMS = JobTerms(world_size=2, run_id="run", timeouts=Timeouts(10.0))


def hello(rank: int = 0, job: JobSpec | None = JOB, **kw: Any) -> Hello:
    values: dict[str, Any] = {"run_id": "run", "world_size": 2, "model_signature": SIG, **kw}
    return Hello(rank=rank, job=job, **values)


def defined(terms: JobTerms = TERMS, h: Hello | None = None) -> DefinedJob:
    out = define_job(terms, hello() if h is None else h)
    assert isinstance(out, DefinedJob), out
    return out


# --------------------------------------------------------------------------------- JobSpec
def test_the_job_fields_are_the_coordinators_less_what_the_deployment_decides() -> None:
    """A field added to CoordConfig must be placed: in the job the ranks bring, or among the
    few a coordinator decides (a forgotten one would silently take its default)."""
    deployment = {"world_size", "min_world_size", "timeouts", "run_id", "hosts"}
    deployment |= {"progressive_dispatch"}  # no Trainer knob: always automatic
    job_only = {"outer", "save_path", "resume_from"}
    assert set(CoordConfig.model_fields) - deployment == set(JobSpec.model_fields) - job_only


def test_a_difference_names_the_first_field_nested_ones_by_their_path() -> None:
    other = JOB.model_copy(update={"elche": ElCheConfig.cpu_cadence(anchor=20)})
    assert JOB.difference(JOB) is None
    assert JOB.difference(other) == ("elche.anchor", 10, 20)
    assert JOB.difference(JOB.model_copy(update={"num_epochs": 3})) == ("num_epochs", 2, 3)
    outer = JOB.model_copy(update={"outer": OuterConfig(kind="slow_momentum", mu=0.9)})
    assert JOB.difference(outer) == ("outer.kind", "avg", "slow_momentum")


def test_a_run_built_from_a_job_keeps_every_job_field() -> None:
    job = JOB.model_copy(update={"has_eval": True, "eval_every": 2, "reports_per_epoch": 4})
    cfg = CoordConfig.for_job(job, world_size=3, run_id="r", timeouts=Timeouts(5.0))
    assert cfg.job_spec() == job
    assert (cfg.world_size, cfg.run_id, cfg.timeouts) == (3, "r", Timeouts(5.0))


# ------------------------------------------------------------------------------ define_job
def test_the_first_hello_defines_the_run_on_the_coordinators_terms() -> None:
    terms = JobTerms(world_size=3, min_world_size=2, run_id="run", timeouts=Timeouts(4.0))
    job = defined(terms, hello(world_size=3))
    assert job.config.job_spec() == JOB
    assert (job.config.world_size, job.config.min_world_size) == (3, 2)
    assert job.config.timeouts == Timeouts(4.0)
    assert job.summary() == (
        "job defined by rank 0: cpu_cadence, dataset_len 2048, batch_size 32, epochs 2"
    )


@pytest.mark.parametrize(
    ("h", "reason"),
    [
        (hello(run_id="other"), "run id 'other' does not match this run ('run')"),
        (hello(world_size=3), "world size 3 does not match this run (2)"),
        (hello(protocol=PROTOCOL_VERSION - 1), f"protocol {PROTOCOL_VERSION - 1} not supported"),
        (hello(job=None), "rank 0 brings no job description"),
        (hello(role="supervisor"), "the job is not defined yet: a rank must say hello first"),
    ],
    ids=["run-id", "world-size", "protocol", "no-job", "supervisor"],
)
def test_a_hello_the_run_would_refuse_defines_nothing(h: Hello, reason: str) -> None:
    out = define_job(TERMS, h)
    assert isinstance(out, str)
    assert out.startswith(reason)


@pytest.mark.parametrize(
    ("assertion", "reason"),
    [
        (
            Assertion("--dataset-len", "dataset_len", 4096, "4096"),
            "--dataset-len 4096 but rank 0 brings dataset_len 2048",
        ),
        (
            Assertion("--mode", "elche.mode", "cpu_sync", "cpu_sync"),
            "--mode cpu_sync but rank 0 brings elche.mode 'cpu_cadence'",
        ),
        (
            Assertion("--outer", "outer", OuterConfig(kind="nesterov", lr=0.7, mu=0.9), "nesterov"),
            "--outer nesterov but rank 0 brings outer avg:1:0",
        ),
        (
            Assertion("--save-path", "save_bundles", True, "/runs/x"),
            "--save-path /runs/x but rank 0 brings save_bundles False",
        ),
    ],
    ids=["dataset-len", "mode", "outer", "save-path"],
)
def test_an_option_of_flodl_coord_is_an_assertion_about_the_job(
    assertion: Assertion, reason: str
) -> None:
    terms = JobTerms(world_size=2, run_id="run", timeouts=Timeouts(10.0), asserted=(assertion,))
    out = define_job(terms, hello())
    assert isinstance(out, str)
    assert out.startswith(reason), out
    met = JobTerms(world_size=2, run_id="run", timeouts=Timeouts(10.0))
    assert isinstance(define_job(met, hello()), DefinedJob)


def test_a_job_that_cannot_run_at_the_coordinators_world_size_is_refused() -> None:
    job = JOB.model_copy(update={"elche": ElCheConfig.cpu_cadence(partition_ratios=(1, 1, 2))})
    out = define_job(TERMS, hello(job=job))
    assert isinstance(out, str)
    assert out.startswith("rank 0's job cannot run here: invalid CoordConfig")
    assert "partition_ratios has 3 entries for world_size 2" in out


def test_the_coordinators_stems_win_over_the_ranks(tmp_path: Path) -> None:
    job = JOB.model_copy(update={"save_bundles": True, "save_path": str(tmp_path / "rank")})
    assert defined(h=hello(job=job)).save_stem == str(tmp_path / "rank")
    terms = JobTerms(
        world_size=2, run_id="run", timeouts=Timeouts(10.0), save_path=str(tmp_path / "coord")
    )
    assert defined(terms, hello(job=job)).save_stem == str(tmp_path / "coord")


def test_a_bundle_that_cannot_be_resumed_refuses_the_hello(tmp_path: Path) -> None:
    job = JOB.model_copy(update={"resume_from": str(tmp_path / "missing")})
    out = define_job(TERMS, hello(job=job))
    assert isinstance(out, str)
    assert out.startswith(f"cannot resume rank 0's job from {tmp_path / 'missing'}: ")


def test_a_coordinator_that_resumes_refuses_a_rank_that_does_not() -> None:
    terms = JobTerms(world_size=2, run_id="run", timeouts=Timeouts(10.0), resume_from="/r/ck")
    out = define_job(terms, hello())
    assert out == (
        "this coordinator resumes from /r/ck but rank 0 does not (its resume_from is not set): "
        "its model would start afresh"
    )


# --------------------------------------------------------------------------------- machine
def test_a_later_rank_with_another_job_is_refused_naming_the_field_and_both_values() -> None:
    cfg = validated(CoordConfig, world_size=3, dataset_len=2048, elche=ElCheConfig.cpu_cadence())
    coord = Coordinator(cfg, random.Random(0))
    coord.tick(0.0)
    out = coord.handle(hello(0, job=cfg.job_spec(), world_size=3), 0.0)
    assert isinstance(out[0], Reply)
    assert isinstance(out[0].frame, Accept)
    other = cfg.job_spec().model_copy(update={"batch_size": 64})
    out = coord.handle(hello(1, job=other, world_size=3), 0.1)
    assert isinstance(out[0], Reply)
    assert isinstance(out[0].frame, Reject)
    reason = (
        "job batch_size 64 differs from the first rank's 32 (every rank must train the same job)"
    )
    assert out[0].frame.reason == reason
    assert out[1] == RefusePeer(reason)
    assert coord.membership.joining() == [1, 2]  # the refusal changed nothing
    out = coord.handle(hello(1, job=cfg.job_spec(), world_size=3), 0.2)
    assert isinstance(out[0], Reply)
    assert isinstance(out[0].frame, Accept)
