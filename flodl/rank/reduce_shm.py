"""The rank half of the data channel's shared-memory lane (format: :mod:`flodl.wire.shm`): its
upload segment, the server's consensus segment mapped read-only, and the views a round writes
and reads. No sockets: :class:`~flodl.rank.reduce_client.ReduceClient` sends the offer, reads
the answer and the frames.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from flodl.errors import CoordinatorLost, FrameError
from flodl.wire.shm import (
    FLAG_SLOT1,
    PROBE_BYTES,
    Answer,
    Region,
    SegmentLayout,
    acc_dtype,
    tensor_views,
)
from flodl.wire.shm_segment import Segment, available
from flodl.wire.tensor_read import FramePrefix
from flodl.wire.tensors import TensorKind

__all__ = ["LocalLane", "STAGE_ELEMENTS", "lane_problem", "through_stage"]

_KINDS = (TensorKind.MODEL_PARAMS, TensorKind.MODEL_BUFFERS)
STAGE_ELEMENTS = 1 << 18
"""Elements per piece of a rank's conversion through a small stage (a scaled upload, a
consensus rounded through bf16): 1 MiB of f32, which stays in a core's cache."""


def through_stage(
    dst: torch.Tensor,
    src: torch.Tensor,
    stage: torch.Tensor,
    op: Callable[[torch.Tensor, torch.Tensor], object],
) -> None:
    """``dst = op(src)`` for flat tensors, piece by piece through ``stage``: ``op(piece, out)``
    writes a piece of ``src`` into ``out`` (a prefix of ``stage``, on ``src``'s device and in
    its working dtype), which is then copied, and converted once, into ``dst``."""
    n, piece = src.numel(), stage.numel()
    for start in range(0, n, piece):
        end = min(n, start + piece)
        part = stage[: end - start]
        op(src[start:end], part)
        dst[start:end].copy_(part)


def lane_problem(params: Sequence[torch.Tensor], buffers: Sequence[torch.Tensor]) -> str | None:
    """Why these tensors cannot take the lane (``None`` when they can): the platform, or an
    accumulation region that would hold two wire dtypes (f32 and bf16 tensors side by side)."""
    why = available()
    if why is not None:
        return why
    for what, tensors in (("params", params), ("buffers", buffers)):
        natives: dict[torch.dtype, torch.dtype] = {}
        for t in tensors:
            if natives.setdefault(acc_dtype(t.dtype), t.dtype) != t.dtype:
                return f"{what} mix {natives[acc_dtype(t.dtype)]} and {t.dtype} tensors"
    return None


