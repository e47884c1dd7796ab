"""The shared-memory lane of the data channel: a rank on the reduce server's host moves its
parameters through memory instead of loopback TCP (docs/design.md §1).

Format only (no sockets, no mappings: :mod:`flodl.wire.shm_segment` maps the segments).

**Negotiation.** After the data handshake, before its first upload, a rank that wants the lane
creates an anonymous upload segment (``memfd``) and sends an **offer**; the server answers
with an **answer** that accepts it, naming the server's consensus segment, or declines it (the
rank then keeps uploading over TCP). Both name a segment as ``(pid, fd)``, which the peer opens
as ``/proc/<pid>/fd/<fd>``: the kernel lets only a process of the same user (or root) open
another's descriptors, no name is left in a shared namespace, and the memory goes with the last
process that maps it (a SIGKILL leaks nothing). Each segment starts with a 16-byte random
**probe** that travels in the authenticated message too: a peer that opened a segment whose
probe differs (another host, another pid namespace, a recycled pid) declines instead of
reading the wrong memory. Fields in network byte order::

    offer, rank -> server, OFFER_BYTES = 53
      magic u32 = 0xF10D17D0 | version u8 = SHM_VERSION | pid u32 | fd u32 | size u64
      | probe, 16 bytes
      | tag: HMAC-SHA256(upload key, "flodl-shm-offer" + the 37 preceding bytes), first 16
    answer, server -> rank, ANSWER_BYTES = 54
      magic u32 = 0xF10D17D1 | version u8 | accepted u8 (0 or 1) | pid u32 | fd u32 | size u64
      | probe, 16 bytes (all zero when declined)
      | tag: HMAC-SHA256(upload key, "flodl-shm-answer" + the 38 preceding bytes
        + the offer's tag), first 16

The upload key is the connection's (:mod:`flodl.wire.data_hello`), so an offer or answer
recorded on one connection fails on any other, and an answer answers one offer.

**Frames.** Once accepted, a round's upload is still a PARAMS and a BUFFERS tensor frame
(:mod:`flodl.wire.tensors`) with the header flag :data:`FLAG_SHM`: its table describes the
tensors, but its payloads are in the rank's upload segment at :class:`SegmentLayout`'s offsets
instead of on the stream, and its tag covers the header and table only. The server's consensus
frames to such a rank carry :data:`FLAG_SHM` too (plus :data:`FLAG_SLOT1` when the consensus is
in slot 1): the consensus is in the server's segment. A frame whose payloads are all elided
(weight 0) has no payload anywhere and goes without the flag. What the memory holds is not
authenticated: the threat model (docs/security-notes.md) trusts processes of the run's user.

**Layouts.** A segment holds a model's tensors as one flat region per accumulation dtype (f32,
or f64 for f64 tensors; bf16 tensors accumulate in f32), in the order of each dtype's first
tensor, exactly as the reduce server's flat buffers; each region is :data:`ALIGN`-aligned and
sized for the accumulation dtype. A region of f32 tensors sent as bf16 holds bf16 elements
packed from its start: an upload of bf16 wire, or a consensus slot of a round every rank sent
as bf16 (its frame's table says bf16). The upload segment is
``[probe region][params][buffers]``; the consensus segment is
``[probe, two stamps][slot 0: params, buffers][slot 1: …]``. A stamp is the round whose
consensus its slot holds (``-1`` while the server writes it): a rank checks it before and after
copying, so a slot rewritten under it is an error, never a silent mix. The server alternates
slots per fold, so a slot is reused only two folds later.
"""

from __future__ import annotations

import hmac
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from flodl.errors import FrameError, LocalProtocolError
from flodl.wire.tensors import FLAG_SHM, FLAG_SLOT1, KNOWN_FLAGS, TAG_BYTES

__all__ = [
    "FLAG_SHM",
    "FLAG_SLOT1",
    "KNOWN_FLAGS",
    "SHM_VERSION",
    "OFFER_MAGIC",
    "ANSWER_MAGIC",
    "OFFER_BYTES",
    "ANSWER_BYTES",
    "PROBE_BYTES",
    "ALIGN",
    "HEADER_REGION",
    "STAMP_WRITING",
    "Offer",
    "Answer",
    "encode_offer",
    "parse_offer",
    "encode_answer",
    "parse_answer",
    "acc_dtype",
    "Region",
    "SegmentLayout",
    "tensor_views",
]

