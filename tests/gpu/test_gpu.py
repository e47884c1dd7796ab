"""The GPU path on real CUDA devices (marker ``gpu``; skipped, with the reason, without CUDA).

Every test runs the user script ``gpu_main.py`` (the launcher re-executes it per rank, as it
would a user's): the single-device tier on CUDA, ranks sharing one GPU in every CPU averaging
mode, GPU and CPU ranks in one run, bf16 on the wire from CUDA parameters, a bundle saved from
CUDA ranks resumed on CUDA and on the CPU, the coordinator refusing a tier-4 rank of a
collective mode on a GPU another rank holds, and — with two or three GPUs — the NCCL modes and
an eviction on NCCL. What needs no GPU (the placement rule, ``devices: all``, the launcher's
refusals, ``NCCL_SOCKET_IFNAME``) is tested on the CPU in ``tests/unit/test_placement.py`` and
``tests/integration/test_devices.py``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from flodl.monitor.records import read_tree

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.integration,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (no GPU visible)"),
]

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "gpu_main.py"
REPO = HERE.parents[1]
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
CPU_MODES = ["cpu_sync", "cpu_cadence", "cpu_async"]


def run(tmp: Path, *args: str, limit_s: float = 240, **env: str) -> dict[str, Any]:
    """``gpu_main.py`` to its end (it must succeed); what it wrote to ``--out``."""
    out = tmp / f"result-{len(list(tmp.glob('result-*')))}.json"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(out), *args],
        capture_output=True,
        text=True,
        timeout=limit_s,
        cwd=REPO,
        env={**os.environ, **env},
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result: dict[str, Any] = json.loads(out.read_text())
    result["stdout"], result["stderr"] = done.stdout, done.stderr
    return result


def resources(records: Path) -> dict[str, list[dict[str, Any]]]:
    """Every rank node's resource samples in the record log."""
    return {
        path: [r["data"] for r in recs if r["kind"] == "resource"]
        for path, recs in read_tree(records).items()
        if path.split("/")[-1].startswith("rank")
    }


def assert_gpu_samples(samples: list[dict[str, Any]], device: str) -> None:
    assert samples, "no resource sample"
    last = samples[-1]
    assert last["device"] == device
    assert 0 < last["vram_allocated"] <= last["vram_reserved"] <= last["vram_total"]
    assert last["gpu_name"] == torch.cuda.get_device_name(0)
    if importlib.util.find_spec("pynvml") is not None:  # nvidia-ml-py: utilisation too
        assert 0.0 <= last["gpu_util_percent"] <= 100.0


def test_the_single_device_tier_trains_on_the_gpu_and_samples_it(tmp_path: Path) -> None:
    """``device="auto"`` (the default) with one GPU visible trains in process on it; with
    several it promotes to one rank per GPU. Either way the GPU did the work, the loss fell,
    the state comes back on the CPU and the record log has the GPU's resource samples."""
    got = run(tmp_path, "--records", str(tmp_path / "rec"))
    assert got["world"] == (1 if GPUS == 1 else GPUS)
    assert got["on_cuda"] == [1.0] * got["world"]
    assert got["losses"][-1] < got["losses"][0]
    assert got["params_device"] == "cpu"
    samples = resources(tmp_path / "rec")
    assert len(samples) == got["world"]
    for path, recs in samples.items():
        rank = int(path.rsplit("rank", 1)[1])
        assert_gpu_samples(recs, "cuda" if GPUS == 1 else f"cuda:{rank}")


@pytest.mark.parametrize("mode", CPU_MODES)
def test_ranks_sharing_one_gpu_train_in_every_cpu_averaging_mode(tmp_path: Path, mode: str) -> None:
    got = run(tmp_path, "--devices", "cuda:0,cuda:0", "--mode", mode, "--records", str(tmp_path))
    assert got["world"] == 2 and got["on_cuda"] == [1.0, 1.0]
    assert got["losses"][-1] < got["losses"][0]
    assert sum(got["samples"]) == 2 * 8192  # every sample of both epochs, once
    for recs in resources(tmp_path).values():
        assert_gpu_samples(recs, "cuda:0")


@pytest.mark.parametrize("mode", ["cpu_cadence", "cpu_async"])
def test_a_gpu_rank_and_a_cpu_rank_train_one_model_balanced_by_speed(
    tmp_path: Path, mode: str
) -> None:
    """The consensus moves between the devices (the launcher checks both ranks deliver the
    same final parameters), and ElChe gives the GPU rank — here the CPU rank is made slow —
    the larger share of the batches."""
    args = ["--devices", "cuda:0,cpu", "--mode", mode, "--cpu-slow-ms", "20", "--epochs", "3"]
    got = run(tmp_path, *args, "--records", str(tmp_path))
    assert got["on_cuda"] == [1.0, 0.0]
    assert got["losses"][-1] < got["losses"][0]
    gpu, cpu = got["samples"]
    assert gpu + cpu == 3 * 8192
    assert gpu > 2 * cpu, got["samples"]
    samples = resources(tmp_path)
    assert_gpu_samples(samples["root/rank0"], "cuda:0")
    assert samples["root/rank1"][-1]["device"] == "cpu"
    assert samples["root/rank1"][-1]["vram_allocated"] is None


def test_bf16_wire_from_cuda_parameters(tmp_path: Path) -> None:
    got = run(tmp_path, "--devices", "cuda:0,cuda:0", "--mode", "cpu_cadence", "--bf16")
    assert got["on_cuda"] == [1.0, 1.0]
    assert got["losses"][-1] < 0.9 * got["losses"][0]


