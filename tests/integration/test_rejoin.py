"""A rank that fails mid-run is respawned by its launcher and rejoins: real launcher, real rank
processes, real sockets (docs/design.md §2, "Rejoin").

``callbacks_main.py --respawn 1`` with rank 2 SIGKILLing itself at its 10th step (its first
incarnation only): the launcher reports the exit, the coordinator declares rank 2 dead and
hands its uncommitted work to the pool, the launcher starts rank 2 again, and the new
incarnation is admitted, gets the consensus in the next averaging round and trains to the end.
A rank SIGSTOPped past its heartbeat timeout does the same once it runs again: it finds its
coordinator gone, exits, and is respawned.
"""

from __future__ import annotations

import subprocess
import time
import uuid
from collections import Counter
from pathlib import Path

import pytest
from processes import left_running, processes_with
from resume_runs import (
    PARITY_MODES,
    completed_chaos_run,
    done,
    evals,
    rank_batches,
    run,
    uninterrupted,
    within_parity,
)

from flodl.chaos import ChaosPlan, Fault
from flodl.config import MODES
from flodl.monitor.records import read_tree

pytestmark = pytest.mark.integration

N = 4096
EPOCHS = 4
SLOW = "0:40,1:40,2:40"
"""40 ms a step: the run lasts long enough (≈ 8 s) for a respawned process to start (import
torch, connect) and still find most of it to train."""


def killed_and_respawned(
    tmp_path: Path, *args: str, step: int, tag: str
) -> subprocess.CompletedProcess[str]:
    """A 3-rank ``callbacks_main.py`` run with ``args`` and ``--respawn 1`` whose rank 2
    SIGKILLs itself at its ``step``-th step (its first incarnation only), logging to
    ``tmp_path/a``."""
    crash = ("--crash-rank", "2", "--crash-step", str(step), "--crash-kill")
    return run(tmp_path, "a", *args, "--ranks", "3", "--respawn", "1", *crash, tag=tag)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", MODES)
def test_a_killed_rank_is_respawned_rejoins_and_trains_to_the_end(
    mode: str, tmp_path: Path
) -> None:
    common = ["--mode", mode, "--epochs", str(EPOCHS), "--samples", str(N), "--eval"]
    common += ["--max-anchor", "5", "--slow", SLOW]
    tag = f"flodl-test-{uuid.uuid4().hex}"
    records = tmp_path / "records"
    out = killed_and_respawned(tmp_path, *common, "--records", str(records), step=10, tag=tag)
    assert out.returncode == 0, out.stderr[-4000:]
    assert done(out.stdout) == {"save_reason": None, "replicas_agree": True}
    assert "rank 2 exited with code -9: respawning it (1 of 1); it rejoins the run" in out.stderr
    # rank processes exit on their own, promptly
    assert left_running(tag, 15) == [], "a process of the run outlived it"

    tree = read_tree(records)
    root = tree["root"]
    events = [r["data"] for recs in tree.values() for r in recs if r["kind"] == "event"]
    assert not [e for e in events if e["class"] == "coverage"], "coverage broken"
    assert [e["class"] for e in events if e["class"] in ("rank_lost", "rank_rejoined")] == [
        "rank_lost",
        "rank_rejoined",
    ]
    [rejoined] = [r["data"] for recs in tree.values() for r in recs if r["kind"] == "rank_rejoined"]
    assert rejoined["rank"] == 2 and rejoined["incarnation"] == 1
    assert rejoined["world_size"] == 3 and rejoined["down_s"] > 0
    epochs = [r["data"]["epoch"] for r in root if r["kind"] == "epoch"]
    assert epochs == list(range(EPOCHS)), epochs

    # every sample of every epoch was trained (the dead incarnation's uncommitted batches are
    # redone, so some twice); rank 2's log holds both incarnations, the second one non-empty
    counts = Counter(i for r in range(3) for b in rank_batches(tmp_path / "a", r) for i in b)
    assert set(counts) == set(range(N)) and min(counts.values()) >= EPOCHS
    # the second incarnation trained (the first one logged 9 batches before its kill)
    assert len(rank_batches(tmp_path / "a", 2)) > 9 + 20
    if mode.endswith("_sync"):
        # whole-epoch partitions: the running epoch is re-split at its catch-up, and it is
        # given the untrained end of the others' queues (what a donor started when the
        # request reached it stays its own: the frame reaches it well within 10 of its steps);
        # a catch-up in the cycle that ends an epoch finds nothing untrained to re-split
        [asked] = [r["data"] for r in root if r["kind"] == "repartition"]
        [given] = [r["data"] for r in root if r["kind"] == "repartitioned"]
        assert asked["ranks"] == [0, 1, 2] and asked["epoch"] == given["epoch"]
        owed = dict(asked["owed"])
        if asked["untrained"] >= 30:
            assert {r for r, _ in asked["asked"]} == {0, 1} and owed[2] >= 10, asked
            assert 0 < dict(given["given"]).get(2, 0) <= owed[2], (asked, given)
    if mode in PARITY_MODES:
        base = uninterrupted(tmp_path, common, 3)
        acc = evals(out.stdout)[-1][1]
        assert within_parity(acc, base), (acc, base)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["cpu_cadence", "nccl_cadence"])
