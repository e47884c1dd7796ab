"""Data-plane tensor frames: a list of CPU tensors on a raw socket, without copying payloads.

The CPU reduce channel (docs/design.md §7) moves whole models (256 MiB and more
per frame), so this codec never concatenates: :func:`encode_tensor_frame` returns a buffer list
for ``socket.sendmsg`` whose f32 payloads are views of the tensors' own memory, and
:func:`~flodl.wire.tensor_read.read_tensor_frame` receives each payload straight into the
caller's preallocated tensors. This module owns the frame format and the sending side;
:mod:`flodl.wire.tensor_read` reads and decodes frames, :mod:`flodl.wire.data_hello` holds the
data channel's handshake.

Layout (one frame; every header and table field in network byte order)::

    fixed header, HEADER_BYTES = 28
      magic u32 = 0xF10D17F1 | version u8 = 2 | kind u8 (TensorKind) | flags u8 (KNOWN_FLAGS)
      | reserved u8 = 0 | weight f64 (finite, >= 0) | round u64 | num_tensors u32 (<= 65 536)
    tensor table, num_tensors entries, 10 + 4 * ndim bytes each
      dtype u8 (WireDtype) | ndim u8 (<= 8) | ndim * dim u32 | nbytes u64
    payloads, in table order: nbytes raw bytes each, native little-endian
    auth tag, TAG_BYTES = 16
      Poly1305(k, every preceding byte of the frame), with the one-time key
      k = HMAC-SHA256(key, b"flodl-tensor-frame-v2" || header and table || sender)

``key`` is what the data channel's handshake agreed (:mod:`flodl.wire.data_hello`): the
connection's upload key for an upload (bound to the run id, the rank and both ends' nonces),
the server's consensus key for a consensus (bound to the run id and the server's nonce); the
functions here call it ``secret`` and take any bytes, so standalone frames (tests, benchmarks)
can use a plain secret. ``sender`` says who sent the frame in which direction (it is not on
the wire: both ends know it): :func:`upload_sender` of the rank for an upload,
:data:`CONSENSUS_SENDER` for the server's consensus. The one-time key covers the header (kind,
weight, round, count), the whole table (dtypes, shapes, elisions) and the sender, so no two
different frames get the same Poly1305 key as long as each key sends one frame per
``(kind, round)`` and table: a connection uploads each round once, and a server's consensus
variants of one round (f32 and bf16 wires) differ in their tables. A frame replayed under
another round, kind, rank, connection, server or run, or in the other direction, fails its
tag. Version 1 frames (a truncated HMAC-SHA256 tag) are refused.

``nbytes`` is either ``numel * itemsize`` or 0. ``nbytes = 0`` with ``numel > 0`` is the
all-zero elision of protocol version 3 in the original: the tensor is all zeros and carries no
payload (idle ranks, zero rounds). Payloads are little-endian because torch stores them that way
on every supported host; importing this module on a big-endian host raises ``ImportError``.

Streaming senders and receivers: :func:`encode_frame_parts` returns a frame without its tag,
so a sender can put the payloads on the wire while another thread computes :func:`frame_tag`;
:func:`~flodl.wire.tensor_read.read_frame_prefix` and
:func:`~flodl.wire.tensor_read.read_frame_payloads` split
:func:`~flodl.wire.tensor_read.read_tensor_frame` for a receiver that looks at the header and
table before it picks the destination tensors.

Throughput: Poly1305 (``cryptography``) runs at about 13 GB/s per core, against about 2 GB/s for
the HMAC-SHA256 of version 1, which made authentication, not moving bytes, the ceiling of a
round; the key derivation is one HMAC over the header and table only.
"""

from __future__ import annotations

import ctypes
import enum
import hmac
import math
import os
import struct
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from cryptography.hazmat.primitives.poly1305 import Poly1305

from flodl.errors import FrameError, LocalProtocolError

if TYPE_CHECKING:
    import socket
    from collections.abc import Sequence

