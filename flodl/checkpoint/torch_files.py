"""The bundle's torch files: ``S.<tag>.fdl`` (the consensus model), ``S.<tag>.rank<N>.optim``
(a rank's optimizer state) and ``S.<tag>.outer.fdl`` (the outer optimizer's momentum).

Every read validates: files are loaded with ``weights_only=True`` (no pickled code runs) and
must carry their format tag and a known version; whatever is wrong raises
:class:`~flodl.errors.CheckpointError` whose message starts with the file's path. Files carry
the global step of their save, so a file from another save is detected by its stamp.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from flodl.checkpoint.files import is_int, model_path, optim_path, outer_path, write_or_raise
from flodl.checkpoint.meta import resolve_tag
from flodl.errors import CheckpointError

__all__ = [
    "MODEL_FORMAT",
    "OPTIM_FORMAT",
    "OUTER_FORMAT",
    "TORCH_FORMAT_VERSION",
    "ModelBundle",
    "save_model",
    "load_model",
    "OptimBundle",
    "save_optim",
    "load_optim",
    "OuterBundle",
    "save_outer",
    "load_outer",
]

MODEL_FORMAT = "flodl.fdl"
OPTIM_FORMAT = "flodl.optim"
OUTER_FORMAT = "flodl.outer"
TORCH_FORMAT_VERSION = 1
"""Version of the three torch file layouts this module writes (and the newest it reads)."""


def _save_torch(path: Path, obj: dict[str, Any]) -> Path:
    return write_or_raise(path, lambda f: torch.save(obj, f))


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
    if not is_int(version) or version < 1:
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


def _get_int(obj: Mapping[str, Any], key: str, path: Path, minimum: int = 0) -> int:
    value = obj.get(key)
    if not is_int(value) or value < minimum:
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
    tag: str | None = None,
) -> Path:
    """Write ``S.<tag>.fdl`` atomically: detached, contiguous CPU copies of ``params`` and
    ``buffers``.

    Returns:
        The path written.

    Raises:
        CheckpointError: the file could not be written (the previous one is intact).
    """
    path = model_path(stem, tag)
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


def load_model(stem: str | os.PathLike[str], tag: str | None = None) -> ModelBundle:
    """Read ``S.<tag>.fdl`` (without a tag: the committed save's, the one the meta names).

    Raises:
        CheckpointError: the file is missing, not a torch file, truncated, not a ``flodl.fdl``,
            from a newer flodl, or holds fields of the wrong type.
    """
    path = model_path(stem, resolve_tag(stem, tag))
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
    tag: str | None = None,
) -> Path:
    """Write ``S.<tag>.rank<N>.optim`` atomically (tensors moved to the CPU).

    Raises:
        CheckpointError: ``state_dict`` holds something ``weights_only`` loading would refuse,
            or the file could not be written (the previous one is intact).
    """
    path = optim_path(stem, rank, tag)
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


def load_optim(
    stem: str | os.PathLike[str], rank: int, tag: str | None = None
) -> OptimBundle | None:
    """Read ``S.<tag>.rank<N>.optim`` (without a tag: the committed save's); ``None`` when
    that file does not exist.

    Raises:
        CheckpointError: the file is corrupt, not a ``flodl.optim``, from a newer flodl, or
            saved by another rank.
    """
    path = optim_path(stem, rank, resolve_tag(stem, tag))
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
    stem: str | os.PathLike[str],
    state: Mapping[str, Sequence[torch.Tensor]],
    *,
    global_step: int,
    tag: str | None = None,
) -> Path:
    """Write ``S.<tag>.outer.fdl`` atomically (CPU copies).

    Raises:
        CheckpointError: ``state`` is not a mapping of names to tensor lists, or the file could
            not be written (the previous one is intact).
    """
    path = outer_path(stem, tag)
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


def load_outer(stem: str | os.PathLike[str], tag: str | None = None) -> OuterBundle | None:
    """Read ``S.<tag>.outer.fdl`` (without a tag: the committed save's); ``None`` when it does
    not exist (zero momentum).

    Raises:
        CheckpointError: the file is corrupt, not a ``flodl.outer`` or from a newer flodl.
    """
    path = outer_path(stem, resolve_tag(stem, tag))
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
