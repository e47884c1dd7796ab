"""A collective that cannot gather or fails, on the pure :class:`RankProtocol`: the rank holds
its frames until the next ``new_session`` and reports the session (``session_failed``), since
without a death nothing else would make the coordinator re-form (docs/design.md §2b,
"Collective sessions")."""

from __future__ import annotations

from flodl.rank.protocol import RankProtocol, Reform
from flodl.wire.frames import NewSession, SessionFailed, SyncNow


def test_a_failed_session_is_reported_and_frames_wait_for_the_next_one() -> None:
    proto = RankProtocol(2, 32, waits_for_update=False)
    proto.broadcasted()
    proto.receive(
        NewSession(session=3, store_prefix="run/s3", new_rank=1, new_world_size=2, ranks=[0, 2])
    )
    assert proto.collective_failed() == SessionFailed(rank=2, session=3)
    assert proto.awaiting_session
    assert proto.receive(SyncNow(cycle=7)) == []  # held
    nxt = NewSession(session=4, store_prefix="run/s4", new_rank=1, new_world_size=2, ranks=[0, 2])
    assert proto.receive(nxt) == [Reform(4, "run/s4", 1, 2, (0, 2))]
    assert not proto.awaiting_session
    assert list(proto.deferred) == [SyncNow(cycle=7)]  # replayed after the re-form