__all__ = [
    "INLINE_TAG_BYTES",
    "MAGIC",
    "VERSION",
    "HEADER_BYTES",
    "TAG_BYTES",
    "MAC_KEY_LABEL",
    "CONSENSUS_SENDER",
    "upload_sender",
    "frame_key",
    "MAX_TENSORS",
    "MAX_NDIM",
    "FLAG_SHM",
    "FLAG_SLOT1",
    "KNOWN_FLAGS",
    "MIN_FRAME_CEILING",
    "DEFAULT_MAX_FRAME_BYTES",
    "TensorKind",
    "WireDtype",
    "FrameHeader",
    "TensorSpec",
    "TensorLayout",
    "entry_nbytes",
    "frame_ceiling",
    "encode_tensor_frame",
    "encode_frame_parts",
    "frame_tag",
    "frame_nbytes",
    "send_buffers",
]

if sys.byteorder != "little":  # pragma: no cover - every torch CPU target today is little-endian
    raise ImportError("flodl tensor frames carry native little-endian payloads; host is big-endian")

MAGIC = 0xF10D17F1
"""First four bytes of every tensor frame (the original's RoundFrame magic)."""
VERSION = 2
"""Tensor frame layout version; a frame with another version is refused (1: HMAC-SHA256 tag)."""
TAG_BYTES = 16
"""Length of the Poly1305 auth tag that ends every frame."""
MAC_KEY_LABEL = b"flodl-tensor-frame-v2"
"""Domain separation prefix of the per-frame key derivation (:func:`frame_key`)."""
CONSENSUS_SENDER = b"down"
"""Sender discriminator of a consensus frame (server to every rank; one message, one key)."""
MAX_TENSORS = 65_536
MAX_NDIM = 8
FLAG_SHM = 0x01
"""Header flag: the payloads are in the connection's shared-memory segment, not in the frame
(:mod:`flodl.wire.shm`); the tag covers the header and table only."""
FLAG_SLOT1 = 0x02
"""With :data:`FLAG_SHM` on a consensus frame: the consensus is in slot 1 (else slot 0)."""
KNOWN_FLAGS = (0, FLAG_SHM, FLAG_SHM | FLAG_SLOT1)
"""Every flags byte a valid frame may carry."""
INLINE_TAG_BYTES = 1 << 20
"""Frames with fewer payload bytes compute their tag before sending; larger ones overlap the
tag computation with sending the payload (the tag goes last)."""

MIN_FRAME_CEILING = 64 * 1024 * 1024
"""Floor of :func:`frame_ceiling` (64 MiB)."""
DEFAULT_MAX_FRAME_BYTES = 1 << 30
"""Ceiling to use before the model size is known (1 GiB, as the original)."""

HEADER_STRUCT = struct.Struct("!IBBBBdQI")
HEADER_BYTES = HEADER_STRUCT.size
"""Size of the fixed header (28 bytes)."""
ENTRY_PREFIX = struct.Struct("!BB")
_ENTRY_NBYTES = struct.Struct("!Q")
_DIMS = tuple(struct.Struct(f"!{n}I") for n in range(MAX_NDIM + 1))
_MAX_DIM = (1 << 32) - 1
_MAX_ROUND = (1 << 64) - 1
_ZERO_PROBE = 4096
_IOV_MAX = max(16, os.sysconf("SC_IOV_MAX")) if hasattr(os, "sysconf") else 16


class TensorKind(enum.IntEnum):
    """What a frame carries (its ``kind`` byte)."""

    MODEL_PARAMS = 0
    MODEL_BUFFERS = 1
    CONTROL = 2
    """Control/counts: bookkeeping tensors of a sync window, always f32."""


class WireDtype(enum.IntEnum):
    """Element type of one tensor on the wire (its ``dtype`` byte)."""

    F32 = 0
    BF16 = 1
    F64 = 2
    I64 = 3

    @property
    def torch_dtype(self) -> torch.dtype:
        """The torch dtype of this wire type."""
        return _TORCH_DTYPE[self]

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return _ITEMSIZE[self]


