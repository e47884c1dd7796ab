"""A collective that cannot gather or fails, on the pure :class:`RankProtocol`: the rank holds
its frames until the next ``new_session`` and reports the session (``session_failed``), since
without a death nothing else would make the coordinator re-form (docs/design.md §2b,
"Collective sessions")."""

from __future__ import annotations

import pytest

from flodl.errors import RemoteProtocolError
from flodl.rank.protocol import RankProtocol, Reform
from flodl.wire.frames import NewSession, SessionFailed, SyncNow


def test_a_failed_session_is_reported_and_frames_wait_for_the_next_one() -> None:
    proto = RankProtocol(2, 32, waits_for_update=False)
    proto.broadcasted()
    proto.receive(
        NewSession(session=3, store_prefix="run/s3", new_world_size=2, spans=[(0, 1), (2, 1)])
    )
    assert proto.collective_failed() == SessionFailed(rank=2, session=3)
    assert proto.awaiting_session
    assert proto.receive(SyncNow(cycle=7)) == []  # held
    nxt = NewSession(session=4, store_prefix="run/s4", new_world_size=2, spans=[(0, 1), (2, 1)])
    assert proto.receive(nxt) == [Reform(4, "run/s4", 1, 2, (0, 2))]
    assert not proto.awaiting_session
    assert list(proto.deferred) == [SyncNow(cycle=7)]  # replayed after the re-form


def test_a_new_session_gives_each_member_its_position_and_refuses_a_non_member() -> None:
    # Protocol 10: every member gets the same frame; its rank in the group is its position.
    frame = NewSession(session=5, store_prefix="run/s5", new_world_size=4, spans=[(1, 1), (4, 3)])
    for rank, position in ((1, 0), (4, 1), (5, 2), (6, 3)):
        proto = RankProtocol(rank, 32, waits_for_update=False)
        assert proto.receive(frame) == [Reform(5, "run/s5", position, 4, (1, 4, 5, 6))]
        assert proto.session == 5
    outsider = RankProtocol(2, 32, waits_for_update=False)
    with pytest.raises(RemoteProtocolError, match="new_session 5 does not list rank 2"):
        outsider.receive(frame)
    assert outsider.session == 0  # nothing changed
