"""The launcher's terminal progress display: one line per update (docs/design.md §7).

``flodl ▏epoch 2/5  47% ▏loss 0.3412 ▏ranks 2/2 ▏r0 12.3k/s 52% · r1 8.1k/s 48% ▏ETA 1m23s``

``ranks n/W`` is the live ranks out of the world size: it drops when a rank dies and grows
back when one rejoins or joins late.

It reads the same records the record log and the dashboard get (node reports at reduce
boundaries, epoch records), so it costs nothing extra. Lines are appended, never redrawn, so a
log of the terminal stays readable; it is off when stdout is not a terminal unless forced.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

__all__ = ["ProgressDisplay", "format_rate", "format_eta"]


def format_rate(per_s: float) -> str:
    """Samples per second, compact: ``950/s``, ``12.3k/s``, ``4.1M/s``."""
    if not math.isfinite(per_s) or per_s < 0:
        return "—"
    for unit, scale in (("M", 1e6), ("k", 1e3)):
        if per_s >= scale:
            return f"{per_s / scale:.1f}{unit}/s"
    return f"{per_s:.0f}/s"


def format_eta(seconds: float | None) -> str:
    if seconds is None or not math.isfinite(seconds) or seconds < 0:
        return "—"
    s = round(seconds)
    h, rest = divmod(s, 3600)
    m, sec = divmod(rest, 60)
    if h:
        return f"{h}h{m:02d}m"
    if m:
        return f"{m}m{sec:02d}s"
    return f"{sec}s"


class ProgressDisplay:
    """Prints a progress line for each epoch or sub-epoch report.

    Args:
        total_epochs: epochs of the run (``num_epochs × epoch_splits``).
        world_size: ranks.
        first_epoch: where a resumed run starts.
        out: the stream (default ``sys.stdout``).
        clock: monotonic seconds.
    """

    def __init__(
        self,
        total_epochs: int,
        world_size: int,
        *,
        first_epoch: int = 0,
        out: TextIO | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.total = max(1, total_epochs)
        self.world = world_size
        self.first = first_epoch
        self.out = out if out is not None else sys.stdout
        self.clock = clock
        self.started = clock()
        self.epoch = first_epoch
        self.fraction = 0.0
        self.loss: float | None = None
        self.rates: dict[int, float] = {}
        self.shares: dict[int, float] = {}
        self.syncs: int | None = None
        self.anchor: int | None = None
        self.ranks: int | None = None
        self.lines = 0

    # ------------------------------------------------------------------ feeding
    def on_node(self, path: str, data: dict[str, Any]) -> None:
        """A node report: rank nodes update rates and shares; the root prints a line."""
        rank = _rank_of(path)
        if rank is not None:  # a metric the report lacks (a dead rank's) is not shown
            for key, into in (("throughput", self.rates), ("batch_share", self.shares)):
                value = data.get(key)
                if isinstance(value, int | float):
                    into[rank] = float(value)
                else:
                    into.pop(rank, None)
            return
        if path != "root":
            return
        self._engine(data)
        if isinstance(data.get("epoch"), int):
            self.epoch = data["epoch"]
        if isinstance(data.get("epoch_progress"), int | float):
            self.fraction = min(1.0, max(0.0, float(data["epoch_progress"])))
        self.emit()

    def on_epoch(self, epoch: int, avg_loss: float, data: dict[str, Any]) -> None:
        """An epoch finished."""
        self.epoch = epoch + 1
        self.fraction = 0.0
        self.loss = avg_loss
        self._engine(data)
        self.emit()

    def _engine(self, data: dict[str, Any]) -> None:
        if isinstance(data.get("loss"), int | float):
            self.loss = float(data["loss"])
        if isinstance(data.get("syncs"), int):
            self.syncs = data["syncs"]
        if isinstance(data.get("anchor"), int):
            self.anchor = data["anchor"]
        if isinstance(data.get("ranks"), int):
            self.ranks = data["ranks"]

    # ------------------------------------------------------------------ output
    def line(self) -> str:
        done = min(self.total, self.epoch) + (self.fraction if self.epoch < self.total else 0.0)
        pct = 100.0 * done / self.total
        parts = [f"flodl ▏epoch {min(self.epoch + 1, self.total)}/{self.total} {pct:3.0f}%"]
        if self.loss is not None and math.isfinite(self.loss):
            parts.append(f"loss {self.loss:.4f}")
        if self.ranks is not None:
            parts.append(f"ranks {self.ranks}/{self.world}")
        ranks = []
        for r in sorted(set(self.rates) | set(self.shares)):
            rate = format_rate(self.rates[r]) if r in self.rates else "—"
            share = f" {100 * self.shares[r]:.0f}%" if r in self.shares else ""
            ranks.append(f"r{r} {rate}{share}")
        if ranks:
            parts.append(" · ".join(ranks[:16]) + (" …" if len(ranks) > 16 else ""))
        if self.syncs is not None:
            parts.append(f"syncs {self.syncs}")
        if self.anchor is not None:
            parts.append(f"anchor {self.anchor}")
        parts.append(f"ETA {format_eta(self._eta(done))}")
        return " ▏".join(parts)

    def _eta(self, done: float) -> float | None:
        progressed = done - self.first
        if progressed <= 0:
            return None
        elapsed = self.clock() - self.started
        return elapsed * (self.total - done) / progressed

    def emit(self) -> None:
        try:
            self.out.write(self.line() + "\n")
            self.out.flush()
        except (OSError, ValueError):
            return  # a closed or broken terminal costs the display, never the run
        self.lines += 1


def _rank_of(path: str) -> int | None:
    last = path.rsplit("/", 1)[-1]
    if last.startswith("rank") and last[4:].isdigit():
        return int(last[4:])
    return None
