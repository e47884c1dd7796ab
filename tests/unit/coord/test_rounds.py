"""The round book the CPU reduce server and the simulator share."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from flodl.coord.rounds import RoundBook
from flodl.errors import LocalProtocolError


def test_a_round_completes_when_every_expected_rank_uploaded() -> None:
    book = RoundBook(3)
    assert book.open(1, [0, 1, 2]).complete is None
    assert book.upload(2, 1) is None
    assert book.upload(0, 1) is None
    assert book.waiting_for(1) == (1,)
    assert book.upload(1, 1) == (0, 1, 2)
    assert book.waiting_for(1) is None  # complete: no longer open
    assert book.problem(0, 1) == "round 1 is not open (latest opened: 1)"


def test_early_uploads_count_and_unexpected_ones_are_refused_at_open() -> None:
    book = RoundBook(3)
    assert book.upload(0, 5) is None  # before open: waits
    assert book.upload(2, 5) is None
    assert book.upload(1, 4) is None  # to a round that will never be opened
    opened = book.open(5, [0, 1])
    assert opened.complete is None
    assert sorted(opened.refused) == [
        (1, "uploaded to round 4, which was never opened"),
        (2, "uploaded to round 5, which does not expect it"),
    ]
    assert book.uploads(5) == (0,)
    assert book.upload(1, 5) == (0, 1)


def test_refusals_name_the_rule() -> None:
    book = RoundBook(2)
    book.open(1, [0])
    assert book.problem(1, 1) == "round 1 does not expect rank 1"
    book.upload(0, 1)
    book.open(2, [0, 1])
    book.upload(0, 2)
    assert book.problem(0, 2) == "second upload to round 2"
    with pytest.raises(LocalProtocolError, match="second upload"):
        book.upload(0, 2)
    with pytest.raises(LocalProtocolError, match="opened after round 2"):
        book.open(2, [0])
    with pytest.raises(LocalProtocolError, match="outside the world"):
        book.open(3, [0, 2])


def test_a_rank_that_leaves_completes_the_rounds_waiting_for_it() -> None:
    book = RoundBook(3)
    book.open(1, [0, 1, 2])
    book.upload(0, 1)
    book.upload(1, 1)  # rank 1 uploaded, then leaves: its upload is not folded in
    assert book.leave(1) == []  # rank 2 has not uploaded yet
    assert book.leave(2) == [(1, (0,))]
    assert book.leave(1) == []  # once
    assert book.problem(1, 2) == "rank 1 left the run"
    assert book.open(2, [0, 1, 2]).complete is None  # a rank that left is not expected
    assert book.upload(0, 2) == (0,)


def test_a_round_whose_every_rank_left_completes_empty() -> None:
    book = RoundBook(2)
    book.open(1, [0, 1])
    book.leave(0)
    assert book.leave(1) == [(1, ())]


@given(
    world=st.integers(1, 5),
    ops=st.lists(
        st.tuples(st.sampled_from(["up", "leave", "open"]), st.integers(0, 4)), max_size=40
    ),
)
def test_contributors_are_exactly_the_uploads_of_ranks_still_in(
    world: int, ops: list[tuple[str, int]]
) -> None:
    """Against a model: a completed round's contributors are its uploads, all expected, none
    gone at completion; no rank is in two completions of one round."""
    book = RoundBook(world)
    cycle = 0
    uploaded: dict[int, set[int]] = {}
    completed: dict[int, tuple[int, ...]] = {}
    for op, rank in ops:
        rank %= world
        if op == "open":
            cycle += 1
            opened = book.open(cycle, range(world))
            if opened.complete is not None:
                completed[cycle] = opened.complete
        elif op == "leave":
            for c, contributors in book.leave(rank):
                completed[c] = contributors
        elif book.problem(rank, cycle + 1) is None:
            uploaded.setdefault(cycle + 1, set()).add(rank)
            got = book.upload(rank, cycle + 1)
            if got is not None:
                completed[cycle + 1] = got
    for c, contributors in completed.items():
        assert set(contributors) <= uploaded.get(c, set())
        assert list(contributors) == sorted(set(contributors))
