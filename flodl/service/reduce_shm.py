"""The reduce server's shared-memory lane (format: :mod:`flodl.wire.shm`): answering a local
rank's offer, reading uploads in place from its segment, and the two consensus slots the fold
writes into.

No sockets and no threads of its own: :class:`~flodl.service.reduce.ReduceServer`'s connection
threads call :meth:`ShmLane.answer` and :meth:`ShmLane.upload_flat`, its fold worker
:meth:`ShmLane.slot`, :meth:`ShmLane.stamp` and :meth:`ShmLane.consensus_head`.
"""

from __future__ import annotations

import logging
import threading

import torch

from flodl.errors import FrameError
from flodl.service.reduce_buffers import Flat, Model
from flodl.wire.shm import (
    FLAG_SHM,
    FLAG_SLOT1,
    HEADER_REGION,
    PROBE_BYTES,
    STAMP_WRITING,
    Offer,
    Region,
    SegmentLayout,
    encode_answer,
)
from flodl.wire.shm_segment import Segment
from flodl.wire.tensor_read import FramePrefix
from flodl.wire.tensors import TensorKind, encode_frame_parts

__all__ = ["ShmLane", "UploadSegment"]

logger = logging.getLogger(__name__)


class UploadSegment:
    """A rank's mapped upload segment and the flat views of it already built."""

    __slots__ = ("flats", "segment")

    def __init__(self, segment: Segment) -> None:
        self.segment = segment
        self.flats: dict[tuple[TensorKind, tuple[torch.dtype, ...]], Flat] = {}

    def close(self) -> None:
        self.flats.clear()
        self.segment.close()


def _flat(
    model: Model, regions: tuple[Region, ...], base: torch.Tensor, wires: tuple[torch.dtype, ...]
) -> Flat:
    return Flat.on(model, {r.dtype: r.view(base, w) for r, w in zip(regions, wires, strict=True)})


