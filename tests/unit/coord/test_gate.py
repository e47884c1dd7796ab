"""The count gate's flags and counts (the simulator checks the gate against
``should_average`` recomputed from scratch after every step; these pin its own rules)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from flodl.coord.gate import CountGate
from flodl.errors import LocalProtocolError

FLAGS = st.lists(st.tuples(st.booleans(), st.booleans(), st.booleans()), min_size=1, max_size=12)


@given(FLAGS)
def test_load_is_reset_then_set_for_every_live_rank(flags: list[tuple[bool, bool, bool]]) -> None:
    # (live, sat, moved) per rank: Dispatch.refresh_all loads what refresh sets rank by rank
    n = len(flags)
    alive = sum(live for live, _, _ in flags)
    one, two = CountGate(n), CountGate(n)
    one.reset(alive)
    for r, (live, sat, moved) in enumerate(flags):
        if live:
            one.set(r, live=True, sat=sat, moved=moved)
    two.load(
        alive,
        [live and sat for live, sat, _ in flags],
        [live and moved for live, _, moved in flags],
    )
    assert two.unsatisfied == one.unsatisfied
    for count in (alive, alive + 1):
        assert two.open(count) == one.open(count)
    # and the gate goes on the same way afterwards: a rank's flags change, a rank dies
    for gate in (one, two):
        gate.set(0, live=True, sat=True, moved=True)
        gate.forget(n - 1)
    assert (two.unsatisfied, two.open(alive)) == (one.unsatisfied, one.open(alive))


def test_load_refuses_flags_for_another_world_size() -> None:
    gate = CountGate(3)
    gate.reset(3)
    with pytest.raises(LocalProtocolError, match="2/3 flags for 3 ranks"):
        gate.load(3, [True, True], [True, True, True])
    assert gate.unsatisfied == 3  # unchanged


def test_ready_is_open_but_for_the_live_count() -> None:
    gate = CountGate(2)
    gate.reset(2)
    assert not gate.ready()
    gate.set(0, live=True, sat=True, moved=False)
    gate.set(1, live=True, sat=True, moved=False)
    assert gate.unsatisfied == 0 and not gate.ready()  # nobody moved yet
    gate.set(1, live=True, sat=True, moved=True)
    assert gate.ready() and gate.open(2) and not gate.open(0)
    gate.set(0, live=True, sat=False, moved=True)
    assert gate.unsatisfied == 1 and not gate.ready() and not gate.open(2)