SHM_VERSION = 1
OFFER_MAGIC = 0xF10D17D0
ANSWER_MAGIC = 0xF10D17D1
PROBE_BYTES = 16
ALIGN = 64
"""Alignment of every region of a segment (a cache line)."""
HEADER_REGION = ALIGN
"""Bytes before the first region: the probe, and in the consensus segment the two stamps."""
STAMP_WRITING = -1
"""A slot's stamp while the server writes it."""

_OFFER = struct.Struct("!IBIIQ16s")
_ANSWER = struct.Struct("!IBBIIQ16s")
OFFER_BYTES = _OFFER.size + TAG_BYTES
ANSWER_BYTES = _ANSWER.size + TAG_BYTES
_OFFER_LABEL = b"flodl-shm-offer"
_ANSWER_LABEL = b"flodl-shm-answer"
_U32 = (1 << 32) - 1
_U64 = (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class Offer:
    """A rank's upload segment, as its offer names it."""

    pid: int
    fd: int
    size: int
    probe: bytes
    tag: bytes


@dataclass(frozen=True, slots=True)
class Answer:
    """The server's answer: ``accepted``, and then its consensus segment."""

    accepted: bool
    pid: int
    fd: int
    size: int
    probe: bytes


def _tag(key: bytes, label: bytes, fields: bytes) -> bytes:
    return hmac.new(key, label + fields, "sha256").digest()[:TAG_BYTES]


def _check_ref(pid: int, fd: int, size: int, probe: bytes) -> None:
    if not (0 <= pid <= _U32 and 0 <= fd <= _U32 and 0 <= size <= _U64):
        raise LocalProtocolError(f"segment ({pid}, {fd}, {size}) does not fit the message")
    if len(probe) != PROBE_BYTES:
        raise LocalProtocolError(f"a probe is {PROBE_BYTES} bytes, got {len(probe)}")


def encode_offer(key: bytes, pid: int, fd: int, size: int, probe: bytes) -> bytes:
    """The offer of the upload segment ``/proc/<pid>/fd/<fd>`` of ``size`` bytes."""
    _check_ref(pid, fd, size, probe)
    fields = _OFFER.pack(OFFER_MAGIC, SHM_VERSION, pid, fd, size, probe)
    return fields + _tag(key, _OFFER_LABEL, fields)


def _check_head(data: bytes, want: int, magic: int, what: str) -> None:
    if len(data) != want:
        raise FrameError(f"shared-memory {what} of {len(data)} bytes, expected {want}")
    got_magic, version = struct.unpack_from("!IB", data)
    if got_magic != magic:
        raise FrameError(f"bad shared-memory {what} magic 0x{got_magic:08x}")
    if version != SHM_VERSION:
        raise FrameError(f"shared-memory {what} version {version}, this build {SHM_VERSION}")


def parse_offer(key: bytes, data: bytes | bytearray | memoryview) -> Offer:
    """Authenticate an offer.

    Raises:
        FrameError: wrong size, magic or version, or a bad tag.
    """
    data = bytes(data)
    _check_head(data, OFFER_BYTES, OFFER_MAGIC, "offer")
    fields, tag = data[: _OFFER.size], data[_OFFER.size :]
    if not hmac.compare_digest(_tag(key, _OFFER_LABEL, fields), tag):
        raise FrameError("bad shared-memory offer auth tag")
    _, _, pid, fd, size, probe = _OFFER.unpack(fields)
    return Offer(pid, fd, size, probe, tag)


def encode_answer(
    key: bytes,
    offer: Offer,
    *,
    accepted: bool,
    pid: int = 0,
    fd: int = 0,
    size: int = 0,
    probe: bytes = bytes(PROBE_BYTES),
) -> bytes:
    """The answer to ``offer``: accepted with the consensus segment ``(pid, fd, size,
    probe)``, or declined (the rank keeps TCP)."""
    _check_ref(pid, fd, size, probe)
    fields = _ANSWER.pack(ANSWER_MAGIC, SHM_VERSION, int(accepted), pid, fd, size, probe)
    return fields + _tag(key, _ANSWER_LABEL, fields + offer.tag)


def parse_answer(key: bytes, offer_bytes: bytes, data: bytes | bytearray | memoryview) -> Answer:
    """Authenticate the answer to the offer ``offer_bytes`` (as sent).

    Raises:
        FrameError: wrong size, magic or version, a bad tag (another offer's answer), or an
            accepted byte other than 0 or 1.
    """
    data = bytes(data)
    _check_head(data, ANSWER_BYTES, ANSWER_MAGIC, "answer")
    fields, tag = data[: _ANSWER.size], data[_ANSWER.size :]
    offer_tag = bytes(offer_bytes)[_OFFER.size :]
    if not hmac.compare_digest(_tag(key, _ANSWER_LABEL, fields + offer_tag), tag):
        raise FrameError("bad shared-memory answer auth tag")
    _, _, accepted, pid, fd, size, probe = _ANSWER.unpack(fields)
    if accepted not in (0, 1):
        raise FrameError(f"shared-memory answer accepted byte is {accepted}")
    return Answer(bool(accepted), pid, fd, size, probe)


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The accumulation dtype of a tensor of ``dtype`` (f64 stays f64, f32 and bf16 are f32)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass(frozen=True, slots=True)
class Region:
    """One flat per-dtype region: byte ``offset`` in its segment, ``numel`` elements."""

    dtype: torch.dtype
    offset: int
    numel: int

    def view(self, base: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The region's elements as a flat tensor of ``dtype`` (its own by default; bf16 for
        an f32 region sent as bf16) over the uint8 tensor ``base`` of the whole segment."""
        dtype = self.dtype if dtype is None else dtype
        nbytes = self.numel * dtype.itemsize
        return base[self.offset : self.offset + nbytes].view(dtype)


def _regions(
    shapes: Sequence[tuple[int, ...]], dtypes: Sequence[torch.dtype], start: int
) -> tuple[tuple[Region, ...], int]:
    sizes: dict[torch.dtype, int] = {}
    for shape, dtype in zip(shapes, dtypes, strict=True):
        sizes[dtype] = sizes.get(dtype, 0) + math.prod(shape)
    regions = []
    offset = start
    for dtype, numel in sizes.items():
        regions.append(Region(dtype, offset, numel))
        offset += _align(numel * dtype.itemsize)
    return tuple(regions), offset


@dataclass(frozen=True, slots=True)
class SegmentLayout:
    """Where a model's params and buffers lie in a segment: ``slots`` copies of (params regions,
    buffers regions) after the header region.

    Built from the shapes and accumulation dtypes of the model's tensors (both ends compute it
    from what they hold: the rank from its tensors, the server from the frames' tables).
    """

    params: tuple[tuple[Region, ...], ...]
    buffers: tuple[tuple[Region, ...], ...]
    nbytes: int

    @classmethod
    def of(
        cls,
        param_shapes: Sequence[tuple[int, ...]],
        param_dtypes: Sequence[torch.dtype],
        buffer_shapes: Sequence[tuple[int, ...]],
        buffer_dtypes: Sequence[torch.dtype],
        *,
        slots: int = 1,
    ) -> SegmentLayout:
        """The layout; ``*_dtypes`` are accumulation dtypes (:func:`acc_dtype`)."""
        offset = HEADER_REGION
        params, buffers = [], []
        for _ in range(slots):
            p, offset = _regions(param_shapes, param_dtypes, offset)
            b, offset = _regions(buffer_shapes, buffer_dtypes, offset)
            params.append(p)
            buffers.append(b)
        return cls(tuple(params), tuple(buffers), offset)


def tensor_views(
    regions: tuple[Region, ...],
    shapes: Sequence[tuple[int, ...]],
    dtypes: Sequence[torch.dtype],
    base: torch.Tensor,
    wire: dict[torch.dtype, torch.dtype] | None = None,
) -> list[torch.Tensor]:
    """One view per tensor (model order, accumulation ``dtypes``) of ``regions`` over the
    segment ``base``, each region in its wire dtype ``wire[acc]`` (its own by default)."""
    wire = wire or {}
    flats = {r.dtype: r.view(base, wire.get(r.dtype, r.dtype)) for r in regions}
    offsets = dict.fromkeys(flats, 0)
    out = []
    for shape, acc in zip(shapes, dtypes, strict=True):
        start, numel = offsets[acc], math.prod(shape)
        out.append(flats[acc][start : start + numel].view(shape))
        offsets[acc] = start + numel
    return out
