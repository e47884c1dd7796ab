"""A rank dies right after acknowledging an averaging round that another rank still holds open,
and its respawn says hello before that round can finalize: real launcher, real rank processes,
real sockets (docs/design.md §2, "Rejoin", the rules for a rejoin while a cycle is pending).

``callbacks_main.py --respawn 1`` with a chaos plan for the first round of epoch 1: rank 1 is
SIGKILLed once its ``sync_ack`` is on the wire (``kill_after_ack``), and rank 2's ``sync_ack``
comes :data:`DELAY_S` late (``delay_ack``: slow, not dead, its heartbeats go on), so the cycle
stays pending while the launcher respawns rank 1 and the coordinator admits the new
incarnation. The old incarnation's batches were folded into that round: they are committed at
its finalize and never trained again; the new incarnation gets no consensus from the old one's
ack, so it trains only after the next round; in the collective modes the death re-forms the
group with the pending cycle's ranks and the admitted rank comes in after it.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
from resume_runs import completed_chaos_run, rank_batches

from flodl.chaos import ChaosPlan, Fault
from flodl.config import MODES

pytestmark = pytest.mark.integration

N = 4096
EPOCHS = 3
DELAY_S = 12.0
"""How long rank 2 holds the round open: a respawn here says hello about 2 s after the kill (the
launcher's exit report, a Python process importing torch), several times that on a loaded
machine. The test asserts that the hello did land inside the round, so a slower respawn fails
it rather than passing without the case it is about."""
SCALE = 0.5
"""Network deadlines × 0.5: liveness 15 s, a session's formation 20 s, both above
:data:`DELAY_S` (in the collective modes rank 0 waits at the re-formed session's barrier for
rank 2, which comes once its late ack is out)."""


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", MODES)
def test_a_rank_killed_after_its_ack_rejoins_while_that_round_is_pending(
    mode: str, tmp_path: Path
) -> None:
    plan = ChaosPlan(
        (
            Fault("kill_after_ack", 1, epoch=1),
            Fault("delay_ack", 2, epoch=1, duration_s=DELAY_S),
        )
    )
    out, tree = completed_chaos_run(
        tmp_path,
        mode,
        plan,
        *("--max-anchor", "5", "--slow", "0:40,1:40,2:40", "--respawn", "1"),
        epochs=EPOCHS,
        samples=N,
        timeout_scale=SCALE,
    )
    assert "rank 1 exited with code -9: respawning it (1 of 1); it rejoins the run" in out.stderr

    fired = {r["data"]["fault"]: r for r in tree["root/chaos"] if r["kind"] == "event"}
    assert set(fired) == {"kill_after_ack", "delay_ack"}  # each once: the respawn fires none
    events = [r for recs in tree.values() for r in recs if r["kind"] == "event"]
    classes = [r["data"]["class"] for r in events]
    assert "coverage" not in classes and classes.count("rank_lost") == 1
    [lost] = [r for r in events if r["data"]["class"] == "rank_lost"]
    [admitted] = [r for r in events if r["data"]["class"] == "rank_rejoined"]
    assert "rank 1 " in lost["data"]["detail"] and "rank 1 " in admitted["data"]["detail"]
    windows = [r for r in tree["root"] if r["kind"] == "window"]
    # the round rank 1 acknowledged finalized after its death, and after its new incarnation
    # was admitted: the case this test is about
    pending = next(w for w in windows if w["ts"] >= lost["ts"])
    assert 1 in pending["data"]["ranks"], pending["data"]
    assert lost["ts"] < admitted["ts"] < pending["ts"], (lost, admitted, pending)
    [caught_up] = [r["data"] for r in tree["root/rank1"] if r["kind"] == "rank_rejoined"]
    assert caught_up["rank"] == 1 and caught_up["incarnation"] == 1
    # the new incarnation trained, once a later round gave it the consensus
    after = [w["data"] for w in windows if w["ts"] > pending["ts"]]
    assert any(d["steps"][d["ranks"].index(1)] > 0 for d in after if 1 in d["ranks"]), (
        "the rejoined rank never trained"
    )

    # every sample of every epoch trained exactly once per epoch: what the old incarnation
    # trained before its ack was committed by that round, and nothing was redone
    counts = Counter(i for r in range(3) for b in rank_batches(tmp_path / "a", r) for i in b)
    assert set(counts) == set(range(N))
    assert set(counts.values()) == {EPOCHS}, Counter(counts.values())
