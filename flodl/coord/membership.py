"""Membership: who is in the run, the handshake that admits a rank, and the collective session.

Pure module (time is an argument; docs/design.md §2). It owns the roster and its transitions,
and nothing else in the coordinator keeps its own copy of it:

* **admission**: a ``hello`` is refused, with the rule that refuses it in words, for another
  protocol, run id or world size, a rank out of range, a duplicate, a rank declared dead, a rank
  that finished, a run past formation, or a model signature unlike the first rank's;
* **liveness** (:class:`~flodl.coord.liveness.Liveness`): joining → alive → dead or exited;
* **the collective session** (:class:`~flodl.coord.cycle.Sessions`): collective modes re-form
  the group among the survivors after every death, renumbering them by ascending global rank;
* **recovery**: the ranks declared dead since the last finalized cycle (the ``recovered``
  record);
* **rejoin** (docs/design.md §2, "Rejoin"): a rank declared dead may come back as a new
  *incarnation* while the run trains (collective modes grow the group back to it). It is alive
  from its ``hello`` on but *awaiting the consensus*: it trains nothing until an averaging
  cycle it entered (with weight 0) finalizes, which gives it the consensus parameters.
  Nothing of an earlier incarnation is accepted: its control connection was closed at the
  death, and its data-plane keys were bound to that connection's nonces.
"""

from __future__ import annotations

from collections.abc import Sequence

from flodl.config import JobSpec, MaxFailure
from flodl.coord.cycle import Sessions
from flodl.coord.effects import Effect, Send
from flodl.coord.liveness import Liveness, RankState, unrecoverable_reason
from flodl.coord.outbound import built_new_session
from flodl.modes import ModeTraits
from flodl.placement import Placement, gpu_key, placement_problem
from flodl.timeouts import Timeouts
from flodl.wire.frames import (
    PROTOCOL_VERSION,
    Accept,
    CoordFrame,
    DeclareDead,
    Hello,
    SaveReason,
)

__all__ = ["Membership", "placed_at"]


def placed_at(hello: Hello) -> Placement:
    """Where the rank of ``hello`` runs, as it says."""
    return Placement(hello.rank, hello.host, hello.device, hello.gpu)