_TORCH_DTYPE = {
    WireDtype.F32: torch.float32,
    WireDtype.BF16: torch.bfloat16,
    WireDtype.F64: torch.float64,
    WireDtype.I64: torch.int64,
}
_ITEMSIZE = {WireDtype.F32: 4, WireDtype.BF16: 2, WireDtype.F64: 8, WireDtype.I64: 8}
_WIRE_DTYPE = {dtype: wire for wire, dtype in _TORCH_DTYPE.items()}


@dataclass(frozen=True, slots=True)
class FrameHeader:
    """The fixed header of a tensor frame.

    Attributes:
        kind: what the frame carries.
        weight: the sender's work weight (uplink) or the round's summed weight (downlink).
        round: the reduce round this frame belongs to.
        num_tensors: number of entries in the tensor table.
        flags: flag bits, one of :data:`KNOWN_FLAGS` (0 but on the shared-memory lane).
        version: layout version, always :data:`VERSION` in a valid frame.
    """

    kind: TensorKind
    weight: float
    round: int
    num_tensors: int
    flags: int = 0
    version: int = VERSION


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One entry of the tensor table.

    Attributes:
        dtype: element type on the wire.
        shape: dimensions (``()`` for a 0-d scalar).
        nbytes: payload bytes that follow for this tensor: ``numel * itemsize``, or 0.
    """

    dtype: WireDtype
    shape: tuple[int, ...]
    nbytes: int

    @property
    def numel(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)

    @property
    def elided(self) -> bool:
        """True when the tensor is all zeros and its payload was left out."""
        return self.nbytes == 0 and self.numel > 0

    @property
    def entry_nbytes(self) -> int:
        """Size of this entry in the table."""
        return entry_nbytes(len(self.shape))


def entry_nbytes(ndim: int) -> int:
    """Size in bytes of a table entry for a tensor with ``ndim`` dimensions."""
    return ENTRY_PREFIX.size + 4 * ndim + _ENTRY_NBYTES.size


def accepts(wire: WireDtype, dst: torch.dtype) -> bool:
    """Whether a payload of type ``wire`` may land in a tensor of type ``dst``."""
    return dst == wire.torch_dtype or (wire is WireDtype.BF16 and dst == torch.float32)


def _parse_entry(
    table: bytes | bytearray | memoryview, offset: int, index: int, expect: torch.Tensor | None
) -> tuple[TensorSpec, int]:
    """Parse the table entry at ``offset``; return it and the offset just past it."""
    if offset + ENTRY_PREFIX.size > len(table):
        raise FrameError(f"tensor table truncated in entry {index}")
    code, ndim = ENTRY_PREFIX.unpack_from(table, offset)
    try:
        dtype = WireDtype(code)
    except ValueError:
        raise FrameError(f"tensor {index}: unknown dtype code {code}") from None
    if ndim > MAX_NDIM:
        raise FrameError(f"tensor {index}: ndim {ndim} exceeds the maximum of {MAX_NDIM}")
    if expect is not None and ndim != expect.dim():
        raise FrameError(
            f"tensor {index}: shape mismatch: frame has {ndim} dims, "
            f"out has shape {tuple(expect.shape)}"
        )
    end = offset + entry_nbytes(ndim)
    if end > len(table):
        raise FrameError(f"tensor table truncated in entry {index}")
    shape: tuple[int, ...] = _DIMS[ndim].unpack_from(table, offset + ENTRY_PREFIX.size)
    (nbytes,) = _ENTRY_NBYTES.unpack_from(table, end - _ENTRY_NBYTES.size)
    spec = TensorSpec(dtype, shape, nbytes)
    dense = spec.numel * dtype.itemsize
    if nbytes not in (0, dense):
        raise FrameError(
            f"tensor {index}: nbytes {nbytes} inconsistent with {dtype.name} x {shape} "
            f"({dense} bytes, or 0 for an all-zero tensor)"
        )
    if expect is not None:
        if shape != tuple(expect.shape):
            raise FrameError(
                f"tensor {index}: shape mismatch: frame {shape}, out {tuple(expect.shape)}"
            )
        if not accepts(dtype, expect.dtype):
            raise FrameError(
                f"tensor {index}: dtype mismatch: frame {dtype.name}, out {expect.dtype}"
            )
    return spec, end


@dataclass(frozen=True, slots=True)
class TensorLayout:
    """The parsed tensor table of a frame.

    Attributes:
        specs: one entry per tensor, in frame order.
    """

    specs: tuple[TensorSpec, ...]

    @classmethod
    def parse(
        cls,
        table: bytes | bytearray | memoryview,
        num_tensors: int,
        *,
        out: Sequence[torch.Tensor] | None = None,
    ) -> TensorLayout:
        """Parse ``num_tensors`` entries from the start of ``table``.

        Bytes past :attr:`table_nbytes` are not looked at. With ``out``, each entry is checked
        against the matching destination tensor as soon as it is parsed.

        Args:
            table: the bytes that follow the fixed header.
            num_tensors: from the fixed header.
            out: the tensors the payloads are meant for, if known.

        Returns:
            The layout.

        Raises:
            FrameError: truncated table, unknown dtype, ndim over 8, nbytes inconsistent with
                dtype * shape, or a count, shape or dtype mismatch against ``out``.
        """
        if out is not None and len(out) != num_tensors:
            raise FrameError(f"tensor count mismatch: frame has {num_tensors}, out has {len(out)}")
        specs: list[TensorSpec] = []
        offset = 0
        for index in range(num_tensors):
            spec, offset = _parse_entry(table, offset, index, None if out is None else out[index])
            specs.append(spec)
        return cls(tuple(specs))

    @staticmethod
    def expected_table_nbytes(out: Sequence[torch.Tensor]) -> int:
        """Size of the table of a frame that matches ``out`` (whatever its dtypes)."""
        return sum(entry_nbytes(t.dim()) for t in out)

    @property
    def table_nbytes(self) -> int:
        """Size of the table."""
        return sum(spec.entry_nbytes for spec in self.specs)

    @property
    def payload_nbytes(self) -> int:
        """Total payload bytes that follow the table."""
        return sum(spec.nbytes for spec in self.specs)

    @property
    def frame_nbytes(self) -> int:
        """Size of the whole frame: header, table, payloads and tag."""
        return HEADER_BYTES + self.table_nbytes + self.payload_nbytes + TAG_BYTES


def frame_ceiling(model_nbytes: int) -> int:
    """Largest frame a process accepts once its model is known: ``max(2 * model, 64 MiB)``.

    Args:
        model_nbytes: bytes of the model as it rides the wire (halved by the bf16 wire).

    Returns:
        The ``max_frame_bytes`` to pass to :func:`~flodl.wire.tensor_read.read_tensor_frame`.
    """
    if model_nbytes < 0:
        raise LocalProtocolError(f"model_nbytes must be >= 0, got {model_nbytes}")
    return max(2 * model_nbytes, MIN_FRAME_CEILING)


def weight_problem(weight: float) -> str | None:
    if math.isnan(weight):
        return "weight is NaN"
    if math.isinf(weight):
        return f"weight is {weight}"
    if weight < 0:
        return f"weight {weight!r} is negative"
    return None


def _all_zero(t: torch.Tensor) -> bool:
    """Whether every element of the contiguous, non-empty tensor ``t`` compares equal to 0."""
    flat = t.view(-1)
    numel = flat.numel()
    # A live tensor is almost never zero in a strided probe of a few thousand elements: that
    # answers in microseconds, and only (nearly) all-zero tensors pay the full scan.
    # count_nonzero scans 2-3x faster than any() on CPU (torch 2.13).
    if numel > _ZERO_PROBE and bool(flat[:: numel // _ZERO_PROBE].any()):
        return False
    return int(flat.count_nonzero()) == 0


def byte_view(t: torch.Tensor) -> memoryview:
    """Writable byte view of a contiguous CPU tensor's memory; no copy, keeps ``t`` alive."""
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(bytearray())
    # numpy is not a dependency, and torch exports no buffer protocol: map the memory by address.
    arr = (ctypes.c_char * n).from_address(t.data_ptr())
    arr._flodl_owner = t  # type: ignore[attr-defined]
    return memoryview(arr).cast("B")


