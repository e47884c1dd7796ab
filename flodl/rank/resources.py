"""A rank's resource use, sampled on the bridge thread and sent as ``resource_sample``
(docs/design.md §7, "Resource samples").

:class:`ResourceProbe` measures, between two calls:

* **CPU %**: the process's CPU time (every thread: the training loop, torch's intra-op pool,
  the bridge) over the wall time, so 100 % is one core busy and a rank using two threads
  fully reads 200 %;
* **RSS** from ``/proc/self/statm`` (Linux), else the peak RSS ``getrusage`` keeps; the host's
  physical memory as the total;
* on a CUDA device: **memory** allocated by torch on it (``torch.cuda.memory_allocated``) and
  held by its caching allocator (``memory_reserved``) out of the device's total, the GPU's
  name, and **utilisation** from NVML (the optional ``nvidia-ml-py`` package,
  ``pip install flodl[gpu]``) where it is installed, for the GPU found by its UUID (NVML counts
  every GPU of the host, ``torch`` only the visible ones); without NVML the utilisation is
  absent, never guessed.

Ranks sample on their bridge thread (:class:`~flodl.rank.bridge.RankBridge`, every
:data:`RESOURCE_INTERVAL_S` and once more as they finish); the single-device tier on a
:class:`ResourceSampler` thread. (A cooperative ``Worker`` on one device has no monitoring,
so nothing to sample into.)

Every measurement that fails is left out of the sample (a sample is never worth a failing
rank): the probe logs the failure once and keeps sampling the rest.
"""

from __future__ import annotations

import logging
import os
import resource
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, Final

from flodl.rank.gpu import cuda_index, gpu_identity
from flodl.wire.frames import ResourceSample

__all__ = ["RESOURCE_INTERVAL_S", "ResourceProbe", "ResourceSampler"]

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
        self._gpu_name: str | None = None
        self._lock = threading.Lock()
        if device.startswith("cuda"):
            self._open_nvml()

    def _warn_once(self, what: str, exc: BaseException) -> None:
        if what not in self._warned:
            self._warned.add(what)
            logger.info("rank %d: no %s in resource samples: %s", self.rank, what, exc)

    def _open_nvml(self) -> None:
        identity = gpu_identity(self.device)  # (never raises: None when CUDA cannot say)
        if identity is not None:
            self._gpu_name = identity.name
        try:
            import pynvml  # nvidia-ml-py: optional

            pynvml.nvmlInit()
            if identity is not None:
                self._nvml_handle = pynvml.nvmlDeviceGetHandleByUUID(identity.uuid)
            else:
                self._nvml_handle = pynvml.nvmlDeviceGetHandleByIndex(cuda_index(self.device))
            self._nvml = pynvml
        except Exception as exc:  # noqa: BLE001 - absent or broken NVML: no utilisation
            self._warn_once("GPU utilisation (NVML)", exc)

    def sample(self) -> ResourceSample:
        """The sample since the previous call (or since construction); thread-safe."""
        with self._lock:
            cpu, wall = time.process_time(), time.monotonic()
            elapsed = wall - self._wall
            cpu_percent = 100.0 * (cpu - self._cpu) / elapsed if elapsed > 0 else 0.0
            self._cpu, self._wall = cpu, wall
        fields: dict[str, Any] = {
            "rank": self.rank,
            "cpu_percent": min(100_000.0, max(0.0, cpu_percent)),
            "ram_used": _rss_bytes(),
            "ram_total": self._ram_total,
            "device": self.device[:64],
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
            index = cuda_index(self.device)
            total = int(torch.cuda.get_device_properties(index).total_memory)
            out["vram_allocated"] = int(torch.cuda.memory_allocated(index))
            out["vram_reserved"] = int(torch.cuda.memory_reserved(index))
            out["vram_total"] = total
            if self._gpu_name is not None:
                out["gpu_name"] = self._gpu_name
        except Exception as exc:  # noqa: BLE001
            self._warn_once("GPU memory", exc)
        if self._nvml is not None:
            try:
                rates = self._nvml.nvmlDeviceGetUtilizationRates(self._nvml_handle)
                out["gpu_util_percent"] = float(min(100, max(0, rates.gpu)))
            except Exception as exc:  # noqa: BLE001
                self._warn_once("GPU utilisation (NVML)", exc)
        return out


class ResourceSampler:
    """A daemon thread that hands ``sink`` a sample every ``every_s`` and once more at
    :meth:`stop` (a run shorter than one interval still has one). For the tier without a
    bridge thread: one device in process.

    Args:
        probe: what to sample.
        sink: where each sample goes (a failure is logged once; sampling goes on).
        every_s: the interval.
    """

    def __init__(
        self,
        probe: ResourceProbe,
        sink: Callable[[ResourceSample], None],
        every_s: float = RESOURCE_INTERVAL_S,
    ) -> None:
        self._probe = probe
        self._sink = sink
        self._every_s = every_s
        self._stop = threading.Event()
        self._failed = False
        self._thread = threading.Thread(target=self._run, name="flodl-resources", daemon=True)

    def start(self) -> ResourceSampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        """End the thread after one last sample. Idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join()
        self._take()

    def _run(self) -> None:
        while not self._stop.wait(self._every_s):
            self._take()

    def _take(self) -> None:
        if self._failed:
            return
        try:
            self._sink(self._probe.sample())
        except Exception:  # a probe or sink bug costs the samples, never the run
            self._failed = True
            logger.exception("resource sampling failed; no more samples")
