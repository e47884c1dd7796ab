"""The reduce server's buffers: the model's layout per frame kind, flat per-dtype storage and its
views, and a round's uploads, consensus frames and bookkeeping (no sockets, no threads).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from flodl.errors import FrameError
from flodl.wire.tensors import TensorKind, TensorLayout, WireDtype

__all__ = ["Model", "Flat", "Upload", "Outgoing", "Consensus", "Round"]

# Accumulation dtype per wire dtype: bf16 payloads are summed in f32.
_ACC_DTYPE = {
    WireDtype.F32: torch.float32,
    WireDtype.BF16: torch.float32,
    WireDtype.F64: torch.float64,
}


@dataclass(frozen=True, slots=True)
class Model:
    """The model's layout for one frame kind: shapes and accumulation dtypes, in frame order."""

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...]
    table_nbytes: int

    @classmethod
    def of(cls, kind: TensorKind, layout: TensorLayout) -> Model:
        dtypes = []
        for index, spec in enumerate(layout.specs):
            acc = _ACC_DTYPE.get(spec.dtype)
            if acc is None:
                raise FrameError(f"{kind.name} tensor {index}: {spec.dtype.name} is not averaged")
            dtypes.append(acc)
        shapes = tuple(spec.shape for spec in layout.specs)
        return cls(shapes, tuple(dtypes), layout.table_nbytes)

    def check(self, kind: TensorKind, layout: TensorLayout) -> None:
        """Raise FrameError unless ``layout`` is this model's (any accepted wire dtypes)."""
        if len(layout.specs) != len(self.shapes):
            raise FrameError(
                f"{kind.name} frame has {len(layout.specs)} tensors, the model {len(self.shapes)}"
            )
        for index, (spec, shape, dtype) in enumerate(
            zip(layout.specs, self.shapes, self.dtypes, strict=True)
        ):
            if spec.shape != shape or _ACC_DTYPE.get(spec.dtype) != dtype:
                raise FrameError(
                    f"{kind.name} tensor {index}: {spec.dtype.name} {spec.shape} differs from "
                    f"the model's {dtype} {shape}"
                )


class Flat:
    """Tensors of a model layout stored as one flat tensor per dtype (so a fold is one op).

    Attributes:
        flats: the flat storage, keyed by the model's (accumulation) dtype.
        views: one view per tensor of the model, in frame order.
    """

    __slots__ = ("flats", "views")

    def __init__(self, flats: dict[torch.dtype, torch.Tensor], views: list[torch.Tensor]) -> None:
        self.flats = flats
        self.views = views

    @classmethod
    def allocate(cls, model: Model) -> Flat:
        """Uninitialized storage for ``model`` in its accumulation dtypes."""
        sizes: dict[torch.dtype, int] = {}
        for shape, dtype in zip(model.shapes, model.dtypes, strict=True):
            sizes[dtype] = sizes.get(dtype, 0) + math.prod(shape)
        flats = {d: torch.empty(n, dtype=d) for d, n in sizes.items()}
        return cls(flats, _views(model, flats))

    @classmethod
    def on(cls, model: Model, flats: dict[torch.dtype, torch.Tensor]) -> Flat:
        """Storage given per accumulation dtype (e.g. regions of a shared segment; a region of
        f32 tensors may hold bf16 elements), viewed as ``model``'s tensors."""
        return cls(flats, _views(model, flats))

    @classmethod
    def bf16_mirror(cls, model: Model, acc: Flat) -> Flat:
        """bf16 storage for the f32 tensors of ``acc``; its other tensors are shared."""
        flats = dict(acc.flats)
        if torch.float32 in flats:
            flats[torch.float32] = torch.empty_like(flats[torch.float32], dtype=torch.bfloat16)
        return cls(flats, _views(model, flats))


def _views(model: Model, flats: dict[torch.dtype, torch.Tensor]) -> list[torch.Tensor]:
    offsets = dict.fromkeys(flats, 0)
    views: list[torch.Tensor] = []
    for shape, dtype in zip(model.shapes, model.dtypes, strict=True):
        start, numel = offsets[dtype], math.prod(shape)
        views.append(flats[dtype][start : start + numel].view(shape))
        offsets[dtype] = start + numel
    return views


@dataclass(eq=False, slots=True)
class Upload:
    """What one rank sent for a round (its buffers stay untouched until the round is done)."""

    weight: float
    mover: bool
    params: Flat
    buffers: Flat
    param_wire: tuple[WireDtype, ...]
    buffer_wire: tuple[WireDtype, ...]
    shm: bool = False
    """The rank reads the consensus in place (its shared-memory offer was accepted)."""


@dataclass(eq=False, slots=True)
class Outgoing:
    """One consensus frame: head and payloads are final when published; the tag follows."""

    head: bytes
    payloads: list[memoryview]
    tag: bytes | None = None


@dataclass(eq=False, slots=True)
class Consensus:
    contributors: tuple[int, ...]
    weight_total: float
    frames: dict[int, tuple[Outgoing, Outgoing]]
    sending: set[int]


@dataclass(eq=False, slots=True)
class Round:
    """A round's payloads and its consensus (which uploads it expects is the round book's)."""

    cycle: int
    uploads: dict[int, Upload] = field(default_factory=dict)
    consensus: Consensus | None = None
    failed: bool = False
