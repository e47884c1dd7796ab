"""Devices on the CPU (docs/design.md §2c, "Devices"): what the GPU path needs that no GPU has
to show. The launcher refuses a collective mode on a shared GPU or on mixed devices before
any rank starts; ``nccl_socket_ifname`` reaches a host's ranks as ``NCCL_SOCKET_IFNAME``; the
single-device tier samples its resources like a rank. (ssh hosts — ``devices: all`` probed
over ssh, a launcher that runs no rank — are in ``test_ssh_e2e.py``; CUDA itself in
``tests/gpu``.)"""

from __future__ import annotations

import logging
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from flodl import ElCheConfig, TensorBatchDataset, Trainer
from flodl.monitor.records import read_tree
from flodl.rank.resources import ResourceProbe, ResourceSampler
from flodl.wire.frames import ResourceSample

pytestmark = pytest.mark.integration

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
GPU_SCRIPT = REPO / "tests" / "gpu" / "gpu_main.py"
TRAINER = HERE / "trainer_main.py"


def launch_script(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
        check=False,
    )


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("devices", "needle"),
    [
        ("cuda:0,cuda:0", "ranks 0 and 1 are both on cuda:0"),
        ("cuda:0,cpu", "rank 0 is on cuda:0 of host"),
    ],
)
def test_a_collective_mode_on_a_shared_gpu_or_mixed_devices_fails_before_any_rank_starts(
    tmp_path: Path, devices: str, needle: str
) -> None:
    """The launcher decides from the placement alone (it never touches CUDA), so this holds
    on a machine without a GPU: ``run()`` raises ConfigError naming the ranks, the devices and
    the CPU averaging modes, and no rank process is started."""
    started = time.monotonic()
    out = launch_script(
        str(GPU_SCRIPT), "--out", str(tmp_path / "r.json"), "--devices", devices,
        "--mode", "nccl_cadence",
    )  # fmt: skip
    assert out.returncode == 1
    assert "flodl.errors.ConfigError" in out.stderr, out.stderr[-2000:]
    assert needle in out.stderr
    assert "cpu_sync, cpu_cadence, cpu_async" in out.stderr
    assert "coordinator" not in out.stdout  # nothing was started
    assert time.monotonic() - started < 60


@pytest.mark.timeout(150)
def test_a_workers_nccl_socket_ifname_reaches_its_ranks(tmp_path: Path) -> None:
    yml = tmp_path / "fdl.cluster.yml"
    yml.write_text(
        "cluster:\n"
        "  controller: {host: 127.0.0.1, port: 0}\n"
        "  env: {NCCL_SOCKET_IFNAME: eth9}\n"
        "  workers:\n"
        "    - host: localhost\n"
        "      devices: [cpu, cpu]\n"
        "      nccl_socket_ifname: lo\n"
    )
    out = launch_script(
        "-m", "flodl", "launch", "--cluster", str(yml), "--", sys.executable, str(TRAINER), "--tag",
        "ifname", "--epochs", "1", "--show-env", "NCCL_SOCKET_IFNAME",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("] env NCCL_SOCKET_IFNAME=lo") == 2, out.stdout  # both ranks
    assert "DONE params=4 world=2" in out.stdout


def test_the_single_device_tier_records_its_resources(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(2048, 8, generator=g), torch.randint(0, 2, (2048,), generator=g)
    handle = (
        Trainer.builder(
            lambda device: torch.nn.Linear(8, 2).to(device),
            lambda params: torch.optim.SGD(params, lr=0.1),
            lambda model, batch: F.cross_entropy(model(batch[0]), batch[1]),
        )
        .dataset(TensorBatchDataset(x, y))
        .batch_size(32)
        .elche(ElCheConfig.cpu_cadence())
        .device("cpu")
        .record_log(str(tmp_path))
        .progress(False)
        .run()
    )
    handle.join()
    samples = [r["data"] for r in read_tree(tmp_path)["root/rank0"] if r["kind"] == "resource"]
    assert samples, "the run is shorter than the interval: its last sample must still be there"
    last = samples[-1]
    assert last["rank"] == 0 and last["device"] == "cpu"
    assert last["ram_used"] > 0 and last["ram_total"] >= last["ram_used"]
    assert last["vram_allocated"] is None and last["gpu_util_percent"] is None


def test_the_sampler_takes_a_last_sample_and_survives_a_failing_sink(
    caplog: pytest.LogCaptureFixture,
) -> None:
    got: list[ResourceSample] = []
    sampler = ResourceSampler(ResourceProbe(3), got.append, every_s=3600.0).start()
    sampler.stop()
    sampler.stop()  # idempotent: one last sample, not two
    assert [s.rank for s in got] == [3]

    calls = [0]

    def broken(sample: ResourceSample) -> None:
        calls[0] += 1
        raise OSError("disk full")

    with caplog.at_level(logging.ERROR, logger="flodl.rank.resources"):
        failing = ResourceSampler(ResourceProbe(0), broken, every_s=0.01).start()
        deadline = time.monotonic() + 30
        while not calls[0]:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        failing.stop()
    assert calls[0] == 1  # the first failure ends the samples, never the run
    assert "resource sampling failed" in caplog.text