def _check_frame_args(kind: TensorKind | int, weight: float, round: int, count: int) -> TensorKind:
    """Validate the header fields of a frame to send; return the kind as a :class:`TensorKind`."""
    try:
        kind = TensorKind(kind)
    except ValueError:
        raise LocalProtocolError(f"unknown tensor frame kind {kind!r}") from None
    problem = weight_problem(weight)
    if problem is not None:
        raise LocalProtocolError(problem)
    if not 0 <= round <= _MAX_ROUND:
        raise LocalProtocolError(f"round {round} does not fit in a u64")
    if count > MAX_TENSORS:
        raise LocalProtocolError(f"too many tensors: {count} > {MAX_TENSORS}")
    return kind


def encode_tensor_frame(
    tensors: Sequence[torch.Tensor],
    *,
    kind: TensorKind | int,
    weight: float,
    round: int,  # the protocol's word; the builtin is not used here
    secret: bytes,
    sender: bytes = b"",
    wire_dtype: torch.dtype | None = None,
    elide_zeros: bool = True,
) -> list[memoryview | bytes]:
    """Encode ``tensors`` as one frame, as a buffer list for ``sendmsg`` / ``writelines``.

    Contiguous f32, f64, i64 and bf16 CPU payloads are not copied: their buffers are views of
    the tensors' memory, so **the tensors must not be modified or resized until the buffers
    are sent** (the tag would no longer match, or the views would dangle). Non-contiguous or
    non-CPU tensors are copied once into a contiguous CPU tensor, kept alive by the buffers.

    Args:
        tensors: at most 65 536 tensors of float32, bfloat16, float64 or int64, ndim <= 8.
        kind: what the frame carries.
        weight: finite and >= 0.
        round: reduce round, 0 <= round < 2**64.
        secret: the key of this direction of the channel (derives the frame's Poly1305 key, see
            :func:`frame_key`).
        sender: who sends the frame (:func:`upload_sender`, :data:`CONSENSUS_SENDER`); the
            receiver must pass the same. The default ``b""`` is for standalone frames only
            (tests, benchmarks): two protocol roles must never share a sender.
        wire_dtype: ``None`` to send every tensor as it is, or ``torch.bfloat16`` to convert
            float32 tensors to bf16 (one conversion copy each); other dtypes ride unchanged.
        elide_zeros: leave out the payload of a tensor that is all zeros on the wire (a
            strided probe, then a full scan only if the probe finds no nonzero). The receiver
            writes +0.0 for a -0.0.

    Returns:
        Buffers: header and table as one ``bytes``, one ``memoryview`` per payload, the tag.

    Raises:
        LocalProtocolError: a value the frame cannot carry (bad kind, weight, round, wire
            dtype, tensor dtype, ndim or dimension, too many tensors).
    """
    kind = _check_frame_args(kind, weight, round, len(tensors))
    if wire_dtype is not None and wire_dtype != torch.bfloat16:
        raise LocalProtocolError(f"wire_dtype must be None or torch.bfloat16, got {wire_dtype}")

    wired = []
    for index, tensor in enumerate(tensors):
        t = _check_tensor(index, tensor).detach()
        if t.dtype == torch.float32 and wire_dtype is not None:
            t = t.to(device="cpu", dtype=torch.bfloat16)
        wired.append(t.cpu().contiguous())  # both no-ops for a contiguous CPU tensor
    head, payloads = _frame_parts(wired, kind, weight, round, elide_zeros, all_zero=False)
    return [head, *payloads, frame_tag(secret, head, payloads, sender=sender)]


