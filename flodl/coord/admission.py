"""Admission into a running run: rejoins of dead ranks and late joins (docs/design.md §2,
"Rejoin" and "Late joins").

Pure module (time is an argument). :class:`~flodl.coord.membership.Membership` owns the roster
and its transitions; this module sequences what an admission changes in the other concerns,
in the order the rules need:

1. the reduce server takes the rank's data hello again (``RankRejoined``) *before* the
   ``accept`` goes out, so the rank's data hello never races it;
2. ElChe revives the rank with no reading (a calibration window), its averaging window
   starts empty, the cohort (counts, gate) is recomputed without it: it is *awaiting the
   consensus* and is given no work;
3. it gets the global step and the callback roles; collective modes re-form the group with
   it, but only once no cycle is pending (members re-forming under a pending collective
   would split it);
4. when a cycle it entered (at weight 0) finalizes with a non-zero total weight, it holds the
   consensus: the ``rank_joined`` / ``rank_rejoined`` record (with ``down_s`` and
   ``consensus_s``), a pinned callback rank (``EpochCallbackPolicy.Rank(n)``) takes its roles
   back, and the cohort takes it in; progressive modes hand it chunks from the
   pool, whole-epoch partitions are re-split (``Dispatch.rebalance``) so it trains a share of
   the open epoch.
"""

from __future__ import annotations

from collections.abc import Sequence

from flodl.coord.averaging import Averaging
from flodl.coord.callbacks import Callbacks
from flodl.coord.cycle import Cycle
from flodl.coord.dispatch import Dispatch
from flodl.coord.effects import Alert, Effect, RankRejoined, Record, Reply, Send
from flodl.coord.elche import ElChe
from flodl.coord.liveness import RankState
from flodl.coord.membership import Membership
from flodl.coord.phases import RunPhase
from flodl.wire.frames import (
    Accept,
    DeclareDead,
    SaveReason,
    SetEpochCallbackRole,
    SetGlobalStep,
)

__all__ = ["Admission", "running_refusal"]


def running_refusal(phase: RunPhase, save_reason: SaveReason | None) -> str | None:
    """Why no rank may join the running run now (None: it may, while it trains and is not
    stopping)."""
    if phase is RunPhase.TRAINING and save_reason is None:
        return None
    if phase is RunPhase.FINAL_EVAL:
        return "every epoch is trained (the run is in its final eval)"
    return f"the run is {phase.value}"


