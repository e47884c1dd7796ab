"""How the record hub checks, encodes and keeps one record: the stored entry, the bounded
ring, the node of the path tree, and the path helpers (the storage half of
:mod:`flodl.monitor.hub`, which holds the rules: sequencing, scopes, subscriptions).

Pure: no locks, no I/O; every function may be called from any thread on data it owns.
"""

from __future__ import annotations

import json
import math
import re
from collections import deque
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from flodl.errors import ConfigError
from flodl.monitor.records import RECORD_VERSION, SEVERITIES, validate_kind, validate_path

__all__ = [
    "Dropped",
    "Entry",
    "Node",
    "Ring",
    "check",
    "encode",
    "finite",
    "kind_set",
    "natural_key",
    "parent_of",
]

_DIGITS: Final = re.compile(r"(\d+)")


def parent_of(path: str) -> str | None:
    """``root/a/rank0`` → ``root/a``; ``root`` → ``None``."""
    cut = path.rfind("/")
    return None if cut < 0 else path[:cut]


def natural_key(path: str) -> list[tuple[int, int | str]]:
    """Sort key putting ``rank2`` before ``rank10``."""
    return [
        (0, int(part)) if part.isdigit() else (1, part)
        for part in _DIGITS.split(path.rsplit("/", 1)[-1])
    ]


@dataclass(slots=True)
class Entry:
    """One kept record: its sequence number, kind and JSON text (with ``seq`` inside)."""

    seq: int
    kind: str
    text: str


@dataclass(slots=True)
class Ring:
    """Kept entries, oldest first, bounded by count and by bytes of text."""

    max_count: int
    max_bytes: int
    entries: deque[Entry] = field(default_factory=deque)
    nbytes: int = 0

    def add(self, entry: Entry) -> None:
        self.entries.append(entry)
        self.nbytes += len(entry.text)
        while len(self.entries) > self.max_count or self.nbytes > self.max_bytes:
            self.nbytes -= len(self.entries.popleft().text)


@dataclass(slots=True)
class Node:
    path: str
    ring: Ring
    kind_rings: dict[str, Ring] = field(default_factory=dict)
    latest: dict[str, Entry] = field(default_factory=dict)
    children: dict[str, Node] = field(default_factory=dict)


class Dropped(Exception):
    """Internal: why a record was refused (message for the log)."""


def finite(obj: Any) -> Any:
    """``obj`` with every non-finite float replaced by ``None`` (JSON has no NaN).

    Containers are copied (tuples become lists); other values are returned as they are.
    """
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [finite(v) for v in obj]
    return obj


def encode(record: Mapping[str, Any]) -> str:
    try:
        return json.dumps(record, separators=(",", ":"), allow_nan=False)
    except ValueError:
        pass  # a NaN or an infinity somewhere (or a circular reference: fails again below)
    except (TypeError, RecursionError) as exc:
        raise Dropped(f"record is not JSON-serializable: {exc}") from None
    try:
        return json.dumps(finite(record), separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError, RecursionError) as exc:
        raise Dropped(f"record is not JSON-serializable: {exc}") from None


def check(record: object) -> tuple[str, str]:
    """``(path, kind)`` of a well-formed record; raises :class:`Dropped` otherwise."""
    if not isinstance(record, Mapping):
        raise Dropped(f"record is a {type(record).__name__}, not a dict")
    try:
        path = validate_path(record.get("path"))
        kind = validate_kind(record.get("kind"))
    except ConfigError as exc:
        raise Dropped(str(exc)) from None
    if record.get("v") != RECORD_VERSION:
        raise Dropped(f"record version {record.get('v')!r} is not {RECORD_VERSION}")
    ts = record.get("ts")
    if isinstance(ts, bool) or not isinstance(ts, int) or ts < 0:
        raise Dropped("record ts is not a non-negative int (unix ms)")
    if record.get("sev") not in SEVERITIES:
        raise Dropped(f"record sev is not one of {', '.join(SEVERITIES)}")
    if not isinstance(record.get("data"), dict):
        raise Dropped("record data is not a dict")
    return path, kind


def kind_set(kinds: Collection[str] | None, what: str) -> frozenset[str] | None:
    """``kinds`` as a frozenset of checked kinds (``None`` stays ``None``).

    Raises:
        ConfigError: not a collection of strings, or a bad kind.
    """
    if kinds is None:
        return None
    if isinstance(kinds, str) or not isinstance(kinds, Collection):
        raise ConfigError(f"{what}={kinds!r} must be a collection of record kinds")
    try:
        return frozenset(validate_kind(k) for k in kinds)
    except ConfigError as exc:
        raise ConfigError(f"{what}: {exc}") from None