def _check_tensor(index: int, tensor: torch.Tensor) -> torch.Tensor:
    """Refuse a tensor a frame cannot carry (dtype, ndim, a dimension over u32)."""
    if tensor.dtype not in _WIRE_DTYPE:
        raise LocalProtocolError(f"tensor {index}: unsupported dtype {tensor.dtype}")
    if tensor.dim() > MAX_NDIM:
        raise LocalProtocolError(f"tensor {index}: ndim {tensor.dim()} > {MAX_NDIM}")
    if any(d > _MAX_DIM for d in tensor.shape):
        raise LocalProtocolError(f"tensor {index}: dimension over u32 in {tuple(tensor.shape)}")
    return tensor


def _frame_parts(
    tensors: Sequence[torch.Tensor],
    kind: TensorKind,
    weight: float,
    round: int,
    elide_zeros: bool,
    *,
    all_zero: bool,
    flags: int = 0,
) -> tuple[bytes, list[memoryview]]:
    """Header + table and payload views of already validated, contiguous CPU tensors."""
    table = [HEADER_STRUCT.pack(MAGIC, VERSION, kind, flags, 0, float(weight), round, len(tensors))]
    payloads: list[memoryview] = []
    for t in tensors:
        wire = _WIRE_DTYPE[t.dtype]
        numel = t.numel()
        elided = numel > 0 and (all_zero or (elide_zeros and _all_zero(t)))
        nbytes = 0 if elided else numel * wire.itemsize
        table.append(ENTRY_PREFIX.pack(wire, t.dim()))
        table.append(_DIMS[t.dim()].pack(*t.shape))
        table.append(_ENTRY_NBYTES.pack(nbytes))
        if nbytes:
            payloads.append(byte_view(t))
    return b"".join(table), payloads