def test_a_rank_stopped_past_its_heartbeat_timeout_is_respawned_when_it_runs_again(
    mode: str, tmp_path: Path
) -> None:
    # SIGSTOP for 6 s under a 3 s heartbeat timeout: the coordinator declares rank 1 dead;
    # continued, the old process finds its coordinator gone and exits 1, and the launcher's
    # respawn rejoins (the simulator's hang-then-rejoin: docs/design.md §3)
    plan = ChaosPlan((Fault("stop", 1, step=20, duration_s=6.0),))
    samples = 4 * N
    out, tree = completed_chaos_run(
        tmp_path,
        mode,
        plan,
        *("--slow", "0:20,1:20,2:20", "--respawn", "1"),
        epochs=3,
        samples=samples,
        timeout_scale=0.1,
    )
    assert "rank 1 exited with code 1: respawning it (1 of 1); it rejoins the run" in out.stderr
    # the old process says it was the one that went quiet, not only that its coordinator did
    assert "this process itself did not run for" in out.stderr, out.stderr[-4000:]
    watched = ("rank_lost", "rank_rejoined", "coverage")
    events = sorted(
        (r["ts"], r["data"]["class"], r["data"]["detail"])
        for recs in tree.values()
        for r in recs
        if r["kind"] == "event" and r["data"]["class"] in watched
    )
    assert [cls for _, cls, _ in events] == ["rank_lost", "rank_rejoined"], events
    assert events[0][2] == "rank 1 declared dead: no frame for 3 s (heartbeat timeout)"
    [rejoined] = [r["data"] for recs in tree.values() for r in recs if r["kind"] == "rank_rejoined"]
    assert rejoined["rank"] == 1 and rejoined["incarnation"] == 1
    # every sample of every epoch trained, and the new incarnation trained (the old one
    # logged about 20 batches before its stop)
    counts = Counter(i for r in range(3) for b in rank_batches(tmp_path / "a", r) for i in b)
    assert set(counts) == set(range(samples)) and min(counts.values()) >= 3
    assert len(rank_batches(tmp_path / "a", 1)) > 60


@pytest.mark.timeout(300)
def test_a_respawned_rank_gets_the_outer_optimizers_state_in_a_collective_mode(
    tmp_path: Path,
) -> None:
    """In a collective mode the outer optimizer's state (Nesterov's previous global model and
    velocity) lives on every rank: the rejoined incarnation gets it from the lowest live rank
    in its first averaging round (``sync_now.heal``), so its outer steps match the others'
    and the replicas end identical (a rank with any other outer state would step elsewhere)."""
    common = ["--mode", "nccl_cadence", "--epochs", str(EPOCHS), "--samples", str(N)]
    common += ["--max-anchor", "5", "--slow", SLOW, "--outer", "nesterov"]
    out = killed_and_respawned(tmp_path, *common, step=10, tag=f"flodl-test-{uuid.uuid4().hex}")
    assert out.returncode == 0, out.stderr[-4000:]
    assert "rank 2 exited with code -9: respawning it (1 of 1); it rejoins the run" in out.stderr
    assert done(out.stdout) == {"save_reason": None, "replicas_agree": True}
    assert len(rank_batches(tmp_path / "a", 2)) > 9 + 20  # the new incarnation trained


@pytest.mark.timeout(120)
def test_a_respawn_still_starting_when_the_run_ends_is_stopped_not_waited_for(
    tmp_path: Path,
) -> None:
    """Rank 2 fails early and its respawned process takes 60 s to start: the run ends first.
    That process was never admitted and has nothing to deliver, so the launcher stops it at
    the end of the run instead of waiting for it (it would wait until the process gave up
    reaching the coordinator: its connect timeout), and leaves no process behind."""
    tag = f"flodl-test-{uuid.uuid4().hex}"
    t0 = time.monotonic()
    out = killed_and_respawned(
        tmp_path,
        *("--mode", "cpu_cadence", "--epochs", "2", "--samples", "2048", "--restart-delay", "60"),
        step=3,
        tag=tag,
    )
    took = time.monotonic() - t0
    assert out.returncode == 0, out.stderr[-4000:]
    assert "respawning it (1 of 1)" in out.stderr
    stopped = "rank 2: its respawned process was never admitted (the run ended first); stopping it"
    assert stopped in out.stderr, out.stderr[-3000:]
    assert done(out.stdout)["save_reason"] is None
    assert took < 50, took  # not the 60 s restart, nor the 40 s the watchers may be waited for
    assert processes_with(tag) == [], "the respawned process outlived the run"


@pytest.mark.timeout(120)
def test_a_respawn_that_cannot_start_leaves_the_rank_dead_and_the_run_going(
    tmp_path: Path,
) -> None:
    """Rank 2 is killed and the launcher cannot start its respawn (the host is out of
    processes: ``fork`` fails with EAGAIN). The run goes on without it, as with no respawn:
    the launcher says the rank stays dead and why, its watcher does not die with a
    traceback, every sample is still trained and no process outlives the run."""
    tag = f"flodl-test-{uuid.uuid4().hex}"
    records = tmp_path / "records"
    out = killed_and_respawned(
        tmp_path,
        *("--mode", "cpu_cadence", "--epochs", "2", "--samples", "2048"),
        *("--respawn-fails", "--records", str(records)),
        step=5,
        tag=tag,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    assert "rank 2 exited with code -9: respawning it (1 of 1); it rejoins the run" in out.stderr
    stays = (
        "flodl: rank 2 stays dead: could not start rank 2 on 127.0.0.1 (here): [Errno 11] "
        "Resource temporarily unavailable (injected)"
    )
    assert stays in out.stderr, out.stderr[-3000:]
    assert "Traceback" not in out.stderr
    assert done(out.stdout) == {"save_reason": None, "replicas_agree": True}
    tree = read_tree(records)
    classes = [r["data"]["class"] for recs in tree.values() for r in recs if r["kind"] == "event"]
    assert "rank_lost" in classes and "rank_rejoined" not in classes
    assert "coverage" not in classes
    counts = Counter(i for r in range(3) for b in rank_batches(tmp_path / "a", r) for i in b)
    assert set(counts) == set(range(2048))
    assert left_running(tag, 15) == [], "a process of the run outlived it"
