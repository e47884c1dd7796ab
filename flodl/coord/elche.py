"""ElChe: the cadence balancer ("the column marches at the slowest one's pace").

The slow rank anchors the cadence: it runs ``anchor`` batches per reduce window, faster ranks run
proportionally more, and everyone meets at the reduce. ElChe owns the anchor, the per-rank
``batch_counts``, the per-rank smoothed ms/batch, the elected anchor rank, the lifecycle phase and
a staged anchor-growth proposal. It lives only in the coordinator. Its constants, :class:`Phase`,
:class:`WindowReport` and :class:`ElCheState` live in :mod:`flodl.coord.elche_state` and are
re-exported here.

Rules (h11 style):

1. Pure and sans-IO: no clock, no I/O, no threads. Times are milliseconds the caller measured.
2. One timing entry point per averaging cycle, :meth:`ElChe.report_window` (or the lower-level
   :meth:`ElChe.report_timing`); one verdict entry point, :meth:`ElChe.apply_verdict`.
3. Growth is only ever *proposed* by the timing feed and *committed or vetoed* by a verdict; the
   one downward force is :class:`~flodl.coord.verdicts.NudgeDown`.

Sub-machines and who sees what:

- Trust rings (per rank, :data:`TRUST_WINDOW_CAP` readings, plain mean) and miss counters: fed by
  ``report_timing`` step 1.
- Phase ``probe → warmup → stable → mature``: advanced at the end of each successful
  ``report_timing`` (Warmup on the 1st, Stable once ``calibration_count ≥ 5``, Mature at ``≥ 20``).
- Anchor-rank election: cohort band, dominance margin, lowest-index tie-break; runs only while no
  anchor is pinned or from Stable on; a pinned anchor that misses :data:`MISS_LIMIT` reports in a
  row is abandoned (dead-window escape).
- Growth latch: off on any non-Stable verdict, re-armed after :data:`GROWTH_REARM_STABLE`
  consecutive Stables.
- Liveness mask: :meth:`ElChe.mark_dead` (called by the coordinator when a rank dies).

Choices (where the original is silent or ambiguous):

- ``world_size`` may be 1 (the Rust original asserts ≥ 2); a one-rank world is well defined.
- ``anchor > max_anchor`` is clamped (Rust builder order: ``min_anchor`` is lowered to
  ``max_anchor`` and the anchor follows), not rejected; an explicit ``min_anchor`` above the anchor
  lifts the anchor.
- Ties among equally slow challengers, and the window-cap remainder among equal largest counts,
  go to the lowest rank index (docs/design.md §4); Rust's ``max_by`` picks the last.
- Window-cap and ``clamp_total`` scaling use exact integer floors (``c * max // total``) instead
  of float ``floor(c * scale)``, so the sum is exact without rounding surprises.
- ``round`` is half-away-from-zero (Rust ``f64::round``), not Python's banker's rounding.
- A non-finite ``sync_ms`` is treated as 0 (no growth signal) rather than poisoning the proposal.
- Wrong-length vectors (``report_timing``, ``apply_callback_slack``, ``set_window_fill_ms``,
  ``WindowReport``) raise :class:`~flodl.errors.LocalProtocolError` (our own API misuse), where the
  Rust setters silently ignore them.
- :meth:`ElChe.report_window` stages the fill only when the window is reported (an all-zero window
  leaves nothing behind).
- ``delivered_coherent`` is re-checked: the delivered scale is used only if the mode is
  ``delivered_capable``, the caller attests coherence, and every alive rank with steps has a
  delivered sample; otherwise every rank feeds the compute scale.
- Dead ranks (:meth:`ElChe.mark_dead`) get count 0, lose their trust ring, are skipped by the
  timing feed, excluded from election, from ``relax_anchor_up``'s speed spread, from the window
  cap's sum and floor and from ``has_speed_hint``; if the anchor rank dies the anchor is re-elected
  at once from the alive ranks with readings (or left unset until the next report).
  :meth:`ElChe.revive` brings a rejoined rank back with no reading (the anchor's count, then
  its first report measures it).
- :meth:`ElChe.restore` clamps the saved anchor to the configured ``max_anchor`` (knobs come from
  config on resume) and recomputes ``batch_counts`` from the restored trajectory without the dead
  zone, so a resumed run starts on proportional counts instead of equal ones.
- ``ElCheState.from_dict`` ignores unknown keys and treats a missing ``trend_history`` as ``None``.
- ``with_partition_ratios`` does not override a pin set by ``with_speed_ratio`` (the higher-priority
  hint), whatever the call order; ``with_initial_anchor`` is public for a caller's spec-prior pick.
- ``report_window`` takes ``delivered_capable`` as a required keyword (the mode's capability).
- :class:`Phase` orders by an explicit ``Phase.order`` (not ``rank``, which means a process here).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence  # (at run time: see docs/design.md §2)
from dataclasses import dataclass, field
from typing import Self

from flodl.config import DEFAULT_ANCHOR, DEFAULT_MAX_ANCHOR, DEFAULT_OVERHEAD_TARGET
from flodl.coord.elche_state import (
    BATCH_COUNTS_WINDOW_CAP,
    COHORT_BAND,
    DEAD_ZONE,
    DOMINANCE_MARGIN,
    GROWTH_REARM_STABLE,
    GROWTH_STEP_CAP,
    MAX_SPEED_RATIO,
    MISS_LIMIT,
    TRUST_WINDOW_CAP,
    WARMUP_GROWTH_MARGIN,
    ElCheState,
    IntArg,
    Phase,
    WindowReport,
    is_int,
    is_number,
)
from flodl.coord.verdicts import AnchorVerdict, NudgeDown, Stable, SuppressGrowth
from flodl.errors import ConfigError, LocalProtocolError

__all__ = [
    "TRUST_WINDOW_CAP",
    "COHORT_BAND",
    "DOMINANCE_MARGIN",
    "MAX_SPEED_RATIO",
    "BATCH_COUNTS_WINDOW_CAP",
    "GROWTH_REARM_STABLE",
    "GROWTH_STEP_CAP",
    "WARMUP_GROWTH_MARGIN",
    "DEAD_ZONE",
    "MISS_LIMIT",
    "Phase",
    "WindowReport",
    "ElCheState",
    "ElChe",
    "AnchorVerdict",
    "Stable",
    "SuppressGrowth",
    "NudgeDown",
]

_STABLE_AFTER = 5
_MATURE_AFTER = 20
_SAME_MS_EPS = 1e-6


def _round_half_away(x: float) -> int:
    """Rust's ``f64::round`` for the non-negative values used here (Python rounds half to even)."""
    return math.floor(x + 0.5) if x >= 0 else -math.floor(-x + 0.5)


