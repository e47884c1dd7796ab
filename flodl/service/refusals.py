"""Refusals: every connection the coordinator refuses or cuts is counted; few are logged.

Pure module (the caller passes ``now``). A hostile peer can open connections as fast as the
network allows; one warning line per refusal would turn that into a disk-filling log and a CPU
sink. So every refusal is counted by its reason (``counts``, what tests and operators read),
at most ``budget`` are logged per ``window_s``, and the surplus is summed up in one line when
the window turns.
"""

from __future__ import annotations

import collections
import logging

__all__ = ["Refusals", "LOG_BUDGET_PER_WINDOW"]

LOG_BUDGET_PER_WINDOW = 20
"""Refusals logged per minute; the rest are counted and reported as one line."""
_REASON_CHARS = 160


class Refusals:
    """Counts refusals by reason and logs them within a budget.

    Args:
        log: where the warnings go.
        budget: warnings per window.
        window_s: the window, seconds.
    """

    def __init__(
        self, log: logging.Logger, budget: int = LOG_BUDGET_PER_WINDOW, window_s: float = 60.0
    ) -> None:
        self.log, self.budget, self.window_s = log, budget, window_s
        self.counts: collections.Counter[str] = collections.Counter()
        self._start: float | None = None
        self._used = 0
        self._suppressed = 0

    def refuse(self, now: float, reason: str, msg: str, *args: object) -> None:
        """Count ``reason``; log ``msg % args`` unless this window's budget is spent."""
        self.counts[reason[:_REASON_CHARS]] += 1
        if self._start is None or now - self._start >= self.window_s:
            if self._suppressed:
                self.log.warning(
                    "%d more connections refused or closed in the last %.0f s (not logged)",
                    self._suppressed,
                    self.window_s,
                )
            self._start, self._used, self._suppressed = now, 0, 0
        if self._used < self.budget:
            self._used += 1
            self.log.warning(msg, *args)
        else:
            self._suppressed += 1
