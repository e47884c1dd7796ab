"""The alert lane: rate-limited ``event`` records an operator must see (docs/design.md §7).

Pure logic: time is an argument (``now``, monotonic seconds), nothing here reads a clock except
:func:`~flodl.monitor.records.make_record` for the display timestamp when ``wall_ms`` is omitted.

Rules (one *key* is a ``(class, path)`` pair):
    - The first alert of a key is emitted at once, as a record; it is never delayed.
    - A repeat less than ``window_s`` after the key's last *emitted* record is absorbed: counted,
      not emitted.
    - The next offer of that key at or after ``window_s`` is emitted with
      ``count = 1 + absorbed``, so the counts of all emitted records of a key sum to the exact
      number of offers.
    - :meth:`AlertLane.flush` (teardown) emits every pending absorbed count, so nothing is lost.
    - At most ``max_live`` keys are tracked. A new key first forgets keys whose window has passed
      with nothing pending (that changes no output); if the lane is still full, the key emitted
      least recently is evicted and its pending count, if any, is emitted now. Totals stay exact.
    - Every emitted record is also printed, one line each:
      ``flodl [<class>] <path>: <detail>`` plus `` (×<count>)`` when ``count > 1``.

Choices (where the original is silent):
    - :meth:`AlertLane.offer` returns ``list[dict]``, not ``dict | None``: an eviction can emit an
      older key's pending record alongside the new key's first one (the evicted one comes first).
    - An emitted record carries the detail of the offer that emits it (for a flush or an eviction:
      the last absorbed detail) and the highest severity among the offers it counts.
"""

from __future__ import annotations

import contextlib
import re
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

from flodl.errors import ConfigError
from flodl.monitor.records import SEVERITIES, make_record, validate_path

__all__ = ["ALERT_CLASSES", "AlertLane", "format_alert"]

ALERT_CLASSES: Final = (
    "rank_lost",
    "rank_joined",
    "rank_rejoined",
    "drift",
    "control_drop",
    "reduce_stall",
)
"""Classes flodl raises itself; any other short lowercase word is accepted too."""

_CLASS_RE: Final = re.compile(r"[a-z][a-z0-9_]{0,31}")
_RANK: Final = {sev: i for i, sev in enumerate(SEVERITIES)}


def _default_printer(line: str) -> None:
    # A closed or broken stdout must not take the run down.
    with contextlib.suppress(OSError, ValueError):
        print(line, flush=True)  # noqa: T201 (docs/design.md §7: alerts always go to stdout)


def format_alert(record: dict[str, Any]) -> str:
    """The stdout line of an alert record: ``flodl [<class>] <path>: <detail> (×<count>)``."""
    data = record["data"]
    detail = " ".join(str(data["detail"]).splitlines())  # one alert, one line
    line = f"flodl [{data['class']}] {record['path']}: {detail}"
    return f"{line} (×{data['count']})" if data["count"] > 1 else line


@dataclass(slots=True)
class _Entry:
    """One live key: when it last emitted, and what it absorbed since."""

    emitted_at: float
    pending: int = 0
    detail: str = ""
    sev: str = "info"


