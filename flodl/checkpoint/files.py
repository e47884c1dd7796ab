"""The bundle's file names, its atomic writes, and the removal of superseded saves.

A save writes its model, optimizer and outer files under a *tag* of its own
(``S.<tag>.fdl``…); the meta ``S.meta.json``, written last, names the tag and so switches the
resume point to the new files in one atomic rename. Files of other tags (an older save, a save
killed before its meta) are removed only after a meta naming a newer tag is on disk
(:func:`remove_superseded`). Untagged names (``S.fdl``…) are what the original flodl and older
versions of this one wrote; they are read when a meta names no tag.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Callable, Collection
from pathlib import Path
from typing import IO, TypeGuard

from flodl.coord.resume import TAG_PATTERN, bundle_tag
from flodl.errors import CheckpointError, ConfigError

__all__ = [
    "TAG_PATTERN",
    "bundle_tag",
    "normalize_stem",
    "model_path",
    "optim_path",
    "meta_path",
    "outer_path",
    "death_path",
    "atomic_write_bytes",
    "write_or_raise",
    "remove_superseded",
    "is_int",
]

_TAG = re.compile(TAG_PATTERN + r"\Z")
_DATA = r"(?:\.outer\.fdl|\.fdl|\.rank\d+\.optim)"
_BUNDLE_SUFFIX = re.compile(
    rf"(?:(?:\.{TAG_PATTERN})?{_DATA}|\.meta\.json|\.rank\d+\.death\.json)\Z"
)


def is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def normalize_stem(path: str | os.PathLike[str]) -> str:
    """The bundle stem named by ``path``: a stem, or the path of one of the bundle's files.

    One known bundle suffix is stripped (``.fdl``, ``.outer.fdl``, ``.rank<N>.optim``, each
    with or without a save's tag, ``.meta.json``, ``.rank<N>.death.json``); anything else is
    returned as is.

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


def _tagged(stem: str | os.PathLike[str], tag: str | None) -> str:
    base = normalize_stem(stem)
    if tag is None:
        return base
    if not _TAG.match(tag):
        raise ConfigError(f"bundle tag {tag!r} is not of the form {TAG_PATTERN}")
    return f"{base}.{tag}"


def model_path(stem: str | os.PathLike[str], tag: str | None = None) -> Path:
    """``S.<tag>.fdl`` (``S.fdl`` without a tag)."""
    return Path(_tagged(stem, tag) + ".fdl")


def optim_path(stem: str | os.PathLike[str], rank: int, tag: str | None = None) -> Path:
    """``S.<tag>.rank<N>.optim``."""
    return Path(f"{_tagged(stem, tag)}.rank{_rank(rank)}.optim")


def outer_path(stem: str | os.PathLike[str], tag: str | None = None) -> Path:
    """``S.<tag>.outer.fdl``."""
    return Path(_tagged(stem, tag) + ".outer.fdl")


def meta_path(stem: str | os.PathLike[str]) -> Path:
    """``S.meta.json`` (never tagged: it is the switch)."""
    return Path(normalize_stem(stem) + ".meta.json")


def death_path(stem: str | os.PathLike[str], rank: int) -> Path:
    """``S.rank<N>.death.json``."""
    return Path(f"{normalize_stem(stem)}.rank{_rank(rank)}.death.json")


def _rank(rank: int) -> int:
    if not is_int(rank) or rank < 0:
        raise ConfigError(f"rank must be an int >= 0, got {rank!r}")
    return rank


# --- atomic writes ---------------------------------------------------------------------------


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Replace ``path`` by ``data`` atomically; creates parent dirs.

    The bytes go to ``<file>.tmp.<pid>`` in the same directory, are flushed and fsynced,
    ``os.replace`` puts them in place, then the directory is fsynced (best effort). A crash
    leaves the previous file or the new one, never a torn one.

    Raises:
        OSError: the write failed; ``path`` is unchanged and no temporary file is left.
    """
    atomic_write(Path(path), lambda f: f.write(data))


def atomic_write(path: Path, fill: Callable[[IO[bytes]], object]) -> None:
    """:func:`atomic_write_bytes` with a writer callback (torch streams into the file)."""
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


def write_or_raise(path: Path, fill: Callable[[IO[bytes]], object]) -> Path:
    """:func:`atomic_write`, a refusal of the disk raised as a :class:`CheckpointError`."""
    try:
        atomic_write(path, fill)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot write: {exc}") from exc
    return path


# --- superseded saves ------------------------------------------------------------------------


def remove_superseded(
    stem: str | os.PathLike[str], keep: str, *, in_flight: Collection[str] = ()
) -> list[Path]:
    """Remove the data files of every save of ``stem`` but ``keep`` (the tag the meta on disk
    names) and the saves still being written (``in_flight``), with the untagged files of the
    original layout and the temporary files of killed writers. Best effort; returns what was
    removed."""
    base = Path(normalize_stem(stem))
    data = re.compile(re.escape(base.name) + rf"(?:\.({TAG_PATTERN}))?{_DATA}(?:\.tmp\.\d+)?\Z")
    spared = {keep, *in_flight}
    removed: list[Path] = []
    try:
        names = os.listdir(base.parent)
    except OSError:
        return removed
    for name in sorted(names):
        match = data.match(name)
        if match is None or match.group(1) in spared:
            continue
        path = base.parent / name
        with contextlib.suppress(OSError):
            path.unlink()
            removed.append(path)
    return removed
