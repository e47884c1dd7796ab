"""GPU discovery through nvidia-smi (a fake one on PATH), honouring CUDA_VISIBLE_DEVICES."""

from __future__ import annotations

import os
import stat
from pathlib import Path

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


def test_cuda_device_auto_promotes_to_one_rank_per_visible_gpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    from flodl.data import TensorBatchDataset
    from flodl.trainer import TrainerConfig, _resolve_cluster

    env = fake_smi(tmp_path, OUTPUT)
    monkeypatch.setenv("PATH", env["PATH"])
    ds = TensorBatchDataset(torch.zeros(64, 2))
    cluster = _resolve_cluster(TrainerConfig(dataset=ds, device="cuda"))
    assert cluster is not None
    assert [s.device for s in cluster.ranks()] == ["cuda:0", "cuda:1", "cuda:2"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2")
    assert _resolve_cluster(TrainerConfig(dataset=ds, device="cuda")) is None  # one GPU: in process
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert _resolve_cluster(TrainerConfig(dataset=ds, device="cpu")) is None  # CPU never promotes
