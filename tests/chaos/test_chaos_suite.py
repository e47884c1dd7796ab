"""The chaos suite: real 4-rank runs of every mode with seeded faults at seeded moments.

Each run of the user script (``tests/integration/callbacks_main.py``) carries a
:class:`~flodl.chaos.ChaosPlan` of six faults on the four ranks: one fatal fault (SIGKILL,
a cut control or data connection, a kill inside an averaging cycle, right after the rank's ack
of one, inside a callback or inside a bundle save — at step 0 it lands in the initial
broadcast), a stop-then-continue hang shorter than the heartbeat timeout, a delayed averaging
upload, and a second SIGKILL later on. Some runs
tolerate one death only (``max_failure``), so they end in ShutdownWithSave, and are resumed.

Every run must: exit 0 (completed, or stopped by ShutdownWithSave per max_failure), leave no
process behind, keep per-epoch coverage exact (the coordinator checks every epoch's ledger when
it closes and would raise a ``coverage`` alert), evict exactly the ranks a fatal fault hit (a
hang or a slow upload is absorbed, not evicted), and end with every survivor holding the same
parameters. A fault counts as a scenario when it fired (its ``chaos`` record is in the record
log); the CI-sized suite needs at least 100. ``FLODL_CHAOS_RUNS=N`` runs N plans per mode (a
longer soak; default 5).

(The hung rank also gets a late averaging ack later, the slowed one a short hang.)
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
from processes import left_running

from flodl import checkpoint
from flodl.chaos import ChaosPlan, Fault
from flodl.config import MODES
from flodl.monitor.records import read_tree

pytestmark = [pytest.mark.integration]

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tests" / "integration" / "callbacks_main.py"
RUNS = int(os.environ.get("FLODL_CHAOS_RUNS", "5"))
WORLD = 4
FATAL = (
    "kill",
    "close_control",
    "close_data",
    "kill_in_reduce",
    "kill_after_ack",
    "kill_in_callback",
    "kill_in_checkpoint",
    "kill_after_save",
)
FIRED: list[dict[str, Any]] = []  # every fault that fired, across the session


def plan_for(mode: str, index: int) -> tuple[ChaosPlan, dict[str, Any]]:
    """Six faults on the four ranks at seeded moments, and the run's options."""
    rng = random.Random(f"{mode}/{index}")
    ranks = rng.sample(range(WORLD), WORLD)
    fatal_kinds = [k for k in FATAL if mode.startswith("cpu_") or k != "close_data"]
    # (cycled from a different start per mode: five runs per mode reach every kind)
    fatal = fatal_kinds[(index + 2 * MODES.index(mode)) % len(fatal_kinds)]
    first_step = rng.choice((0, rng.randint(1, 30), rng.randint(30, 70)))
    if fatal in ("kill_in_callback", "kill_in_checkpoint", "kill_after_save"):
        first_step = rng.randint(1, 20)  # armed early, fires at the next callback/save
    faults = (
        Fault(fatal, ranks[0], step=first_step),
        Fault("stop", ranks[1], step=rng.randint(1, 60), duration_s=1.0),
        Fault("delay_reduce", ranks[2], step=rng.randint(1, 60), duration_s=0.5),
        Fault("kill", ranks[3], step=rng.randint(40, 90)),
        Fault("delay_ack", ranks[1], step=rng.randint(61, 90), duration_s=0.3),
        Fault("stop", ranks[2], step=rng.randint(61, 90), duration_s=0.5),
    )
    options = {
        # the callback role sits on the rank armed to die inside a callback
        "policy": str(ranks[0]) if fatal == "kill_in_callback" else "fastest",
        "max_failure": 1 if index % 3 == 2 else None,  # stop with a save at the first death
    }
    return ChaosPlan(faults, seed=index), options


def run_script(
    tmp: Path, name: str, args: list[str], timeout_s: float = 200
) -> tuple[subprocess.CompletedProcess[str], str]:
    """Run the chaos job script under a fresh tag; its output goes to ``tmp/<name>.*`` too, its
    launcher's run directory (tempfile) under ``tmp/<name>.tmp``."""
    tag = f"flodl-chaos-{uuid.uuid4().hex}"
    scratch = tmp / f"{name}.tmp"
    scratch.mkdir()
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--tag", tag, "--log-dir", str(tmp / name), *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        cwd=REPO,
        # heartbeat timeout 6 s
        env={**os.environ, "FLODL_NET_TIMEOUT_SCALE": "0.2", "TMPDIR": str(scratch)},
    )
    (tmp / f"{name}.stdout").write_text(out.stdout)
    (tmp / f"{name}.stderr").write_text(out.stderr)
    return out, tag


def done_line(stdout: str) -> dict[str, Any]:
    lines = [line for line in stdout.splitlines() if line.startswith("DONE ")]
    assert len(lines) == 1, stdout[-2000:]
    result: dict[str, Any] = json.loads(lines[0][5:])
    return result


