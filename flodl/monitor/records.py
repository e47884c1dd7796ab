"""The record log: one bounded JSONL ring per node of the record tree (docs/design.md §7).

A *record* is a JSON-ready dict, one per line::

    {"v": 1, "ts": <unix ms>, "sev": "info"|"warning"|"critical",
     "path": "root" | "root/<host>" | "root/<host>/rank3" | "root/rank0",
     "kind": "node"|"event"|"meta"|<short word>, "data": {...}}

Records are absolute snapshots, so a reader that only sees the last ``n`` lines of a node
(:meth:`RecordLog.tail`) has the whole current state of that node.

Layout on disk (:func:`node_file`): node ``root`` lives in ``<dir>/root.log``, node ``root/a`` in
``<dir>/root/a.log``, node ``root/a/rank1`` in ``<dir>/root/a/rank1.log``. Each node is a ring of
``segments`` files: the active ``X.log`` and the older ``X.log.1`` … ``X.log.<segments-1>``
(``.1`` the newest of them). A segment holds at most ``max_bytes // segments`` bytes; when the
next line would overflow the active one, the oldest segment is dropped, the others shift by one
and a fresh active file starts. So a node never holds more than ``max_bytes`` bytes on disk.

Rules:
    - :func:`validate_path` is the single gate between a node path and the file system. It guards
      the file tree of the writer and the dashboard's HTTP ``path=`` queries (no ``..``, no
      separators, no escapes, bounded depth).
    - Writing never raises (:meth:`RecordLog.write`): monitoring must not take a training run
      down. I/O errors and bad records are dropped, each kind of problem is logged once per
      :class:`RecordLog`, and a later write tries again (a full disk may drain).
    - Readers never raise on file contents: a line that is not a JSON object with the required
      keys (garbage, a torn last line being written right now) is skipped.

Choices (where the original is silent):
    - One writer per node directory is assumed (the coordinator); two :class:`RecordLog` objects
      on the same directory keep separate size counts, so the bound holds per writer only.
    - The bound covers the segments this writer rotates: a directory reused with a larger
      ``max_bytes`` or more ``segments`` shrinks back to the bound as it rotates.
    - A line is written with one unbuffered ``write`` call, so a concurrent reader sees it as soon
      as :meth:`RecordLog.write` returns. If an earlier write left a torn line, the next write
      starts on a fresh line so only the torn record is lost.
    - ``json.dumps`` keeps Python's default ``allow_nan=True``: a NaN metric is written as ``NaN``
      (Python readers accept it; a browser's ``JSON.parse`` does not, so serve it re-encoded).
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import re
import threading
import time
from collections.abc import Generator
from pathlib import Path
from types import TracebackType
from typing import Any, Final, Self

from flodl.errors import ConfigError

__all__ = [
    "RECORD_VERSION",
    "SEVERITIES",
    "REQUIRED_KEYS",
    "DEFAULT_MAX_BYTES",
    "MAX_PATH_DEPTH",
    "make_record",
    "validate_path",
    "validate_kind",
    "node_file",
    "RecordLog",
    "read_tree",
    "paths",
]

logger = logging.getLogger(__name__)

RECORD_VERSION: Final = 1
SEVERITIES: Final = ("info", "warning", "critical")
REQUIRED_KEYS: Final = frozenset({"v", "ts", "sev", "path", "kind", "data"})
DEFAULT_MAX_BYTES: Final = 32 * 2**20
MIN_MAX_BYTES: Final = 4096
MIN_SEGMENT_BYTES: Final = 1024
MAX_PATH_DEPTH: Final = 4  # segments, ``root`` included: root/<host>/rank3 is 3 deep

_ROOT: Final = "root"
_SUFFIX: Final = ".log"
_SEGMENT_RE: Final = re.compile(r"[A-Za-z0-9._-]{1,64}")
_KIND_RE: Final = re.compile(r"[a-z][a-z0-9_]{0,31}")
# "<segment>.log" is an active file, "<segment>.log.<k>" (k >= 1) an older segment; the two
# suffixes never overlap, so a file name maps back to exactly one node and one index.
_FILE_RE: Final = re.compile(r"(?P<seg>.+)\.log(?:\.(?P<k>[1-9][0-9]{0,5}))?")
_READ_BLOCK: Final = 1 << 16


def validate_path(path: object) -> str:
    """Check that ``path`` names a node of the record tree and return it.

    A node path is ``root`` or ``root/`` followed by ``/``-separated segments of 1 to 64
    characters from ``[A-Za-z0-9._-]``, neither ``.`` nor ``..``, at most :data:`MAX_PATH_DEPTH`
    segments in all (``root`` included).

    Raises:
        ConfigError: ``path`` is not a string or breaks a rule; the message names the rule.
    """
    if not isinstance(path, str):
        raise ConfigError(f"record path must be a string, got {type(path).__name__}")
    if not path:
        raise ConfigError("record path is empty")
    parts = path.split("/")
    if parts[0] != _ROOT:
        raise ConfigError(f"record path {path[:80]!r} must start with {_ROOT!r}")
    if len(parts) > MAX_PATH_DEPTH:
        raise ConfigError(
            f"record path {path[:80]!r} is {len(parts)} segments deep (at most {MAX_PATH_DEPTH})"
        )
    for part in parts[1:]:
        if part in (".", ".."):
            raise ConfigError(f"record path {path!r} has a {part!r} segment")
        if not _SEGMENT_RE.fullmatch(part):
            raise ConfigError(
                f"record path {path[:80]!r} has a bad segment {part[:80]!r} "
                "(1-64 characters from A-Z a-z 0-9 . _ -)"
            )
    return path


def validate_kind(kind: object) -> str:
    """Check that ``kind`` is a short lowercase word (``node``, ``event``, ``meta``, ``epoch``…).

    Raises:
        ConfigError: not a string of 1-32 characters from ``[a-z0-9_]`` starting with a letter.
    """
    if not isinstance(kind, str) or not _KIND_RE.fullmatch(kind):
        raise ConfigError(f"record kind {kind!r} must be a short lowercase word ([a-z][a-z0-9_]*)")
    return kind


def make_record(
    path: str,
    kind: str,
    data: dict[str, Any],
    *,
    sev: str = "info",
    ts_ms: int | None = None,
) -> dict[str, Any]:
    """Build one record.

    Args:
        path: node path (see :func:`validate_path`).
        kind: ``node``, ``event``, ``meta`` or another short word.
        data: the payload; must be JSON-serializable for the record to be written.
        sev: ``info``, ``warning`` or ``critical``.
        ts_ms: unix time in milliseconds; defaults to the wall clock now. For display only: no
            decision ever compares these across hosts.

    Raises:
        ConfigError: a bad path, kind, severity, timestamp or non-dict data.
    """
    validate_path(path)
    validate_kind(kind)
    if sev not in SEVERITIES:
        raise ConfigError(f"record severity {sev!r} must be one of {', '.join(SEVERITIES)}")
    if not isinstance(data, dict):
        raise ConfigError(f"record data must be a dict, got {type(data).__name__}")
    if ts_ms is None:
        ts_ms = time.time_ns() // 1_000_000
    elif isinstance(ts_ms, bool) or not isinstance(ts_ms, int) or ts_ms < 0:
        raise ConfigError(f"record ts_ms must be a non-negative int, got {ts_ms!r}")
    return {"v": RECORD_VERSION, "ts": ts_ms, "sev": sev, "path": path, "kind": kind, "data": data}


def node_file(directory: str | os.PathLike[str], path: str) -> Path:
    """The active file of node ``path`` under ``directory`` (``root`` → ``<dir>/root.log``).

    Raises:
        ConfigError: ``path`` is not a valid node path.
    """
    parts = validate_path(path).split("/")
    return Path(directory).joinpath(*parts[:-1], parts[-1] + _SUFFIX)


def _record_problem(record: object) -> str | None:
    """Why ``record`` may not be written, or ``None`` when it is fine."""
    if not isinstance(record, dict):
        return f"record is a {type(record).__name__}, not a dict"
    missing = REQUIRED_KEYS - record.keys()
    if missing:
        return f"record lacks {sorted(missing)}"
    try:
        validate_path(record["path"])
        validate_kind(record["kind"])
    except ConfigError as exc:
        return str(exc)
    if record["sev"] not in SEVERITIES:
        return f"record severity {record['sev']!r} is not one of {', '.join(SEVERITIES)}"
    if not isinstance(record["data"], dict):
        return "record data is not a dict"
    return None


def _parse_line(line: bytes) -> dict[str, Any] | None:
    """The record on ``line``, or ``None`` for blank, torn or garbage lines."""
    if not line.strip():
        return None
    try:
        obj = json.loads(line)
    except (ValueError, RecursionError):  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        return None
    if not isinstance(obj, dict) or not obj.keys() >= REQUIRED_KEYS:
        return None
    return obj


def _lines_newest_first(file: Path) -> Generator[bytes, None, None]:
    """The lines of ``file`` from the last to the first, reading backwards in blocks.

    The size is fixed when the file is opened: a line appended meanwhile is not seen, and a
    rotation (a rename) does not disturb the open file. A missing file yields nothing.
    """
    try:
        f = open(file, "rb")  # noqa: SIM115 (a generator holds it; closed in finally)
    except OSError:
        return
    try:
        pos = f.seek(0, os.SEEK_END)
        carry = b""
        while pos > 0:
            step = min(_READ_BLOCK, pos)
            pos -= step
            f.seek(pos)
            chunk = f.read(step) + carry
            lines = chunk.split(b"\n")
            carry = lines[0]  # may continue in the previous block
            yield from reversed(lines[1:])
        yield carry
    except OSError:
        return
    finally:
        f.close()


def _segment_files(active: Path) -> list[Path]:
    """The files of the node whose active file is ``active``, newest first."""
    older: list[tuple[int, Path]] = []
    prefix = active.name + "."
    try:
        with os.scandir(active.parent) as it:
            for entry in it:
                rest = entry.name[len(prefix) :]
                if (
                    entry.name.startswith(prefix)
                    and rest.isdigit()
                    and rest.isascii()
                    and not rest.startswith("0")
                    and entry.is_file(follow_symlinks=False)
                ):
                    older.append((int(rest), Path(entry.path)))
    except OSError:
        pass
    return [active, *(p for _, p in sorted(older))]


class _Node:
    """Writer state of one node: the open active file and its size in bytes."""

    __slots__ = ("active", "handle", "size", "torn")

    def __init__(self, active: Path) -> None:
        self.active = active
        self.handle: io.FileIO | None = None  # unbuffered: a write is visible at once
        self.size = 0
        self.torn = False  # the active file does not end with a newline

    def close(self) -> None:
        handle, self.handle = self.handle, None
        if handle is not None:
            with contextlib.suppress(OSError):
                handle.close()


class RecordLog:
    """Appends records to a bounded ring of JSONL files per node. Never raises on write.

    Thread-safe: one lock serializes every write (the coordinator writes from its event-loop
    thread; others may write too). Files are opened lazily and stay open until :meth:`close`;
    a write after :meth:`close` opens them again. Usable as a context manager.

    Args:
        directory: root of the record tree; created on the first write.
        max_bytes: bound on one node's bytes on disk; ``0`` means :data:`DEFAULT_MAX_BYTES`
            (32 MiB).
        segments: number of files in one node's ring (the active one included).

    Raises:
        ConfigError: ``max_bytes`` is negative or below 4096, ``segments`` is below 1, or one
            segment (``max_bytes // segments``) would be under 1024 bytes.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        max_bytes: int = DEFAULT_MAX_BYTES,
        *,
        segments: int = 4,
    ) -> None:
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int):
            raise ConfigError(f"record_log max_bytes must be an int, got {max_bytes!r}")
        if max_bytes == 0:
            max_bytes = DEFAULT_MAX_BYTES
        if max_bytes < MIN_MAX_BYTES:
            raise ConfigError(
                f"record_log max_bytes={max_bytes} is below {MIN_MAX_BYTES} (0 means 32 MiB)"
            )
        if isinstance(segments, bool) or not isinstance(segments, int) or segments < 1:
            raise ConfigError(f"record_log segments={segments!r} must be an int >= 1")
        if max_bytes // segments < MIN_SEGMENT_BYTES:
            raise ConfigError(
                f"record_log segment size max_bytes // segments = {max_bytes // segments} is "
                f"below {MIN_SEGMENT_BYTES} bytes; use fewer segments or more bytes"
            )
        self.directory = Path(directory)
        self.max_bytes = max_bytes
        self.segments = segments
        self.segment_bytes = max_bytes // segments
        self._lock = threading.Lock()
        self._nodes: dict[str, _Node] = {}
        self._warned: set[str] = set()

    # -- writing ---------------------------------------------------------------------------

    def write(self, record: dict[str, Any]) -> None:
        """Append ``record`` as one line to its node's ring. Never raises.

        A bad record (not a dict, missing keys, bad path/kind/sev, not JSON-serializable) or
        one larger than a segment is dropped; an I/O error drops the record and closes the node's
        file so the next write reopens it. Each kind of problem is logged once per log.
        """
        problem = _record_problem(record)
        if problem is not None:
            self._warn_once("record", "dropped a bad record: %s (not reported again)", problem)
            return
        try:
            line = (json.dumps(record, separators=(",", ":")) + "\n").encode()
        except (TypeError, ValueError, RecursionError) as exc:
            self._warn_once(
                "record",
                "dropped a record that is not JSON-serializable: %s (not reported again)",
                exc,
            )
            return
        path: str = record["path"]
        with self._lock:
            node = self._nodes.get(path)
            if node is None:
                node = self._nodes[path] = _Node(node_file(self.directory, path))
            if len(line) > self.segment_bytes:
                self._warn_once(
                    "oversize",
                    "dropped a %d-byte record for %s: larger than one segment (%d bytes) "
                    "(not reported again)",
                    len(line),
                    path,
                    self.segment_bytes,
                )
                return
            try:
                self._append(node, line)
            except OSError as exc:
                node.close()
                self._warn_once(
                    "io",
                    "cannot write records under %s: %s (not reported again)",
                    self.directory,
                    exc,
                )

    def _append(self, node: _Node, line: bytes) -> None:
        handle = node.handle if node.handle is not None else self._open(node)
        if node.torn:
            line = b"\n" + line
        if node.size + len(line) > self.segment_bytes:
            handle = self._rotate(node)
            line = line.lstrip(b"\n")
        written = handle.write(line) or 0
        node.size += written
        node.torn = False
        if written < len(line):
            # A short write tears the line; the reopen after this error sees the torn end
            # (see _open) and starts the next line on a fresh one.
            raise OSError(f"short write to {node.active} ({written} of {len(line)} bytes)")

    def _open(self, node: _Node) -> io.FileIO:
        node.active.parent.mkdir(parents=True, exist_ok=True)
        handle = open(node.active, "ab", buffering=0)  # noqa: SIM115 (kept open across writes)
        try:
            size = os.fstat(handle.fileno()).st_size
            torn = False
            if size > 0:
                with open(node.active, "rb") as f:
                    f.seek(-1, os.SEEK_END)
                    torn = f.read(1) != b"\n"
        except OSError:
            handle.close()
            raise
        node.handle, node.size, node.torn = handle, size, torn
        return handle

    def _rotate(self, node: _Node) -> io.FileIO:
        """Drop the oldest segment, shift the rest by one and start an empty active file."""
        node.close()
        active = node.active
        last = self.segments - 1
        if last == 0:
            active.unlink(missing_ok=True)
        else:
            Path(f"{active}.{last}").unlink(missing_ok=True)
            for k in range(last - 1, 0, -1):
                older = Path(f"{active}.{k}")
                if older.exists():
                    os.replace(older, f"{active}.{k + 1}")
            if active.exists():
                os.replace(active, f"{active}.1")
        return self._open(node)

    def _warn_once(self, problem: str, msg: str, *args: object) -> None:
        # Every ``msg`` ends with "(not reported again)": each problem is logged once per log.
        # Called with or without the lock; a rare duplicate warning under a race is harmless.
        if problem in self._warned:
            return
        self._warned.add(problem)
        logger.warning(msg, *args)

    def close(self) -> None:
        """Close every open file. Never raises."""
        with self._lock:
            for node in self._nodes.values():
                node.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- reading ---------------------------------------------------------------------------

    @staticmethod
    def tail(directory: str | os.PathLike[str], path: str, n: int) -> list[dict[str, Any]]:
        """The last ``n`` records of node ``path``, oldest first (catch-up for a new reader).

        Reads the segments from the newest backwards and stops as soon as it has ``n`` records.
        Garbage and torn lines are skipped. An unknown node gives ``[]``.

        Raises:
            ConfigError: ``path`` is not a valid node path or ``n`` is not an int >= 1.
        """
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ConfigError(f"tail n={n!r} must be an int >= 1")
        active = node_file(directory, path)
        newest_first: list[dict[str, Any]] = []
        for file in _segment_files(active):
            with contextlib.closing(_lines_newest_first(file)) as lines:
                for line in lines:
                    record = _parse_line(line)
                    if record is not None:
                        newest_first.append(record)
                        if len(newest_first) == n:
                            newest_first.reverse()
                            return newest_first
        newest_first.reverse()
        return newest_first


