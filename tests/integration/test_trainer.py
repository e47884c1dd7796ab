"""The Trainer entry on its tiers: one process, and N local ranks through the launcher.

The launcher tests run a user script in a subprocess (the trampoline re-executes it per rank)
and check that no process of the run outlives it: after success, after a rank crash, after
SIGINT to the launcher.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from processes import left_running, processes_with

from flodl import ConfigError, ElCheConfig, EpochMetrics, Trainer, TrainerConfig, record_scalar
from flodl.data import TensorBatchDataset

pytestmark = pytest.mark.integration

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "trainer_main.py"
REPO = HERE.parents[1]


def data(n: int = 2048) -> TensorBatchDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 16, generator=g)
    y = (x @ torch.randn(16, 4, generator=g)).argmax(dim=1)
    return TensorBatchDataset(x, y)


def model(device: torch.device) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def optim(params: object) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)  # type: ignore[arg-type]


def step(m: torch.nn.Module, batch: list[torch.Tensor]) -> torch.Tensor:
    loss = F.cross_entropy(m(batch[0]), batch[1])
    record_scalar("batch_rows", float(batch[0].shape[0]))
    return loss


def run_script(
    tag: str, *extra: str, limit_s: float = 120, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--tag", tag, *extra],
        check=False,
        capture_output=True,
        text=True,
        timeout=limit_s,
        cwd=REPO,
        env=None if env is None else {**os.environ, **env},
    )


@pytest.mark.timeout(120)
def test_single_process_tier_trains_and_streams_metrics(caplog: pytest.LogCaptureFixture) -> None:
    seen: list[int] = []

    def metrics_fn(m: EpochMetrics) -> None:
        seen.append(m.epoch)
        raise ValueError("a broken metrics_fn must not stop training")

    cfg = TrainerConfig(dataset=data(), batch_size=32, num_epochs=3, metrics_fn=metrics_fn)
    with caplog.at_level(logging.ERROR, logger="flodl"):
        handle = Trainer.run(model, optim, step, cfg)
        state = handle.join(timeout=60)
    streamed = list(iter(lambda: handle.next_metrics(timeout=1), None))
    assert [m.epoch for m in streamed] == [0, 1, 2]
    assert seen == [0, 1, 2]
    assert streamed[-1].avg_loss < 0.6 * streamed[0].avg_loss
    assert streamed[0].scalars == {"batch_rows": 32.0}  # record_scalar works in process too
    assert "metrics_fn (epoch 0) raised (training continues)" in caplog.text
    fresh = model(torch.device("cpu"))
    state.load_into(fresh)
    assert len(state.params) == len(list(fresh.parameters()))


@pytest.mark.timeout(120)
def test_single_process_tier_tags_each_eval_with_its_epoch_and_runs_the_final_one_once() -> None:
    got: list[int] = []
    handle = (
        Trainer.builder(model, optim, step)
        .dataset(data(512))
        .batch_size(32)
        .num_epochs(4)
        .eval_dataset(data(64))
        .eval_fn(lambda m, ds: 1.0)
        .eval_every(2)
        .eval_result_fn(lambda epoch, metric: got.append(epoch))
        .run()
    )
    handle.join(timeout=60)
    assert got == [1, 3]  # 0-based like EpochMetrics; the last epoch's eval is the final one


@pytest.mark.timeout(120)
def test_single_process_tier_gives_each_epoch_its_sub_epoch_reports(tmp_path: Path) -> None:
    from flodl.monitor.records import read_tree

    handle = (
        Trainer.builder(model, optim, step)
        .dataset(data(640))  # 20 batches an epoch
        .batch_size(32)
        .num_epochs(2)
        .record_log(str(tmp_path / "records"))
        .reports_per_epoch(4)
        .run()
    )
    handle.join(timeout=60)
    tree = read_tree(tmp_path / "records")
    roots = [r["data"] for r in tree["root"] if r["kind"] == "node"]
    assert [(d["epoch"], d["epoch_progress"]) for d in roots] == [
        (e, p) for e in (0, 1) for p in (0.25, 0.5, 0.75, 1.0)
    ]
    ranks = [r["data"] for r in tree["root/rank0"] if r["kind"] == "node"]
    assert [d["steps"] for d in ranks] == [5.0] * 8 and all(d["loss"] > 0 for d in ranks)


@pytest.mark.timeout(150)
def test_local_ranks_tier_runs_the_same_script_and_leaves_no_process() -> None:
    tag = f"flodl-test-{uuid.uuid4().hex}"
    out = run_script(tag, "--ranks", "3", "--epochs", "2")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "DONE params=4 world=3" in out.stdout
    assert out.stdout.count("epoch 1 loss") == 1  # metrics_fn fires once per epoch, in the launcher
    assert processes_with(tag) == []


@pytest.mark.timeout(200)
@pytest.mark.parametrize("lane", ["shared memory", "TCP"])
def test_bf16_wire_averages_through_bf16_on_either_lane(lane: str) -> None:
    """``ElCheConfig(bf16_wire=True)``: local ranks average through shared memory (or TCP with
    ``FLODL_SHARED_MEMORY=0``) and every final parameter is a bf16 value; without it, not."""
    tag = f"flodl-test-{uuid.uuid4().hex}"
    env = {"FLODL_SHARED_MEMORY": "1" if lane == "shared memory" else "0"}
    args = ("--ranks", "2", "--epochs", "2", "--log-info")
    bf16 = run_script(tag, *args, "--bf16-wire", env=env)
    assert bf16.returncode == 0, bf16.stderr[-3000:]
    assert "bf16-exact=True" in bf16.stdout
    for rank in (0, 1):
        said = f"rank {rank} averages through shared memory"
        assert (said in bf16.stderr) is (lane == "shared memory"), bf16.stderr[-3000:]
    f32 = run_script(tag, *args, env=env)
    assert f32.returncode == 0, f32.stderr[-3000:]
    assert "bf16-exact=False" in f32.stdout
    assert processes_with(tag) == []


@pytest.mark.timeout(150)
def test_a_schedulers_lr_cliff_reaches_the_coordinator_and_halves_the_window() -> None:
    """scheduler_fn → the rank's lr_update → the LR meta-controller's nudge (its alert is the
    user-visible trace); the run without a drop has none."""
    tag = f"flodl-test-{uuid.uuid4().hex}"
    cliff = run_script(tag, "--ranks", "2", "--epochs", "2", "--lr-drop-at", "96")
    steady = run_script(tag, "--ranks", "2", "--epochs", "2")
    for out in (cliff, steady):
        assert out.returncode == 0, out.stderr[-3000:]
        assert "DONE params=4 world=2" in out.stdout
    # (the convergence watcher may nudge too, on the guard's verdicts: only cliffs counted)
    nudges = [ln for ln in cliff.stdout.splitlines() if "LR cliff" in ln]
    # 2 ranks: the LR is scaled ×2 (lr_scale_ratio 1), so 0.1 → 0.01 arrives as 0.2 → 0.02
    assert len(nudges) == 1, cliff.stdout[-3000:]
    assert nudges[0].startswith("flodl [drift] root: LR meta-controller nudged the anchor down ×")
    assert nudges[0].endswith("(LR cliff 0.2 → 0.02)")
    assert "LR meta-controller" not in steady.stdout  # no scheduler: no LR to watch
    assert processes_with(tag) == []


@pytest.mark.timeout(150)
def test_launched_ranks_obey_the_one_knob_through_their_coordinator(tmp_path: Path) -> None:
    """Tier 2: ``heartbeat_timeout(4)`` under ``FLODL_NET_TIMEOUT_SCALE=0.5`` is a 2 s liveness
    timeout for the ranks: a frozen launcher (its coordinator silent, connections open) is lost
    after 2 s, each rank says so in its death record, and the launcher, thawed, names it."""
    tag = f"flodl-test-{uuid.uuid4().hex}"
    env = {**os.environ, "FLODL_NET_TIMEOUT_SCALE": "0.5"}
    cmd = [sys.executable, str(SCRIPT), "--tag", tag, "--ranks", "2", "--epochs", "500"]
    launcher = subprocess.Popen(
        [*cmd, "--heartbeat-timeout", "4"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert launcher.stdout is not None
        while "epoch 0 loss" not in (line := launcher.stdout.readline()):  # the cohort trains
            assert line, launcher.stderr.read() if launcher.stderr else ""
        launcher.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + 60

        def ranks_alive() -> list[str]:
            return [p for p in processes_with(tag) if int(p.split()[0]) != launcher.pid]

        while ranks_alive():  # the frozen launcher cannot report its children's exit
            assert time.monotonic() < deadline, ranks_alive()
            time.sleep(0.2)
        launcher.send_signal(signal.SIGCONT)
        _, err = launcher.communicate(timeout=60)
    finally:
        launcher.send_signal(signal.SIGCONT)
        if launcher.poll() is None:
            launcher.kill()
            launcher.communicate()
    assert launcher.returncode != 0
    records = sorted(tmp_path.glob("flodl-runs/*/run.rank*.death.json"))
    assert [r.name for r in records] == ["run.rank0.death.json", "run.rank1.death.json"]
    from flodl import checkpoint

    for rank, record in enumerate(records):
        error = checkpoint.read_death_record(str(record.parent / "run"), rank).error
        assert "liveness timeout 2 s" in error, error
    assert "liveness timeout 2 s" in err, err[-3000:]
    assert processes_with(tag) == []


@pytest.mark.timeout(150)
def test_a_crashing_rank_is_survived_and_leaves_no_process() -> None:
    tag = f"flodl-test-{uuid.uuid4().hex}"
    out = run_script(tag, "--ranks", "3", "--crash-rank", "1", "--crash-step", "20")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "injected failure on rank 1" in out.stderr
    assert "DONE" in out.stdout
    assert "rank_lost" in out.stdout
    assert processes_with(tag) == []


def default_sigint() -> None:
    """In the child: SIGINT's default action (a shell's background job, such as a CI run
    started with ``&``, passes SIGINT on ignored, and Python then installs no handler)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_to_the_launcher_stops_every_child(sig: signal.Signals, tmp_path: Path) -> None:
    tag = f"flodl-test-{uuid.uuid4().hex}"
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), "--tag", tag, "--epochs", "200", "--samples", "20000"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        cwd=REPO,
        env={**os.environ, "TMPDIR": str(tmp_path)},  # where its run directory goes
        preexec_fn=default_sigint,  # noqa: PLW1509 - it only resets one signal (see there)
    )
    try:
        assert proc.stdout is not None
        # wait for the first epoch's metrics: training is under way (ranks print a hello first)
        lines = [proc.stdout.readline() for _ in range(1)]
        while not lines[-1].startswith("epoch 0") and lines[-1] and len(lines) < 50:
            lines.append(proc.stdout.readline())
        assert lines[-1].startswith("epoch 0"), lines
        assert len(processes_with(tag)) == 4  # the launcher and its 3 ranks
        proc.send_signal(sig)
        proc.wait(timeout=30)
        assert left_running(tag, 15) == []
        assert proc.returncode != 0
        assert list(tmp_path.glob("flodl-*")) == []  # the launcher removed its run directory
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
        for line in processes_with(tag):
            os.kill(int(line.split()[0]), signal.SIGKILL)


