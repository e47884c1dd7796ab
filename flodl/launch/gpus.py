"""GPU discovery without a CUDA context: ask ``nvidia-smi`` (the launcher must never initialise
CUDA; ranks do that on their own devices).

``CUDA_VISIBLE_DEVICES`` is honoured: only the listed indices count, in the listed order (an
empty value hides every GPU; entries that are not indices, such as GPU UUIDs, are matched
against the UUID column).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["GpuInfo", "parse_nvidia_smi", "visible", "detect_gpus"]

QUERY = ["--query-gpu=index,uuid,name,memory.total", "--format=csv,noheader,nounits"]


@dataclass(frozen=True, slots=True)
class GpuInfo:
    index: int
    uuid: str
    name: str
    memory_mib: int


def parse_nvidia_smi(text: str) -> list[GpuInfo]:
    """Parse ``nvidia-smi --query-gpu=index,uuid,name,memory.total --format=csv,noheader,nounits``
    output; malformed lines are skipped."""
    gpus: list[GpuInfo] = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 4:
            continue
        try:
            gpus.append(GpuInfo(int(parts[0]), parts[1], parts[2], int(float(parts[3]))))
        except ValueError:
            continue
    return gpus


def visible(gpus: list[GpuInfo], env: Mapping[str, str]) -> list[GpuInfo]:
    """The GPUs ``CUDA_VISIBLE_DEVICES`` lets a process see, in its order."""
    mask = env.get("CUDA_VISIBLE_DEVICES")
    if mask is None:
        return list(gpus)
    chosen: list[GpuInfo] = []
    for entry in (e.strip() for e in mask.split(",")):
        if not entry:
            continue
        match = [g for g in gpus if (entry.isdigit() and g.index == int(entry)) or g.uuid == entry]
        if not match:
            break  # CUDA stops at the first invalid entry
        chosen.append(match[0])
    return chosen


def detect_gpus(env: Mapping[str, str] | None = None, timeout_s: float = 10.0) -> list[GpuInfo]:
    """GPUs visible to this process per ``nvidia-smi``; empty when it is absent or fails."""
    env = os.environ if env is None else env
    exe = shutil.which("nvidia-smi", path=env.get("PATH"))
    if exe is None:
        return []
    try:
        out = subprocess.run(
            [exe, *QUERY], capture_output=True, text=True, timeout=timeout_s, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return []
    if out.returncode != 0:
        return []
    return visible(parse_nvidia_smi(out.stdout), env)
