"""``S.meta.json``: the switch that commits a bundle, and what it seeds into a resume.

The coordinator writes it last, once the save's model file is on disk, so a meta always names
files that exist; its ``bundle_tag`` says which. Field names and ``schema_version`` are the
original flodl's, so both read the same file: unknown fields are ignored, versions
``1..META_SCHEMA_VERSION`` are read (v1 has no ``elche_state``, v2 no ``trend_history``), newer
ones are refused. :func:`write_meta` validates through :class:`CheckpointMeta`, so the
coordinator can never commit a meta its own resume refuses.

Choices: an unknown ``save_reason`` reads as ``graceful_shutdown`` (the wire bytes 0..4 and
CamelCase names are understood too) and is logged; ``uncovered_ranges`` must be what the
coordinator accepts on resume (non-negative, batch-aligned offset *and* size, inside
``total_samples``, non-overlapping); ``elche_state`` must hold one speed per rank of
``world_size_at_save``; non-finite floats (a NaN trend value) are written as JSON ``NaN``.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Annotated, Any, Self, TypeVar, get_args

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    StrictInt,
    StrictStr,
    ValidationError,
    field_validator,
    model_validator,
)

from flodl.checkpoint.files import is_int, meta_path, remove_superseded, write_or_raise
from flodl.coord.elche_state import ElCheState
from flodl.coord.resume import META_SCHEMA_VERSION, TAG_PATTERN, ResumeState
from flodl.errors import CheckpointError, ConfigError, LocalProtocolError
from flodl.sampling import epoch_slice, index_space, permutation, pick_to_sample
from flodl.wire.frames import SaveReason

__all__ = [
    "META_SCHEMA_VERSION",
    "SAVE_REASONS",
    "JsonModel",
    "EpochCoverage",
    "Coverage",
    "CheckpointMeta",
    "write_meta",
    "commit_bundle",
    "resolve_tag",
    "read_meta",
    "resume_state",
    "uncovered_samples",
    "covered_samples",
    "validation_problem",
]

logger = logging.getLogger(__name__)

SAVE_REASONS: tuple[str, ...] = get_args(SaveReason)
"""The SaveReason names, in wire-byte order (``0 graceful_shutdown`` … ``4 reduce_stall``)."""

NonNegInt = Annotated[StrictInt, Field(ge=0)]
PosInt = Annotated[StrictInt, Field(ge=1)]


class JsonModel(BaseModel):
    # extra="ignore": fields the original flodl (or a later one) adds are tolerated.
    model_config = ConfigDict(frozen=True, extra="ignore")


class EpochCoverage(JsonModel):
    """What of one open epoch was still untrained at the save.

    Attributes:
        epoch: the epoch.
        total_samples: samples in the epoch (``batches × batch_size``).
        uncovered_ranges: ``(offset, size)`` in samples, batch-aligned, sorted by the writer.
    """

    epoch: NonNegInt
    total_samples: NonNegInt
    uncovered_ranges: list[tuple[StrictInt, StrictInt]] = Field(default_factory=list)


class Coverage(JsonModel):
    """The coverage block: what a coverage-granular resume needs (newer original metas)."""

    seed: StrictInt
    batch_size: PosInt
    epoch_splits: PosInt = 1
    per_epoch: list[EpochCoverage] = Field(default_factory=list)

    @model_validator(mode="after")
    def _check_ranges(self) -> Self:
        bs = self.batch_size
        seen: set[int] = set()
        for entry in self.per_epoch:
            if entry.epoch in seen:
                raise ValueError(f"epoch {entry.epoch} appears twice in per_epoch")
            seen.add(entry.epoch)
            end = 0
            for offset, size in sorted(entry.uncovered_ranges):
                where = f"epoch {entry.epoch} uncovered range (offset={offset}, size={size})"
                if offset < 0 or size < 0:
                    raise ValueError(f"{where} is negative")
                if offset % bs or size % bs:
                    raise ValueError(f"{where} is not batch-aligned (batch_size={bs})")
                if offset + size > entry.total_samples:
                    raise ValueError(f"{where} ends past total_samples={entry.total_samples}")
                if offset < end:
                    raise ValueError(f"{where} overlaps the previous range")
                end = offset + size
        return self


_CAMEL = re.compile(r"(?<!^)(?=[A-Z])")


class CheckpointMeta(JsonModel):
    """``S.meta.json``, as the coordinator writes it and the original flodl reads it.

    Attributes:
        schema_version: ``1..META_SCHEMA_VERSION``.
        epoch: the epoch to resume (the first open one at the save).
        global_step: optimizer steps over the run.
        sync_round: averaging rounds finished.
        world_size_at_save: the run's world size (a resume may use another one).
        save_reason: one of :data:`SAVE_REASONS`.
        elche_state: :meth:`~flodl.coord.elche_state.ElCheState.to_dict` (+ ``trend_history``, v3);
            absent in v1 metas.
        coverage: the coverage block, absent in the original's v1..v3 metas.
        bundle_tag: the tag of the save's files (``S.<tag>.fdl``…); absent: the untagged
            files of the original layout.
    """

    schema_version: Annotated[StrictInt, Field(ge=1, le=META_SCHEMA_VERSION)]
    epoch: NonNegInt
    global_step: NonNegInt
    sync_round: NonNegInt
    world_size_at_save: PosInt
    save_reason: SaveReason = "graceful_shutdown"
    elche_state: dict[str, Any] | None = None
    coverage: Coverage | None = None
    bundle_tag: Annotated[StrictStr, Field(pattern=TAG_PATTERN + "$")] | None = None
    _source: Path | None = PrivateAttr(default=None)

    @field_validator("save_reason", mode="before")
    @classmethod
    def _known_reason(cls, value: object) -> str:
        if is_int(value) and 0 <= value < len(SAVE_REASONS):
            return SAVE_REASONS[value]
        if isinstance(value, str):
            name = _CAMEL.sub("_", value).lower()
            if name in SAVE_REASONS:
                return name
        logger.warning("unknown save_reason %r read as graceful_shutdown", value)
        return "graceful_shutdown"

    @field_validator("elche_state")
    @classmethod
    def _valid_elche(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None:
            try:
                ElCheState.from_dict(value)
            except ConfigError as exc:
                raise ValueError(str(exc)) from None
        return value

    @model_validator(mode="after")
    def _elche_matches_world(self) -> Self:
        if self.elche_state is not None:
            speeds = self.elche_state["smoothed_ms_per_batch"]
            if len(speeds) != self.world_size_at_save:
                raise ValueError(
                    f"elche_state.smoothed_ms_per_batch has {len(speeds)} ranks, "
                    f"world_size_at_save is {self.world_size_at_save}"
                )
            anchor_rank = self.elche_state["anchor_rank"]
            if anchor_rank is not None and anchor_rank >= self.world_size_at_save:
                raise ValueError(
                    f"elche_state.anchor_rank {anchor_rank} is out of range for "
                    f"world_size_at_save {self.world_size_at_save}"
                )
        return self

    @property
    def source(self) -> Path | None:
        """The file this meta was read from (set by :func:`read_meta`), for error messages.

        Not a field (not dumped), but pydantic's ``==`` compares it: compare ``model_dump()``
        to compare contents."""
        return self._source

    @property
    def elche(self) -> ElCheState | None:
        """The ElChe state (with ``trend_history`` when saved), or ``None``."""
        return None if self.elche_state is None else ElCheState.from_dict(self.elche_state)


def validation_problem(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(parts)


M = TypeVar("M", bound=BaseModel)


def read_json_model(path: Path, model: type[M], what: str, newest: int) -> M:
    """Read the JSON object at ``path`` into ``model``; ``what`` names it in every error.

    Raises:
        CheckpointError: missing, unreadable, not JSON (or absurdly deep), not an object, a
            ``schema_version`` above ``newest``, or invalid fields (named); the message starts
            with the path.
    """
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise CheckpointError(f"no {what} at {path}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: cannot read the {what}: {exc}") from None
    try:
        raw = json.loads(text)
    except (ValueError, RecursionError) as exc:  # RecursionError: absurdly deep nesting
        raise CheckpointError(f"{path}: not JSON: {type(exc).__name__}: {exc}") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path}: the {what} must be a JSON object, not {type(raw).__name__}")
    version = raw.get("schema_version")
    if is_int(version) and version > newest:
        raise CheckpointError(
            f"{path}: written by a newer flodl (schema {version} > {newest}); upgrade"
        )
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        raise CheckpointError(f"{path}: invalid {what}: {validation_problem(exc)}") from None


def write_meta(stem: str | os.PathLike[str], meta: Mapping[str, Any]) -> Path:
    """Validate ``meta`` (e.g. :meth:`Coordinator.meta_record`) and write ``S.meta.json``
    atomically as pretty JSON.

    Raises:
        CheckpointError: ``meta`` would not read back (the fields are named), or the file
            could not be written (the previous one is intact).
    """
    path = meta_path(stem)
    try:
        model = CheckpointMeta.model_validate(dict(meta))
    except ValidationError as exc:
        raise CheckpointError(
            f"{path}: refusing to write an invalid meta: {validation_problem(exc)}"
        ) from None
    record = {k: v for k, v in model.model_dump().items() if v is not None}
    text = json.dumps(record, indent=2) + "\n"
    return write_or_raise(path, lambda f: f.write(text.encode()))


def commit_bundle(
    stem: str | os.PathLike[str], meta: Mapping[str, Any], *, in_flight: Collection[str] = ()
) -> Path:
    """Commit a save: write the meta that names its tag (the switch of the resume point),
    then remove the files of every other save but those still being written (``in_flight``):
    older ones, and killed ones.

    Raises:
        CheckpointError: the meta is invalid or could not be written; nothing was removed and
            the previous bundle is still the resume point.
    """
    path = write_meta(stem, meta)
    tag = meta.get("bundle_tag")
    if isinstance(tag, str):
        remove_superseded(stem, tag, in_flight=in_flight)
    return path


def read_meta(stem: str | os.PathLike[str], *, world_size: int | None = None) -> CheckpointMeta:
    """Read and validate ``S.meta.json``.

    Args:
        stem: the bundle stem (or one of its files).
        world_size: when given, the world size the caller expects the bundle to have been
            saved at (a check for tools and tests: a resume itself takes any world size).

    Raises:
        CheckpointError: the file is missing, not JSON, not an object, from a newer schema,
            has invalid fields (named), or was saved at another world size than
            ``world_size``.
    """
    path = meta_path(stem)
    meta = read_json_model(path, CheckpointMeta, "checkpoint meta", META_SCHEMA_VERSION)
    if world_size is not None and meta.world_size_at_save != world_size:
        raise CheckpointError(
            f"{path}: saved with world size {meta.world_size_at_save}, {world_size} was expected"
        )
    meta._source = path
    return meta


def resolve_tag(stem: str | os.PathLike[str], tag: str | None = None) -> str | None:
    """``tag``, or — without one — the tag of the committed save (the meta's; ``None``, the
    untagged names, when there is no meta or it names no tag).

    Raises:
        CheckpointError: the meta exists but cannot be read.
    """
    if tag is not None or not meta_path(stem).exists():
        return tag
    return read_meta(stem).bundle_tag


def resume_state(
    meta: CheckpointMeta, *, seed: int, batch_size: int, epoch_splits: int, total_epochs: int
) -> ResumeState:
    """What ``meta`` seeds into this run's coordinator.

    ``uncovered`` holds the ranges of the ``per_epoch`` entry of ``meta.epoch`` (``None``
    without one: that epoch restarts whole).

    Raises:
        CheckpointError: the coverage was made with another seed, batch size or epoch split,
            or ``meta.epoch`` is past this run's ``total_epochs``.
    """
    where = meta.source if meta.source is not None else "checkpoint meta"
    if meta.epoch > total_epochs:
        raise CheckpointError(
            f"{where}: the checkpoint is at epoch {meta.epoch}, this run has only "
            f"{total_epochs} epochs"
        )
    uncovered: tuple[tuple[int, int], ...] | None = None
    cov = meta.coverage
    if cov is not None:
        for name, saved, ours in (
            ("seed", cov.seed, seed),
            ("batch size", cov.batch_size, batch_size),
            ("epoch_splits", cov.epoch_splits, epoch_splits),
        ):
            if saved != ours:
                raise CheckpointError(
                    f"{where}: the checkpoint was made with {name} {saved}, this run uses "
                    f"{ours}: resume needs the same {name}"
                )
        entry = _resumed_entry(meta)
        if entry is not None:
            uncovered = tuple(sorted((o, n) for o, n in entry.uncovered_ranges))
    return ResumeState(
        epoch=meta.epoch,
        global_step=meta.global_step,
        sync_round=meta.sync_round,
        elche=meta.elche,
        uncovered=uncovered,
        world_size_at_save=meta.world_size_at_save,
    )


def uncovered_samples(
    meta: CheckpointMeta, dataset_len: int, *, augment: int = 1
) -> list[int] | None:
    """The dataset indices that the epoch a resume restarts at (``meta.epoch``) still has to
    train: the coverage block's uncovered ranges (positions in that epoch's shuffle order)
    mapped through the shared shuffle (:mod:`flodl.sampling`), range by range, in shuffle
    order. With ``augment > 1`` a sample appears once per view still to train.

    Returns:
        The indices, or ``None`` when the meta has no coverage entry for ``meta.epoch`` (that
        epoch restarts whole: every sample of it).

    Raises:
        CheckpointError: ``dataset_len`` or ``augment`` give the epoch another size than the
            one saved (another dataset).
    """
    found = _epoch_positions(meta, dataset_len, augment)
    if found is None:
        return None
    order, ranges = found
    return [order[i] for offset, size in ranges for i in range(offset, offset + size)]


def covered_samples(
    meta: CheckpointMeta, dataset_len: int, *, augment: int = 1
) -> list[int] | None:
    """The dataset indices of the epoch a resume restarts at (``meta.epoch``) that the saved
    run had already trained, so that the resume skips: every whole batch of that epoch's
    shuffle order outside the uncovered ranges, in shuffle order. With
    :func:`uncovered_samples` it makes the whole epoch, each sample once per view.

    Returns:
        The indices, or ``None`` when the meta has no coverage entry for ``meta.epoch`` (it
        restarts whole: nothing of it counts as trained).

    Raises:
        CheckpointError: as :func:`uncovered_samples`.
    """
    found = _epoch_positions(meta, dataset_len, augment)
    if found is None:
        return None
    order, ranges = found
    todo = {i for offset, size in ranges for i in range(offset, offset + size)}
    return [sample for i, sample in enumerate(order) if i not in todo]


def _epoch_positions(
    meta: CheckpointMeta, dataset_len: int, augment: int
) -> tuple[list[int], list[tuple[int, int]]] | None:
    """The dataset index at each position of ``meta.epoch``'s whole batches, and its
    uncovered ranges (sorted); None without a coverage entry for it."""
    cov, entry = meta.coverage, _resumed_entry(meta)
    if cov is None or entry is None:
        return None
    where = meta.source if meta.source is not None else "checkpoint meta"
    try:
        space = index_space(dataset_len, augment)
        data_pass, start, stop = epoch_slice(meta.epoch, space, cov.epoch_splits)
    except LocalProtocolError as exc:
        raise CheckpointError(f"{where}: {exc}") from None
    whole = (stop - start) // cov.batch_size * cov.batch_size
    if whole != entry.total_samples:
        raise CheckpointError(
            f"{where}: epoch {meta.epoch} had {entry.total_samples} samples at the save; a "
            f"dataset of {dataset_len} (augment {augment}) gives it {whole}: another dataset"
        )
    perm = permutation(space, data_pass, cov.seed)
    order = [pick_to_sample(pick, augment)[0] for pick in perm[start : start + whole]]
    return order, sorted((o, n) for o, n in entry.uncovered_ranges)


def _resumed_entry(meta: CheckpointMeta) -> EpochCoverage | None:
    """The coverage entry of the epoch a resume restarts at, if the meta has one."""
    if meta.coverage is None:
        return None
    return next((e for e in meta.coverage.per_epoch if e.epoch == meta.epoch), None)