class ShmLane:
    """The server half of the lane.

    Args:
        enabled: ``False`` declines every offer (ranks keep TCP).
    """

    def __init__(self, *, enabled: bool = True) -> None:
        self.enabled = enabled
        self._lock = threading.Lock()
        self._consensus: Segment | None = None
        self._slot_bytes = 0
        # Owned by the fold worker once the consensus segment exists.
        self._slots: tuple[dict[tuple[TensorKind, bool], Flat], ...] | None = None
        self._stamps: torch.Tensor | None = None
        self._next = 0

    @property
    def active(self) -> bool:
        """Whether some rank's offer was accepted (the fold then writes into the slots)."""
        return self._consensus is not None

    def close(self) -> None:
        with self._lock:
            seg, self._consensus = self._consensus, None
            self._slots = None
            self._stamps = None
        if seg is not None:
            seg.close()

    # ------------------------------------------------------------------ connection threads
    def answer(self, key: bytes, offer: Offer, rank: int) -> tuple[bytes, UploadSegment | None]:
        """The answer to ``rank``'s offer and, when accepted, its mapped upload segment."""
        if not self.enabled:
            return encode_answer(key, offer, accepted=False), None
        slot_bytes = offer.size - HEADER_REGION
        if slot_bytes <= 0:
            logger.info("rank %d: shared-memory offer of %d bytes declined", rank, offer.size)
            return encode_answer(key, offer, accepted=False), None
        try:
            upload = Segment.open_peer(offer.pid, offer.fd, offer.size, offer.probe)
        except OSError as exc:  # another host, another user: the rank keeps TCP
            logger.info("rank %d: shared memory declined (%s); it uploads over TCP", rank, exc)
            return encode_answer(key, offer, accepted=False), None
        with self._lock:
            cons = self._consensus
            if cons is None:
                try:
                    cons = Segment.create(HEADER_REGION + 2 * slot_bytes, "flodl-consensus")
                except OSError as exc:
                    upload.close()
                    logger.warning("shared memory declined: no consensus segment (%s)", exc)
                    return encode_answer(key, offer, accepted=False), None
                stamps = cons.data[PROBE_BYTES : PROBE_BYTES + 16].view(torch.int64)
                stamps.fill_(STAMP_WRITING)
                self._consensus, self._slot_bytes, self._stamps = cons, slot_bytes, stamps
            elif slot_bytes != self._slot_bytes:
                upload.close()
                logger.info(
                    "rank %d: shared-memory offer for a %d-byte model, the lane's is %d bytes;"
                    " it uploads over TCP",
                    rank,
                    slot_bytes,
                    self._slot_bytes,
                )
                return encode_answer(key, offer, accepted=False), None
        logger.info("rank %d uploads through shared memory", rank)
        answer = encode_answer(
            key, offer, accepted=True, pid=cons.pid, fd=cons.fd, size=cons.size, probe=cons.probe
        )
        return answer, UploadSegment(upload)

    def upload_flat(
        self,
        upload: UploadSegment,
        kind: TensorKind,
        models: dict[TensorKind, Model],
        prefix: FramePrefix,
    ) -> Flat:
        """The upload a shared-memory frame announces, as views of the rank's segment in the
        frame's wire dtypes (nothing is copied).

        Raises:
            FrameError: an elided tensor, tensors of one region in two wire dtypes, or a
                layout that does not fit the segment.
        """
        specs = prefix.layout.specs
        if any(s.elided for s in specs):
            raise FrameError("a shared-memory frame elides a tensor (it carries them all)")
        model = models[kind]
        wires: dict[torch.dtype, torch.dtype] = {}
        for index, (spec, acc) in enumerate(zip(specs, model.dtypes, strict=True)):
            wire = spec.dtype.torch_dtype
            if wires.setdefault(acc, wire) != wire:
                raise FrameError(
                    f"{kind.name} tensor {index}: {spec.dtype.name} where the other {acc} "
                    f"tensors are {wires[acc]} (one wire dtype per region)"
                )
        key = (kind, tuple(wires[d] for d in dict.fromkeys(model.dtypes)))
        flat = upload.flats.get(key)
        if flat is None:
            layout = _layout(models, slots=1)
            regions = layout.params[0] if kind is TensorKind.MODEL_PARAMS else layout.buffers[0]
            end = max((r.offset + r.numel * r.dtype.itemsize for r in regions), default=0)
            if end > upload.segment.size:
                raise FrameError(
                    f"{kind.name} needs {end} bytes of shared memory, the segment has "
                    f"{upload.segment.size}"
                )
            flat = upload.flats[key] = _flat(model, regions, upload.segment.data, key[1])
        return flat

    # ------------------------------------------------------------------ fold worker
    def slot(
        self, models: dict[TensorKind, Model], narrow: frozenset[TensorKind] = frozenset()
    ) -> tuple[int, dict[TensorKind, Flat]] | None:
        """The slot the next fold writes (alternating), as the accumulators of both kinds, its
        stamp set to "being written"; None when the lane is not active or the model does not
        fit it (the fold then uses private memory).

        ``narrow``: the kinds whose f32 region holds this round's consensus as bf16, in the
        first half of the region (a round whose every rank has bf16 wire: each reads half the
        bytes and rounds nothing)."""
        if self._consensus is None or len(models) < 2:
            return None
        if self._slots is None:
            layout = _layout(models, slots=2)
            if layout.nbytes != self._consensus.size:
                logger.warning(
                    "the model needs %d bytes of consensus memory, the segment has %d: "
                    "shared-memory ranks are sent the consensus over TCP",
                    layout.nbytes,
                    self._consensus.size,
                )
                self.enabled = False
                return None
            base = self._consensus.data
            kinds = (
                (TensorKind.MODEL_PARAMS, layout.params),
                (TensorKind.MODEL_BUFFERS, layout.buffers),
            )
            self._slots = tuple(
                {
                    (kind, narrowed): _flat(
                        models[kind],
                        regions[k],
                        base,
                        tuple(
                            torch.bfloat16 if narrowed and r.dtype == torch.float32 else r.dtype
                            for r in regions[k]
                        ),
                    )
                    for kind, regions in kinds
                    for narrowed in (False, True)
                }
                for k in range(2)
            )
        assert self._stamps is not None
        k = self._next
        self._next ^= 1
        self._stamps[k] = STAMP_WRITING
        flats = self._slots[k]
        return k, {
            kind: flats[(kind, kind in narrow)]
            for kind in (TensorKind.MODEL_PARAMS, TensorKind.MODEL_BUFFERS)
        }

    def stamp(self, slot: int, cycle: int) -> None:
        """Slot ``slot`` now holds round ``cycle``'s consensus."""
        assert self._stamps is not None
        self._stamps[slot] = cycle

    @staticmethod
    def consensus_head(kind: TensorKind, acc: Flat, cycle: int, divisor: float, slot: int) -> bytes:
        """Header and table of the shared-memory consensus frame of ``kind`` in ``slot``."""
        flags = FLAG_SHM | (FLAG_SLOT1 if slot else 0)
        head, _ = encode_frame_parts(
            acc.views, kind=kind, weight=divisor, round=cycle, elide_zeros=False, flags=flags
        )
        return head


def _layout(models: dict[TensorKind, Model], *, slots: int) -> SegmentLayout:
    params = models[TensorKind.MODEL_PARAMS]
    buffers = models.get(TensorKind.MODEL_BUFFERS)
    return SegmentLayout.of(
        params.shapes,
        params.dtypes,
        () if buffers is None else buffers.shapes,
        () if buffers is None else buffers.dtypes,
        slots=slots,
    )
