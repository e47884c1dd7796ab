"""``S.rank<N>.death.json``: why a rank died (forensics only; never read for a resume).

Written best effort by the dying rank (a failed write returns ``None``: the rank is dying
anyway), atomically, with a wall-clock stamp that is never compared.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from pathlib import Path
from typing import Annotated

from pydantic import Field, StrictInt, StrictStr

from flodl.checkpoint.files import atomic_write_bytes, death_path, normalize_stem
from flodl.checkpoint.meta import JsonModel, NonNegInt, PosInt, read_json_model
from flodl.errors import CheckpointError, ConfigError

__all__ = [
    "DEATH_SCHEMA_VERSION",
    "DeathRecord",
    "write_death_record",
    "read_death_record",
    "death_records",
]

logger = logging.getLogger(__name__)

DEATH_SCHEMA_VERSION = 1
_MAX_DEATH_ERROR = 4096


class DeathRecord(JsonModel):
    """``S.rank<N>.death.json``: why a rank died (forensics only; never read for a resume)."""

    schema_version: Annotated[StrictInt, Field(ge=1, le=DEATH_SCHEMA_VERSION)]
    rank: NonNegInt
    world_size: PosInt
    error: StrictStr
    unix_time_secs: NonNegInt


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
    record = read_json_model(path, DeathRecord, "death record", DEATH_SCHEMA_VERSION)
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