def test_a_cuda_ranks_bf16_upload_is_rounded_once_as_a_cpu_ranks(tmp_path: Path) -> None:
    """Rank processes with their model on CUDA and bf16 on the wire, on both lanes, end three
    rounds with the exact consensus of the CPU rule (each upload scaled in f32, rounded to bf16
    once): a CUDA upload copied to bf16 and scaled there rounds twice and differs."""
    sys.path.insert(0, str(REPO / "tests" / "shell"))
    from test_reduce_shm import expected_params, run_ranks

    expected = expected_params(2, bf16=True)
    for shm in (True, False):
        for r in run_ranks(tmp_path, 2, shm=shm, bf16=True, device="cuda:0"):
            assert all(torch.equal(x, y) for x, y in zip(r["params"], expected, strict=True))


def test_a_bundle_saved_by_cuda_ranks_resumes_on_the_gpu_and_on_the_cpu(tmp_path: Path) -> None:
    stem = str(tmp_path / "ck")
    saved = run(tmp_path, "--devices", "cuda:0,cuda:0", "--epochs", "1", "--save", stem)
    assert saved["first_epoch"] == 0 and Path(f"{stem}.meta.json").is_file()
    on_gpu = run(tmp_path, "--device", "cuda:0", "--resume", stem, "--epochs", "2")
    assert on_gpu["first_epoch"] == 1 and on_gpu["on_cuda"] == [1.0]
    on_cpu = run(tmp_path, "--device", "cpu", "--resume", stem, "--epochs", "2")
    assert on_cpu["first_epoch"] == 1 and on_cpu["on_cuda"] == [0.0]
    # the resumed runs start from the saved model: their loss is the trained one, not a fresh
    assert on_gpu["losses"][0] < saved["losses"][0]
    assert on_cpu["losses"][0] < saved["losses"][0]


def test_a_tier4_rank_of_a_collective_mode_on_a_held_gpu_is_refused(tmp_path: Path) -> None:
    """Two ranks started by hand (no flodl launcher knew their devices) both take ``cuda:0``
    under ``nccl_cadence``: the coordinator refuses whichever says hello second, naming the
    GPU and the modes that would work, and that rank fails at once instead of NCCL failing."""
    secret = tmp_path / "secret"
    coord = subprocess.Popen(
        [sys.executable, "-m", "flodl", "coord", "--world-size", "2", "--secret-file", str(secret)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    ranks: list[subprocess.Popen[str]] = []
    try:
        assert coord.stdout is not None
        lines = [coord.stdout.readline(), coord.stdout.readline()]
        assert "FLODL_COORD=" in lines[1], lines
        address = lines[1].split("FLODL_COORD=")[1].split()[0]
        run_id = lines[1].split("FLODL_RUN_ID=")[1].split()[0]
        for rank in (0, 1):
            env = {
                **os.environ,
                "FLODL_COORD": address,
                "FLODL_RUN_ID": run_id,
                "FLODL_SECRET_FILE": str(secret),
                "FLODL_RANK": str(rank),
                "FLODL_WORLD_SIZE": "2",
            }
            cmd = [sys.executable, str(SCRIPT), "--out", str(tmp_path / "unused.json")]
            cmd += ["--mode", "nccl_cadence", "--device", "cuda:0"]
            ranks.append(
                subprocess.Popen(
                    cmd,
                    env=env,
                    cwd=REPO,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
            )
        deadline = time.monotonic() + 120
        while all(p.poll() is None for p in ranks):  # the refused rank ends; the other waits
            assert time.monotonic() < deadline, "no rank was refused within 120 s"
            time.sleep(0.1)
        (refused,) = [p for p in ranks if p.poll() is not None]
        _, err = refused.communicate(timeout=30)
        assert refused.returncode != 0
        assert "needs a GPU of its own for every rank" in err, err[-3000:]
        assert re.search(r"ranks [01] and [01] are both on cuda:0", err), err[-3000:]
        assert "cpu_sync, cpu_cadence, cpu_async" in err
    finally:
        for p in [*ranks, coord]:
            if p.poll() is None:
                p.kill()
            p.communicate(timeout=30)


@pytest.mark.skipif(GPUS < 2, reason=f"needs 2 GPUs (a GPU per NCCL rank), {GPUS} visible")
@pytest.mark.parametrize("mode", ["nccl_sync", "nccl_cadence"])
def test_the_nccl_modes_train_with_a_gpu_per_rank(tmp_path: Path, mode: str) -> None:
    got = run(tmp_path, "--devices", "cuda:0,cuda:1", "--mode", mode)
    assert got["on_cuda"] == [1.0, 1.0]
    assert got["losses"][-1] < got["losses"][0]
    assert sum(got["samples"]) == 2 * 8192


@pytest.mark.skipif(GPUS < 3, reason=f"needs 3 GPUs (2 NCCL survivors of a death), {GPUS} visible")
def test_a_sigkilled_rank_is_evicted_on_nccl_and_the_survivors_finish(tmp_path: Path) -> None:
    args = ["--devices", "cuda:0,cuda:1,cuda:2", "--mode", "nccl_cadence", "--epochs", "3"]
    got = run(tmp_path, *args, "--kill-rank", "2", "--kill-step", "40", "--records", str(tmp_path))
    assert "rank 2 declared dead" in got["stdout"] + got["stderr"]
    assert got["losses"][-1] < got["losses"][0]
    assert sum(got["samples"]) == 3 * 8192  # the dead rank's uncommitted work was redone
