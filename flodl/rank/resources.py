"""A rank's resource use, sampled on the bridge thread and sent as ``resource_sample``
(docs/design.md §7, "Resource samples").

:class:`ResourceProbe` measures, between two calls:

* **CPU %**: the process's CPU time (every thread: the training loop, torch's intra-op pool,
  the bridge) over the wall time, so 100 % is one core busy and a rank using two threads
  fully reads 200 %;
* **RSS** from ``/proc/self/statm`` (Linux), else the peak RSS ``getrusage`` keeps; the host's
  physical memory as the total;
* on a CUDA device: **memory** allocated by torch on it (``torch.cuda.memory_allocated``) out of
  the device's total, and **utilisation** from NVML (the optional ``nvidia-ml-py`` package,
  ``pip install flodl[gpu]``) where it is installed; without NVML the utilisation is absent,
  never guessed.

Every measurement that fails is left out of the sample (a sample is never worth a failing
rank): the probe logs the failure once and keeps sampling the rest.
"""

from __future__ import annotations

import logging
import os
import resource
import sys
import time
from typing import Any, Final

from flodl.wire.frames import ResourceSample

__all__ = ["RESOURCE_INTERVAL_S", "ResourceProbe"]

logger = logging.getLogger(__name__)

RESOURCE_INTERVAL_S: Final = 5.0
"""Seconds between a rank's resource samples (the first comes one interval after the accept)."""


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return int(peak if sys.platform == "darwin" else peak * 1024)  # macOS: bytes, Linux: KiB


def _ram_total() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (OSError, ValueError):
        return 0


class ResourceProbe:
    """Samples this process's resources; see the module docstring.

    Args:
        rank: the rank the samples are of.
        device: the rank's torch device string (``"cpu"``, ``"cuda:1"``…).
    """

    def __init__(self, rank: int, device: str = "cpu") -> None:
        self.rank = rank
        self.device = device
        self._cpu = time.process_time()
        self._wall = time.monotonic()
        self._ram_total = _ram_total()
        self._warned: set[str] = set()
        self._nvml: Any = None
        self._nvml_handle: Any = None
        if device.startswith("cuda"):
            self._open_nvml()

    def _warn_once(self, what: str, exc: BaseException) -> None:
        if what not in self._warned:
            self._warned.add(what)
            logger.info("rank %d: no %s in resource samples: %s", self.rank, what, exc)

    def _cuda_index(self) -> int:
        _, _, index = self.device.partition(":")
        return int(index) if index else 0

    def _open_nvml(self) -> None:
        try:
            import pynvml  # nvidia-ml-py: optional

            pynvml.nvmlInit()
            self._nvml_handle = pynvml.nvmlDeviceGetHandleByIndex(self._cuda_index())
            self._nvml = pynvml
        except Exception as exc:  # noqa: BLE001 - absent or broken NVML: no utilisation
            self._warn_once("GPU utilisation (NVML)", exc)

    def sample(self) -> ResourceSample:
        """The sample since the previous call (or since construction)."""
        cpu, wall = time.process_time(), time.monotonic()
        elapsed = wall - self._wall
        cpu_percent = 100.0 * (cpu - self._cpu) / elapsed if elapsed > 0 else 0.0
        self._cpu, self._wall = cpu, wall
        fields: dict[str, Any] = {
            "rank": self.rank,
            "cpu_percent": min(100_000.0, max(0.0, cpu_percent)),
            "ram_used": _rss_bytes(),
            "ram_total": self._ram_total,
        }
        if self.device.startswith("cuda"):
            fields.update(self._gpu())
        return ResourceSample(**fields)

    def _gpu(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        try:
            import torch

            if not torch.cuda.is_available():
                raise RuntimeError("CUDA is not available")
            index = self._cuda_index()
            total = int(torch.cuda.get_device_properties(index).total_memory)
            out["vram_allocated"] = int(torch.cuda.memory_allocated(index))
            out["vram_total"] = total
        except Exception as exc:  # noqa: BLE001
            self._warn_once("GPU memory", exc)
        if self._nvml is not None:
            try:
                rates = self._nvml.nvmlDeviceGetUtilizationRates(self._nvml_handle)
                out["gpu_util_percent"] = float(min(100, max(0, rates.gpu)))
            except Exception as exc:  # noqa: BLE001
                self._warn_once("GPU utilisation (NVML)", exc)
        return out
