"""A rank's GPU: which physical device its torch device is, and which device a rank started by
another launcher takes (docs/design.md §2c, "Devices").

Only rank processes call this (they may initialise CUDA; a launcher never does). torch is
imported by the calls, not the module: the bridge imports this without torch.

* :func:`gpu_identity` gives the UUID (``GPU-…``, as ``nvidia-smi`` and NVML write it) and the
  name of the GPU behind ``cuda:N``. Two ranks whose ``CUDA_VISIBLE_DEVICES`` differ both see
  ``cuda:0`` on different GPUs; the UUID tells them apart, so the coordinator can refuse two
  ranks of a collective mode on one GPU before NCCL fails on it.
* :func:`tier4_device` picks the device of a rank started by torchrun, SLURM or by hand from
  its ``TrainerConfig.device``: ``auto`` and ``cuda`` take the GPU of its local rank
  (``LOCAL_RANK``, ``SLURM_LOCALID``) among the visible ones when CUDA is available.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    import torch

__all__ = ["GpuIdentity", "gpu_identity", "cuda_index", "tier4_device"]

logger = logging.getLogger(__name__)

_LOCAL_RANK_VARS = ("LOCAL_RANK", "SLURM_LOCALID")


class GpuIdentity(NamedTuple):
    uuid: str
    name: str


def cuda_index(device: str | torch.device) -> int:
    """The CUDA index of ``device`` (``cuda`` alone: the current device)."""
    import torch

    dev = torch.device(device)
    return dev.index if dev.index is not None else torch.cuda.current_device()


def gpu_identity(device: str | torch.device) -> GpuIdentity | None:
    """UUID and name of the GPU behind ``device``; ``None`` for a CPU device or when CUDA
    cannot say (logged)."""
    if not str(device).startswith("cuda"):
        return None
    try:
        import torch

        props = torch.cuda.get_device_properties(cuda_index(device))
        raw = str(props.uuid)
    except Exception as exc:  # noqa: BLE001 - no identity is a weaker check, not a failure
        logger.info("no identity for %s: %s", device, exc)
        return None
    uuid = raw if raw.startswith("GPU-") else f"GPU-{raw}"
    return GpuIdentity(uuid[:96], str(props.name)[:96])


def tier4_device(configured: str, env: Mapping[str, str] | None = None) -> str:
    """The device of a rank no flodl launcher placed (no ``FLODL_DEVICE``): ``cpu`` and
    ``cuda:N`` as configured; ``auto`` and ``cuda`` the local rank's GPU (local rank mod the
    visible GPUs) when CUDA is available, else the CPU."""
    env = os.environ if env is None else env
    if configured == "cpu" or configured.startswith("cuda:"):
        return configured
    import torch

    if not torch.cuda.is_available():
        if configured == "cuda":
            logger.warning("device 'cuda' asked but CUDA is not available: this rank uses the CPU")
        return "cpu"
    local = next((env[v] for v in _LOCAL_RANK_VARS if env.get(v, "").isdigit()), "0")
    return f"cuda:{int(local) % torch.cuda.device_count()}"
