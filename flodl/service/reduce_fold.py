"""The reduce server's fold arithmetic: a round's uploads summed in rank order and divided, into
private memory or a shared-memory consensus slot, and which kinds of a round the slot holds as
bf16 (docs/design.md §1). No sockets, threads or locks: the server's fold worker owns the
:class:`Folder`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from flodl.service.reduce_buffers import Flat, Model, Upload
from flodl.wire.tensors import TensorKind, WireDtype

__all__ = ["FOLD_CHUNK_ELEMENTS", "Folder", "narrow_kinds"]

FOLD_CHUNK_ELEMENTS = 1 << 20
"""Elements per piece of a fold that widens bf16 uploads (4 MiB of f32: the piece, its widened
source and its bf16 sources stay in the last-level cache)."""


def narrow_kinds(
    models: Mapping[TensorKind, Model], uploads: Sequence[Upload], *, outer: bool
) -> frozenset[TensorKind]:
    """The kinds whose consensus goes into the shared slot as bf16: every rank of the round
    sent that kind's f32 tensors as bf16, so every rank receives them as bf16 (and, for the
    parameters, no ``outer`` optimizer steps their f32 consensus)."""
    narrow = set()
    for kind, model in models.items():
        f32 = [i for i, d in enumerate(model.dtypes) if d == torch.float32]
        if not f32 or (kind is TensorKind.MODEL_PARAMS and outer):
            continue
        if all(
            (u.param_wire if kind is TensorKind.MODEL_PARAMS else u.buffer_wire)[i]
            is WireDtype.BF16
            for u in uploads
            for i in f32
        ):
            narrow.add(kind)
    return frozenset(narrow)


class Folder:
    """Folds ``acc = sum(parts) / divisor``, keeping its scratch buffers between rounds
    (allocating one per round would cost more than a piece's work)."""

    def __init__(self) -> None:
        self._scratch: dict[tuple[str, torch.dtype], torch.Tensor] = {}

    def clear(self) -> None:
        self._scratch.clear()

    def fold(self, acc: Flat, parts: Sequence[Flat], divisor: float) -> None:
        """``acc`` = the sum of ``parts`` in rank order over ``divisor``, one flat tensor per
        accumulation dtype.

        Parts read in place from a shared segment may hold bf16 for an f32 accumulator: they
        are widened first, so the sum is the same f32 arithmetic as for a TCP upload (whose
        bf16 payload was widened on receipt). Such folds, and folds into a slot region viewed
        as bf16 (a narrowed round, :func:`narrow_kinds`), go in pieces of
        :data:`FOLD_CHUNK_ELEMENTS`, every pass over a piece while it is in cache; the
        narrowed region receives each piece's f32 result rounded to bf16, the values a TCP
        rank of bf16 wire receives. Other folds are whole-tensor passes."""
        for dtype, out in acc.flats.items():
            srcs = [p.flats[dtype] for p in parts]
            if out.dtype == dtype and all(s.dtype == dtype for s in srcs):
                self._sum(out, srcs, divisor)
                continue
            n = out.numel()
            for start in range(0, n, FOLD_CHUNK_ELEMENTS):
                end = min(n, start + FOLD_CHUNK_ELEMENTS)
                piece = [s[start:end] for s in srcs]
                if out.dtype == dtype:
                    self._sum(out[start:end], piece, divisor)
                else:  # summed in the accumulation dtype, then rounded into the slot
                    wide = self._buffer("sum", end - start, dtype)
                    self._sum(wide, piece, divisor)
                    out[start:end].copy_(wide)

    def _sum(self, out: torch.Tensor, srcs: list[torch.Tensor], divisor: float) -> None:
        """``out`` = the sum of ``srcs`` in order over ``divisor``, in ``out``'s dtype (bf16
        sources widened through a kept buffer: ``add_`` would allocate one)."""
        dtype = out.dtype
        if len(srcs) == 1 or srcs[0].dtype != dtype or srcs[1].dtype != dtype:
            out.copy_(srcs[0])
            rest = srcs[1:]
        else:
            torch.add(srcs[0], srcs[1], out=out)
            rest = srcs[2:]
        for src in rest:
            if src.dtype != dtype:
                part = self._buffer("widen", out.numel(), dtype)
                part.copy_(src)
                src = part
            out.add_(src)
        if divisor != 1.0:
            out.div_(divisor)

    def _buffer(self, use: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        buf = self._scratch.get((use, dtype))
        if buf is None or buf.numel() < numel:
            buf = torch.empty(max(numel, FOLD_CHUNK_ELEMENTS), dtype=dtype)
            self._scratch[(use, dtype)] = buf
        return buf[:numel]