class AlertLane:
    """Collapses repeated alerts per ``(class, path)`` into counted ``event`` records.

    Not thread-safe: call it from one thread (the coordinator's event loop).

    Args:
        window_s: repeats of a key within this many seconds of its last emitted record are
            absorbed (seconds, monotonic).
        max_live: most keys tracked at once (>= 1).
        printer: receives each emitted record's line; defaults to ``print(line, flush=True)``
            (errors of a broken stdout are ignored). A custom printer's exceptions propagate,
            after the lane's state is updated.

    Raises:
        ConfigError: ``window_s`` is negative or not finite, or ``max_live < 1``.
    """

    def __init__(
        self,
        *,
        window_s: float = 10.0,
        max_live: int = 200,
        printer: Callable[[str], None] | None = None,
    ) -> None:
        if not 0.0 <= window_s < float("inf"):
            raise ConfigError(f"alert window_s={window_s!r} must be finite and >= 0")
        if isinstance(max_live, bool) or not isinstance(max_live, int) or max_live < 1:
            raise ConfigError(f"alert max_live={max_live!r} must be an int >= 1")
        self.window_s = window_s
        self.max_live = max_live
        self._printer = printer if printer is not None else _default_printer
        # Ordered by last emission, oldest first (emission times never decrease).
        self._live: OrderedDict[tuple[str, str], _Entry] = OrderedDict()

    def __len__(self) -> int:
        """Number of live keys."""
        return len(self._live)

    def offer(
        self,
        cls: str,
        path: str,
        detail: str,
        *,
        sev: str = "warning",
        now: float,
        wall_ms: int | None = None,
    ) -> list[dict[str, Any]]:
        """Offer one alert; return the records to publish now (already printed).

        Args:
            cls: alert class, a short lowercase word (``rank_lost``, ``drift``…).
            path: node path the alert is about (``root/rank3``…).
            detail: human-readable reason.
            sev: ``info``, ``warning`` or ``critical``.
            now: monotonic time in seconds.
            wall_ms: unix ms stamped on emitted records; defaults to the wall clock.

        Returns:
            ``[]`` if the alert was absorbed; otherwise its record, preceded by an evicted key's
            pending record when the lane was full.

        Raises:
            ConfigError: a bad class, path or severity.
        """
        if not isinstance(cls, str) or not _CLASS_RE.fullmatch(cls):
            raise ConfigError(f"alert class {cls!r} must be a short lowercase word")
        validate_path(path)
        if sev not in _RANK:
            raise ConfigError(f"alert severity {sev!r} must be one of {', '.join(SEVERITIES)}")
        key = (cls, path)
        out: list[dict[str, Any]] = []
        entry = self._live.get(key)
        if entry is not None and now - entry.emitted_at < self.window_s:
            entry.pending += 1
            entry.detail = detail
            entry.sev = _worst(entry.sev, sev)
            return out
        if entry is None:
            out += self._make_room(now, wall_ms)
            count = 1
        else:
            count = 1 + entry.pending
            sev = _worst(entry.sev, sev) if entry.pending else sev
        self._live[key] = _Entry(emitted_at=now, sev="info")
        self._live.move_to_end(key)
        out.append(_record(cls, path, detail, sev, count, wall_ms))
        self._print(out)
        return out

    def flush(self, now: float, *, wall_ms: int | None = None) -> list[dict[str, Any]]:
        """Emit every pending absorbed count (teardown) and forget all keys.

        Args:
            now: monotonic time in seconds (accepted for symmetry; flushing ignores windows).
            wall_ms: unix ms stamped on the records; defaults to the wall clock.
        """
        del now
        out = [
            _record(cls, path, e.detail, e.sev, e.pending, wall_ms)
            for (cls, path), e in self._live.items()
            if e.pending
        ]
        self._live.clear()
        self._print(out)
        return out

    def _make_room(self, now: float, wall_ms: int | None) -> list[dict[str, Any]]:
        if len(self._live) < self.max_live:
            return []
        for key in [k for k, e in self._live.items() if _idle(e, now, self.window_s)]:
            del self._live[key]
        if len(self._live) < self.max_live:
            return []
        (cls, path), evicted = self._live.popitem(last=False)
        if not evicted.pending:
            return []
        return [_record(cls, path, evicted.detail, evicted.sev, evicted.pending, wall_ms)]

    def _print(self, records: list[dict[str, Any]]) -> None:
        for record in records:
            self._printer(format_alert(record))


def _idle(entry: _Entry, now: float, window_s: float) -> bool:
    """True when forgetting ``entry`` changes nothing: its window passed, nothing pending."""
    return not entry.pending and now - entry.emitted_at >= window_s


def _worst(a: str, b: str) -> str:
    return a if _RANK[a] >= _RANK[b] else b


def _record(
    cls: str, path: str, detail: str, sev: str, count: int, wall_ms: int | None
) -> dict[str, Any]:
    data = {"class": cls, "detail": detail, "count": count}
    return make_record(path, "event", data, sev=sev, ts_ms=wall_ms)
