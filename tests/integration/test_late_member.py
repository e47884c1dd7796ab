"""A death while a member of the collective group is busy in a long callback: real launcher,
real rank processes, real sockets, Gloo (docs/design.md §2b, "Collective sessions").

Rank 2 holds every role and its ``epoch_fn`` takes 12 s; rank 1 is SIGKILLed at its first step
of epoch 1, as rank 2 starts epoch 0's ``epoch_fn``. The coordinator re-forms the group for
the death, but rank 2 reaches the new session's barrier only after its callback, past the
8 s a session may take to gather (``FLODL_NET_TIMEOUT_SCALE=0.2``). Rank 0 gives up on it and
says so (``session_failed``); the coordinator re-forms the same members, and rank 2, once
back, forms that one with rank 0. Before ``session_failed`` both waited for a ``new_session``
that only another death would have sent, until the stall ceiling ended the run
(``reduce_stall``)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
from resume_runs import completed_chaos_run, rank_batches

from flodl.chaos import ChaosPlan, Fault

pytestmark = pytest.mark.integration

N = 4096
EPOCHS = 2


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["nccl_cadence", "nccl_sync"])
def test_a_member_late_to_a_reformed_session_is_waited_for_not_wedged(
    mode: str, tmp_path: Path
) -> None:
    out, tree = completed_chaos_run(
        tmp_path,
        mode,
        ChaosPlan((Fault("kill", 1, epoch=1),)),
        *("--slow", "0:20,1:20,2:20", "--epoch-fn-sleep", "12", "--policy", "2"),
        epochs=EPOCHS,
        samples=N,
    )
    # the case: rank 0 gave up gathering while rank 2 was in its callback
    assert "not every member arrived within 8 s; waiting for the next session" in out.stderr
    events = [r["data"] for recs in tree.values() for r in recs if r["kind"] == "event"]
    classes = Counter(e["class"] for e in events)
    assert classes["rank_lost"] == 1 and "coverage" not in classes, classes
    retries = [e["detail"] for e in events if e["class"] == "session_retry"]
    assert retries and "its members re-form as session" in retries[0], events
    # every sample trained once per epoch but what the killed rank had not committed
    counts = Counter(i for r in range(3) for b in rank_batches(tmp_path / "a", r) for i in b)
    assert set(counts) == set(range(N)) and min(counts.values()) >= EPOCHS