def encode_frame_parts(
    tensors: Sequence[torch.Tensor],
    *,
    kind: TensorKind | int,
    weight: float,
    round: int,  # the protocol's word; the builtin is not used here
    elide_zeros: bool = True,
    all_zero: bool = False,
    flags: int = 0,
) -> tuple[bytes, list[memoryview]]:
    """The frame of ``tensors`` without its tag, for senders that authenticate while sending.

    The frame is ``head``, then the payloads, then :func:`frame_tag` of both. Nothing is
    converted or copied: every tensor must already be a contiguous CPU tensor of a wire dtype
    (float32, bfloat16, float64, int64), and, as for :func:`encode_tensor_frame`, must not be
    modified until the frame is sent. Since the tag ends the frame, a sender may put the head
    and payloads on the wire while another thread computes the tag over the same memory (both
    Poly1305 and ``sendmsg`` release the GIL), which hides one authentication pass.

    Args:
        tensors: contiguous CPU tensors, at most 65 536, ndim <= 8.
        kind: what the frame carries.
        weight: finite and >= 0.
        round: reduce round, 0 <= round < 2**64.
        elide_zeros: as for :func:`encode_tensor_frame`.
        all_zero: the caller knows every tensor is all zeros: elide every payload without
            reading the tensors' contents (an idle rank's upload, a round with no weight).
            Only shapes and dtypes are read, so any layout will do, e.g. the zero-stride
            ``torch.zeros((), dtype=d).expand(shape)``.
        flags: the header's flags byte (:data:`KNOWN_FLAGS`). With :data:`FLAG_SHM` the
            frame is ``head`` and its tag only: the payloads returned are not sent (pass
            ``elide_zeros=False``, so the table gives every tensor's size in the segment).

    Returns:
        ``(head, payloads)``: header and table as one ``bytes``; one ``memoryview`` per
        payload that is not elided, in table order.

    Raises:
        LocalProtocolError: a value the frame cannot carry, or (unless ``all_zero``) a tensor
            that is not a contiguous CPU tensor.
    """
    kind = _check_frame_args(kind, weight, round, len(tensors))
    for index, tensor in enumerate(tensors):
        _check_tensor(index, tensor)
        if not all_zero and (tensor.device.type != "cpu" or not tensor.is_contiguous()):
            raise LocalProtocolError(f"tensor {index}: must be a contiguous CPU tensor")
    if flags not in KNOWN_FLAGS:
        raise LocalProtocolError(f"unknown tensor frame flags 0x{flags:02x}")
    detached = [t.detach() for t in tensors]
    return _frame_parts(detached, kind, weight, round, elide_zeros, all_zero=all_zero, flags=flags)


