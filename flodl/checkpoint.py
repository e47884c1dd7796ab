"""The checkpoint bundle: its file formats, atomic writes and validating reads (flodl-spec.md §8).

A bundle is a set of files sharing a stem ``S`` (DESIGN.md §7):

========================== ================================================ ======================
file                       content                                          written by
========================== ================================================ ======================
``S.fdl``                  parameters + buffers (``torch.save``)            checkpoint rank / CPU
                                                                            controller
``S.rank<N>.optim``        rank ``N``'s optimizer ``state_dict``            rank ``N``
``S.meta.json``            epoch, step, ElChe state, coverage (pretty JSON) coordinator
``S.outer.fdl``            outer-optimizer momentum                         outer-optimizer owner
``S.rank<N>.death.json``   forensic record of a rank that died              the dying rank
========================== ================================================ ======================

Rules:

1. **Every write is atomic.** The bytes go to ``<file>.tmp.<pid>`` in the same directory, are
   flushed and fsynced, ``os.replace`` puts them in place, then the directory is fsynced (best
   effort). A crash leaves the previous file or the new one, never a torn one, and a failed write
   removes its temporary file.
2. **Every read validates.** Torch files are loaded with ``weights_only=True`` (no pickled code
   runs) and must carry their format tag and a known version; the meta goes through
   :class:`CheckpointMeta`. Whatever is wrong (missing, truncated, foreign bytes, a newer schema,
   another model, another world size, seed or batch size) raises
   :class:`~flodl.errors.CheckpointError` whose message starts with the file's path.
3. **One model for writing and reading the meta.** :func:`write_meta` validates through
   :class:`CheckpointMeta`, so the coordinator can never commit a meta its own resume refuses.
4. **The original's meta.** Field names and ``schema_version`` are the original flodl's, so both
   read the same file: unknown fields are ignored, versions ``1..META_SCHEMA_VERSION`` are read
   (v1 has no ``elche_state``, v2 no ``trend_history``), newer ones are refused.

Choices (where the spec is silent):

- Any function taking a stem also takes a bundle file's path: :func:`normalize_stem` strips one
  known bundle suffix (``run.fdl`` and ``run.meta.json`` both name the bundle ``run``).
- Writers raise ``CheckpointError`` (chaining the ``OSError``) when the disk refuses, so callers
  catch one type; :func:`write_death_record` alone is best effort and returns ``None`` instead.
- Torch files are streamed into the temporary file rather than built in memory first, so saving
  a large model does not hold a second serialized copy.
- ``save_optim``/``save_outer`` refuse state that ``weights_only`` loading could not read back
  (anything but containers, scalars, strings, bytes, tensors, sizes, dtypes and devices): the
  mistake surfaces at the save, not at the resume.
- An unknown ``save_reason`` reads as ``graceful_shutdown`` (as the spec says of unknown reason
  bytes; the wire bytes 0..4 and CamelCase names are understood too) and is logged.
- ``uncovered_ranges`` must be what the coordinator accepts on resume
  (:func:`~flodl.coord.chunks.from_samples`): non-negative, batch-aligned offset *and* size,
  inside ``total_samples``, non-overlapping; ``elche_state`` must hold one speed per rank of
  ``world_size_at_save``.
- Non-finite floats (a NaN trend value) are written as JSON ``NaN`` rather than failing the save.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Annotated, Any, Self, TypeGuard, get_args

import torch
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

from flodl.coord.elche_state import ElCheState
from flodl.coord.resume import META_SCHEMA_VERSION, ResumeState
from flodl.errors import CheckpointError, ConfigError
from flodl.wire.frames import SaveReason

__all__ = [
    # the bundle's names
    "normalize_stem",
    "model_path",
    "optim_path",
    "meta_path",
    "outer_path",
    "death_path",
    "atomic_write_bytes",
    # S.fdl
    "MODEL_FORMAT",
    "ModelBundle",
    "save_model",
    "load_model",
    # S.rank<N>.optim
    "OPTIM_FORMAT",
    "OptimBundle",
    "save_optim",
    "load_optim",
    # S.outer.fdl
    "OUTER_FORMAT",
    "OuterBundle",
    "save_outer",
    "load_outer",
    # S.meta.json
    "META_SCHEMA_VERSION",
    "SAVE_REASONS",
    "EpochCoverage",
    "Coverage",
    "CheckpointMeta",
    "write_meta",
    "read_meta",
    "resume_state",
    # S.rank<N>.death.json
    "DEATH_SCHEMA_VERSION",
    "DeathRecord",
    "write_death_record",
    "read_death_record",
    "death_records",
]

logger = logging.getLogger(__name__)

MODEL_FORMAT = "flodl.fdl"
OPTIM_FORMAT = "flodl.optim"
OUTER_FORMAT = "flodl.outer"
TORCH_FORMAT_VERSION = 1
"""Version of the three torch file layouts this module writes (and the newest it reads)."""
DEATH_SCHEMA_VERSION = 1
SAVE_REASONS: tuple[str, ...] = get_args(SaveReason)
"""The SaveReason names, in wire-byte order (``0 graceful_shutdown`` … ``4 reduce_stall``)."""
_MAX_DEATH_ERROR = 4096

# =============================================================================================
# Names
# =============================================================================================

_BUNDLE_SUFFIX = re.compile(
    r"(?:\.outer\.fdl|\.fdl|\.meta\.json|\.rank\d+\.optim|\.rank\d+\.death\.json)\Z"
)


def normalize_stem(path: str | os.PathLike[str]) -> str:
    """The bundle stem named by ``path``: a stem, or the path of one of the bundle's files.

    One known bundle suffix is stripped (``.fdl``, ``.outer.fdl``, ``.meta.json``,
    ``.rank<N>.optim``, ``.rank<N>.death.json``); anything else is returned as is.

    Raises:
        ConfigError: ``path`` is empty, ends in a directory separator, or is only a suffix.
    """
    text = os.fspath(path)
    tail = os.path.basename(text)
    if not tail:
        raise ConfigError(f"checkpoint stem {text!r} names no file")
    match = _BUNDLE_SUFFIX.search(tail)
    if match is None:
        return text
    if match.start() == 0:
        raise ConfigError(f"checkpoint stem {text!r} is only a bundle suffix")
    return text[: len(text) - len(match.group())]


def model_path(stem: str | os.PathLike[str]) -> Path:
    """``S.fdl``."""
    return Path(normalize_stem(stem) + ".fdl")


def optim_path(stem: str | os.PathLike[str], rank: int) -> Path:
    """``S.rank<N>.optim``."""
    return Path(f"{normalize_stem(stem)}.rank{_rank(rank)}.optim")


def meta_path(stem: str | os.PathLike[str]) -> Path:
    """``S.meta.json``."""
    return Path(normalize_stem(stem) + ".meta.json")


def outer_path(stem: str | os.PathLike[str]) -> Path:
    """``S.outer.fdl``."""
    return Path(normalize_stem(stem) + ".outer.fdl")


def death_path(stem: str | os.PathLike[str], rank: int) -> Path:
    """``S.rank<N>.death.json``."""
    return Path(f"{normalize_stem(stem)}.rank{_rank(rank)}.death.json")


def _rank(rank: int) -> int:
    if not _is_int(rank) or rank < 0:
        raise ConfigError(f"rank must be an int >= 0, got {rank!r}")
    return rank


# =============================================================================================
# Atomic writes
# =============================================================================================


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Replace ``path`` by ``data`` atomically (see the module rules); creates parent dirs.

    Raises:
        OSError: the write failed; ``path`` is unchanged and no temporary file is left.
    """
    _atomic_write(Path(path), lambda f: f.write(data))


