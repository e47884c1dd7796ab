"""Contribution: what each rank gives the run against what it costs the others, and the
advice that follows (docs/design.md §7, "Contribution and advice").

Pure module. At every finalized averaging cycle the coordinator knows, for each rank that
trained through the window, its *busy* time (compute + data wait of the window it closed) and
the window's *span* (the previous cycle's finalize, or the start of training, to this one).
From them:

* **averaging** of the window = ``span − the longest busy``: the time the slowest rank of the
  window spent not training (the reduce, its messages, the coordinator's turn), which every
  rank pays; the coordinator's own ``sync_ms`` (trigger → finalize) is recorded beside it, but
  in the Sync modes it also holds the wait for the slowest rank, so it is not used here;
* **idle** of a rank = ``span − averaging − busy``: the time it waited for the slowest rank;
* **induced idle** — the wait a rank makes the others suffer. Every rank starts its window at
  the same instant, so while the ``k`` earliest finishers wait between the ``k``-th and the
  ``k+1``-th busy time, the ranks still busy are the cause; that interval's waiting is charged
  to them in equal parts (:func:`induced_idle` also takes a measured idle that is less than
  the busy difference and charges only that). In ``cpu_async`` every rank trains through the
  window, so busy ≈ span for all and nothing is induced. O(W log W) per cycle (one sort,
  prefix sums);
* **averaging share** of a rank = ``averaging / live ranks`` per window: the averaging time split
  evenly among the ranks that average.

The running totals give each rank's *sample share* (its trained samples over everyone's) and
its *cost share* (the induced idle and averaging share it is charged, over the ranks' summed
span time). :func:`advise` turns them into one word and a reason:

* ``evict`` when it costs more of the cluster's time than its share of the samples is worth
  (cost share > sample share): the others would train faster without it;
* ``cpu_async`` when the run waits at a barrier (not already ``cpu_async``) and the waits it
  induces are notable (cost share ≥ :data:`NOTABLE_COST` and ≥ a quarter of its sample share):
  without a barrier nobody waits for it;
* ``keep`` otherwise.

``flodl sim --from-records`` quantifies the advice by replaying the run without the rank and in
``cpu_async`` (:mod:`flodl.sim.replay`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final, Literal

from flodl.coord.metrics import WindowStats

__all__ = ["NOTABLE_COST", "Advice", "MOVE_TO_ASYNC", "induced_idle", "advise", "Contribution"]

NOTABLE_COST: Final = 0.02
"""A rank whose charged waits are under 2 % of the cluster's time is never worth moving."""

Advice = Literal["keep", "cpu_async", "evict"]
MOVE_TO_ASYNC: Final[Advice] = "cpu_async"
"""The advice to run without a barrier (it names the mode a user would pick)."""


def induced_idle(busy: Sequence[float], idle: Sequence[float]) -> list[float]:
    """The idle each rank induced in the others over one window (see the module docstring).

    Args:
        busy: each rank's busy time in the window (ms); every rank started it at once.
        idle: each rank's measured idle in the window (ms); caps what its wait can charge.

    Returns:
        Induced idle per rank (ms), in the order of ``busy``; the sum never exceeds the sum
        of ``idle``.
    """
    n = len(busy)
    out = [0.0] * n
    if n < 2:
        return out
    order = sorted(range(n), key=busy.__getitem__)
    top = busy[order[-1]]
    waiting = 0.0  # Σ of the real-wait fraction of the ranks already done
    charge = 0.0  # what each still-busy rank has been charged so far
    for k in range(n - 1):
        r = order[k]
        span = top - busy[r]
        if span > 0:  # (min(1.0, x) as a comparison: the builtin costs 8× it on 3.11)
            fraction = idle[r] / span
            waiting += fraction if fraction < 1.0 else 1.0
        delta = busy[order[k + 1]] - busy[r]
        charge += delta * waiting / (n - k - 1)
        out[order[k + 1]] = charge
    return out


