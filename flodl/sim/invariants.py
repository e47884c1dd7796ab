"""What the simulator checks after every step (docs/design.md §3): the coordinator's state and
every frame it sends. Each check returns the first violation it finds, in words, or None;
:class:`~flodl.sim.cluster.SimCluster` raises it as
:class:`~flodl.errors.InvariantViolation` with its seed, mode and virtual time."""

from __future__ import annotations

from pydantic_core import PydanticSerializationError

from flodl.coord.cycle import should_average
from flodl.coord.liveness import RankState
from flodl.coord.machine import Coordinator, RunPhase
from flodl.modes import ModeTraits
from flodl.sim.trace import SimTrace
from flodl.wire.frames import CoordFrame

__all__ = ["frame_violation", "state_violation"]


def frame_violation(frame: CoordFrame) -> str | None:
    """A frame the coordinator sends is one validation accepts, unchanged: the per-rank frames
    are built without validation (``flodl.coord.outbound``). A field holding a value of
    another type than its model declares is one too (pydantic would only warn as it dumps)."""
    try:
        dumped = frame.__pydantic_serializer__.to_python(frame, warnings="error")
    except PydanticSerializationError as exc:
        return f"the coordinator sent a {frame.kind} frame with a field of the wrong type: {exc}"
    try:
        again = type(frame).model_validate(dumped)
    except ValueError as exc:
        return f"the coordinator sent an invalid {frame.kind} frame: {exc}"
    if again != frame:
        return f"{frame.kind} frame changes under validation: {frame!r} → {again!r}"
    return None


def state_violation(
    c: Coordinator,
    traits: ModeTraits,
    trace: SimTrace,
    *,
    world: int,
    stall_ceiling_s: float,
    now: float,
) -> str | None:
    """The coordinator's state after a step: exact ledgers, no work held by the dead or by a
    rank without the consensus, one chunk in flight and one open epoch where the mode is
    barrier-paced, the incremental count gate equal to :func:`should_average`, no cycle
    pending past the stall ceiling, exact coverage of every closed epoch, and no rank that
    failed without an injected fault."""
    if trace.rank_failures:
        t, rank, why = trace.rank_failures[0]
        return f"rank {rank} failed without a fault at {t:.4f} s: {why}"
    if c.phase is RunPhase.FORMING:
        return None
    barrier = traits.barrier_paced
    works = c.dispatch.works
    for e, work in works.items():
        report = work.coverage_report()
        if not report.ok:
            return f"epoch {e} ledger broken: {report}"
        for rank in range(world):
            dead = c.membership.state(rank) is RankState.DEAD
            if dead and rank not in c.averaging.deferred_forfeit and work.pending(rank):
                return f"dead rank {rank} still holds work in epoch {e}"
            # (a new incarnation whose old one died inside the pending cycle: until that
            # cycle's finalize settles it, what it holds is the old incarnation's work)
            awaiting = rank in c.membership.awaiting and rank not in c.averaging.deferred_forfeit
            if awaiting and work.pending(rank):
                return f"rank {rank} holds work before it has the consensus"
            if barrier and c.progressive and len(work.outstanding(rank)) > 1:
                return f"rank {rank} has more than one chunk in flight (epoch {e})"
    if barrier and c.phase is RunPhase.TRAINING and len(works) > 1:
        return f"barrier-paced run has epochs {sorted(works)} open at once"
    if c.phase is RunPhase.TRAINING and not c.cycle.pending:
        expected = should_average(
            one_step=traits.one_step_gate,
            alive=c.membership.alive(),
            window_steps=[r.window.steps for r in c.windows],
            counts=[max(1, n) for n in c.elche.batch_counts],
            quiesced=[c.in_flight(r) == 0 for r in range(world)],
            chunked=traits.chunk_is_window and c.progressive,
        )
        if expected != c.gate_open():
            return f"incremental count gate {c.gate_open()} != should_average"
    stall = c.cycle.stall_deadline(stall_ceiling_s)
    if stall is not None and now > stall + 1e-9 and c.save_reason is None:
        return "a cycle stayed pending past the stall ceiling"
    if not all(trace.coverage_ok):
        return "an epoch closed without exact coverage"
    return None
