"""A model's identity and its final state: signatures, :class:`TrainedState`, death records."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch

from flodl.checkpoint import DEATH_SCHEMA_VERSION, write_death_record

__all__ = [
    "TrainedState",
    "model_signature",
    "float_buffers",
    "write_death_record",
    "DEATH_SCHEMA_VERSION",
]


@dataclass
class TrainedState:
    """CPU copies of a model's parameters and buffers, in ``parameters()``/``buffers()`` order.

    ``save_reason`` (and ``save_detail``, the coordinator's words) are set when the run ended
    through a ShutdownWithSave.
    """

    params: list[torch.Tensor] = field(default_factory=list)
    buffers: list[torch.Tensor] = field(default_factory=list)
    save_reason: str | None = None
    replicas_agree: bool | None = None
    """Whether every rank that delivered a final state held these exact parameters (``None``
    when fewer than two did)."""
    save_detail: str = ""

    @classmethod
    def of(cls, model: torch.nn.Module, save_reason: str | None = None) -> TrainedState:
        return cls(
            params=[p.detach().to("cpu", copy=True) for p in model.parameters()],
            buffers=[b.detach().to("cpu", copy=True) for b in model.buffers()],
            save_reason=save_reason,
        )

    def load_into(self, model: torch.nn.Module) -> None:
        """Copy this state into ``model`` (same architecture), in place."""
        params = list(model.parameters())
        buffers = list(model.buffers())
        if len(params) != len(self.params) or len(buffers) != len(self.buffers):
            raise ValueError(
                f"state has {len(self.params)} params / {len(self.buffers)} buffers, the model "
                f"{len(params)} / {len(buffers)}"
            )
        with torch.no_grad():
            for dst, src in zip(params + buffers, self.params + self.buffers, strict=True):
                if dst.shape != src.shape:
                    raise ValueError(f"shape mismatch: {tuple(dst.shape)} vs {tuple(src.shape)}")
                dst.copy_(src)


def model_signature(model: torch.nn.Module) -> str:
    """SHA-256 (hex) of parameter and buffer names, shapes and dtypes: ranks building a
    different model are refused at the handshake."""
    h = hashlib.sha256()
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype};".encode())
    return h.hexdigest()


def float_buffers(model: torch.nn.Module) -> list[torch.Tensor]:
    """Buffers that are averaged (floating point); integer ones such as
    ``num_batches_tracked`` are not."""
    return [b for b in model.buffers() if b.is_floating_point()]