class Admission:
    """Ranks admitted into the running run, from their ``hello`` to their catch-up.

    Args:
        collective: the mode averages with a collective group (it re-forms to take a rank in).
        paths: each rank's record path.
    """

    def __init__(
        self,
        membership: Membership,
        elche: ElChe,
        dispatch: Dispatch,
        averaging: Averaging,
        callbacks: Callbacks,
        cycle: Cycle,
        *,
        collective: bool,
        paths: Sequence[str],
    ) -> None:
        self.membership = membership
        self.elche = elche
        self.dispatch = dispatch
        self.averaging = averaging
        self.callbacks = callbacks
        self.cycle = cycle
        self.collective = collective
        self.paths = paths
        self.dead_at: dict[int, float] = {}
        """When each rank was last declared dead (for ``down_s``)."""
        self._admitted_at: dict[int, float] = {}
        self._admitted_in: dict[int, int] = {}
        """The cycle number when each awaiting rank was admitted: an ack of that cycle or an
        earlier one is its old incarnation's, never its own."""
        self._first_joins: set[int] = set()
        """Admitted ranks that never joined the run before (``rank_joined``)."""
        self._grow_due = False

    def formed(self, out: list[Effect]) -> str:
        """The run starts training: ranks that have not joined (a minimum world size below
        the maximum) get no count and no election until they join; collective modes form the
        group of the ranks that did, first. Returns why training starts (the phase log)."""
        membership = self.membership
        vacant = membership.joining()
        if not vacant:
            return "every rank joined"
        for r in vacant:
            self.elche.mark_dead(r)  # ElChe.revive when it joins
        self.callbacks.on_formed(vacant, self.elche.smoothed_ms, out)
        if self.collective:
            out.extend(membership.reform_session(None))
        joined = membership.world_size - len(vacant)
        return (
            f"{joined} of {membership.world_size} ranks joined (the minimum world size); "
            f"ranks {vacant} may join while it trains"
        )

    def on_death(self, rank: int, now: float) -> None:
        self.dead_at[rank] = now
        self._admitted_at.pop(rank, None)
        self._admitted_in.pop(rank, None)
        self._first_joins.discard(rank)

    def reform_after_death(self, dead: int, reason: str) -> list[Effect]:
        """Collective modes: ``dead``'s death re-forms the group. While a cycle is pending, only
        with that cycle's ranks: one admitted after its trigger was never asked into it, and a
        member that never comes would hold the others in their collective for good (found by
        the simulator); it comes in at the grow once the cycle is over. The death of such a
        rank, outside the group, re-forms nothing. Otherwise with every live rank, admitted
        ones too, and no grow is due any more."""
        alive = self.membership.alive()
        if self.cycle.pending and dead not in self.membership.sessions.members:
            # (an admitted rank that had not come in yet: the group and the collective it is in
            # are whole, and a new session would split the members already in it from those
            # that take the new one first)
            self._grow_due = not set(alive) <= set(self.membership.sessions.members)
            return self.membership.broadcast(DeclareDead(rank=dead, reason=reason))
        return self._reform(alive, dead, reason)

    def reform_after_failure(self, rank: int, session: int) -> list[Effect]:
        """Collective modes: member ``rank`` could not form ``session`` or its collective
        failed in it (``session_failed``). Unless a newer session went out already (a death
        re-forms on its own), the same ranks re-form under a new prefix: a member that was
        busy past the formation deadline (a long callback), or a death not detected yet, left
        the others waiting for a ``new_session`` that nothing else would send. While a cycle is
        pending, with that cycle's ranks (as after a death); else with every live rank."""
        sessions = self.membership.sessions
        if not self.collective or session != sessions.session or rank not in sessions.members:
            return []  # (no sessions, a stale one, or not a member of it: nothing to re-form)
        return self._reform(self.membership.alive(), None)

    def _reform(self, alive: list[int], dead: int | None, reason: str = "") -> list[Effect]:
        """A new session: while a cycle is pending with that cycle's ranks only (the grow
        follows it), else with every live rank (no grow due any more)."""
        members = [r for r in alive if r in self.cycle.expected] if self.cycle.pending else alive
        self._grow_due = len(members) < len(alive)
        return self.membership.reform_session(dead, reason, members=members)

    def admit(self, rank: int, accept: Accept, now: float, out: list[Effect]) -> None:
        """Admit ``rank`` (its ``hello`` was not refused) into the running run."""
        membership = self.membership
        first = membership.state(rank) is RankState.JOINING
        incarnation = membership.rejoin(rank, now)
        out.append(RankRejoined(rank, incarnation))  # before the accept: its data hello
        out.append(Reply(accept))
        self.elche.revive(rank)
        self.averaging.on_admit(rank)
        self.dispatch.invalidate_cohort()
        self._admitted_at[rank] = now
        self._admitted_in[rank] = self.cycle.number
        if first:
            self._first_joins.add(rank)
        out.append(Send(rank, SetGlobalStep(global_step=self.averaging.global_step)))
        out.append(Send(rank, SetEpochCallbackRole(rank=self.callbacks.roles.epoch_callback_role)))
        verb = "joined" if first else f"rejoined (incarnation {incarnation})"
        out.append(
            Alert(
                "rank_joined" if first else "rank_rejoined",
                self.paths[rank],
                f"rank {rank} {verb}; it trains once the next averaging round gives it the "
                f"consensus ({membership.alive_count()} of {membership.world_size} ranks)",
                "info",
            )
        )
        if self.collective:
            self._grow_due = True
            self.maybe_grow_session(out)

    def maybe_grow_session(self, out: list[Effect]) -> None:
        """Collective modes: re-form the group with the admitted ranks, once no cycle is
        pending (every member then gets ``new_session`` before the next ``sync_now``)."""
        if self._grow_due and not self.cycle.pending:
            self._grow_due = False
            out.extend(self.membership.reform_session(None))

    def caught_up(self, now: float, out: list[Effect], *, training: bool) -> None:
        """Admitted ranks that entered the cycle being finalized hold the consensus: they may
        train from now on; while the run trains, whole-epoch partitions are re-split to give
        them a share of the open epoch (``training``: the run's phase is training)."""
        if not self.membership.awaiting or self.cycle.weight_total == 0:
            return  # (a round of total weight 0 realized nothing: every rank kept its state)
        number = self.cycle.number
        entered = {r for r in self.cycle.acked if self._admitted_in.get(r, -1) < number}
        synced = self.membership.got_consensus(entered)
        for rank in synced:
            self._admitted_in.pop(rank, None)
            at = self._admitted_at.pop(rank, now)
            dead_at = self.dead_at.get(rank)
            first = rank in self._first_joins
            self._first_joins.discard(rank)
            out.append(
                Record(
                    self.paths[rank],
                    "rank_joined" if first else "rank_rejoined",
                    {
                        "rank": rank,
                        "incarnation": self.membership.incarnations[rank],
                        "down_s": None if dead_at is None else round(at - dead_at, 3),
                        "consensus_s": round(now - at, 3),
                        "world_size": self.membership.alive_count(),
                    },
                )
            )
        if synced:
            self.callbacks.on_consensus(sorted(synced), out)
            self.dispatch.invalidate_cohort()
            if training:
                self.dispatch.rebalance(out)
