"""The frames the coordinator builds per rank per cycle, built without re-validating what it
holds checked. Pure module, compiled in the compiled core (docs/design.md §2).

A validated construction of a frame costs ~0.9 µs and three tracked objects (the model, its
``__dict__`` and its fields-set); a finalize at 4,096 ranks builds two per rank (an ``update``
and the ``EpochPlan`` folded into it), a tenth of the cycle and most of its young-generation
garbage. These build the same pydantic models from values the coordinator took from its own
checked state (ledger ranges, counters), the way ``model_construct`` does but without its
per-call work: the field dict in declaration order and a shared frozen fields-set (the models
are frozen: nothing adds to it). The simulator re-validates every frame the coordinator sends
while it checks invariants, and the unit tests compare each builder with validation, field by
field and byte by byte (docs/design.md §2, "Coordinator cost").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel

from flodl.wire.frames import EpochPlan, NewSession, StartEpoch, Update, rank_spans

__all__ = ["built_new_session", "built_plan", "built_start_epoch", "built_update"]

# The slots every pydantic model has, set through their descriptors: ``object.__setattr__``
# finds the descriptor through the class's MRO on every call, a third of a frame's build.
_new = object.__new__
_set_dict = BaseModel.__dict__["__dict__"].__set__
_set_fields_set = BaseModel.__dict__["__pydantic_fields_set__"].__set__
_set_extra = BaseModel.__dict__["__pydantic_extra__"].__set__
_set_private = BaseModel.__dict__["__pydantic_private__"].__set__


def _built(cls: type[Any], values: dict[str, Any], fields_set: frozenset[str]) -> Any:
    frame = _new(cls)
    _set_dict(frame, values)
    _set_fields_set(frame, fields_set)
    _set_extra(frame, None)
    _set_private(frame, None)
    return frame


_PLAN_SET = frozenset(("epoch", "partition_offset", "partition_size"))
_START_SET = frozenset(("plan",))
_UPDATE_SET = frozenset(("version", "next_plan", "global_step"))
_SESSION_SET = frozenset(("session", "store_prefix", "new_world_size", "spans"))


def built_plan(epoch: int, partition_offset: int, partition_size: int) -> EpochPlan:
    """``EpochPlan(epoch=…, partition_offset=…, partition_size=…)`` from checked counts."""
    values = {
        "epoch": epoch,
        "partition_offset": partition_offset,
        "partition_size": partition_size,
    }
    plan: EpochPlan = _built(EpochPlan, values, _PLAN_SET)
    return plan


def built_start_epoch(plan: EpochPlan) -> StartEpoch:
    """``StartEpoch(plan=plan)`` for a plan the coordinator built."""
    frame: StartEpoch = _built(StartEpoch, {"kind": "start_epoch", "plan": plan}, _START_SET)
    return frame


def built_update(version: int, next_plan: EpochPlan | None, global_step: int | None) -> Update:
    """``Update(version=…, next_plan=…, global_step=…)`` from the coordinator's counters."""
    values = {
        "kind": "update",
        "version": version,
        "next_plan": next_plan,
        "global_step": global_step,
    }
    frame: Update = _built(Update, values, _UPDATE_SET)
    return frame


def built_new_session(session: int, store_prefix: str, ranks: Sequence[int]) -> NewSession:
    """``NewSession(…, new_world_size=len(ranks), spans=rank_spans(ranks))`` for a session the
    coordinator opened, ``ranks`` ascending: one frame for every member (a frame per member,
    each validating the member list, made a re-form quadratic in the world size)."""
    values = {
        "kind": "new_session",
        "session": session,
        "store_prefix": store_prefix,
        "new_world_size": len(ranks),
        "spans": rank_spans(ranks),
    }
    frame: NewSession = _built(NewSession, values, _SESSION_SET)
    return frame