class LocalLane:
    """The rank's segments once the server accepted its offer.

    Create with :meth:`offer_segment` (before the offer), then :meth:`accept` the answer.
    """

    def __init__(self, params: Sequence[torch.Tensor], buffers: Sequence[torch.Tensor]) -> None:
        self._shapes = {
            TensorKind.MODEL_PARAMS: [tuple(t.shape) for t in params],
            TensorKind.MODEL_BUFFERS: [tuple(t.shape) for t in buffers],
        }
        self._natives = {
            TensorKind.MODEL_PARAMS: [t.dtype for t in params],
            TensorKind.MODEL_BUFFERS: [t.dtype for t in buffers],
        }
        self._accs = {k: [acc_dtype(d) for d in self._natives[k]] for k in _KINDS}
        args = (
            self._shapes[TensorKind.MODEL_PARAMS],
            self._accs[TensorKind.MODEL_PARAMS],
            self._shapes[TensorKind.MODEL_BUFFERS],
            self._accs[TensorKind.MODEL_BUFFERS],
        )
        self.upload_layout = SegmentLayout.of(*args, slots=1)
        self.consensus_layout = SegmentLayout.of(*args, slots=2)
        self.upload = Segment.create(self.upload_layout.nbytes, "flodl-upload")
        self.consensus: Segment | None = None
        self._upload_views: dict[tuple[TensorKind, bool], list[torch.Tensor]] = {}
        self._consensus_views: dict[tuple[object, ...], list[torch.Tensor]] = {}
        self._round_stage = torch.empty(0, dtype=torch.bfloat16)
        self._stamps: torch.Tensor | None = None

    def accept(self, answer: Answer) -> None:
        """Map the consensus segment the answer names.

        Raises:
            OSError: it cannot be mapped, or is not what was named.
        """
        if answer.size != self.consensus_layout.nbytes:
            raise OSError(
                f"the server's consensus segment is {answer.size} bytes, this model needs "
                f"{self.consensus_layout.nbytes}"
            )
        self.consensus = Segment.open_peer(answer.pid, answer.fd, answer.size, answer.probe)
        self._stamps = self.consensus.data[PROBE_BYTES : PROBE_BYTES + 16].view(torch.int64)

    def close(self) -> None:
        self._upload_views.clear()
        self._consensus_views.clear()
        self._stamps = None
        self.upload.close()
        if self.consensus is not None:
            self.consensus.close()

    def _regions(self, layout: SegmentLayout, kind: TensorKind, slot: int) -> tuple[Region, ...]:
        return layout.params[slot] if kind is TensorKind.MODEL_PARAMS else layout.buffers[slot]

    def upload_views(self, kind: TensorKind, bf16: bool) -> list[torch.Tensor]:
        """Where a round's upload of ``kind`` goes: the tensors' own dtypes, or with ``bf16``
        (this round's wire) f32 tensors narrowed to bf16 in the first half of their region, as
        a TCP rank of the same wire sends them (half the bytes to write and to fold)."""
        views = self._upload_views.get((kind, bf16))
        if views is None:
            accs = self._accs[kind]
            natives = self._natives[kind]
            if bf16:
                natives = [torch.bfloat16 if d == torch.float32 else d for d in natives]
            wire = dict(zip(accs, natives, strict=True))
            regions = self._regions(self.upload_layout, kind, 0)
            views = tensor_views(regions, self._shapes[kind], accs, self.upload.data, wire)
            self._upload_views[(kind, bf16)] = views
        return views

    def consensus_views(
        self, kind: TensorKind, prefix: FramePrefix
    ) -> tuple[int, list[torch.Tensor]]:
        """The slot a shared-memory consensus frame names and its tensors there, after
        checking the frame's table against the model: each region in its accumulation dtype,
        or an f32 region wholly as bf16 (a round every rank sent as bf16).

        Raises:
            FrameError: the table is not this model's in those dtypes.
        """
        specs = prefix.layout.specs
        shapes = [s.shape for s in specs]
        wires: dict[torch.dtype, torch.dtype] = {}
        fits = shapes == self._shapes[kind] and not any(s.elided for s in specs)
        if fits:
            for spec, acc in zip(specs, self._accs[kind], strict=True):
                wire = spec.dtype.torch_dtype
                narrowed = acc == torch.float32 and wire == torch.bfloat16
                if (wire != acc and not narrowed) or wires.setdefault(acc, wire) != wire:
                    fits = False
                    break
        if not fits:
            raise FrameError(f"shared-memory consensus {kind.name} table is not the model's")
        slot = 1 if prefix.header.flags & FLAG_SLOT1 else 0
        key = (kind, slot, tuple(sorted(wires.items(), key=str)))
        views = self._consensus_views.get(key)
        if views is None:
            assert self.consensus is not None
            regions = self._regions(self.consensus_layout, kind, slot)
            views = tensor_views(
                regions, self._shapes[kind], self._accs[kind], self.consensus.data, wires
            )
            self._consensus_views[key] = views
        return slot, views

    def check_stamp(self, slot: int, cycle: int) -> None:
        """Raise unless ``slot`` holds round ``cycle``'s consensus (before and after a copy).

        Raises:
            CoordinatorLost: the slot holds another round (rewritten under this rank: it fell
                two rounds behind while copying), so this rank's copy is not a consensus.
        """
        assert self._stamps is not None
        held = int(self._stamps[slot])
        if held != cycle:
            raise CoordinatorLost(
                f"consensus slot {slot} holds round {held} while reading round {cycle}"
            )

    def apply(
        self,
        dst: Sequence[torch.Tensor],
        src: Sequence[torch.Tensor],
        bf16: bool,
    ) -> None:
        """Copy the consensus ``src`` into ``dst``; with ``bf16`` (this round's wire) f32
        tensors are rounded through bf16 on the way, so the values are those a TCP rank of the
        same wire receives. The rounding goes through a cache-sized bf16 stage, piece by piece:
        memory is read and written once, as by a plain copy. A consensus the server already
        wrote as bf16 is only widened."""
        for d, s in zip(dst, src, strict=True):
            if not bf16 or s.dtype != torch.float32:
                d.copy_(s)
            elif not d.is_contiguous():
                d.copy_(s.to(torch.bfloat16))
            else:
                flat_s = s.reshape(-1)
                if self._round_stage.numel() < min(flat_s.numel(), STAGE_ELEMENTS):
                    self._round_stage = torch.empty(STAGE_ELEMENTS, dtype=torch.bfloat16)
                through_stage(d.view(-1), flat_s, self._round_stage, _round)


def _round(piece: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(piece)  # into the bf16 stage: the rounding