BAD = [
    ({"batch_size": -1}, "batch_size"),
    ({"batch_size": 0}, "batch_size"),
    ({"num_epochs": 0}, "num_epochs"),
    ({"max_grad_norm": -1.0}, "max_grad_norm"),
    ({"heartbeat_timeout": 0}, "heartbeat_timeout"),
    ({"augment": 0}, "augment"),
    ({"epoch_splits": 0}, "epoch_splits"),
    ({"ranks": 0}, "ranks"),
    ({"device": "tpu"}, "device must be"),
    ({"batch_size": 10_000}, "fewer than one batch"),
    ({"dataset": object()}, "map-style dataset"),
    ({"unknown_knob": 1}, "unknown_knob"),
    ({"lr_scale_ratio": float("nan")}, "lr_scale_ratio"),
    ({"ranks": 2, "elche": ElCheConfig(partition_ratios=(0.5, 0.3, 0.2))}, "partition_ratios"),
    ({"max_failure": {"absolute": 1, "percent": 0.5}}, "exactly one of absolute or percent"),
]


@pytest.mark.parametrize(("override", "phrase"), BAD)
def test_bad_config_fails_at_run_naming_the_problem(
    override: dict[str, object], phrase: str
) -> None:
    builder = Trainer.builder(model, optim, step).dataset(data())
    for key, value in override.items():
        builder._values[key] = value
    with pytest.raises(ConfigError) as exc:
        builder.run()
    assert phrase in str(exc.value)


def test_bad_mode_and_bad_overhead_target_name_the_field() -> None:
    with pytest.raises(ConfigError, match="unknown mode 'gpu_turbo'"):
        ElCheConfig.preset("gpu_turbo")
    with pytest.raises(ConfigError, match="overhead_target"):
        ElCheConfig.cpu_cadence(overhead_target=0.9)
    with pytest.raises(ConfigError, match="anchor"):
        ElCheConfig.preset("cpu_cadence", anchor=0)
