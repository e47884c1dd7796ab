"""``flodl coord``'s job: the ranks bring it (docs/design.md §2c, "The ranks bring the job").

A standalone coordinator knows only what a scheduler gives it (the world size, the run id, its
deadlines). The first rank's ``hello`` carries the job description (:class:`~flodl.config.
JobSpec`) and defines the run; options given on ``flodl coord``'s command line are assertions
about that job, and every later rank must bring the same job (the machine checks it, naming the
field and both values). A refused first hello changes nothing: the next one may define the job.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from flodl import checkpoint
from flodl.config import CoordConfig, JobSpec, OuterConfig
from flodl.coord.membership import Membership
from flodl.coord.resume import ResumeState
from flodl.errors import CheckpointError, ConfigError
from flodl.service.bundles import resume_from_bundle
from flodl.timeouts import Timeouts
from flodl.wire.frames import Hello

__all__ = ["Assertion", "JobTerms", "DefinedJob", "define_job"]


@dataclass(frozen=True)
class Assertion:
    """A job option given on the command line: ``option`` (``--dataset-len``) says the field
    at ``path`` (``dataset_len``, ``elche.mode``) must be ``value``."""

    option: str
    path: str
    value: Any
    shown: str = ""
    """How the command line wrote the value (default: ``value``)."""


@dataclass(frozen=True)
class JobTerms:
    """What a standalone coordinator knows before any rank said hello."""

    world_size: int
    run_id: str
    timeouts: Timeouts
    min_world_size: int | None = None
    asserted: tuple[Assertion, ...] = ()
    save_path: str | None = None
    """``--save-path``: where the meta goes (default: the ranks' ``save_path``)."""
    resume_from: str | None = None
    """``--resume-from`` (default: the ranks' ``resume_from``)."""


@dataclass(frozen=True)
class DefinedJob:
    """The run the first admitted hello defined."""

    config: CoordConfig
    job: JobSpec
    rank: int
    """The rank whose hello defined it."""
    resume: ResumeState | None
    outer_state: dict[str, list[torch.Tensor]] | None
    save_stem: str | None
    resume_stem: str | None

    @property
    def outer(self) -> OuterConfig:
        """The outer optimizer the job brings (applied here in the CPU modes)."""
        return self.job.outer

    def summary(self) -> str:
        """One line for the coordinator's log."""
        c, j = self.config, self.job
        parts = [
            c.elche.mode,
            f"dataset_len {c.dataset_len}",
            f"batch_size {c.batch_size}",
            f"epochs {c.num_epochs}",
        ]
        if not j.outer.is_identity:
            parts.append(f"outer {j.outer.kind}:{j.outer.lr:g}:{j.outer.mu:g}")
        if self.save_stem:
            parts.append(f"bundles at {self.save_stem}")
        if self.resume_stem:
            parts.append(f"resuming from {self.resume_stem}")
        return f"job defined by rank {self.rank}: " + ", ".join(parts)


def define_job(terms: JobTerms, hello: Hello) -> DefinedJob | str:
    """The run ``hello`` defines, or why it is refused (then nothing changed).

    A hello the run would refuse anyway (another protocol, run id or world size) is refused
    for that first; then one without a job description, one that contradicts an assertion,
    one whose job is invalid at this world size, and one whose bundle cannot be resumed.
    """
    probe = Membership(
        terms.world_size, terms.run_id, terms.timeouts, forming_size=terms.min_world_size
    )
    reason = probe.refusal(hello, forming=True)
    if reason is not None:
        return reason
    if hello.role != "rank":
        return "the job is not defined yet: a rank must say hello first"
    job = hello.job
    if job is None:
        return (
            f"rank {hello.rank} brings no job description, and this coordinator takes its job "
            "from the first rank (a rank built by flodl's Trainer always brings one)"
        )
    for a in terms.asserted:
        got = job.value(a.path)
        if got != a.value:
            return (
                f"{a.option} {a.shown or a.value} but rank {hello.rank} brings "
                f"{a.path} {_shown(got)}: the coordinator's options must match the ranks' job"
            )
    try:
        config = CoordConfig.for_job(
            job,
            world_size=terms.world_size,
            min_world_size=terms.min_world_size,
            run_id=terms.run_id,
            timeouts=terms.timeouts,
        )
    except ConfigError as exc:
        return f"rank {hello.rank}'s job cannot run here: {exc}"
    if terms.resume_from is not None and job.resume_from is None:
        return (
            f"this coordinator resumes from {terms.resume_from} but rank {hello.rank} does not "
            "(its resume_from is not set): its model would start afresh"
        )
    save_stem = terms.save_path or job.save_path
    resume_stem = terms.resume_from or job.resume_from
    resume, outer_state = None, None
    if resume_stem is not None:
        try:
            resume, outer_state = resume_from_bundle(checkpoint.normalize_stem(resume_stem), config)
        except CheckpointError as exc:
            return f"cannot resume rank {hello.rank}'s job from {resume_stem}: {exc}"
    return DefinedJob(
        config=config,
        job=job,
        rank=hello.rank,
        resume=resume,
        outer_state=outer_state,
        save_stem=checkpoint.normalize_stem(save_stem) if save_stem else None,
        resume_stem=resume_stem,
    )


def _shown(value: Any) -> str:
    if isinstance(value, OuterConfig):
        return f"{value.kind}:{value.lr:g}:{value.mu:g}"
    return repr(value) if isinstance(value, str) else str(value)