@dataclass
class _Ring:
    """Trust window: the last :data:`TRUST_WINDOW_CAP` ms/batch readings of one rank."""

    samples: deque[float] = field(default_factory=lambda: deque(maxlen=TRUST_WINDOW_CAP))
    _mean: float | None = None
    """The mean of ``samples``, computed on first ask after a change: a window report asks
    each rank's a few times (election, counts, the slow cohort), at O(W) per ask."""

    def push(self, ms: float) -> None:
        self.samples.append(ms)
        self._mean = None

    def clear(self) -> None:
        self.samples.clear()
        self._mean = 0.0

    def mean(self) -> float:
        m = self._mean
        if m is None:
            s = self.samples
            m = self._mean = sum(s) / len(s) if s else 0.0
        return m


class ElChe:
    """The cadence balancer. Owned and driven by the coordinator (one thread, no locks).

    Args:
        world_size: number of ranks (≥ 1).
        anchor: initial batches per window for the anchor rank (≥ 1); 10 for the Cadence/Async
            presets, 1 for Sync.
        max_anchor: staleness cap (≥ 1).
        min_anchor: floor for growth proposals only (``None`` = the initial anchor); a
            ``NudgeDown`` bypasses it.
        overhead_target: target per-window fixed-overhead fraction, clamped to [0.01, 0.5].
        max_batch_diff: per-update clamp on count changes once calibrated (``None`` = off); also
            bounds :meth:`relax_anchor_up`.
        window_growth_applicable: ``False`` for Sync (no window to amortize): never propose growth.

    Raises:
        ConfigError: an argument is out of range; the message names it.
    """

    def __init__(
        self,
        world_size: IntArg,
        *,
        anchor: IntArg = DEFAULT_ANCHOR,
        max_anchor: IntArg = DEFAULT_MAX_ANCHOR,
        min_anchor: IntArg | None = None,
        overhead_target: float = DEFAULT_OVERHEAD_TARGET,
        max_batch_diff: IntArg | None = None,
        window_growth_applicable: bool = True,
    ) -> None:
        if not is_int(world_size) or world_size < 1:
            raise ConfigError(f"world_size must be an int >= 1, got {world_size!r}")
        if not is_int(anchor) or anchor < 1:
            raise ConfigError(f"anchor must be an int >= 1, got {anchor!r}")
        if not is_int(max_anchor) or max_anchor < 1:
            raise ConfigError(f"max_anchor must be an int >= 1, got {max_anchor!r}")
        if min_anchor is not None and (not is_int(min_anchor) or min_anchor < 1):
            raise ConfigError(f"min_anchor must be None or an int >= 1, got {min_anchor!r}")
        if not is_number(overhead_target) or not math.isfinite(overhead_target):
            raise ConfigError(f"overhead_target must be a finite number, got {overhead_target!r}")
        if max_batch_diff is not None and (not is_int(max_batch_diff) or max_batch_diff < 0):
            raise ConfigError(f"max_batch_diff must be None or an int >= 0, got {max_batch_diff!r}")
        if not isinstance(window_growth_applicable, bool):
            raise ConfigError(
                f"window_growth_applicable must be a bool, got {window_growth_applicable!r}"
            )

        floor = anchor if min_anchor is None else min_anchor
        floor = min(floor, max_anchor)
        self._world_size = world_size
        self._max_anchor = max_anchor
        self._min_anchor = floor
        self._anchor = min(max(anchor, floor), max_anchor)
        self._overhead_target = min(max(float(overhead_target), 0.01), 0.5)
        self._max_batch_diff = max_batch_diff
        self._window_growth_applicable = window_growth_applicable

        self._batch_counts = [self._anchor] * world_size
        self._rings = [_Ring() for _ in range(world_size)]
        self._misses = [0] * world_size
        self._alive = [True] * world_size
        self._counts_window: deque[list[int]] = deque(maxlen=BATCH_COUNTS_WINDOW_CAP)
        self._calibrated = False
        self._calibration_count = 0
        self._phase = Phase.PROBE
        self._anchor_rank: int | None = None
        self._speed_ratio_pinned = False
        self._max_total_batches: int | None = None
        self._window_cap_binding = False
        self._pending_slack_ms = [0.0] * world_size
        self._pending_fill_ms = [0.0] * world_size
        self._proposal: int | None = None
        self._growth_enabled = True
        self._consecutive_stable = 0

    # ------------------------------------------------------------------ accessors

    @property
    def world_size(self) -> int:
        """Number of ranks, dead ones included."""
        return self._world_size

    @property
    def anchor(self) -> int:
        """Batches the anchor rank runs per reduce window."""
        return self._anchor

    @property
    def anchor_rank(self) -> int | None:
        """The elected (or pinned) anchor rank; ``None`` until the first election."""
        return self._anchor_rank

    @property
    def batch_counts(self) -> list[int]:
        """Per-rank batches for the next window (a copy; dead ranks are 0)."""
        return list(self._batch_counts)

    @property
    def total_batches(self) -> int:
        """Sum of :attr:`batch_counts`."""
        return sum(self._batch_counts)

    @property
    def smoothed_ms(self) -> list[float]:
        """Per-rank trust-ring mean ms/batch (0 where the ring is empty)."""
        return [ring.mean() for ring in self._rings]

    def smoothed_ms_per_batch(self, rank: int) -> float | None:
        """Rank's trust-ring mean, or ``None`` when it has no reading (unlike the 0 sentinel)."""
        ring = self._rings[rank]
        return ring.mean() if ring.samples else None

    @property
    def phase(self) -> Phase:
        """Current lifecycle phase."""
        return self._phase

    @property
    def calibration_count(self) -> int:
        """Successful :meth:`report_timing` calls (restored from a checkpoint on resume)."""
        return self._calibration_count

    @property
    def calibrated(self) -> bool:
        """Whether at least one real measurement has landed."""
        return self._calibrated

    @property
    def proposal(self) -> int | None:
        """The staged grow target awaiting a verdict, or ``None``."""
        return self._proposal

    @property
    def growth_enabled(self) -> bool:
        """The growth latch: off after any non-Stable verdict until re-armed."""
        return self._growth_enabled

    @property
    def window_cap_binding(self) -> bool:
        """Whether the last recompute had to scale counts down to the window cap."""
        return self._window_cap_binding

    @property
    def max_total_batches(self) -> int | None:
        """The window cap (the epoch's batch count), ``None`` when unbounded."""
        return self._max_total_batches

    @property
    def alive(self) -> list[bool]:
        """Per-rank liveness mask (a copy)."""
        return list(self._alive)

    @property
    def overhead_target(self) -> float:
        """The clamped overhead target."""
        return self._overhead_target

    @property
    def min_anchor(self) -> int:
        """Floor for growth proposals."""
        return self._min_anchor

    @property
    def max_anchor(self) -> int:
        """Staleness cap."""
        return self._max_anchor

    @property
    def max_batch_diff(self) -> int | None:
        """Per-update count-change clamp, or ``None``."""
        return self._max_batch_diff

    @property
    def window_growth_applicable(self) -> bool:
        """``False`` under Sync: growth is never proposed."""
        return self._window_growth_applicable

    @property
    def pending_callback_slack_ms(self) -> list[float]:
        """The slack the current counts were shrunk by, undone by the next recompute (a copy;
        all zeros by default)."""
        return list(self._pending_slack_ms)

    def has_speed_hint(self) -> bool:
        """Whether the alive ranks' counts are non-uniform (epoch 0 may use proportional sizes)."""
        counts = {c for c, up in zip(self._batch_counts, self._alive, strict=True) if up}
        return len(counts) > 1

    def anchor_wall_ms(self) -> float:
        """Intended wall time of one window: ``anchor × slow_ms`` (0 if uncalibrated)."""
        if not self._calibrated:
            return 0.0
        return self._anchor * self._slow_ms()

    def recent_batch_share(self) -> list[float]:
        """Per-rank share of the counts summed over the last 10 snapshots.

        Falls back to the current counts when no snapshot exists, and to equal shares when the
        total is zero.
        """
        snapshots = list(self._counts_window) or [self._batch_counts]
        sums = [float(sum(snap[r] for snap in snapshots)) for r in range(self._world_size)]
        total = sum(sums)
        if total <= 0:
            return [1.0 / self._world_size] * self._world_size
        return [s / total for s in sums]

    def clamp_total(self, max_total: int) -> list[int]:
        """Counts scaled down to at most ``max_total`` (for an epoch's tail); state is unchanged.

        Proportional floor scaling (alive ranks keep at least 1, dead ranks stay 0), then the
        remainder goes one batch each to the first alive ranks.

        Raises:
            LocalProtocolError: ``max_total`` is negative.
        """
        if max_total < 0:
            raise LocalProtocolError(f"clamp_total: max_total must be >= 0, got {max_total}")
        total = sum(self._batch_counts)
        if total <= max_total:
            return list(self._batch_counts)
        clamped = [
            max(1, c * max_total // total) if up else 0
            for c, up in zip(self._batch_counts, self._alive, strict=True)
        ]
        remainder = max(0, max_total - sum(clamped))
        for r in range(self._world_size):
            if remainder == 0:
                break
            if self._alive[r]:
                clamped[r] += 1
                remainder -= 1
        return clamped

    # ------------------------------------------------------------------ hints and setters

    def with_speed_ratio(self, slow_rank: int, ratio: float) -> Self:
        """Cold-start hint: ``slow_rank`` runs ``anchor``, the others ``round(anchor·ratio)``.

        Pins ``slow_rank`` as the anchor rank (highest-priority hint); the pin holds through
        Probe and Warmup.

        Raises:
            ConfigError: ``slow_rank`` is out of range or ``ratio`` is not finite.
        """
        self._check_rank(slow_rank, "slow_rank")
        if not is_number(ratio) or not math.isfinite(ratio):
            raise ConfigError(f"speed ratio must be a finite number, got {ratio!r}")
        ratio = max(float(ratio), 1.0)
        for r in range(self._world_size):
            if not self._alive[r]:
                continue
            self._batch_counts[r] = (
                self._anchor if r == slow_rank else max(1, _round_half_away(self._anchor * ratio))
            )
        self._anchor_rank = slow_rank
        self._speed_ratio_pinned = True
        return self

    def with_partition_ratios(self, ratios: Sequence[float]) -> Self:
        """Pin the smallest-ratio rank (lowest index on ties) as the cold-start anchor.

        ``ratios`` is the user's explicit per-rank split (sum ≈ 1). Counts are untouched. A pin
        from :meth:`with_speed_ratio` wins.

        Raises:
            ConfigError: wrong length, a negative or non-finite ratio, or a zero sum.
        """
        values = list(ratios)
        if len(values) != self._world_size:
            raise ConfigError(
                f"partition_ratios must have {self._world_size} entries, got {len(values)}"
            )
        if not all(is_number(v) and math.isfinite(v) and v >= 0 for v in values):
            raise ConfigError(f"partition_ratios must be finite and >= 0, got {values!r}")
        if sum(values) <= 0:
            raise ConfigError("partition_ratios must not sum to 0")
        if not self._speed_ratio_pinned:
            self._anchor_rank = min(range(self._world_size), key=lambda r: (values[r], r))
        return self

    def with_initial_anchor(self, slow_rank: int) -> Self:
        """Pin ``slow_rank`` as the cold-start anchor without a ratio (e.g. a spec prior).

        Raises:
            ConfigError: ``slow_rank`` is out of range.
        """
        self._check_rank(slow_rank, "slow_rank")
        self._anchor_rank = slow_rank
        return self

    def set_max_total_batches(self, max_total: int) -> None:
        """Cap the window (``sum(batch_counts)``) at the epoch's batch count; 0 removes the cap.

        Applied by the next recompute.

        Raises:
            ConfigError: ``max_total`` is negative.
        """
        if not is_int(max_total) or max_total < 0:
            raise ConfigError(f"max_total_batches must be an int >= 0, got {max_total!r}")
        self._max_total_batches = max_total or None

    def set_window_fill_ms(self, fill_ms: Sequence[float]) -> None:
        """Stage per-rank window fill (ms), consumed once by the next proposal.

        Raises:
            LocalProtocolError: wrong length.
        """
        self._pending_fill_ms = self._per_rank(fill_ms, "fill_ms")

    def apply_callback_slack(self, slack_ms: Sequence[float]) -> None:
        """Shrink the counts of the coming window by per-rank callback wall time (ms).

        Rank ``r``'s count drops now by ``ceil(slack_ms[r] / ms[r])`` batches (never below 1),
        after whatever recompute the cycle's verdicts made, and the next recompute restores it
        (bypassing the dead zone). Deviation: the original staged the slack for the next
        recompute, where a verdict's own recompute could undo it (docs/design.md §4).

        Raises:
            LocalProtocolError: wrong length.
        """
        slack = self._per_rank(slack_ms, "slack_ms")
        for r, ms_slack in enumerate(slack):
            ms = self._rings[r].mean()
            if not self._alive[r] or ms_slack <= 0 or ms <= 0:
                continue
            self._batch_counts[r] = max(1, self._batch_counts[r] - math.ceil(ms_slack / ms))
            self._pending_slack_ms[r] = ms_slack

    def mark_dead(self, rank: int) -> None:
        """Declare ``rank`` dead (final).

        A dead rank gets count 0, loses its trust ring and miss counter, is skipped by the timing
        feed and excluded from election, the speed spread, the window cap and the speed-hint
        check. If it was the anchor rank, the anchor rank is re-elected at once from the alive
        ranks with readings (``None`` if none has one: the next report elects), and the counts
        are recomputed when a reading exists.

        Raises:
            LocalProtocolError: ``rank`` is out of range.
        """
        if not 0 <= rank < self._world_size:
            raise LocalProtocolError(f"mark_dead: rank {rank} out of range 0..{self._world_size}")
        if not self._alive[rank]:
            return
        self._alive[rank] = False
        self._rings[rank].clear()
        self._misses[rank] = 0
        self._batch_counts[rank] = 0
        self._pending_slack_ms[rank] = 0.0
        self._pending_fill_ms[rank] = 0.0
        if self._anchor_rank == rank:
            self._anchor_rank = None
            self._anchor_rank = self._elect_anchor()
        slow_ms = self._slow_ms()
        if slow_ms > 0:
            self.recompute_batch_counts(slow_ms)

    def revive(self, rank: int) -> None:
        """A dead ``rank`` rejoined (docs/design.md §2, "Rejoin"): alive again with no
        reading, so it runs the anchor's count (its calibration window) until its first
        report measures it. A no-op for a live rank.

        Raises:
            LocalProtocolError: ``rank`` is out of range.
        """
        if not 0 <= rank < self._world_size:
            raise LocalProtocolError(f"revive: rank {rank} out of range 0..{self._world_size}")
        if self._alive[rank]:
            return
        self._alive[rank] = True
        self._rings[rank].clear()
        self._misses[rank] = 0
        self._batch_counts[rank] = self._anchor
        self._recompute_if_measured()

    # ------------------------------------------------------------------ timing feed

    def report_window(self, report: WindowReport, *, delivered_capable: bool) -> None:
        """Ingest one reduce window: select the scale, stage the fill, feed :meth:`report_timing`.

        An all-zero feed (e.g. a fully idle window) reports nothing.

        Args:
            report: the window's observations.
            delivered_capable: whether the mode rides the delivered feed (CPU Cadence/Async, NCCL
                Cadence); ``False`` for Sync.

        Raises:
            LocalProtocolError: the report's length is not ``world_size``.
        """
        if len(report.wall_ms) != self._world_size:
            raise LocalProtocolError(
                f"WindowReport has {len(report.wall_ms)} ranks, ElChe has {self._world_size}"
            )
        ms, batches = report.select_feed(delivered_capable=delivered_capable, alive=self._alive)
        if not any(m > 0 for m in ms):
            return
        self.set_window_fill_ms(report.fill_ms)
        self.report_timing(ms, batches, report.sync_ms)

    def report_timing(
        self, wall_ms: Sequence[float], batches: Sequence[int], sync_ms: float
    ) -> None:
        """Report one window's measured wall (ms) and *actual* batches per rank, plus the reduce.

        Steps (docs/design.md §4): push readings into trust rings (or count misses); elect the
        anchor rank if allowed; escape a dead pinned anchor; stage a growth proposal; recompute the
        counts with the current anchor; snapshot, calibrate, advance the phase. Returns early,
        without calibrating, when no anchor rank has a reading.

        Raises:
            LocalProtocolError: a sequence's length is not ``world_size``.
        """
        walls = self._per_rank(wall_ms, "wall_ms")
        if len(batches) != self._world_size:
            raise LocalProtocolError(
                f"batches must have {self._world_size} entries, got {len(batches)}"
            )
        # 1. trust rings and miss counters
        rings, misses, isfinite = self._rings, self._misses, math.isfinite
        for r, up in enumerate(self._alive):
            if not up:
                continue
            n, wall = batches[r], walls[r]
            if n > 0 and wall > 0 and isfinite(wall):
                rings[r].push(wall / n)
                misses[r] = 0
            else:
                misses[r] += 1
                if misses[r] >= MISS_LIMIT:
                    rings[r].clear()
        # 2. election: only to make the first pick, or from Stable on (pins hold until then)
        if self._anchor_rank is None or self._phase >= Phase.STABLE:
            elected = self._elect_anchor()
            if elected is not None:
                self._anchor_rank = elected
        # 3. no anchor reading: pinned-anchor dead-window escape
        if self._anchor_rank is None:
            return
        slow_ms = self._rings[self._anchor_rank].mean()
        if slow_ms <= 0:
            if self._misses[self._anchor_rank] >= MISS_LIMIT:
                elected = self._elect_anchor()
                if elected is not None:
                    self._anchor_rank = elected
                    slow_ms = self._rings[elected].mean()
            if slow_ms <= 0:
                return
        # 4. growth proposal (from the 2nd calibration), then consume the fill
        self._proposal = None
        if self._phase >= Phase.STABLE or (
            self._phase is Phase.WARMUP and self._calibration_count >= 1
        ):
            self._proposal = self.propose_anchor(sync_ms)
        self._pending_fill_ms = [0.0] * self._world_size
        # 5. counts from the current (pre-proposal) anchor
        self.recompute_batch_counts(slow_ms)
        # 6. snapshot, calibrate, advance
        self._counts_window.append(list(self._batch_counts))
        self._calibrated = True
        self._calibration_count += 1
        self._advance_phase()

    def propose_anchor(self, sync_ms: float) -> int | None:
        """The window-pressure grow target, or ``None``; pure (nothing is staged).

        ``overhead = fixed / (anchor·marginal_b + fixed)`` with ``fixed = sync + fill_b`` for the
        anchor rank ``b``. Fires above the target from Stable, above ``2 × target`` in Warmup;
        grows by ``min(overhead/target, 2)``, clamped to ``[min_anchor, max_anchor]``. Never
        proposes under Sync, with growth latched off, with the window cap binding, or with no
        fixed cost.
        """
        if not (self._window_growth_applicable and self._growth_enabled):
            return None
        if self._window_cap_binding or self._anchor_rank is None:
            return None
        b = self._anchor_rank
        marginal_b = self._rings[b].mean()
        if marginal_b <= 0:
            return None
        reduce_ms = sync_ms if math.isfinite(sync_ms) else 0.0
        fill_b = self._pending_fill_ms[b] if math.isfinite(self._pending_fill_ms[b]) else 0.0
        fixed = max(reduce_ms, 0.0) + max(fill_b, 0.0)
        denom = self._anchor * marginal_b + fixed
        if fixed <= 0 or denom <= 0:
            return None
        overhead = fixed / denom
        if self._phase >= Phase.STABLE:
            fire_at = self._overhead_target
        else:
            fire_at = self._overhead_target * WARMUP_GROWTH_MARGIN
        if overhead <= fire_at:
            return None
        scale = min(overhead / self._overhead_target, GROWTH_STEP_CAP)
        new = min(max(math.ceil(self._anchor * scale), self._min_anchor), self._max_anchor)
        return new if new > self._anchor else None

    def recompute_batch_counts(self, slow_ms: float) -> None:
        """Recompute per-rank counts from the anchor and the smoothed speeds.

        Target ``anchor`` for the anchor's speed (or no reading), else
        ``max(1, round(anchor·min(slow_ms/ms, 64)))``, minus the callback slack in batches.
        Applied when outside the 5 % dead zone, before calibration, or with slack; clamped to
        ``±max_batch_diff`` once calibrated. Then the window cap, then the slack is consumed.

        Raises:
            LocalProtocolError: ``slow_ms`` is not a positive finite number.
        """
        if not (slow_ms > 0 and math.isfinite(slow_ms)):
            raise LocalProtocolError(f"recompute_batch_counts: bad slow_ms {slow_ms!r}")
        counts, rings, slack = self._batch_counts, self._rings, self._pending_slack_ms
        anchor, calibrated = self._anchor, self._calibrated
        clamp = self._max_batch_diff if calibrated else None
        for r, up in enumerate(self._alive):
            if not up:
                counts[r] = 0
                continue
            ms = rings[r].mean()
            if ms <= 0 or abs(ms - slow_ms) < _SAME_MS_EPS:
                target = anchor
            else:
                ratio = slow_ms / ms
                if ratio > MAX_SPEED_RATIO:  # (min/max of two as comparisons: 8× cheaper)
                    ratio = float(MAX_SPEED_RATIO)
                target = _round_half_away(anchor * ratio)
                if target < 1:
                    target = 1
            current = counts[r]
            if (
                abs(target - current) > DEAD_ZONE * current
                or not calibrated
                or slack[r] > 0  # a slack-shrunk count is always restored
            ):
                if clamp is not None:
                    if target > current:
                        target = min(current + clamp, target)
                    else:
                        target = max(current - clamp, target, 1)
                counts[r] = target
        self._apply_window_cap()
        self._pending_slack_ms = [0.0] * self._world_size

    # ------------------------------------------------------------------ verdict seam

    def apply_verdict(self, verdict: AnchorVerdict | object) -> None:
        """Apply a verdict from any producer (guard, meta-controller): the one seam. (Typed
        wider than :data:`AnchorVerdict` so that the compiled core, which checks a declared
        union at the call, also answers another object with the error below: a guard may be
        the user's; docs/design.md §2.)

        - ``Stable(relax_up)``: commit the staged proposal (anchor = proposal, recompute); if
          ``relax_up``, :meth:`relax_anchor_up`; one more consecutive Stable, re-arming growth at
          :data:`GROWTH_REARM_STABLE`.
        - ``SuppressGrowth()``: drop the proposal (veto); anchor unchanged; growth latched off and
          the Stable streak reset.
        - ``NudgeDown(factor)``: drop the proposal *before* :meth:`nudge_anchor_down`; growth
          latched off and the Stable streak reset.

        Raises:
            LocalProtocolError: ``verdict`` is not one of the three verdict types.
        """
        match verdict:
            case Stable(relax_up=relax_up):
                self._consecutive_stable += 1
                if self._consecutive_stable >= GROWTH_REARM_STABLE:
                    self._growth_enabled = True
                proposal, self._proposal = self._proposal, None
                if proposal is not None:
                    self._anchor = proposal
                    self._recompute_if_measured()
                if relax_up:
                    self.relax_anchor_up()
            case SuppressGrowth():
                self._latch_growth_off()
            case NudgeDown(factor=factor):
                # Discard first: a proposal computed from the pre-nudge anchor must never be
                # committed over the nudge by a later Stable.
                self._latch_growth_off()
                self.nudge_anchor_down(factor)
            case _:
                raise LocalProtocolError(f"apply_verdict: not a verdict: {verdict!r}")

    def nudge_anchor_down(self, factor: float) -> None:
        """``anchor = min(anchor, max(1, ceil(anchor·clamp(factor, 0.1, 1))))``; recompute.

        Bypasses ``min_anchor`` (divergence outranks the overhead floor). A non-finite factor is
        ignored.
        """
        if not math.isfinite(factor):
            return
        f = min(max(factor, 0.1), 1.0)
        self._anchor = min(self._anchor, max(1, math.ceil(self._anchor * f)))
        self._recompute_if_measured()

    def relax_anchor_up(self) -> None:
        """Drift the anchor up by one batch; recompute.

        No-op at ``max_anchor``. With ``max_batch_diff = M``, refused when the projected spread
        ``round((anchor+1)·max_ms/min_ms) − (anchor+1)`` over the alive ranks would exceed ``M``.
        """
        if self._anchor >= self._max_anchor:
            return
        if self._max_batch_diff is not None:
            speeds = [ring.mean() for ring, up in zip(self._rings, self._alive, strict=True) if up]
            positive = [s for s in speeds if s > 0]
            if positive:
                new = self._anchor + 1
                fast = max(1, _round_half_away(new * max(positive) / min(positive)))
                if max(0, fast - new) > self._max_batch_diff:
                    return
        self._anchor += 1
        self._recompute_if_measured()

    # ------------------------------------------------------------------ checkpoint

    def to_state(self) -> ElCheState:
        """Snapshot the trajectory for a checkpoint (``trend_history`` is left ``None``)."""
        return ElCheState(
            anchor=self._anchor,
            anchor_rank=self._anchor_rank,
            smoothed_ms_per_batch=self.smoothed_ms,
            phase=self._phase.value,
            calibration_count=self._calibration_count,
            trend_history=None,
        )

    def restore(self, state: ElCheState) -> None:
        """Restore a trajectory saved by :meth:`to_state` (the knobs stay as configured).

        Each rank's trust ring is seeded with one sample equal to the saved mean (none for 0),
        ``calibrated = any(saved > 0)``, the anchor is clamped to ``max_anchor``, and the counts
        are recomputed from the restored speeds without the dead zone. The transient proposal,
        fill and slack are cleared; the growth latch and ``window_growth_applicable`` are left
        alone. ``trend_history`` belongs to the guard and is ignored here.

        Raises:
            ConfigError: the saved world size differs, or ``anchor_rank`` is out of range.
        """
        saved = list(state.smoothed_ms_per_batch)
        if len(saved) != self._world_size:
            raise ConfigError(
                f"smoothed_ms_per_batch has {len(saved)} ranks but world_size is "
                f"{self._world_size}; resume must use the saved run's world size"
            )
        if state.anchor_rank is not None and not 0 <= state.anchor_rank < self._world_size:
            raise ConfigError(
                f"anchor_rank {state.anchor_rank} out of range for world_size {self._world_size}"
            )
        self._anchor = min(state.anchor, self._max_anchor)
        self._anchor_rank = state.anchor_rank
        self._phase = Phase(state.phase)
        self._calibration_count = state.calibration_count
        for r, mean in enumerate(saved):
            self._rings[r].clear()
            self._misses[r] = 0
            if mean > 0 and self._alive[r]:
                self._rings[r].push(float(mean))
        self._proposal = None
        self._pending_fill_ms = [0.0] * self._world_size
        self._pending_slack_ms = [0.0] * self._world_size
        if self._anchor_rank is None or not self._alive[self._anchor_rank]:
            # dead at the save, or dropped by a resize (ElCheState.resized): elect among the
            # ranks with readings
            self._anchor_rank = None
            self._anchor_rank = self._elect_anchor()
        self._calibrated = False
        self._batch_counts = [self._anchor if up else 0 for up in self._alive]
        slow_ms = self._slow_ms()
        if slow_ms > 0:
            self.recompute_batch_counts(slow_ms)
        self._calibrated = any(mean > 0 for mean in saved)

    # ------------------------------------------------------------------ internals

    def _check_rank(self, rank: int, name: str) -> None:
        if not is_int(rank) or not 0 <= rank < self._world_size:
            raise ConfigError(f"{name} must be in 0..{self._world_size - 1}, got {rank!r}")

    def _per_rank(self, values: Sequence[float], name: str) -> list[float]:
        if len(values) != self._world_size:
            raise LocalProtocolError(
                f"{name} must have {self._world_size} entries, got {len(values)}"
            )
        return [float(v) for v in values]

    def _slow_ms(self) -> float:
        return 0.0 if self._anchor_rank is None else self._rings[self._anchor_rank].mean()

    def _slow_cohort(self, means: Sequence[float]) -> list[int]:
        """The live ranks within :data:`COHORT_BAND` of the slowest, by ``means``: each rank's
        trust-window mean, read once per election where each use asked its ring again."""
        alive = [r for r, up in enumerate(self._alive) if up]
        max_ms = max((means[r] for r in alive), default=0.0)
        if max_ms <= 0:
            return []
        threshold = max_ms * (1.0 - COHORT_BAND)
        return [r for r in alive if means[r] >= threshold]

    def _elect_anchor(self) -> int | None:
        means = self.smoothed_ms
        cohort = self._slow_cohort(means)
        if not cohort:
            return None
        if len(cohort) == 1:
            return cohort[0]
        sitting = self._anchor_rank
        if sitting is not None and sitting in cohort:
            # Slowest challenger; the lowest index wins among equals.
            slowest, neg_rank = max((means[r], -r) for r in cohort if r != sitting)
            if slowest > means[sitting] * (1.0 + DOMINANCE_MARGIN):
                return -neg_rank
            return sitting
        return min(cohort)

    def _recompute_if_measured(self) -> None:
        slow_ms = self._slow_ms()
        if slow_ms > 0:
            self.recompute_batch_counts(slow_ms)

    def _apply_window_cap(self) -> None:
        self._window_cap_binding = False
        cap = self._max_total_batches
        if cap is None:
            return
        alive = [r for r in range(self._world_size) if self._alive[r]]
        total = sum(self._batch_counts[r] for r in alive)
        if total <= cap:
            return
        self._window_cap_binding = True
        for r in alive:
            # The per-rank floor of 1 wins over the cap when there are more ranks than batches.
            self._batch_counts[r] = max(1, self._batch_counts[r] * cap // total)
        remainder = cap - sum(self._batch_counts[r] for r in alive)
        if remainder > 0:
            largest = max(alive, key=lambda r: (self._batch_counts[r], -r))
            self._batch_counts[largest] += remainder

    def _latch_growth_off(self) -> None:
        self._proposal = None
        self._consecutive_stable = 0
        self._growth_enabled = False

    def _advance_phase(self) -> None:
        if self._phase is Phase.PROBE:
            self._phase = Phase.WARMUP
        elif self._phase is Phase.WARMUP and self._calibration_count >= _STABLE_AFTER:
            self._phase = Phase.STABLE
        elif self._phase is Phase.STABLE and self._calibration_count >= _MATURE_AFTER:
            self._phase = Phase.MATURE