def upload_sender(rank: int) -> bytes:
    """Sender discriminator of rank ``rank``'s uploads: ``b"up"`` + rank as a u32."""
    if not 0 <= rank <= 0xFFFFFFFF:
        raise LocalProtocolError(f"rank {rank} does not fit in a u32")
    return b"up" + struct.pack("!I", rank)


def frame_key(secret: bytes, head: bytes | bytearray | memoryview, sender: bytes) -> bytes:
    """The one-time Poly1305 key of the frame that starts with ``head``.

    ``HMAC-SHA256(secret, MAC_KEY_LABEL + head + sender)``, 32 bytes. ``head`` (fixed header and
    table) is self-delimiting, so distinct ``(head, sender)`` pairs never share a key input.

    Args:
        secret: the key of this direction of the channel (see the module docstring).
        head: the frame's fixed header and tensor table, exactly as on the wire.
        sender: :func:`upload_sender` of the sending rank, or :data:`CONSENSUS_SENDER`.

    Returns:
        The 32-byte key.
    """
    return hmac.new(secret, MAC_KEY_LABEL + bytes(head) + sender, "sha256").digest()


def frame_tag(
    secret: bytes, head: bytes, payloads: Sequence[memoryview | bytes], *, sender: bytes = b""
) -> bytes:
    """The auth tag that ends the frame ``head`` + ``payloads`` (see :func:`encode_frame_parts`).

    Args:
        secret: the key of this direction of the channel (see the module docstring).
        head: header and table.
        payloads: the payload buffers, in order.
        sender: as for :func:`encode_tensor_frame`.

    Returns:
        Poly1305(:func:`frame_key` of ``head`` and ``sender``, head + payloads): 16 bytes.
    """
    mac = Poly1305(frame_key(secret, head, sender))
    mac.update(head)
    for payload in payloads:
        mac.update(payload)
    return mac.finalize()


def frame_nbytes(buffers: Sequence[memoryview | bytes]) -> int:
    """Total bytes of an encoded frame's buffer list."""
    return sum(b.nbytes if isinstance(b, memoryview) else len(b) for b in buffers)


def send_buffers(sock: socket.socket, buffers: Sequence[memoryview | bytes]) -> int:
    """Send every byte of ``buffers`` on a blocking socket with ``sendmsg`` (scatter, no join).

    Partial sends are resumed where they stopped; lists longer than the host's ``IOV_MAX`` go
    in batches.

    Args:
        sock: a connected stream socket in blocking mode (a timeout is allowed and raises).
        buffers: e.g. the result of :func:`encode_tensor_frame`.

    Returns:
        The number of bytes sent (:func:`frame_nbytes` of ``buffers``).
    """
    views = [v for v in (memoryview(b).cast("B") for b in buffers) if v.nbytes]
    total = 0
    first = 0
    while first < len(views):
        sent = sock.sendmsg(views[first : first + _IOV_MAX])
        total += sent
        while sent:
            size = views[first].nbytes
            if sent >= size:
                sent -= size
                first += 1
            else:
                views[first] = views[first][sent:]
                sent = 0
    return total