@pytest.mark.timeout(400)
@pytest.mark.parametrize("index", range(RUNS))
@pytest.mark.parametrize("mode", MODES)
def test_a_run_survives_its_faults(mode: str, index: int, tmp_path: Path) -> None:
    plan, options = plan_for(mode, index)
    stem, records = tmp_path / "ck", tmp_path / "records"
    common = [
        *("--ranks", str(WORLD), "--mode", mode, "--samples", "2048", "--slow", "0:2,1:2,2:2,3:2"),
        *("--save", str(stem), "--checkpoint-every", "1", "--max-anchor", "8"),
        *("--eval", "--epoch-fn-sleep", "0", "--ckpt-fn", "--policy", options["policy"]),
    ]
    if options["max_failure"]:
        common += ["--max-failure-abs", str(options["max_failure"])]
    args = [*common, "--epochs", "6", "--records", str(records), "--chaos", plan.to_env()]
    out, tag = run_script(tmp_path, "run", args)
    assert out.returncode == 0, out.stderr[-4000:]
    result = done_line(out.stdout)
    # rank processes exit on their own, promptly
    assert left_running(tag, 15) == [], "a process of the run outlived it"
    assert list((tmp_path / "run.tmp").glob("flodl-*")) == []  # the run directory is removed

    tree = read_tree(records)
    events = [(p, r) for p, recs in tree.items() for r in recs if r["kind"] == "event"]
    assert not [r for _, r in events if r["data"]["class"] == "coverage"], "coverage broken"
    fired = [r["data"] for p, r in events if p == "root/chaos"]
    lost = {int(p.rsplit("rank", 1)[1]) for p, r in events if r["data"]["class"] == "rank_lost"}
    immediate = {
        f["rank"]
        for f in fired
        if f["fault"] not in ("stop", "delay_reduce", "delay_ack", "close_data")
    }
    deferred = {f["rank"] for f in fired if f["fault"] == "close_data"}  # bites at the next reduce
    # every fatal fault that fired evicted its rank; nobody else was evicted (a 1 s hang and a
    # slow upload are absorbed); a cut data connection evicts its rank unless the run ended first
    assert immediate <= lost, (fired, lost)
    assert lost <= immediate | deferred, (fired, lost)
    if result["save_reason"] is None:
        # completed: every survivor took part in the final reduce and holds its consensus
        assert result["replicas_agree"] in (True, None), "survivors hold different parameters"
    else:
        assert result["save_reason"] in ("max_failure_exceeded", "single_survivor")
    for f in fired:
        FIRED.append({"mode": mode, "run": index, **f})

    if result["save_reason"] is not None or index == 0:
        # the bundle on disk resumes cleanly (same world size), and finishes the run
        meta = checkpoint.read_meta(stem, world_size=WORLD)
        resumed, _ = run_script(
            tmp_path,
            "resume",
            [*common, "--epochs", str(max(6, meta.epoch + 1)), "--resume", str(stem)],
        )
        assert resumed.returncode == 0, resumed.stderr[-4000:]
        assert done_line(resumed.stdout)["save_reason"] is None


def test_zz_the_suite_ran_at_least_100_fault_scenarios() -> None:
    if not FIRED:
        pytest.skip("the chaos runs were deselected")
    kinds: dict[str, int] = {}
    for f in FIRED:
        kinds[f["fault"]] = kinds.get(f["fault"], 0) + 1
    summary = ", ".join(f"{k} {n}" for k, n in sorted(kinds.items()))
    print(f"\nchaos suite: {len(FIRED)} fault scenarios fired ({summary})")
    assert len(FIRED) >= 100 or RUNS < 5


@pytest.mark.timeout(400)
@pytest.mark.parametrize("mode", ["nccl_cadence", "nccl_sync"])
def test_a_death_while_the_survivors_reform_costs_only_that_rank(mode: str, tmp_path: Path) -> None:
    """Rank 1 dies; rank 3 dies as the survivors form the session without rank 1, before it
    reaches the session's barrier. Ranks 0 and 2 must not wait for it at that barrier until
    they fail too (the session is superseded by the one the coordinator announces for rank 3's
    death): the run completes on two ranks, with only ranks 1 and 3 evicted."""
    records = tmp_path / "records"
    # step 12: rank 1 trains ~48 of the run's 192 batches, but ElChe gives a rank that the
    # machine's load slows far fewer (in one CI run it never reached step 30, so nothing fired)
    plan = ChaosPlan((Fault("kill", 1, step=12), Fault("kill_in_reform", 3, step=1)), seed=0)
    args = [
        *("--ranks", str(WORLD), "--mode", mode, "--samples", "2048", "--epochs", "3"),
        *("--records", str(records), "--chaos", plan.to_env()),
    ]
    out, tag = run_script(tmp_path, "run", args)
    assert out.returncode == 0, out.stderr[-4000:]
    result = done_line(out.stdout)
    assert result["save_reason"] is None
    tree = read_tree(records)
    events = [(p, r) for p, recs in tree.items() for r in recs if r["kind"] == "event"]
    fired = sorted(r["data"]["fault"] for p, r in events if p == "root/chaos")
    lost = {int(p.rsplit("rank", 1)[1]) for p, r in events if r["data"]["class"] == "rank_lost"}
    assert fired == ["kill", "kill_in_reform"]
    assert lost == {1, 3}
    assert not [r for _, r in events if r["data"]["class"] == "coverage"], "coverage broken"
    assert left_running(tag, 15) == []


@pytest.mark.timeout(300)
def test_survivors_that_end_on_different_parameters_fail_the_run(tmp_path: Path) -> None:
    """Rank 2 delivers its final parameters skewed (``skew_final``): the run completed, but its
    survivors disagree, so ``join()`` raises, naming the parameter and the rank, and the job
    exits non-zero instead of handing over one rank's parameters as the result."""
    plan = ChaosPlan((Fault("skew_final", 2, step=1),), seed=0)
    args = [
        *("--ranks", str(WORLD), "--mode", "cpu_cadence", "--samples", "1024", "--epochs", "2"),
        *("--chaos", plan.to_env()),
    ]
    out, tag = run_script(tmp_path, "run", args)
    assert out.returncode != 0, out.stdout[-2000:]
    assert "DONE " not in out.stdout
    assert "the survivors of the run disagree: parameter 0" in out.stderr, out.stderr[-4000:]
    assert "of rank 2 differs from rank 0's (max |difference| 0.001)" in out.stderr
    assert left_running(tag, 15) == []
