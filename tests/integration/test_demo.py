"""``flodl demo``: the README's first command runs end to end and refuses bad options."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from flodl.cli import main

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(240)
def test_demo_trains_solo_lockstep_then_flodl_and_its_table_matches_the_records(
    tmp_path: Path,
) -> None:
    out_dir = tmp_path / "demo"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "flodl",
            "demo",
            "--epochs",
            "1",
            "--out",
            str(out_dir),
            "--json",
            str(tmp_path / "demo.json"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=230,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    # the three runs in order, the prediction before the distributed ones
    order = [
        "[1/3] solo baseline",
        "flodl sim predicts for this rig",
        "[2/3] lock-step DDP (torch DistributedDataParallel, Gloo): 2 local CPU ranks",
        "[3/3] flodl cpu_cadence: 2 local CPU ranks",
    ]
    assert [out.index(s) for s in order] == sorted(out.index(s) for s in order)
    assert "rank 1 slowed 3×" in out
    assert "flodl ▏epoch 1/1" in out
    summary = out[out.index("summary (") :]
    table = {}
    for line in summary.splitlines()[2:]:
        cells = re.split(r"\s{2,}", line.strip())
        if len(cells) == 4:
            table[cells[0]] = cells[1:]
    assert {"accuracy", "wall time", "training time", "predicted", "replayed"} <= set(table)
    assert {"batch share", "syncs", "anchor"} <= set(table)
    # accuracy: every run beats the trivial ~30 % after one epoch
    for cell in table["accuracy"]:
        assert float(cell.split()[0]) > 40.0, table["accuracy"]
    # lock-step: equal shards, one all-reduce per step (128,000 windows / 2 ranks / batch 128)
    assert table["batch share"][1] == "r0 50% · r1 50%"
    assert table["syncs"][1] == "500"
    # flodl's column is what its records say
    root_log = (out_dir / "records" / "root.log").read_text().splitlines()
    records = [json.loads(line) for line in root_log]
    epoch = [r["data"] for r in records if r["kind"] == "epoch"][-1]
    contribution = [r["data"] for r in records if r["kind"] == "contribution"][-1]
    assert table["syncs"][2] == str(epoch["syncs"])
    assert table["anchor"][2] == str(epoch["anchor"])
    train = float(table["training time"][2].split()[0])
    assert train == round(epoch["t_s"], 1)
    samples = [x["samples"] for x in contribution["ranks"]]
    shares = [f"r{i} {100 * n / sum(samples):.0f}%" for i, n in enumerate(samples)]
    assert table["batch share"][2] == " · ".join(shares)
    assert samples[0] > samples[1]  # the fast rank did more of the work
    # the speed-up is lock-step's training span over flodl's, as shown
    lock = float(table["training time"][1].split()[0])
    speed = re.search(r"\(([\d.]+)× lock-step's speed\)", table["training time"][2])
    assert speed is not None and abs(float(speed[1]) - lock / train) <= 0.01 + 0.05 * lock / train
    assert f"flodl trained {speed[1]}× as fast as lock-step DDP" in summary
    for column in (1, 2):
        assert re.fullmatch(r"[\d.]+ s( \(\d+ syncs\))?", table["predicted"][column]), table
    assert re.fullmatch(r"[\d.]+ s \(from its records\)", table["replayed"][2]), table
    # the files the summary points at
    assert (out_dir / "records" / "root.log").stat().st_size > 0
    assert "<html" in (out_dir / "dashboard.html").read_text().lower()
    meta = json.loads((out_dir / "checkpoint.meta.json").read_text())
    assert isinstance(meta, dict)
    assert (out_dir / f"checkpoint.{meta['bundle_tag']}.fdl").stat().st_size > 0
    assert sorted(p.name for p in out_dir.iterdir() if p.name.startswith("lockstep")) == []
    for name in ("records", "dashboard.html", "checkpoint.meta.json", "flodl sim --from-records"):
        assert name in summary
    # --json: the same figures, and the table as printed
    figures = json.loads((tmp_path / "demo.json").read_text())
    assert figures["options"]["slow"] == {"1": 3.0} and figures["options"]["epochs"] == 1
    result = figures["result"]
    assert (result["syncs"], result["anchor"]) == (epoch["syncs"], epoch["anchor"])
    assert round(result["train_s"], 1) == train
    assert result["lockstep_syncs"] == 500
    # (the derived figure is the ratio of the two spans it reports, not a speed bound)
    assert abs(result["speedup"] - result["lockstep_train_s"] / result["train_s"]) < 1e-9
    assert summary.startswith(figures["summary"].rstrip())


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--slow", "5:3"], "rank 5 is out of range for --ranks 2"),
        (["--ranks", "3", "--slow", "1:3,1:2"], "rank 1 is given twice"),
        (["--slow", "1:0.5"], "the factor must be a finite number >= 1"),
        (["--slow", "fast"], "expected RANK:FACTOR"),
        (["--mode", "nope"], "--mode 'nope': expected one of nccl_sync, nccl_cadence"),
        (["--ranks", "1"], "--ranks 1: expected 2..16"),
        (["--epochs", "0"], "--epochs 0: expected 1..1000"),
        (["--json", "{tmp}/absent/demo.json"], "absent does not exist"),
        (["--json", "{tmp}"], "is a directory"),
    ],
)
def test_bad_options_exit_2_naming_the_problem(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    assert main(["demo", "--out", str(tmp_path / "never"), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("flodl demo: error: ")
    assert message in err
    assert not (tmp_path / "never").exists()  # refused before anything ran


def test_bad_option_exits_2_from_the_console_entry() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "flodl", "demo", "--slow", "5:3"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 2
    assert "rank 5 is out of range for --ranks 2" in proc.stderr


def test_demo_task_is_deterministic_with_disjoint_held_out_windows() -> None:
    import torch

    from flodl.demo import VOCAB_SIZE, demo_task

    a, b = demo_task(samples=2_000, held_out=500), demo_task(samples=2_000, held_out=500)
    for ta, tb in zip(
        (*a.train.tensors, *a.held_out), (*b.train.tensors, *b.held_out), strict=True
    ):
        assert torch.equal(ta, tb)
    x, y = a.train.tensors
    assert x.shape == (2_000, a.context) and y.shape == (2_000,)
    assert int(x.max()) < VOCAB_SIZE and int(y.min()) >= 0
    held = {tuple(row) for row in a.held_out[0].tolist()}
    assert len(held) > 400  # distinct windows, not one repeated
    assert 0.2 < a.trivial_accuracy < 0.4  # spaces dominate Python source
    model = a.model_factory("cpu")
    assert 0.0 <= a.eval_fn(model, a.held_out) <= 1.0
    assert torch.equal(next(model.parameters()), next(b.model_factory("cpu").parameters()))


def test_slowdown_sleeps_factor_minus_one_times_the_measured_step() -> None:
    from flodl.demo import Slowdown

    def busy(seconds: float) -> None:
        import time

        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            pass

    slow = Slowdown(3.0)
    with slow.step():
        busy(0.02)
    assert slow.compute_s >= 0.02
    assert slow.slept_s >= 2.0 * slow.compute_s  # a sleep never ends early
    fwd = Slowdown(2.0, step_per_forward=4.0)
    with fwd.forward():
        busy(0.01)
    assert fwd.compute_s >= 0.04 and fwd.slept_s >= fwd.compute_s
    off = Slowdown(3.0, active=False)
    with off.step():
        busy(0.005)
    assert off.slept_s == 0.0 and off.compute_s == 0.0


def test_timed_step_thread_cpu_slows_the_step_cpu_never_a_blocked_wait(tmp_path: Path) -> None:
    import time

    import torch

    from flodl.demo import Slowdown
    from flodl.demo.lockstep import TimedStep, read_step_record
    from flodl.errors import FlodlError

    def spin(seconds: float) -> None:
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass

    def forward(model: Any, batch: Any) -> torch.Tensor:
        spin(0.01)
        return torch.zeros(())

    slow = Slowdown(3.0)
    timed = TimedStep(forward, slow, 3.8, tmp_path / "r.steps", measure="thread_cpu")
    c0 = time.thread_time()
    for _ in range(4):
        timed(None, None)
        spin(0.005)  # the "backward": counted at the next call
        time.sleep(0.03)  # blocked in a collective: never counted, never multiplied
    timed(None, None)
    cpu = time.thread_time() - c0  # everything the thread ran, the loop included
    assert 5 * 0.01 + 4 * 0.005 <= slow.compute_s <= cpu + 1e-3
    assert slow.compute_s < 5 * 0.01 + 4 * 0.005 + 0.02  # the 0.12 s of sleeps stayed out
    assert slow.slept_s >= 2.0 * slow.compute_s - 1e-6  # (factor - 1) × the step CPU
    rec = read_step_record(tmp_path / "r.steps")
    assert rec is not None and rec["steps"] == 5
    assert rec["busy_s"] == pytest.approx(slow.compute_s + slow.slept_s, rel=1e-6)
    assert rec["cpu_s"] == pytest.approx(slow.compute_s, rel=1e-6)  # the sleeps left out
    with pytest.raises(FlodlError, match="measure"):
        TimedStep(forward, slow, 3.8, measure="wall")


def test_demo_task_sizes_make_the_realistic_model_and_a_held_out_loss() -> None:
    import math

    from flodl.demo import demo_task
    from flodl.errors import ConfigError

    task = demo_task(samples=512, held_out=256, context=32, embed=32, hidden=1024)
    model = task.model_factory("cpu")
    assert task.parameters == sum(p.numel() for p in model.parameters()) == 2_201_729
    assert "2.20 M-parameter" in task.description
    assert abs(task.loss_fn(model, task.held_out) - math.log(task.vocab_size)) < 0.2
    with pytest.raises(ConfigError, match="hidden"):
        demo_task(samples=16, hidden=0)


@pytest.mark.timeout(240)
def test_lockstep_local_sgd_averages_every_period_and_once_more_at_the_end(
    tmp_path: Path,
) -> None:
    from flodl.demo.lockstep import run_lockstep

    def train(name: str, period: int | None = None) -> dict[str, Any]:
        return run_lockstep(
            world=2,
            samples=512,
            seed=0,
            epochs=1,
            batch_size=32,
            slow={1: 2.0},
            step_per_forward=3.8,
            threads=1,
            out_dir=tmp_path / name,
            timeout_s=180.0,
            measure="thread_cpu",
            period=period,
        )

    sgd = train("sgd", period=3)
    # 8 steps per rank: averaged after steps 0, 3, 6, then once more for step 7
    assert sgd["syncs"] == 4 and [r["steps"] for r in sgd["ranks"]] == [8, 8]
    assert 0.0 < sgd["loss"] < 10.0 and 0.0 <= sgd["metric"] <= 1.0
    ddp = train("ddp")
    assert ddp["syncs"] == 8 and 0.0 < ddp["loss"] < 10.0


def test_slowed_train_step_slows_only_its_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    from flodl.demo import demo_task, slowed

    task = demo_task(samples=256, held_out=64)
    model = task.model_factory("cpu")
    batch = task.train.get_batch(list(range(64)))
    for rank, expect_active in (("0", False), ("1", True), (None, False)):
        if rank is None:
            monkeypatch.delenv("FLODL_RANK", raising=False)
        else:
            monkeypatch.setenv("FLODL_RANK", rank)
        step = slowed(task.train_step, 3.0, slow_rank=1)
        loss = step(model, batch)
        assert loss.dim() == 0
        assert step.slowdown.active is expect_active  # type: ignore[attr-defined]


def test_parse_slow_accepts_repeats_and_comma_lists() -> None:
    from flodl.demo import parse_slow

    assert parse_slow(["1:3"], 2) == {1: 3.0}
    assert parse_slow(["1:3", "2:1.5,3:2"], 4) == {1: 3.0, 2: 1.5, 3: 2.0}
    assert parse_slow([], 2) == {}


def test_json_under_a_file_is_refused_before_anything_runs(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    (tmp_path / "afile").write_text("x")
    argv = ["demo", "--out", str(tmp_path / "never"), "--json", str(tmp_path / "afile" / "d.json")]
    assert main(argv) == 2
    assert "afile is not a directory" in capsys.readouterr().err
    assert not (tmp_path / "never").exists()