def _check_record_dir(directory: str | os.PathLike[str]) -> Path:
    base = Path(directory)
    if not (base / (_ROOT + _SUFFIX)).is_file() and not (base / _ROOT).is_dir():
        raise ConfigError(
            f"{str(base)!r} is not a record directory (no {_ROOT}{_SUFFIX} and no {_ROOT}/)"
        )
    return base


def _node_files(base: Path) -> dict[str, dict[int, Path]]:
    """Every node path under ``base`` → {segment index (0 = active): file}."""
    found: dict[str, dict[int, Path]] = {}

    def add(node: str, name: str, file: Path) -> None:
        m = _FILE_RE.fullmatch(name)
        if m is None:
            return
        node = f"{node}/{m['seg']}" if node else m["seg"]
        try:
            validate_path(node)
        except ConfigError:
            return
        found.setdefault(node, {})[int(m["k"] or 0)] = file

    try:
        with os.scandir(base) as it:
            for entry in it:
                if entry.name.startswith(_ROOT + _SUFFIX) and entry.is_file(follow_symlinks=False):
                    add("", entry.name, Path(entry.path))
    except OSError:
        pass
    for dirpath, dirnames, filenames in os.walk(base / _ROOT):  # never follows symlinks
        rel = Path(dirpath).relative_to(base).as_posix()
        # A file in a directory MAX_PATH_DEPTH deep would be one segment too deep: prune there.
        deep = rel.count("/") + 1 >= MAX_PATH_DEPTH
        dirnames[:] = [] if deep else sorted(d for d in dirnames if _SEGMENT_RE.fullmatch(d))
        for name in filenames:
            file = Path(dirpath, name)
            if not file.is_symlink():
                add(rel, name, file)
    return found


def paths(directory: str | os.PathLike[str]) -> list[str]:
    """Every node path that has a file under ``directory``, sorted.

    Raises:
        ConfigError: ``directory`` is not a record directory.
    """
    return sorted(_node_files(_check_record_dir(directory)))


def read_tree(directory: str | os.PathLike[str]) -> dict[str, list[dict[str, Any]]]:
    """Every node under ``directory`` → all its records, oldest first (garbage skipped).

    Keys are sorted node paths.

    Raises:
        ConfigError: ``directory`` does not exist or holds neither ``root.log`` nor ``root/``.
    """
    tree: dict[str, list[dict[str, Any]]] = {}
    found = _node_files(_check_record_dir(directory))
    for node in sorted(found):
        records: list[dict[str, Any]] = []
        by_index = found[node]
        for k in sorted(by_index, reverse=True):  # oldest segment first, the active one last
            try:
                data = by_index[k].read_bytes()
            except OSError:
                continue
            for line in data.split(b"\n"):
                record = _parse_line(line)
                if record is not None:
                    records.append(record)
        tree[node] = records
    return tree
