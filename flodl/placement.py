"""Where ranks run, and which modes can run there (docs/design.md §2c, "Devices").

Pure module. A rank's :class:`Placement` is its host, its torch device (``cpu`` or
``cuda:N``) and, where the rank knows it, the physical GPU behind that device (its UUID: two
ranks whose ``CUDA_VISIBLE_DEVICES`` differ both see ``cuda:0`` on different GPUs, and the
same GPU can be ``cuda:0`` for one and ``cuda:1`` for another).

The CPU averaging modes train any placement: ranks on CPUs and GPUs mixed, several ranks on one
GPU. A collective mode averages with one ``torch.distributed`` backend among the ranks (NCCL on
CUDA, Gloo on CPU), so :func:`placement_problem` refuses, with a message naming the modes that
work, ranks on mixed device kinds and two ranks on one GPU (NCCL refuses a second rank on a
device it already serves). The launcher applies it before any process starts, the
coordinator to every rank that says hello (tier 4 ranks, whose devices no launcher knew).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from flodl.modes import MODE_TRAITS, ModeTraits

__all__ = [
    "DeviceKind",
    "Placement",
    "device_kind",
    "gpu_key",
    "cpu_averaging_modes",
    "placement_problem",
]

DeviceKind = Literal["cpu", "cuda"]


def device_kind(device: str) -> DeviceKind:
    """``cpu`` or ``cuda`` for a device string (``cuda``, ``cuda:N``)."""
    return "cuda" if device.startswith("cuda") else "cpu"


def cpu_averaging_modes() -> list[str]:
    """The modes that average through the coordinator's reduce server (any placement)."""
    return [mode for mode, traits in MODE_TRAITS.items() if traits.cpu_averaging]


@dataclass(frozen=True, slots=True)
class Placement:
    """One rank's place.

    Attributes:
        rank: the rank.
        host: the host's identity (``""`` when unknown: then only the GPU id tells GPUs apart).
        device: ``cpu`` or ``cuda:N``.
        gpu: the physical GPU (UUID) when known, else ``None`` (the device string stands in).
    """

    rank: int
    host: str
    device: str
    gpu: str | None = None

    @property
    def kind(self) -> DeviceKind:
        return device_kind(self.device)

    def where(self) -> str:
        """How messages name the place: ``cuda:0 of host 'a'``."""
        return f"{self.device} of host {self.host!r}" if self.host else self.device


def gpu_key(p: Placement) -> tuple[str, str]:
    """What names ``p``'s GPU: its UUID where known, else its host and device string."""
    if p.gpu:
        return ("", p.gpu)  # a UUID names one GPU anywhere
    return (p.host, p.device)


def placement_problem(traits: ModeTraits, placements: Sequence[Placement]) -> str | None:
    """Why ``traits.mode`` cannot train ranks placed like this, or ``None`` when it can.

    A CPU averaging mode trains any placement. A collective mode needs every rank on the same
    device kind and, on CUDA, each rank on a GPU of its own.
    """
    if traits.cpu_averaging or len(placements) < 2:
        return None
    others = ", ".join(cpu_averaging_modes())
    first = placements[0]
    for p in placements[1:]:
        if p.kind != first.kind:
            return (
                f"{traits.mode} averages with one torch.distributed backend (NCCL on CUDA, Gloo "
                f"on CPU), so its ranks must all be on CUDA or all on CPU: rank {first.rank} is "
                f"on {first.where()} and rank {p.rank} on {p.where()}; the CPU averaging modes "
                f"({others}) train ranks on mixed devices"
            )
    if first.kind != "cuda":
        return None
    seen: dict[tuple[str, str], Placement] = {}
    for p in placements:
        earlier = seen.setdefault(gpu_key(p), p)
        if earlier is not p:
            if earlier.device == p.device:
                both = f"ranks {earlier.rank} and {p.rank} are both on {p.where()}"
            else:  # one GPU under two names (the ranks' visibility masks differ)
                both = (
                    f"ranks {earlier.rank} ({earlier.device}) and {p.rank} ({p.device}) are "
                    f"both on one GPU" + (f" of host {p.host!r}" if p.host else "")
                )
            gpu = f" (GPU {p.gpu})" if p.gpu else ""
            return (
                f"{traits.mode} needs a GPU of its own for every rank (NCCL refuses two ranks "
                f"on one device): {both}{gpu}; give each rank its own GPU, or use a CPU "
                f"averaging mode ({others}), whose ranks may share one"
            )
    return None
