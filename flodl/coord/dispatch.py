"""Dispatch: epochs, the work each rank is handed, and the count gate over it.

Pure module (docs/design.md §2, §5). One :class:`~flodl.coord.ledger.EpochWork` per open epoch
is the source of truth for coverage; this module decides what goes into it:

* **epochs** open in order; barrier-paced modes keep one open at a time, Async may open the next
  one while the last chunks of the current are still in flight. Closing an epoch audits its
  ledger (the coordinator raises a critical ``coverage`` alert if it broke);
* **whole-epoch partitions** (Sync by default) are assigned when the epoch opens, in proportion
  to measured speeds where the mode says so; a dead rank's uncommitted share is split among the
  survivors (``extend_partition``); a rank that joins mid-epoch gets a share of what the
  others have not trained yet (``revoke_partition``, then ``extend_partition``: the ranks give
  back the untrained tail of their queue and say how much, so nothing started is ever moved);
* **progressive chunks** (Cadence, Async) are handed one at a time: barrier-paced modes hold a
  rank with work in flight or during a pending cycle, never cross a reduce barrier, and serve
  the epoch's final window from a plan pinned per (epoch, cohort version); Async counts work
  already handed out against the window budget plus its overshoot. A dead rank's uncommitted
  chunk returns to the pool;
* **the count gate** (:class:`~flodl.coord.gate.CountGate`): Sync needs one step per live rank,
  progressive Cadence the rank's chunk done (one chunk is one window, and a final-window slot
  may be one batch above the count), otherwise the rank's batch count; a quiesced rank always
  counts as done.

Choices: the Async overshoot is the 0.5.3 rule (3, +1 per Stable verdict up to
``clamp(epoch_batches / 50, 3, 10)``, reset on any other verdict) unless ``max_overshoot`` is
set.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from flodl.config import CoordConfig
from flodl.coord.cycle import Cycle, RankWindow
from flodl.coord.effects import Effect, Record, Send
from flodl.coord.elche import ElChe
from flodl.coord.gate import CountGate
from flodl.coord.ledger import (
    BatchRange,
    CoverageReport,
    EpochWork,
    from_samples,
    range_total,
    to_samples,
)
from flodl.coord.membership import Membership
from flodl.coord.outbound import built_plan, built_start_epoch
from flodl.coord.partition import (
    carve_ranges,
    chunk_batches,
    final_window_alloc,
    partition_sizes,
    split_among,
    window_chunk,
)
from flodl.coord.resume import ResumeState
from flodl.errors import LocalProtocolError, RemoteProtocolError
from flodl.sampling import epoch_batches
from flodl.wire.frames import (
    Batch,
    EpochPlan,
    ExtendPartition,
    PartitionRevoked,
    RevokePartition,
)

__all__ = ["Dispatch", "ClosedEpoch", "OVERSHOOT_INITIAL"]

OVERSHOOT_INITIAL = 3
"""The Async overshoot budget before any Stable verdict."""

EpochOpened = Callable[[int, list[Effect]], None]
"""Called when an epoch opens, before any of its work is sent (the callbacks of the epoch that
just ended must reach the role rank first: FIFO on its control connection)."""


@dataclass(frozen=True, slots=True)
class ClosedEpoch:
    """An epoch whose every batch was committed."""

    epoch: int
    coverage: CoverageReport
    started_at: float


class Dispatch:
    """Who trains which batches.

    Args:
        config: the run's configuration.
        membership: the roster (who is alive).
        elche: the cadence controller (batch counts, speeds).
        cycle: the averaging cycle (a pending cycle holds barrier-paced dispatch).
        windows: each rank's averaging window (steps since the last trigger).
        on_epoch_opened: see :data:`EpochOpened`.
    """

    def __init__(
        self,
        config: CoordConfig,
        membership: Membership,
        elche: ElChe,
        cycle: Cycle,
        windows: Sequence[RankWindow],
        on_epoch_opened: EpochOpened,
    ) -> None:
        el = config.elche
        self.config = config
        self.traits = el.traits
        self.progressive = config.progressive
        self.membership = membership
        self._is_alive = membership.liveness.is_alive  # (every batch asks it: bound once)
        self.elche = elche
        self.cycle = cycle
        self.windows = windows
        self._on_epoch_opened = on_epoch_opened
        self._bs = config.batch_size
        self._barrier = self.traits.barrier_paced
        self.works: dict[int, EpochWork] = {}
        self.epoch_started_at: dict[int, float] = {}
        self.final_plans: dict[int, tuple[int, list[int] | None]] = {}
        """epoch → (cohort version, the final-window slots, or None: the window that version
        opened is not the epoch's final one)."""
        self.next_epoch = 0
        self.last_aggregated = -1
        self.first_epoch = 0
        """The first epoch this run opens (a resumed run skips the epochs the earlier one
        closed, and their callbacks)."""
        self.coverage_log: dict[int, CoverageReport] = {}
        self.max_overshoot = el.max_overshoot if el.max_overshoot is not None else OVERSHOOT_INITIAL
        self.gate = CountGate(config.world_size)
        self._gate_stale = False
        """The cohort changed since the gate's flags were computed (see invalidate_cohort)."""
        self._cohort_cache: tuple[list[int], list[bool], int] | None = None
        self._cohort_version = 0
        self._calibrating = False
        """ElChe has no measurement nor hint yet (cached with the cohort)."""
        self._whole_chunk = self.progressive and self.traits.chunk_is_window  # chunk = window
        self._extends = self._barrier and self._whole_chunk
        self._ext_cycle = -1
        self._ext_holding: set[int] = set()
        """Ranks holding a calibration extension in the window after cycle ``_ext_cycle``."""
        self._resume_epoch: int | None = None
        self._resume_uncovered: list[BatchRange] | None = None
        self.revoking: dict[tuple[int, int], list[BatchRange]] = {}
        """(rank, epoch) → the ranges that rank was asked to give back and has not answered."""
        self.wants: dict[int, dict[int, int]] = {}
        """epoch → rank → batches a re-split owes it, filled from what others give back."""
        self._given: dict[int, dict[int, int]] = {}
        """epoch → rank → batches the re-split in progress gave it (its record)."""

    # ------------------------------------------------------------------ queries
    @property
    def cohort_version(self) -> int:
        """Bumped whenever ElChe's counts or the live set may have changed."""
        return self._cohort_version

    @property
    def barrier_paced(self) -> bool:
        """The mode hands a rank no work while it holds some or a cycle is pending."""
        return self._barrier

    @property
    def overshoot(self) -> int:
        """Steps a rank may take past its count in a window: ``max_overshoot`` where the mode
        allows overshoot (Async), else 0; the window budget is ``count + overshoot``."""
        return self.max_overshoot if self.traits.overshoot else 0

    def in_flight(self, rank: int) -> int:
        """Batches handed to ``rank`` and not yet trained, over every open epoch."""
        works = self.works
        if len(works) == 1:  # the common case (barrier-paced runs have one open epoch)
            for w in works.values():
                return w.in_flight(rank)
        return sum(w.in_flight(rank) for w in works.values())

    def _in_flight_reader(self) -> Callable[[int], int]:
        """:meth:`in_flight`, bound to the ledger when one epoch is open (one call, not three)."""
        works = self.works
        return next(iter(works.values())).in_flight if len(works) == 1 else self.in_flight

    def coverage(self, epoch: int) -> CoverageReport | None:
        """The coverage report of a finished epoch (checked when it closed), or of an open one."""
        if epoch in self.works:
            return self.works[epoch].coverage_report()
        return self.coverage_log.get(epoch)

    def first_unassigned(self) -> EpochWork | None:
        """The lowest open epoch with unassigned work (epochs are opened in order, so the
        dict's insertion order is ascending)."""
        for w in self.works.values():
            if w.remaining() > 0:
                return w
        return None

    def current(self) -> EpochWork | None:
        """The lowest open epoch."""
        return self.works[min(self.works)] if self.works else None

    def epoch_batches(self, epoch: int) -> int:
        c = self.config
        return epoch_batches(epoch, c.index_space, c.batch_size, c.epoch_splits)

    def snapshot(self, rank: int) -> dict[int, int]:
        """``rank``'s done count per open epoch (what a cycle it enters will commit)."""
        return {e: w.done(rank) for e, w in self.works.items()}

    # ------------------------------------------------------------------ the count gate
    def cohort(self) -> tuple[list[int], list[bool], int]:
        """(counts ≥ 1 for ranks that train and 0 for the others — dead, or rejoined and
        awaiting the consensus —, that mask, Σ counts), cached until ElChe's counts or the
        membership change (reading them per dispatch would be O(W))."""
        if self._cohort_cache is None:
            alive = self.membership.training_mask()
            counts = [  # (max(1, c) as a conditional: the builtin costs 8× it on 3.11)
                (c if c > 1 else 1) if a else 0
                for c, a in zip(self.elche.batch_counts, alive, strict=True)
            ]
            self._cohort_cache = (counts, alive, sum(counts))
            self._calibrating = not (self.elche.calibrated or self.elche.has_speed_hint())
        return self._cohort_cache

    def invalidate_cohort(self) -> None:
        """ElChe's counts or the live set changed: drop the cache; the count gate is rebuilt
        on its next read (a finalize hands every rank its next chunk first, which would
        otherwise set every rank's flags twice)."""
        self._cohort_cache = None
        self._cohort_version += 1
        self._gate_stale = True

    def _fresh_gate(self) -> CountGate:
        """The count gate, rebuilt first if the cohort changed since it was."""
        if self._gate_stale:
            self.refresh_all()
        return self.gate

    def refresh(self, rank: int, in_flight: int = -1) -> None:
        """Recompute ``rank``'s count-gate flags (nothing while the gate awaits its rebuild,
        which computes them); ``in_flight``: its count if the caller just took it, else -1."""
        if self._gate_stale:
            return
        live = self._is_alive(rank)
        if not live:
            self.gate.set(rank, live=False, sat=False, moved=False)
            return
        steps = self.windows[rank].window.steps
        quiesced = (in_flight if in_flight >= 0 else self.in_flight(rank)) == 0
        if self._whole_chunk:  # (the window is done when its chunk is, never in its middle)
            sat = quiesced
        else:
            need = 1 if self.traits.one_step_gate else self.cohort()[0][rank]
            sat = steps >= need or quiesced
        self.gate.set(rank, live=True, sat=sat, moved=steps > 0)

    def refresh_all(self) -> None:
        """Every rank's count-gate flags by :meth:`refresh`'s rule, in one pass (per cycle)."""
        self._gate_stale = False
        n = self.config.world_size
        sat, moved = [False] * n, [False] * n  # (a rank not alive: both cleared)
        windows, in_flight = self.windows, self._in_flight_reader()
        whole = self._whole_chunk
        need = [1] * n if self.traits.one_step_gate else self.cohort()[0]
        for r in self.membership.alive():
            steps = windows[r].window.steps
            quiesced = in_flight(r) == 0
            sat[r] = quiesced if whole else steps >= need[r] or quiesced
            moved[r] = steps > 0
        self.gate.load(self.membership.alive_count(), sat, moved)

    def gate_open(self) -> bool:
        """Whether the count gate says a cycle may start."""
        return self._fresh_gate().ready() and self.gate.open(self.membership.alive_count())

    # ------------------------------------------------------------------ epochs
    def open_epoch(self, epoch: int, now: float, out: list[Effect]) -> EpochWork:
        """Open ``epoch`` (or return it if open): its ledger, then — whole-epoch partitions —
        every rank's share."""
        work = self.works.get(epoch)
        if work is not None:
            return work
        uncovered = self._resume_uncovered if epoch == self._resume_epoch else None
        work = EpochWork(
            epoch, self.epoch_batches(epoch), self.config.world_size, uncovered=uncovered
        )
        self.works[epoch] = work
        self.epoch_started_at[epoch] = now
        self.next_epoch = max(self.next_epoch, epoch + 1)
        self.elche.set_max_total_batches(max(1, work.total_batches))
        self.invalidate_cohort()
        self._on_epoch_opened(epoch, out)
        if not self.progressive:
            self._partition(work, out)
        return work

    def _shares(self, total: int) -> list[int]:
        """Each rank's partition of ``total`` batches: the training ranks', by the mode's
        rule (ratios, measured speeds where the mode says so, else equal)."""
        calibrated = self.elche.calibrated or self.elche.has_speed_hint()
        return partition_sizes(
            total,
            self.config.world_size,
            alive=self.membership.training_mask(),
            ms_per_batch=self.elche.smoothed_ms if calibrated else None,
            ratios=self.config.elche.partition_ratios,
            proportional=self.traits.speed_proportional and calibrated,
        )

    def _partition(self, work: EpochWork, out: list[Effect]) -> None:
        sizes = self._shares(work.remaining())
        for rank, ranges in enumerate(carve_ranges(work.unassigned_ranges(), sizes)):
            for rng in ranges:
                work.assign(rank, rng)
                plan = self.plan(work.epoch, rng)
                out.append(Send(rank, built_start_epoch(plan)))
            self.refresh(rank)

    def plan(self, epoch: int, rng: BatchRange) -> EpochPlan:
        offset, size = to_samples(rng, self._bs)
        return built_plan(epoch, offset, size)

    def pop_done_epoch(self) -> ClosedEpoch | None:
        """Close the lowest open epoch if every batch of it is committed."""
        if not self.works:
            return None
        first = min(self.works)
        if not self.works[first].is_done():
            return None
        work = self.works.pop(first)
        self.wants.pop(first, None)
        self._given.pop(first, None)
        report = work.coverage_report()
        self.coverage_log[first] = report
        self.final_plans.pop(first, None)
        self.last_aggregated = first
        return ClosedEpoch(first, report, self.epoch_started_at.pop(first, 0.0))

    # ------------------------------------------------------------------ progressive chunks
    def dispatch(self, rank: int, now: float, out: list[Effect]) -> EpochPlan | None:
        """Give ``rank`` its next progressive chunk if the pacing rules allow (``start_epoch``);
        the plan is also returned."""
        plan = self.take_chunk(rank, now, out)
        if plan is not None:
            out.append(Send(rank, built_start_epoch(plan)))
        return plan

    def dispatch_idle(self, now: float, out: list[Effect]) -> None:
        """Progressive: a chunk for every live rank that holds none."""
        if not self.progressive:
            return
        for r in self.membership.alive():
            if self.in_flight(r) == 0:
                self.dispatch(r, now, out)

    def take_chunk(self, rank: int, now: float, out: list[Effect]) -> EpochPlan | None:
        """Take ``rank``'s next progressive chunk from the ledger (not sent: the caller sends it,
        alone or folded into an ``update``); None when the pacing rules hold it."""
        return self.take_chunks((rank,), now, out).get(rank)

    def take_chunks(
        self, ranks: Iterable[int], now: float, out: list[Effect]
    ) -> dict[int, EpochPlan]:
        """:meth:`take_chunk` for each of ``ranks`` in turn, in one pass: what is the same for
        all of them (the pacing mode, the cohort, the epoch served) is read once, not per rank
        (docs/design.md §2, "Coordinator cost"). Ranks the pacing rules hold get no entry."""
        plans: dict[int, EpochPlan] = {}
        barrier = self._barrier
        if barrier and self.cycle.pending:
            return plans
        refresh, plan = self.refresh, self.plan
        in_flight = self._in_flight_reader()
        windows = self.windows
        overshoot = self.overshoot
        # (the cohort's mask is Membership.trains per rank: a change of it invalidates the cohort)
        counts, trains, sum_counts = self.cohort()
        calibrated = not self._calibrating  # (cached with the cohort)
        world_size = self.config.world_size
        work: EpochWork | None = None
        slots: list[int] | None = None  # the epoch's pinned final-window slots (barrier-paced)
        for rank in ranks:
            if not trains[rank]:
                continue
            held = in_flight(rank)
            if barrier and held > 0:
                continue
            # Work already handed out counts against the window budget: without this an Async
            # rank would pile up a chunk per finalize and the overshoot bound would not hold.
            steps = windows[rank].window.steps + held
            count = counts[rank]
            rank_sum = sum_counts  # (this rank's, even if it opens an epoch below)
            extension = steps >= count + overshoot
            if extension and not self._may_extend(rank):
                continue
            if work is None or (remaining := work.remaining()) == 0:
                work = self.first_unassigned()
                if work is None:
                    if barrier or self.next_epoch >= self.config.total_epochs:
                        break  # nothing unassigned, and nothing to open: no rank gets a chunk
                    work = self.open_epoch(self.next_epoch, now, out)
                    counts, trains, sum_counts = self.cohort()  # opening invalidated it
                    in_flight = self._in_flight_reader()  # (another epoch is open)
                    calibrated = not self._calibrating
                    if work.remaining() == 0:
                        work = None
                        continue
                remaining = work.remaining()
                # Pinned once per (epoch, cohort version): the same for every rank served
                # from this epoch (the list is the pin itself, so the slots taken below show).
                slots = self._final_slots(work) if barrier else None
            final_slot = None if slots is None else slots[rank]
            if extension:
                # one batch at a time, and never into the epoch's final-window band: the pool
                # keeps what the closing windows need
                if final_slot is not None or remaining <= self._final_band():
                    continue
                size = 1
            elif barrier and final_slot is None:
                size = window_chunk(count, steps, remaining)
            else:
                size = chunk_batches(
                    barrier_paced=barrier,
                    count=count,
                    steps_in_window=steps,
                    remaining=remaining,
                    sum_counts=rank_sum,
                    final_slot=final_slot,
                    max_overshoot=overshoot,
                    calibrated=calibrated,
                    world_size=world_size,
                    total_batches=work.total_batches,
                    checked=False,  # (every value read from the ledger and the cohort)
                )
            if size <= 0:
                continue
            rng = work.take(rank, size)
            if rng is None:
                continue
            if extension:
                self._ext_holding.add(rank)
            refresh(rank)  # (nothing while the gate awaits a finalize's rebuild)
            if final_slot is not None and slots is not None:
                slots[rank] = max(0, slots[rank] - rng.size)
            plans[rank] = plan(work.epoch, rng)
        return plans

    def window_spent(self, rank: int) -> bool:
        """Whether the pacing rules hand ``rank``, which holds no work, nothing before the next
        finalize: its window's budget is spent (``steps ≥ count + overshoot``, as
        :meth:`take_chunks` has it) and no calibration fill applies. O(1): every rank asks it
        once per cycle in the barrier-paced modes (docs/design.md §2, "Coordinator cost")."""
        if self.windows[rank].window.steps < self.cohort()[0][rank] + self.overshoot:
            return False
        return not self._may_extend(rank)

    def _may_extend(self, rank: int) -> bool:
        """Whether ``rank``, done with its window's chunk, may train one more batch of it: in
        the calibration window only (progressive Cadence before ElChe's first measurement),
        while another rank still trains its first chunk, so the fast ranks fill the wait for
        the slow one (docs/design.md §5, "Calibration fill"). O(1): the count gate's
        unsatisfied ranks are exactly the ranks holding work."""
        if not self._extends:
            return False
        self.cohort()
        if not self._calibrating:
            return False
        if self._ext_cycle != self.cycle.number:  # a new window: nobody is extending yet
            self._ext_cycle = self.cycle.number
            self._ext_holding.clear()
        gate = self._fresh_gate()
        self.refresh(rank)  # its own flag may predate the batch that emptied its chunk
        return gate.unsatisfied - len(self._ext_holding) > 0

    def _final_band(self) -> int:
        """The pool size below which an epoch's window is final: Σ counts + W, as
        final_window_due() has it, without its O(W) sum (Σ counts is cached with the cohort)."""
        return self.cohort()[2] + self.config.world_size

    def _final_slots(self, work: EpochWork) -> list[int] | None:
        """Every rank's slot in the epoch's final window, or None when the window is not final.

        Decided once per (epoch, cohort version) — a window, since every finalize bumps the
        version — from the pool as the window's first chunk found it: a window that did not
        start final stays so for the ranks that ask later, who get their full counts, instead
        of a final plan computed from what the first ranks left (docs/design.md §5). The list
        returned is the pin: a chunk taken against a slot is subtracted from it in place."""
        counts, alive, _ = self.cohort()
        key = self._cohort_version
        pinned = self.final_plans.get(work.epoch)
        if pinned is None or pinned[0] != key:
            rem = work.remaining()
            due = 0 < rem < self._final_band()
            pinned = (key, final_window_alloc(rem, counts, alive) if due else None)
            self.final_plans[work.epoch] = pinned
        return pinned[1]

    # ------------------------------------------------------------------ batches, commits, deaths
    def on_batch(self, batch: Batch) -> int:
        """A rank trained a batch of its oldest assigned range; returns the batches it holds
        in flight now (:meth:`in_flight`, counted once per batch).

        Raises:
            RemoteProtocolError: the rank was given no work of that epoch (it is evicted).
        """
        rank = batch.rank
        work = self.works.get(batch.epoch)
        try:  # (advance refuses a step beyond the batches in flight: one call, not two)
            left = -1 if work is None else work.advance(rank)
        except LocalProtocolError:  # (and the rank is in range, as every frame's sender is)
            left = -1
        if left < 0:
            raise RemoteProtocolError(
                f"rank {rank} trained a batch of epoch {batch.epoch} it was not given", rank=rank
            )
        if len(self.works) > 1:  # (another epoch is open too: count them all)
            left = self.in_flight(rank)
        if left == 0 and rank in self._ext_holding:
            self._ext_holding.discard(rank)
        return left

    def commit(self, rank: int, snapshot: dict[int, int]) -> None:
        """Commit ``rank``'s work up to its snapshot (a finalized cycle folded it in)."""
        works = self.works
        for e, done in snapshot.items():
            work = works.get(e)
            if work is not None:
                work.commit_upto(rank, done, clamp=True)

    def forfeit(self, rank: int, out: list[Effect], *, redistribute: bool = True) -> None:
        """Return the dead rank's uncommitted work: to the pool (progressive, or when the run
        is shutting down), else split among survivors with ``extend_partition``."""
        alive = self.membership.training()
        self._ext_holding.discard(rank)
        for _, work in sorted(self.works.items()):
            returned = work.forfeit(rank)
            if not returned or self.progressive or not alive or not redistribute:
                continue
            for survivor, piece in split_among(returned, alive):
                self._extend(work, survivor, piece, out)
        for key in [k for k in self.revoking if k[0] == rank]:
            del self.revoking[key]  # (what it was asked to give back was forfeited above)
        for wants in self.wants.values():
            wants.pop(rank, None)
        for epoch in list(self.wants):  # its answer may have been the last one awaited
            self._maybe_close_resplit(epoch, out)

    def _extend(self, work: EpochWork, rank: int, piece: BatchRange, out: list[Effect]) -> None:
        """Append ``piece`` of the pool to ``rank``'s partition (``extend_partition``)."""
        work.assign(rank, piece)
        self.refresh(rank)
        offset, size = to_samples(piece, self._bs)
        out.append(
            Send(
                rank,
                ExtendPartition(epoch=work.epoch, partition_offset=offset, partition_size=size),
            )
        )

    # ------------------------------------------------------------------ re-partitioning
    def rebalance(self, out: list[Effect]) -> None:
        """Whole-epoch partitions: re-split each open epoch's untrained work over the ranks
        that train now (a rank joined mid-epoch, docs/design.md §2 "Rejoin").

        Each rank's holding is its untrained work, less what it was asked to give back, plus
        what it is owed. Ranks above their share are asked for the excess
        (``revoke_partition``, the tail of their queue); ranks below it are owed the
        difference, which they get from what the others give back (:meth:`on_revoked`). A rank
        with a revoke still unanswered in that epoch is asked for nothing more."""
        if self.progressive:
            return
        training = self.membership.training()
        if len(training) < 2:
            return
        for epoch, work in sorted(self.works.items()):
            wants = self.wants.setdefault(epoch, {})
            held = {
                r: work.in_flight(r)
                - range_total(self.revoking.get((r, epoch), ()))
                + wants.get(r, 0)
                for r in training
            }
            sizes = self._shares(sum(held.values()))
            asked: list[list[int]] = []
            for r in training:
                gap = sizes[r] - held[r]
                if gap > 0:
                    wants[r] = wants.get(r, 0) + gap
                elif gap < 0 and (r, epoch) not in self.revoking:
                    asked.append([r, self._revoke(work, r, -gap, out)])
            out.append(
                Record(
                    "root",
                    "repartition",
                    {
                        "epoch": epoch,
                        "untrained": sum(held.values()),
                        "ranks": training,
                        "asked": asked,
                        "owed": sorted([r, n] for r, n in wants.items()),
                    },
                )
            )
            # nobody asked (nothing untrained, or every rank at its share): nothing will come
            self._maybe_close_resplit(epoch, out)

    def _revoke(self, work: EpochWork, rank: int, batches: int, out: list[Effect]) -> int:
        """Ask ``rank`` for the last ``batches`` of its untrained queue, one request per
        queued range the tail spans; how many batches were asked for."""
        wanted = batches
        asked: list[BatchRange] = []
        for rng in reversed(work.outstanding(rank)):
            if batches <= 0:
                break
            take = min(batches, rng.size)
            piece = BatchRange(rng.stop - take, rng.stop)
            asked.append(piece)
            batches -= take
            offset, size = to_samples(piece, self._bs)
            out.append(
                Send(
                    rank,
                    RevokePartition(epoch=work.epoch, partition_offset=offset, partition_size=size),
                )
            )
        if asked:
            self.revoking[(rank, work.epoch)] = asked
        return wanted - batches

    def on_revoked(self, frame: PartitionRevoked, out: list[Effect], *, redistribute: bool) -> None:
        """A rank answered ``revoke_partition``: what it dropped returns to the pool and goes
        to the ranks owed work (what they are not owed, equally to every training rank); it
        stays in the pool when the run is stopping (``redistribute`` False).

        Raises:
            RemoteProtocolError: an answer to a revoke the rank was not sent, or one that drops
                more than asked or batches it already reported trained (it is evicted).
        """
        rank, epoch, bs = frame.rank, frame.epoch, self._bs
        key = (rank, epoch)
        asked = self.revoking.get(key, [])
        try:
            rng = from_samples(frame.partition_offset, frame.partition_size, bs)
            dropped = from_samples(0, frame.revoked_size, bs).size
        except LocalProtocolError as exc:
            raise RemoteProtocolError(
                f"rank {rank}: bad partition_revoked: {exc}", rank=rank
            ) from exc
        if rng not in asked or dropped > rng.size:
            raise RemoteProtocolError(
                f"rank {rank} answered a revoke of [{rng.start}, {rng.stop}) of epoch {epoch} "
                f"(dropping {dropped} batches) that it was not sent",
                rank=rank,
            )
        asked.remove(rng)
        if not asked:
            del self.revoking[key]
        freed = BatchRange(rng.stop - dropped, rng.stop)
        work = self.works.get(epoch)
        wants = self.wants.get(epoch, {})
        if work is None:
            if freed.size:  # the epoch closed: every batch of it was committed
                raise RemoteProtocolError(
                    f"rank {rank} gave back batches of epoch {epoch}, which is complete", rank=rank
                )
        else:
            try:
                work.release(rank, freed)
            except LocalProtocolError as exc:
                raise RemoteProtocolError(str(exc), rank=rank) from exc
            self.refresh(rank)
            if redistribute and freed.size:
                self._share_out(work, freed, wants, out)
        self._maybe_close_resplit(epoch, out)

    def _maybe_close_resplit(self, epoch: int, out: list[Effect]) -> None:
        """Once no revoke of ``epoch`` awaits an answer, its re-split is over: what is still
        owed lapses, and the ``repartitioned`` record says what each rank was given."""
        if any(e == epoch for _, e in self.revoking):
            return
        self.wants.pop(epoch, None)
        given = self._given.pop(epoch, {})
        out.append(
            Record(
                "root",
                "repartitioned",
                {"epoch": epoch, "given": sorted([r, n] for r, n in given.items())},
            )
        )

    def _share_out(
        self, work: EpochWork, freed: BatchRange, wants: dict[int, int], out: list[Effect]
    ) -> None:
        cursor = freed.start
        given = self._given.setdefault(work.epoch, {})
        for r in sorted(wants):
            if cursor == freed.stop:
                break
            take = min(wants[r], freed.stop - cursor)
            if take <= 0 or not self.membership.trains(r):
                continue
            self._extend(work, r, BatchRange(cursor, cursor + take), out)
            wants[r] -= take
            cursor += take
            given[r] = given.get(r, 0) + take
        rest = BatchRange(cursor, freed.stop)
        training = self.membership.training()
        if rest.size and training:
            for r, piece in split_among([rest], training):
                self._extend(work, r, piece, out)
                given[r] = given.get(r, 0) + piece.size

    def observe_verdict(self, stable: bool) -> None:
        """The automatic Async overshoot: grows by one per Stable verdict, resets otherwise."""
        if self.config.elche.max_overshoot is not None or not self.traits.overshoot:
            return
        if stable:
            cap = min(10, max(3, self.epoch_batches(0) // 50))
            self.max_overshoot = min(cap, self.max_overshoot + 1)
        else:
            self.max_overshoot = OVERSHOOT_INITIAL

    # ------------------------------------------------------------------ meta and resume
    def meta_epoch(self) -> int:
        """The epoch a resume restarts at (the first open one, or the next to open)."""
        epochs = sorted(self.works)
        return epochs[0] if epochs else min(self.next_epoch, self.config.total_epochs)

    def meta_coverage(self) -> list[dict[str, Any]]:
        """The uncovered ranges of every open epoch, in samples (the meta's ``per_epoch``)."""
        bs = self.config.batch_size
        return [
            {
                "epoch": e,
                "total_samples": self.works[e].total_batches * bs,
                "uncovered_ranges": [
                    list(to_samples(r, bs)) for r in self.works[e].uncovered_ranges()
                ],
            }
            for e in sorted(self.works)
        ]

    def seed_resume(self, resume: ResumeState) -> None:
        """Start at the interrupted epoch, training only its uncovered ranges."""
        self.next_epoch = resume.epoch
        self.first_epoch = resume.epoch
        self.last_aggregated = resume.epoch - 1
        if resume.uncovered is not None:
            self._resume_epoch = resume.epoch
            bs = self.config.batch_size
            self._resume_uncovered = [from_samples(o, n, bs) for o, n in resume.uncovered]