def advise(
    sample_share: float, cost_share: float, *, live: int, barrier: bool
) -> tuple[Advice, str]:
    """One rank's advice and its reason (see the module docstring)."""
    samples = f"trains {100 * sample_share:.1f} % of the samples"
    costs = f"costs the others {100 * cost_share:.1f} % of the cluster's time"
    if live < 2:
        return "keep", "the only live rank"
    if cost_share > sample_share:
        return "evict", f"it {samples} but {costs} in waits and averaging"
    if barrier and cost_share >= NOTABLE_COST and cost_share >= sample_share / 4:
        return MOVE_TO_ASYNC, f"it {samples} and {costs}; cpu_async has no barrier to wait at"
    return "keep", f"it {samples} for {100 * cost_share:.1f} % of the cluster's time"


class Contribution:
    """Per-rank running totals over the run's finalized cycles.

    Args:
        world_size: ranks.
        barrier: the mode makes ranks wait for each other (every mode but ``cpu_async``).
    """

    def __init__(self, world_size: int, *, barrier: bool = True) -> None:
        self.world_size = world_size
        self.barrier = barrier
        zeros = [0.0] * world_size
        self._samples = [0] * world_size
        self._busy, self._idle, self._induced = list(zeros), list(zeros), list(zeros)
        self._averaging, self._span = list(zeros), list(zeros)
        self._last_at: float | None = None

    def start(self, now: float) -> None:
        """Training (re)started at ``now``: the first window's span begins here."""
        self._last_at = now

    def on_cycle(
        self, now: float, sync_ms: float, windows: Sequence[WindowStats], ranks: Sequence[int]
    ) -> dict[str, Any]:
        """A cycle finalized: fold the windows ``ranks`` closed into the totals; returns the
        ``window`` record's data (per-rank lists in ``ranks``' order). ``sync_ms`` (the
        coordinator's trigger → finalize) is recorded, not used. O(W log W)."""
        span = max(0.0, (now - (self._last_at if self._last_at is not None else now)) * 1000.0)
        self._last_at = now
        closed = [windows[r] for r in ranks]
        busy = [w.compute_ms + w.data_ms for w in closed]
        steps = [w.steps for w in closed]
        averaging = max(0.0, span - max(busy, default=0.0))
        free = span - averaging
        # (max(0.0, x) as a conditional: the builtin costs 8× it on Python 3.11)
        idle = [d if (d := free - b) > 0.0 else 0.0 for b in busy]
        induced = induced_idle(busy, idle)
        share = averaging / len(ranks) if ranks else 0.0
        samples_t, busy_t, idle_t = self._samples, self._busy, self._idle
        induced_t, averaging_t, span_t = self._induced, self._averaging, self._span
        for r, w, b, i, d in zip(ranks, closed, busy, idle, induced, strict=True):
            samples_t[r] += w.samples
            busy_t[r] += b
            idle_t[r] += i
            induced_t[r] += d
            averaging_t[r] += share
            span_t[r] += span
        return {
            "span_ms": span,
            "sync_ms": sync_ms,
            "averaging_ms": averaging,
            "ranks": list(ranks),
            "steps": steps,
            "busy_ms": busy,
            "idle_ms": idle,
            "induced_ms": induced,
            "ms_per_batch": [b / n if n else None for b, n in zip(busy, steps, strict=True)],
        }

    def figures(self, live: Sequence[int]) -> list[dict[str, Any]]:
        """Each rank's contribution so far and its advice (the ``contribution`` record). O(W)."""
        samples = sum(self._samples)
        cluster_ms = sum(self._span)
        alive = set(live)
        out = []
        for r in range(self.world_size):
            sample_share = self._samples[r] / samples if samples else 0.0
            cost = self._induced[r] + self._averaging[r]
            cost_share = cost / cluster_ms if cluster_ms else 0.0
            advice: str
            if r in alive:
                advice, reason = advise(
                    sample_share, cost_share, live=len(alive), barrier=self.barrier
                )
            else:
                advice, reason = "gone", "not a live rank"
            out.append(
                {
                    "rank": r,
                    "live": r in alive,
                    "samples": self._samples[r],
                    "sample_share": round(sample_share, 4),
                    "busy_s": round(self._busy[r] / 1000.0, 3),
                    "idle_s": round(self._idle[r] / 1000.0, 3),
                    "induced_idle_s": round(self._induced[r] / 1000.0, 3),
                    "averaging_s": round(self._averaging[r] / 1000.0, 3),
                    "cost_share": round(cost_share, 4),
                    "advice": advice,
                    "reason": reason,
                }
            )
        return out
