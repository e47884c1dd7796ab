"""GPU discovery through nvidia-smi (a fake one on PATH), honouring CUDA_VISIBLE_DEVICES."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import pytest

from flodl.launch.gpus import GpuInfo, detect_gpus, parse_nvidia_smi, visible

OUTPUT = """0, GPU-aaa, NVIDIA H200, 143771
1, GPU-bbb, NVIDIA H200, 143771
2, GPU-ccc, NVIDIA GeForce GTX 1060 6GB, 6144
garbage line
"""
GPUS = parse_nvidia_smi(OUTPUT)


def test_parse_skips_malformed_lines() -> None:
    assert [g.index for g in GPUS] == [0, 1, 2]
    assert GPUS[2] == GpuInfo(2, "GPU-ccc", "NVIDIA GeForce GTX 1060 6GB", 6144)


def test_visible_devices_filter_and_order() -> None:
    assert [g.index for g in visible(GPUS, {})] == [0, 1, 2]
    assert [g.index for g in visible(GPUS, {"CUDA_VISIBLE_DEVICES": "2,0"})] == [2, 0]
    assert visible(GPUS, {"CUDA_VISIBLE_DEVICES": ""}) == []
    assert [g.index for g in visible(GPUS, {"CUDA_VISIBLE_DEVICES": "GPU-bbb"})] == [1]
    # CUDA stops at the first invalid entry
    assert [g.index for g in visible(GPUS, {"CUDA_VISIBLE_DEVICES": "1,7,0"})] == [1]


def fake_smi(tmp: Path, body: str, code: int = 0) -> dict[str, str]:
    exe = tmp / "nvidia-smi"
    exe.write_text(f"#!/bin/sh\ncat <<'EOF'\n{body}EOF\nexit {code}\n")
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    return {"PATH": f"{tmp}{os.pathsep}/usr/bin:/bin"}


def test_detect_gpus_runs_nvidia_smi(tmp_path: Path) -> None:
    env = fake_smi(tmp_path, OUTPUT)
    assert [g.index for g in detect_gpus(env)] == [0, 1, 2]
    assert [g.index for g in detect_gpus({**env, "CUDA_VISIBLE_DEVICES": "1"})] == [1]


def test_detect_gpus_is_empty_without_nvidia_smi_or_on_failure(tmp_path: Path) -> None:
    assert detect_gpus({"PATH": str(tmp_path)}) == []
    assert detect_gpus(fake_smi(tmp_path, OUTPUT, code=9)) == []


def placement(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, *, cuda_built: bool = True, **config: Any
) -> tuple[list[str] | None, str]:
    """What ``Trainer.run`` would start for this config on a host whose nvidia-smi shows
    :data:`OUTPUT`: each rank's device (``None``: in process) and the single device."""
    import torch

    from flodl.data import TensorBatchDataset
    from flodl.trainer import TrainerConfig, _placement

    monkeypatch.setenv("PATH", fake_smi(tmp_path, OUTPUT)["PATH"])
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: cuda_built)
    ds = TensorBatchDataset(torch.zeros(64, 2))
    cluster, device = _placement(TrainerConfig(dataset=ds, **config))
    return (None if cluster is None else [s.device for s in cluster.ranks()]), device


ALL3 = ["cuda:0", "cuda:1", "cuda:2"]


def test_auto_and_cuda_promote_to_one_rank_per_visible_gpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert placement(monkeypatch, tmp_path) == (ALL3, "cuda")  # device auto, the default
    assert placement(monkeypatch, tmp_path, device="cuda") == (ALL3, "cuda")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2")
    assert placement(monkeypatch, tmp_path) == (None, "cuda")  # one GPU: in process
    assert placement(monkeypatch, tmp_path, device="cuda") == (None, "cuda")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert placement(monkeypatch, tmp_path) == (None, "cpu")  # none visible
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    # a CPU build of torch cannot use the GPUs nvidia-smi shows: auto stays on the CPU
    assert placement(monkeypatch, tmp_path, cuda_built=False) == (None, "cpu")


def test_cpu_and_an_indexed_gpu_never_promote(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert placement(monkeypatch, tmp_path, device="cpu") == (None, "cpu")
    assert placement(monkeypatch, tmp_path, device="cuda:1") == (None, "cuda:1")
    assert placement(monkeypatch, tmp_path, device="cpu", ranks=2) == (["cpu", "cpu"], "cpu")


def test_local_ranks_take_a_gpu_each_or_share_them_with_cuda(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert placement(monkeypatch, tmp_path, ranks=2) == (["cuda:0", "cuda:1"], "cuda")
    # more ranks than GPUs: auto keeps them on the CPU, cuda shares the GPUs round-robin
    assert placement(monkeypatch, tmp_path, ranks=4) == (["cpu"] * 4, "cpu")
    shared = ["cuda:0", "cuda:1", "cuda:2", "cuda:0"]
    assert placement(monkeypatch, tmp_path, ranks=4, device="cuda") == (shared, "cuda")
    assert placement(monkeypatch, tmp_path, ranks=1) == (None, "cuda")


def test_local_devices_mix_cpu_and_gpu_ranks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    got = placement(monkeypatch, tmp_path, local_devices=["cuda:0", "cpu", 0])
    assert got == (["cuda:0", "cpu", "cuda:0"], "cpu")
    assert placement(monkeypatch, tmp_path, local_devices=["cuda:1"]) == (None, "cuda:1")
