"""The rank's resource probe (docs/design.md §7): what it measures and what it leaves out."""

from __future__ import annotations

import pytest
import torch

from flodl.rank.resources import ResourceProbe


def test_a_cpu_rank_reports_cpu_and_memory_and_no_gpu() -> None:
    probe = ResourceProbe(3, "cpu")
    sum(i * i for i in range(200_000))
    s = probe.sample()
    assert s.rank == 3 and s.cpu_percent > 0
    assert 0 < s.ram_used < s.ram_total
    assert (s.gpu_util_percent, s.vram_allocated, s.vram_total) == (None, None, None)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a CUDA rank on a machine without one")
def test_a_cuda_rank_without_cuda_leaves_the_gpu_figures_out(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level("INFO", logger="flodl.rank.resources")
    probe = ResourceProbe(0, "cuda:1")
    first, second = probe.sample(), probe.sample()
    assert first.vram_allocated is None and first.gpu_util_percent is None
    assert second.ram_used > 0
    assert sum("no GPU memory" in r.message for r in caplog.records) == 1  # logged once


def test_a_tier4_rank_takes_its_local_ranks_gpu_under_auto_and_cuda(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A rank started by torchrun or srun (no ``FLODL_DEVICE``): ``auto`` and ``cuda`` take
    the GPU of its local rank among the visible ones; ``cpu`` and ``cuda:N`` are kept."""
    from flodl.rank.gpu import tier4_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert tier4_device("auto", {"LOCAL_RANK": "1"}) == "cuda:1"
    assert tier4_device("cuda", {"SLURM_LOCALID": "3"}) == "cuda:1"  # 3 mod 2 GPUs
    assert tier4_device("auto", {}) == "cuda:0"
    assert tier4_device("cpu", {"LOCAL_RANK": "1"}) == "cpu"
    assert tier4_device("cuda:1", {}) == "cuda:1"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert tier4_device("auto", {"LOCAL_RANK": "1"}) == "cpu"
    assert tier4_device("cuda", {}) == "cpu"  # (logged: CUDA asked but not available)


def test_a_cpu_device_has_no_gpu_identity() -> None:
    from flodl.rank.gpu import gpu_identity

    assert gpu_identity("cpu") is None
