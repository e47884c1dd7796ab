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