def _atomic_write(path: Path, fill: Callable[[IO[bytes]], object]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp.{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            fill(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def _fsync_dir(directory: Path) -> None:
    """Make the rename durable where the platform allows it (not on Windows)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_or_raise(path: Path, fill: Callable[[IO[bytes]], object]) -> Path:
    try:
        _atomic_write(path, fill)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot write: {exc}") from exc
    return path


# =============================================================================================
# Torch files: S.fdl, S.rank<N>.optim, S.outer.fdl
# =============================================================================================


def _save_torch(path: Path, obj: dict[str, Any]) -> Path:
    return _write_or_raise(path, lambda f: torch.save(obj, f))


def _load_torch(path: Path, fmt: str) -> dict[str, Any]:
    """Load a torch file of format ``fmt``; every failure is a :class:`CheckpointError`."""
    if not path.exists():
        raise CheckpointError(f"{path}: no such checkpoint file")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises anything from EOFError to RuntimeError here
        raise CheckpointError(f"{path}: not a readable {fmt} file ({_first_line(exc)})") from exc
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path}: not a {fmt} file (holds a {type(obj).__name__})")
    tag = obj.get("format")
    if tag != fmt:
        raise CheckpointError(f"{path}: not a {fmt} file (format tag {tag!r})")
    version = obj.get("version")
    if not _is_int(version) or version < 1:
        raise CheckpointError(f"{path}: invalid format version {version!r}")
    if version > TORCH_FORMAT_VERSION:
        raise CheckpointError(
            f"{path}: written by a newer flodl (format version {version} > "
            f"{TORCH_FORMAT_VERSION}); upgrade"
        )
    return obj


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    line = text[0] if text else type(exc).__name__
    return line if len(line) <= 200 else line[:199] + "…"


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _get_int(obj: Mapping[str, Any], key: str, path: Path, minimum: int = 0) -> int:
    value = obj.get(key)
    if not _is_int(value) or value < minimum:
        raise CheckpointError(f"{path}: {key} must be an int >= {minimum}, got {value!r}")
    return value


def _get_tensors(obj: Mapping[str, Any], key: str, path: Path) -> tuple[torch.Tensor, ...]:
    value = obj.get(key)
    if not isinstance(value, list | tuple):
        raise CheckpointError(
            f"{path}: {key} must be a list of tensors, got {type(value).__name__}"
        )
    for i, t in enumerate(value):
        if not isinstance(t, torch.Tensor):
            raise CheckpointError(f"{path}: {key}[{i}] is a {type(t).__name__}, not a tensor")
    return tuple(value)


def _cpu_copy(t: torch.Tensor) -> torch.Tensor:
    """A detached, contiguous CPU tensor with its own compact storage (a view of a flat buffer
    would otherwise save the whole buffer)."""
    return t.detach().to("cpu", memory_format=torch.contiguous_format, copy=True)


def _to_cpu(obj: Any) -> Any:
    """``obj`` with every tensor moved to the CPU (containers rebuilt, scalars kept)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return type(obj)((k, _to_cpu(v)) for k, v in obj.items())
    if type(obj) is list:
        return [_to_cpu(v) for v in obj]
    if type(obj) is tuple:
        return tuple(_to_cpu(v) for v in obj)
    return obj


_PLAIN_SCALARS = (str, bytes, bytearray, int, float, complex, bool, type(None))
_PLAIN_TORCH = (torch.Tensor, torch.Size, torch.dtype, torch.device)


def _check_loadable(obj: Any, where: str) -> None:
    """Refuse what ``torch.load(weights_only=True)`` could not read back."""
    if isinstance(obj, _PLAIN_SCALARS + _PLAIN_TORCH):
        return
    if type(obj) in (dict, OrderedDict):
        for k, v in obj.items():
            _check_loadable(k, f"{where} key {k!r}")
            _check_loadable(v, f"{where}[{k!r}]")
        return
    if type(obj) in (list, tuple, set):
        for i, v in enumerate(obj):
            _check_loadable(v, f"{where}[{i}]")
        return
    raise TypeError(f"{where} is a {type(obj).__name__}, which weights_only loading refuses")


# --- S.fdl -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelBundle:
    """A loaded ``S.fdl``: CPU parameters and buffers in ``parameters()``/``buffers()`` order.

    Attributes:
        params: parameter tensors (CPU).
        buffers: buffer tensors (CPU), integer ones such as ``num_batches_tracked`` included.
        signature: :func:`~flodl.rank.snapshot.model_signature` of the model that saved them.
        global_step: optimizer steps taken over the run when saved.
        sync_round: averaging rounds finished when saved.
        epoch: the epoch in progress (or finished) when saved.
        path: the file it was read from (``None`` when built in memory).
    """

    params: tuple[torch.Tensor, ...]
    buffers: tuple[torch.Tensor, ...]
    signature: str
    global_step: int
    sync_round: int
    epoch: int
    path: Path | None = None

    def load_into(self, model: torch.nn.Module, signature: str) -> None:
        """Copy this bundle into ``model`` in place (any device), after checking it fits.

        Args:
            model: the model to overwrite.
            signature: ``model_signature(model)``; must equal the bundle's.

        Raises:
            CheckpointError: the bundle is from another model (signature), or the number,
                shapes or dtypes of parameters or buffers differ; ``model`` is left untouched.
        """
        where = self.path if self.path is not None else "model bundle"
        if signature != self.signature:
            raise CheckpointError(
                f"{where}: bundle from another model: saved signature {self.signature[:16]}…, "
                f"this model's {signature[:16]}…"
            )
        params = list(model.parameters())
        buffers = list(model.buffers())
        if len(params) != len(self.params) or len(buffers) != len(self.buffers):
            raise CheckpointError(
                f"{where}: bundle has {len(self.params)} params / {len(self.buffers)} buffers, "
                f"the model {len(params)} / {len(buffers)}"
            )
        pairs: list[tuple[str, int, torch.Tensor, torch.Tensor]] = []
        for kind, dsts, srcs in (("param", params, self.params), ("buffer", buffers, self.buffers)):
            pairs += [(kind, i, d, s) for i, (d, s) in enumerate(zip(dsts, srcs, strict=True))]
        for kind, i, dst, src in pairs:
            if dst.shape != src.shape or dst.dtype != src.dtype:
                raise CheckpointError(
                    f"{where}: {kind} {i} is {tuple(src.shape)} {src.dtype} in the bundle, "
                    f"{tuple(dst.shape)} {dst.dtype} in the model"
                )
        with torch.no_grad():
            for _, _, dst, src in pairs:
                dst.copy_(src)


def save_model(
    stem: str | os.PathLike[str],
    params: Sequence[torch.Tensor],
    buffers: Sequence[torch.Tensor],
    *,
    signature: str,
    global_step: int,
    sync_round: int,
    epoch: int,
) -> Path:
    """Write ``S.fdl`` atomically: detached, contiguous CPU copies of ``params`` and ``buffers``.

    Returns:
        The path written.

    Raises:
        CheckpointError: the file could not be written (the previous one is intact).
    """
    path = model_path(stem)
    record: dict[str, Any] = {
        "format": MODEL_FORMAT,
        "version": TORCH_FORMAT_VERSION,
        "signature": signature,
        "global_step": global_step,
        "sync_round": sync_round,
        "epoch": epoch,
        "params": [_cpu_copy(t) for t in params],
        "buffers": [_cpu_copy(t) for t in buffers],
    }
    return _save_torch(path, record)


def load_model(stem: str | os.PathLike[str]) -> ModelBundle:
    """Read ``S.fdl``.

    Raises:
        CheckpointError: the file is missing, not a torch file, truncated, not a ``flodl.fdl``,
            from a newer flodl, or holds fields of the wrong type.
    """
    path = model_path(stem)
    obj = _load_torch(path, MODEL_FORMAT)
    signature = obj.get("signature")
    if not isinstance(signature, str):
        raise CheckpointError(f"{path}: signature must be a string, got {signature!r}")
    return ModelBundle(
        params=_get_tensors(obj, "params", path),
        buffers=_get_tensors(obj, "buffers", path),
        signature=signature,
        global_step=_get_int(obj, "global_step", path),
        sync_round=_get_int(obj, "sync_round", path),
        epoch=_get_int(obj, "epoch", path),
        path=path,
    )


# --- S.rank<N>.optim -------------------------------------------------------------------------


@dataclass(frozen=True)
class OptimBundle:
    """A loaded ``S.rank<N>.optim``; ``state`` goes to ``optimizer.load_state_dict``."""

    rank: int
    global_step: int
    sync_round: int
    state: dict[str, Any]
    path: Path | None = None


def save_optim(
    stem: str | os.PathLike[str],
    rank: int,
    state_dict: dict[str, Any],
    *,
    global_step: int,
    sync_round: int,
) -> Path:
    """Write ``S.rank<N>.optim`` atomically (tensors moved to the CPU).

    Raises:
        CheckpointError: ``state_dict`` holds something ``weights_only`` loading would refuse,
            or the file could not be written (the previous one is intact).
    """
    path = optim_path(stem, rank)
    state = _to_cpu(state_dict)
    try:
        _check_loadable(state, "state")
    except TypeError as exc:
        raise CheckpointError(f"{path}: refusing to write: {exc}") from None
    record: dict[str, Any] = {
        "format": OPTIM_FORMAT,
        "version": TORCH_FORMAT_VERSION,
        "rank": rank,
        "global_step": global_step,
        "sync_round": sync_round,
        "state": state,
    }
    return _save_torch(path, record)


def load_optim(stem: str | os.PathLike[str], rank: int) -> OptimBundle | None:
    """Read ``S.rank<N>.optim``; ``None`` when that file does not exist.

    Raises:
        CheckpointError: the file is corrupt, not a ``flodl.optim``, from a newer flodl, or
            saved by another rank.
    """
    path = optim_path(stem, rank)
    if not path.exists():
        return None
    obj = _load_torch(path, OPTIM_FORMAT)
    saved_rank = _get_int(obj, "rank", path)
    if saved_rank != rank:
        raise CheckpointError(f"{path}: saved by rank {saved_rank}, read for rank {rank}")
    global_step = _get_int(obj, "global_step", path)
    sync_round = _get_int(obj, "sync_round", path)
    state = obj.get("state")
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: state must be a dict, got {type(state).__name__}")
    return OptimBundle(
        rank=rank, global_step=global_step, sync_round=sync_round, state=state, path=path
    )


# --- S.outer.fdl -----------------------------------------------------------------------------


@dataclass(frozen=True)
class OuterBundle:
    """A loaded ``S.outer.fdl``: named lists of tensors (e.g. ``{"momentum": [...]}``)."""

    state: dict[str, list[torch.Tensor]]
    global_step: int
    path: Path | None = None


def save_outer(
    stem: str | os.PathLike[str], state: Mapping[str, Sequence[torch.Tensor]], *, global_step: int
) -> Path:
    """Write ``S.outer.fdl`` atomically (CPU copies).

    Raises:
        CheckpointError: ``state`` is not a mapping of names to tensor lists, or the file could
            not be written (the previous one is intact).
    """
    path = outer_path(stem)
    copied: dict[str, list[torch.Tensor]] = {}
    for name, tensors in state.items():
        if not isinstance(name, str) or not all(isinstance(t, torch.Tensor) for t in tensors):
            raise CheckpointError(f"{path}: refusing to write: {name!r} is not a tensor list")
        copied[name] = [_cpu_copy(t) for t in tensors]
    record: dict[str, Any] = {
        "format": OUTER_FORMAT,
        "version": TORCH_FORMAT_VERSION,
        "global_step": global_step,
        "state": copied,
    }
    return _save_torch(path, record)


def load_outer(stem: str | os.PathLike[str]) -> OuterBundle | None:
    """Read ``S.outer.fdl``; ``None`` when it does not exist (start from zero momentum).

    Raises:
        CheckpointError: the file is corrupt, not a ``flodl.outer`` or from a newer flodl.
    """
    path = outer_path(stem)
    if not path.exists():
        return None
    obj = _load_torch(path, OUTER_FORMAT)
    raw = obj.get("state")
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path}: state must be a dict, got {type(raw).__name__}")
    state: dict[str, list[torch.Tensor]] = {}
    for name in raw:
        if not isinstance(name, str):
            raise CheckpointError(f"{path}: state key {name!r} is not a string")
        state[name] = list(_get_tensors(raw, name, path))
    return OuterBundle(state=state, global_step=_get_int(obj, "global_step", path), path=path)


# =============================================================================================
# S.meta.json
# =============================================================================================

_NonNegInt = Annotated[StrictInt, Field(ge=0)]
_PosInt = Annotated[StrictInt, Field(ge=1)]


class _Json(BaseModel):
    # extra="ignore": fields the original flodl (or a later one) adds are tolerated.
    model_config = ConfigDict(frozen=True, extra="ignore")


class EpochCoverage(_Json):
    """What of one open epoch was still untrained at the save.

    Attributes:
        epoch: the epoch.
        total_samples: samples in the epoch (``batches × batch_size``).
        uncovered_ranges: ``(offset, size)`` in samples, batch-aligned, sorted by the writer.
    """

    epoch: _NonNegInt
    total_samples: _NonNegInt
    uncovered_ranges: list[tuple[StrictInt, StrictInt]] = Field(default_factory=list)


class Coverage(_Json):
    """The coverage block: what a coverage-granular resume needs (newer original metas)."""

    seed: StrictInt
    batch_size: _PosInt
    epoch_splits: _PosInt = 1
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


class CheckpointMeta(_Json):
    """``S.meta.json``, as the coordinator writes it and the original flodl reads it.

    Attributes:
        schema_version: ``1..META_SCHEMA_VERSION``.
        epoch: the epoch to resume (the first open one at the save).
        global_step: optimizer steps over the run.
        sync_round: averaging rounds finished.
        world_size_at_save: the run's world size; a resume needs the same one.
        save_reason: one of :data:`SAVE_REASONS`.
        elche_state: :meth:`~flodl.coord.elche_state.ElCheState.to_dict` (+ ``trend_history``, v3);
            absent in v1 metas.
        coverage: the coverage block, absent in the original's v1..v3 metas.
    """

    schema_version: Annotated[StrictInt, Field(ge=1, le=META_SCHEMA_VERSION)]
    epoch: _NonNegInt
    global_step: _NonNegInt
    sync_round: _NonNegInt
    world_size_at_save: _PosInt
    save_reason: SaveReason = "graceful_shutdown"
    elche_state: dict[str, Any] | None = None
    coverage: Coverage | None = None
    _source: Path | None = PrivateAttr(default=None)

    @field_validator("save_reason", mode="before")
    @classmethod
    def _known_reason(cls, value: object) -> str:
        if _is_int(value) and 0 <= value < len(SAVE_REASONS):
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


def _validation_problem(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(parts)


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
            f"{path}: refusing to write an invalid meta: {_validation_problem(exc)}"
        ) from None
    record = {k: v for k, v in model.model_dump().items() if v is not None}
    text = json.dumps(record, indent=2) + "\n"
    return _write_or_raise(path, lambda f: f.write(text.encode()))


def read_meta(stem: str | os.PathLike[str], *, world_size: int | None = None) -> CheckpointMeta:
    """Read and validate ``S.meta.json``.

    Args:
        stem: the bundle stem (or one of its files).
        world_size: this run's world size; when given it must equal ``world_size_at_save``.

    Raises:
        CheckpointError: the file is missing, not JSON, not an object, from a newer schema,
            has invalid fields (named), or was saved with another world size.
    """
    path = meta_path(stem)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise CheckpointError(f"no checkpoint meta at {path}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: cannot read the checkpoint meta: {exc}") from exc
    try:
        raw = json.loads(text)
    except (ValueError, RecursionError) as exc:  # RecursionError: absurdly deep nesting
        raise CheckpointError(f"{path}: not JSON: {type(exc).__name__}: {exc}") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path}: the meta must be a JSON object, not {type(raw).__name__}")
    version = raw.get("schema_version")
    if _is_int(version) and version > META_SCHEMA_VERSION:
        raise CheckpointError(
            f"{path}: written by a newer flodl (schema {version} > {META_SCHEMA_VERSION}); upgrade"
        )
    try:
        meta = CheckpointMeta.model_validate(raw)
    except ValidationError as exc:
        raise CheckpointError(f"{path}: invalid meta: {_validation_problem(exc)}") from None
    if world_size is not None and meta.world_size_at_save != world_size:
        raise CheckpointError(
            f"{path}: saved with world size {meta.world_size_at_save}, this run has "
            f"{world_size}: resume needs the same world size"
        )
    meta._source = path
    return meta


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
        for entry in cov.per_epoch:
            if entry.epoch == meta.epoch:
                uncovered = tuple(sorted((o, n) for o, n in entry.uncovered_ranges))
    return ResumeState(
        epoch=meta.epoch,
        global_step=meta.global_step,
        sync_round=meta.sync_round,
        elche=meta.elche,
        uncovered=uncovered,
    )


# =============================================================================================
# S.rank<N>.death.json
# =============================================================================================


class DeathRecord(_Json):
    """``S.rank<N>.death.json``: why a rank died (forensics only; never read for a resume)."""

    schema_version: Annotated[StrictInt, Field(ge=1, le=DEATH_SCHEMA_VERSION)]
    rank: _NonNegInt
    world_size: _PosInt
    error: StrictStr
    unix_time_secs: _NonNegInt


def write_death_record(
    stem: str | os.PathLike[str], rank: int, world_size: int, error: str
) -> Path | None:
    """Best-effort, atomic ``<stem>.rank<N>.death.json``; the path, or ``None`` if it failed."""
    try:
        path = death_path(stem, rank)
    except ConfigError:
        return None
    record = {
        "schema_version": DEATH_SCHEMA_VERSION,
        "rank": rank,
        "world_size": world_size,
        "error": error[:_MAX_DEATH_ERROR],
        # A forensic wall-clock stamp, as the original's unix_time_secs; never compared.
        "unix_time_secs": int(time.time()),  # noqa: TID251
    }
    try:
        atomic_write_bytes(path, json.dumps(record, indent=2).encode())
    except OSError:
        return None
    return path


_DEATH_NAME = re.compile(r"\.rank(\d+)\.death\.json\Z")


def read_death_record(path_or_stem: str | os.PathLike[str], rank: int | None = None) -> DeathRecord:
    """Read a death record: the file ``path_or_stem`` itself, or ``<stem>.rank<rank>.death.json``.

    Raises:
        CheckpointError: missing, not JSON, invalid fields, a newer schema, or a ``rank`` that
            disagrees with the file name.
    """
    path = Path(path_or_stem) if rank is None else death_path(path_or_stem, rank)
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"no death record at {path}") from None
    except (OSError, ValueError, RecursionError) as exc:
        raise CheckpointError(f"{path}: not a JSON death record: {exc}") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path}: a death record must be a JSON object")
    version = raw.get("schema_version")
    if _is_int(version) and version > DEATH_SCHEMA_VERSION:
        raise CheckpointError(
            f"{path}: written by a newer flodl (schema {version} > {DEATH_SCHEMA_VERSION}); upgrade"
        )
    try:
        record = DeathRecord.model_validate(raw)
    except ValidationError as exc:
        raise CheckpointError(f"{path}: invalid death record: {_validation_problem(exc)}") from None
    named = _DEATH_NAME.search(path.name)
    if named is not None and int(named.group(1)) != record.rank:
        raise CheckpointError(f"{path}: the record says rank {record.rank}")
    return record


def death_records(
    stem: str | os.PathLike[str], *, world_size: int | None = None
) -> list[DeathRecord]:
    """Every readable ``S.rank*.death.json``, by rank; unreadable ones are skipped with a
    warning. With ``world_size``, only records of a run of that size."""
    base = Path(normalize_stem(stem))
    pattern = re.compile(re.escape(base.name) + r"\.rank\d+\.death\.json\Z")
    try:
        names = sorted(p for p in os.listdir(base.parent) if pattern.match(p))
    except OSError:
        return []
    records = []
    for name in names:
        try:
            records.append(read_death_record(base.parent / name))
        except CheckpointError as exc:
            logger.warning("skipping a death record: %s", exc)
    records.sort(key=lambda r: r.rank)
    if world_size is not None:
        records = [r for r in records if r.world_size == world_size]
    return records