class Membership:
    """The roster of one run.

    Args:
        world_size: ranks the run forms with.
        run_id: the run's id (a ``hello`` must name it).
        timeouts: the run's deadlines (the liveness timeout; ``accept`` carries them).
    """

    def __init__(
        self,
        world_size: int,
        run_id: str,
        timeouts: Timeouts,
        *,
        forming_size: int | None = None,
        traits: ModeTraits | None = None,
    ) -> None:
        self.traits = traits
        """The run's mode (which placements it trains); ``None``: the job's, once known."""
        self.world_size = world_size
        self.forming_size = world_size if forming_size is None else forming_size
        """Ranks that must join before training starts (the others may join later)."""
        self.run_id = run_id
        self.timeouts = timeouts
        self.liveness = Liveness(world_size, timeouts.heartbeat_s)
        self.sessions = Sessions(session=0, members=tuple(range(world_size)))
        self.signature: str | None = None
        self.job: JobSpec | None = None
        """The first admitted rank's job description (every later rank must match it)."""
        self.devices: list[int | None] = [None] * world_size
        self.placements: list[Placement | None] = [None] * world_size
        """Where each rank that said hello runs (its latest incarnation)."""
        self._by_kind: dict[str, set[int]] = {"cpu": set(), "cuda": set()}
        self._by_gpu: dict[tuple[str, str], set[int]] = {}
        """Ranks by device kind and by GPU (dead ones too: a lookup skips them), so checking
        a hello costs O(1), not a pass over the live ranks."""
        self.unrecovered: list[int] = []
        """Ranks declared dead since the last finalized cycle."""
        self.incarnations = [0] * world_size
        """How many times each rank rejoined (0: the incarnation that formed the run)."""
        self.formed: frozenset[int] = frozenset()
        """The ranks that formed the run (every later one joined or rejoined it running)."""
        self.awaiting: set[int] = set()
        """Rejoined ranks that have not received the consensus yet (they train nothing)."""

    # ------------------------------------------------------------------ queries
    def in_range(self, rank: int) -> bool:
        return 0 <= rank < self.world_size

    def is_alive(self, rank: int) -> bool:
        return self.liveness.is_alive(rank)

    def alive(self) -> list[int]:
        """Live ranks, ascending."""
        return self.liveness.alive()

    def alive_mask(self) -> list[bool]:
        return self.liveness.alive_mask()

    def alive_count(self) -> int:
        return self.liveness.alive_count()

    def trains(self, rank: int) -> bool:
        """Alive and holding the consensus: the rank may be given work."""
        return self.liveness.is_alive(rank) and rank not in self.awaiting

    def training(self) -> list[int]:
        """Ranks that may be given work, ascending."""
        return [r for r in self.liveness.alive() if r not in self.awaiting]

    def training_mask(self) -> list[bool]:
        """:meth:`trains` of every rank, in one pass over the live mask."""
        awaiting = self.awaiting
        return [up and r not in awaiting for r, up in enumerate(self.liveness.alive_mask())]

    def state(self, rank: int) -> RankState:
        return self.liveness.state(rank)

    def joining(self) -> list[int]:
        """Ranks that have not joined yet (formation)."""
        return [r for r in range(self.world_size) if self.state(r) is RankState.JOINING]

    def heartbeat_ages(self, now: float) -> list[float | None]:
        """Seconds since each live rank's last frame (``None`` for dead or finished ranks)."""
        return [
            round(max(0.0, now - self.liveness.last_seen_at(r)), 3) if self.is_alive(r) else None
            for r in range(self.world_size)
        ]

    # ------------------------------------------------------------------ admission
    def refusal(self, hello: Hello, *, forming: bool, rejoining: str | None = None) -> str | None:
        """Why ``hello`` is refused, or None when it may join.

        Args:
            forming: the run still forms (every rank not yet joined may join).
            rejoining: ``None`` when a dead rank may rejoin now, else why not (the run is
                shutting down, say); read only for a rank declared dead.
        """
        if hello.protocol != PROTOCOL_VERSION:
            return (
                f"protocol {hello.protocol} not supported (coordinator speaks {PROTOCOL_VERSION})"
            )
        if hello.run_id != self.run_id:
            return f"run id {hello.run_id!r} does not match this run ({self.run_id!r})"
        if hello.world_size != self.world_size:
            return f"world size {hello.world_size} does not match this run ({self.world_size})"
        if hello.rank >= self.world_size:
            if self.forming_size < self.world_size:
                return f"rank {hello.rank} is beyond the run's maximum world size {self.world_size}"
            return f"rank {hello.rank} out of range for world size {self.world_size}"
        if hello.role == "supervisor":
            return None
        state = self.state(hello.rank)
        if state is RankState.ALIVE:
            return f"rank {hello.rank} is already connected (duplicate rank)"
        if state is RankState.EXITED:
            return f"rank {hello.rank} already finished"
        if state is RankState.DEAD:
            if rejoining is not None:
                return f"rank {hello.rank} cannot rejoin: {rejoining}"
        elif not forming and rejoining is not None:  # a rank that missed the formation
            return f"rank {hello.rank} cannot join: {rejoining}"
        if self.job is not None and hello.job is not None:
            found = self.job.difference(hello.job)
            if found is not None:
                field, first, got = found
                return (
                    f"job {field} {got!r} differs from the first rank's {first!r} (every rank "
                    "must train the same job)"
                )
        if self.signature is not None and hello.model_signature != self.signature:
            return (
                f"model signature {hello.model_signature[:12]}… differs from the first rank's "
                f"{self.signature[:12]}… (a different model or dtype)"
            )
        job = self.job or hello.job
        traits = self.traits or (job.elche.traits if job is not None else None)
        if traits is not None and not traits.cpu_averaging:
            problem = self._placement_refusal(traits, placed_at(hello))
            if problem is not None:
                return f"rank {hello.rank} cannot join: {problem}"
        return None

    def _placement_refusal(self, traits: ModeTraits, new: Placement) -> str | None:
        """:func:`~flodl.placement.placement_problem` of ``new`` beside the live ranks: a
        live rank on the other device kind, or one on ``new``'s GPU, is all it can object to."""
        other_kind = "cuda" if new.kind == "cpu" else "cpu"
        candidates = [self._by_kind[other_kind]]
        if new.kind == "cuda":
            candidates.append(self._by_gpu.get(gpu_key(new), set()))
        for ranks in candidates:
            for r in ranks:
                held = self.placements[r]
                if r != new.rank and held is not None and self.is_alive(r):
                    return placement_problem(traits, [held, new])
        return None

    def place(self, hello: Hello) -> None:
        """Remember where an admitted rank runs (the placement rule reads it)."""
        if hello.role == "supervisor":
            return
        rank = hello.rank
        old = self.placements[rank]
        if old is not None:
            self._by_kind[old.kind].discard(rank)
            self._by_gpu.get(gpu_key(old), set()).discard(rank)
        new = self.placements[rank] = placed_at(hello)
        self._by_kind[new.kind].add(rank)
        if new.kind == "cuda":
            self._by_gpu.setdefault(gpu_key(new), set()).add(rank)

    def accept(self, hello: Hello, *, running: bool = False) -> Accept:
        """The reply that admits ``hello`` (the shell adds the data and store ports);
        ``running``: it joins a running run (its ``incarnation`` is then ≥ 1)."""
        return Accept(
            run_id=self.run_id,
            rank=hello.rank,
            world_size=self.world_size,
            session=self.sessions.session,
            heartbeat_timeout_s=self.timeouts.heartbeat_s,
            timeout_scale=self.timeouts.scale,
            incarnation=self.incarnations[hello.rank] + int(running),
        )

    def is_dead(self, rank: int) -> bool:
        return self.state(rank) is RankState.DEAD

    def rejoin(self, rank: int, now: float) -> int:
        """Admit a rank into the running run (not refused) — a dead rank's new incarnation,
        or a rank that missed the formation: alive, awaiting the consensus; its incarnation
        number (the count of its joins into the running run)."""
        self.liveness.rejoin(rank, now)
        self.incarnations[rank] += 1
        self.awaiting.add(rank)
        return self.incarnations[rank]

    def got_consensus(self, contributors: set[int] | frozenset[int]) -> list[int]:
        """The ranks of ``contributors`` that were awaiting the consensus (a cycle they entered
        finalized): they may train from now on."""
        synced = sorted(self.awaiting & contributors)
        self.awaiting.difference_update(synced)
        return synced

    def join(self, hello: Hello, now: float) -> bool:
        """Admit a rank that was not refused; True once every rank joined."""
        if self.signature is None:
            self.signature = hello.model_signature
        if self.job is None:
            self.job = hello.job
        self.liveness.join(hello.rank, now)
        if self.liveness.joined_count() < self.forming_size:
            return False
        self.formed = frozenset(self.alive())
        return True

    # ------------------------------------------------------------------ transitions
    def seen(self, rank: int, now: float) -> None:
        self.liveness.seen(rank, now)

    def mark_exited(self, rank: int) -> bool:
        """A rank finished cleanly; False when it was not alive."""
        self.awaiting.discard(rank)
        return self.liveness.mark_exited(rank)

    def declare_dead(self, rank: int, reason: str) -> bool:
        """True on the alive (or joining) → dead transition, once."""
        self.awaiting.discard(rank)
        return self.liveness.declare_dead(rank, reason)

    def record_death(self, rank: int) -> None:
        """A death the survivors have to recover from (its ``recovered`` record is due)."""
        self.unrecovered.append(rank)

    def recovered(self) -> list[int]:
        """The deaths recovered from by the cycle that just finalized (then forgotten)."""
        ranks, self.unrecovered = self.unrecovered, []
        return ranks

    def unrecoverable(
        self, *, max_failure: MaxFailure | None, needs_two: bool
    ) -> tuple[SaveReason, str] | None:
        """Whether the survivors must stop, with the reason (see
        :func:`~flodl.coord.liveness.unrecoverable_reason`). Ranks admitted mid-run that await
        the consensus cannot carry the run on their own: with no rank holding the consensus
        left, every rank is lost."""
        verdict = unrecoverable_reason(
            world_size=self.world_size,
            dead=len(self.liveness.dead()),
            alive=self.alive_count(),
            needs_two=needs_two,
            max_failure=max_failure,
        )
        if verdict is None and self.alive_count() > 0 and not self.training():
            why = (
                f"every rank that held the consensus is lost (ranks {sorted(self.awaiting)} "
                "joined the running run and await it)"
            )
            return ("all_ranks_lost", why)
        return verdict

    def reform_session(
        self, dead: int | None, reason: str = "", *, members: Sequence[int] | None = None
    ) -> list[Effect]:
        """Collective modes: a new session among ``members`` (default: the live ranks) — the
        survivors of ``dead``'s death, or (``dead`` None) the members plus the ranks that
        rejoined; the frames that tell every member (and every live rank of the death)."""
        alive = self.alive()
        session, ranks = self.sessions.reform(alive if members is None else members)
        prefix = self.sessions.store_prefix(self.run_id)
        out: list[Effect] = []
        declared = None if dead is None else DeclareDead(rank=dead, reason=reason)
        # One frame for every member (a member finds its position among them): the shell
        # encodes its body once (docs/design.md §1, protocol 10).
        frame = built_new_session(session, prefix, ranks)
        members_set = set(ranks)
        for r in alive:
            if declared is not None:
                out.append(Send(r, declared))
            if r in members_set:
                out.append(Send(r, frame))
        return out

    # ------------------------------------------------------------------ clocks
    def stale(self, now: float) -> list[int]:
        return self.liveness.stale(now)

    def next_deadline(self) -> float | None:
        return self.liveness.next_deadline()

    def broadcast(self, frame: CoordFrame) -> list[Effect]:
        """``frame`` to every live rank (one instance: frames are immutable)."""
        return [Send(r, frame) for r in self.alive()]
