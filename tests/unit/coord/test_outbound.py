"""The coordinator's per-rank frames built without validation (``built_plan``,
``built_start_epoch``, ``built_update``, ``built_new_session``) are the frames validation
builds: equal, same fields set, same dump, same wire bytes, just as immutable, and a changed
model fails here."""

from __future__ import annotations

import copy
import pickle

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import BaseModel, ValidationError

from flodl.coord.outbound import built_new_session, built_plan, built_start_epoch, built_update
from flodl.wire.codec import decode_frame, encode_frame
from flodl.wire.frames import MAX_U63, EpochPlan, NewSession, StartEpoch, Update, rank_spans

SECRET = b"k" * 32
counts = st.integers(min_value=0, max_value=MAX_U63)


def same(built: BaseModel, validated: BaseModel) -> None:
    assert type(built) is type(validated)
    assert built == validated
    assert built.model_fields_set == validated.model_fields_set
    assert built.model_dump() == validated.model_dump()
    assert list(built.__dict__) == list(validated.__dict__)  # declaration order: the dump's
    assert repr(built) == repr(validated)
    try:
        assert hash(built) == hash(validated)
    except TypeError:  # (a frame with a list field is no more hashable validated)
        with pytest.raises(TypeError):
            hash(validated)
    assert copy.deepcopy(built) == validated
    assert pickle.loads(pickle.dumps(built)) == validated


@given(counts, counts, counts)
def test_built_plan_is_the_validated_plan(epoch: int, offset: int, size: int) -> None:
    same(
        built_plan(epoch, offset, size),
        EpochPlan(epoch=epoch, partition_offset=offset, partition_size=size),
    )


@given(counts, counts, counts, counts, st.none() | counts, st.booleans())
def test_built_update_and_start_epoch_are_the_validated_frames(
    epoch: int, offset: int, size: int, version: int, step: int | None, folded: bool
) -> None:
    plan = EpochPlan(epoch=epoch, partition_offset=offset, partition_size=size)
    next_plan = built_plan(epoch, offset, size) if folded else None
    update = built_update(version, next_plan, step)
    same(update, Update(version=version, next_plan=plan if folded else None, global_step=step))
    assert encode_frame(update, SECRET) == encode_frame(
        Update(version=version, next_plan=plan if folded else None, global_step=step), SECRET
    )
    start = built_start_epoch(built_plan(epoch, offset, size))
    same(start, StartEpoch(plan=plan))
    wire = encode_frame(start, SECRET)
    assert wire == encode_frame(StartEpoch(plan=plan), SECRET)
    assert decode_frame(wire, SECRET) == start


@given(counts, st.lists(st.integers(min_value=0, max_value=4095), min_size=1, max_size=64))
def test_built_new_session_is_the_validated_frame(session: int, members: list[int]) -> None:
    ranks = sorted(set(members))
    built = built_new_session(session, "run/s1", ranks)
    validated = NewSession(
        session=session, store_prefix="run/s1", new_world_size=len(ranks), spans=rank_spans(ranks)
    )
    same(built, validated)
    wire = encode_frame(built, SECRET)
    assert wire == encode_frame(validated, SECRET)
    assert decode_frame(wire, SECRET) == built
    assert built.members() == ranks
    assert [built.position(r) for r in ranks] == list(range(len(ranks)))
    assert all(built.position(r) is None for r in set(range(4097)) - set(ranks))


def test_built_frames_are_frozen() -> None:
    update = built_update(3, built_plan(0, 0, 8), 7)
    with pytest.raises(ValidationError, match="frozen"):
        update.version = 4  # type: ignore[misc]
    assert update.next_plan is not None
    with pytest.raises(ValidationError, match="frozen"):
        update.next_plan.partition_size = 9  # type: ignore[misc]


@pytest.mark.parametrize("model", [EpochPlan, StartEpoch, Update, NewSession])
def test_the_builders_name_every_field_of_their_model(model: type[BaseModel]) -> None:
    # a field added to one of these models must be added to its builder too (the builder
    # would otherwise send frames without it: the dump would miss a key)
    built = {
        EpochPlan: built_plan(1, 2, 3),
        StartEpoch: built_start_epoch(built_plan(1, 2, 3)),
        Update: built_update(1, None, None),
        NewSession: built_new_session(1, "run/s1", [0, 3]),
    }[model]
    assert list(built.__dict__) == list(model.model_fields)
