"""Reading tensor frames (format: :mod:`flodl.wire.tensors`): from a socket into the caller's
preallocated tensors, or from memory; payloads land in place and the tag is checked last.

Reading is two-step so a socket reader can receive in place. The fixed header has a constant
size and :func:`parse_header` validates it. The table size then follows from ``num_tensors``
and each entry's ``ndim``: a reader without expectations reads 2 bytes (dtype, ndim), then
``4 * ndim + 8`` (:func:`~flodl.wire.tensors.entry_nbytes`), ``num_tensors`` times. A reader
that knows the tensors it expects computes the whole table size up front
(:meth:`~flodl.wire.tensors.TensorLayout.expected_table_nbytes`) and reads it in one call,
which is what :func:`read_tensor_frame` does. :class:`~flodl.wire.tensors.TensorLayout`
parses the table and checks it against the destination tensors.

The tag is checked last, after every payload has been written into the destination tensors
(that is what "receive in place" costs). **On a FrameError the contents of ``out`` are
unspecified and the caller must discard them**; the reduce server receives into per-rank
buffers for this reason. A mismatch between the frame and ``out`` (count, shape, dtype) and an
oversize frame are detected from the header and table, before any payload byte is written.
"""

from __future__ import annotations

import hmac
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from cryptography.hazmat.primitives.poly1305 import Poly1305

from flodl.errors import FrameError, LocalProtocolError
from flodl.wire.tensors import (
    ENTRY_PREFIX,
    FLAG_SHM,
    HEADER_BYTES,
    HEADER_STRUCT,
    KNOWN_FLAGS,
    MAGIC,
    MAX_NDIM,
    MAX_TENSORS,
    TAG_BYTES,
    VERSION,
    FrameHeader,
    TensorKind,
    TensorLayout,
    accepts,
    byte_view,
    entry_nbytes,
    frame_key,
    weight_problem,
)

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

__all__ = [
    "parse_header",
    "read_tensor_frame",
    "FramePrefix",
    "read_frame_prefix",
    "read_frame_payloads",
    "read_frame_tag",
    "decode_tensor_frame",
]

logger = logging.getLogger(__name__)

# How much a memory-backed reader hands out per call: small enough that the MAC reads each chunk
# from cache right after it was copied into place.
_MEMORY_CHUNK = 256 * 1024


def parse_header(prefix: bytes | bytearray | memoryview) -> FrameHeader:
    """Parse and validate the fixed header at the start of ``prefix``.

    Args:
        prefix: at least :data:`~flodl.wire.tensors.HEADER_BYTES` bytes; only those are read.

    Returns:
        The header.

    Raises:
        FrameError: short prefix, bad magic, unsupported version, unknown kind, unknown flags,
            a nonzero reserved byte, weight NaN, infinite or negative, more than 65 536 tensors.
    """
    if len(prefix) < HEADER_BYTES:
        raise FrameError(f"truncated tensor frame header: {len(prefix)} of {HEADER_BYTES} bytes")
    magic, version, kind, flags, reserved, weight, round_, num_tensors = HEADER_STRUCT.unpack_from(
        prefix, 0
    )
    if magic != MAGIC:
        raise FrameError(f"bad magic 0x{magic:08x} (tensor frames start with 0x{MAGIC:08x})")
    if version != VERSION:
        old = " (a flodl from before Poly1305 frame tags)" if version == 1 else ""
        raise FrameError(
            f"unsupported tensor frame version {version}{old}: this build speaks {VERSION}; "
            "every process of a run must use the same flodl"
        )
    try:
        kind = TensorKind(kind)
    except ValueError:
        raise FrameError(f"unknown tensor frame kind {kind}") from None
    if flags not in KNOWN_FLAGS:
        raise FrameError(f"unknown tensor frame flags 0x{flags:02x}")
    if reserved:
        raise FrameError(f"reserved header byte is {reserved}, must be 0")
    problem = weight_problem(weight)
    if problem is not None:
        raise FrameError(problem)
    if num_tensors > MAX_TENSORS:
        raise FrameError(f"too many tensors: {num_tensors} > {MAX_TENSORS}")
    return FrameHeader(kind, weight, round_, num_tensors, flags, version)


def _recv_exactly(
    recv_into: Callable[[memoryview], int],
    view: memoryview,
    mac: Poly1305 | None,
    what: str,
) -> None:
    """Fill ``view`` from ``recv_into``, feeding each chunk to ``mac`` as it lands."""
    got = 0
    want = view.nbytes
    while got < want:
        n = recv_into(view[got:])
        if n <= 0:
            raise FrameError(f"truncated tensor frame: EOF in {what} after {got} of {want} bytes")
        if mac is not None:
            mac.update(view[got : got + n])
        got += n


def read_tensor_frame(
    recv_into: Callable[[memoryview], int],
    out: Sequence[torch.Tensor],
    *,
    secret: bytes,
    max_frame_bytes: int,
    scratch: torch.Tensor | None = None,
    sender: bytes = b"",
) -> FrameHeader:
    """Receive exactly one frame, writing its payloads into the preallocated ``out`` tensors.

    A payload whose dtype equals its destination's, bound for a contiguous CPU tensor, is
    received straight into that tensor's memory. Others (bf16 into float32, or a
    non-contiguous or non-CPU destination) land in ``scratch`` first and are copied with
    ``out[i].copy_()``, so a bf16 payload is accumulated as f32. Elided tensors are zeroed.

    Direct writes bypass autograd (no version-counter bump), as under ``torch.no_grad()``;
    ``out`` must not be read or written by another thread meanwhile. On a :class:`FrameError`
    the contents of ``out`` are unspecified: discard them.

    Args:
        recv_into: blocking ``socket.recv_into``-like callable: fills a prefix of the given
            buffer, returns how many bytes it wrote, 0 at EOF.
        out: one destination per tensor of the frame, same shapes; float32 destinations also
            accept bf16 payloads.
        secret: the key of this direction of the channel (derives the frame's Poly1305 key).
        max_frame_bytes: ceiling on the whole frame, checked before any payload is read (see
            :func:`~flodl.wire.tensors.frame_ceiling`).
        scratch: optional uint8 CPU tensor reused as the staging buffer across calls; it is
            grown in place (``resize_``) when too small.
        sender: who sent the frame, as the sender passed it (see
            :func:`~flodl.wire.tensors.encode_tensor_frame`).

    Returns:
        The frame's header.

    Raises:
        FrameError: bad header or table, mismatch against ``out``, oversize, EOF mid-frame, or
            bad tag.
        LocalProtocolError: ``scratch`` is not a contiguous uint8 CPU tensor.
    """
    if scratch is not None:
        _check_scratch(scratch)  # before the first byte: a bad argument must not desync the stream
    head = memoryview(bytearray(HEADER_BYTES))
    _recv_exactly(recv_into, head, None, "header")
    header = parse_header(head)
    if header.flags & FLAG_SHM:
        raise FrameError("a shared-memory frame where a frame with its payloads was expected")
    if header.num_tensors != len(out):
        raise FrameError(
            f"tensor count mismatch: frame has {header.num_tensors}, out has {len(out)}"
        )
    table_nbytes = TensorLayout.expected_table_nbytes(out)
    if HEADER_BYTES + table_nbytes + TAG_BYTES > max_frame_bytes:
        raise FrameError(
            f"tensor frame exceeds the {max_frame_bytes} byte ceiling: its table alone is "
            f"{table_nbytes} bytes"
        )
    table = memoryview(bytearray(table_nbytes))
    _recv_exactly(recv_into, table, None, "tensor table")
    layout = TensorLayout.parse(table, header.num_tensors, out=out)
    size = layout.frame_nbytes
    if size > max_frame_bytes:
        raise FrameError(f"tensor frame of {size} bytes exceeds the {max_frame_bytes} byte ceiling")

    mac = _head_mac(secret, bytes(head) + bytes(table), sender)
    _read_payloads(recv_into, layout, out, mac, scratch, zero_elided=True)
    return header


def _head_mac(secret: bytes, head: bytes, sender: bytes) -> Poly1305:
    """The frame's Poly1305 state after its header and table (``head``)."""
    mac = Poly1305(frame_key(secret, head, sender))
    mac.update(head)
    return mac


def _read_payloads(
    recv_into: Callable[[memoryview], int],
    layout: TensorLayout,
    out: Sequence[torch.Tensor],
    mac: Poly1305,
    scratch: torch.Tensor | None,
    *,
    zero_elided: bool,
) -> None:
    """Receive the payloads of ``layout`` into ``out`` (already checked), then check the tag."""
    direct = [
        spec.nbytes > 0
        and dst.dtype == spec.dtype.torch_dtype
        and dst.device.type == "cpu"
        and dst.is_contiguous()
        for spec, dst in zip(layout.specs, out, strict=True)
    ]
    staged = max(
        (s.nbytes for s, d in zip(layout.specs, direct, strict=True) if s.nbytes and not d),
        default=0,
    )
    if staged:
        scratch = _ready_scratch(scratch, staged)

    with torch.no_grad():
        for index, (spec, dst) in enumerate(zip(layout.specs, out, strict=True)):
            what = f"tensor {index} payload"
            if spec.elided:
                if zero_elided:
                    dst.zero_()
            elif direct[index]:
                _recv_exactly(recv_into, byte_view(dst), mac, what)
            elif spec.nbytes:
                assert scratch is not None  # sized above whenever a payload is staged
                stage = scratch[: spec.nbytes]
                _recv_exactly(recv_into, byte_view(stage), mac, what)
                dst.copy_(stage.view(spec.dtype.torch_dtype).view(spec.shape))

    tag = memoryview(bytearray(TAG_BYTES))
    _recv_exactly(recv_into, tag, None, "auth tag")
    if not hmac.compare_digest(mac.finalize(), tag):
        raise FrameError(
            "bad tensor frame auth tag (not keyed to this run, server and connection, or corrupted)"
        )


@dataclass(frozen=True, slots=True)
class FramePrefix:
    """The header and table of a frame whose payloads are still on the wire.

    Returned by :func:`read_frame_prefix`, consumed once by :func:`read_frame_payloads`.

    Attributes:
        header: the validated fixed header.
        layout: the parsed tensor table.
        mac: the frame's running Poly1305 (one-time key) over every byte read so far (header
            and table).
    """

    header: FrameHeader
    layout: TensorLayout
    mac: Poly1305


def read_frame_prefix(
    recv_into: Callable[[memoryview], int],
    *,
    secret: bytes,
    max_frame_bytes: int,
    table_nbytes: int | None = None,
    sender: bytes = b"",
) -> FramePrefix:
    """Receive and validate the header and table of one frame, leaving its payloads unread.

    The receiving half of :func:`read_tensor_frame` for a reader that decides where the
    payloads go only after seeing the header (its kind, round, weight) and the table (a
    receiver that allocates its buffers from the first frame). Nothing is authenticated yet:
    the tag is checked by :func:`read_frame_payloads`, so act on nothing here but what
    rejecting the frame needs.

    Args:
        recv_into: as for :func:`read_tensor_frame`.
        secret: the key of this direction of the channel (derives the frame's Poly1305 key).
        max_frame_bytes: ceiling on the whole frame, checked before any payload is read.
        table_nbytes: size of the table when the reader knows it (a frame like the previous
            one: :attr:`TensorLayout.table_nbytes`); it is then read in one call. ``None``
            reads the table entry by entry (two reads per tensor).
        sender: who sent the frame, as the sender passed it (see
            :func:`~flodl.wire.tensors.encode_tensor_frame`).

    Returns:
        The prefix, to pass to :func:`read_frame_payloads`.

    Raises:
        FrameError: bad header or table, a table of another size than ``table_nbytes``,
            oversize, or EOF.
    """
    head = memoryview(bytearray(HEADER_BYTES))
    _recv_exactly(recv_into, head, None, "header")
    header = parse_header(head)
    room = max_frame_bytes - HEADER_BYTES - TAG_BYTES
    if table_nbytes is not None:
        if table_nbytes > room:
            raise FrameError(
                f"tensor frame exceeds the {max_frame_bytes} byte ceiling: its table alone is "
                f"{table_nbytes} bytes"
            )
        table = memoryview(bytearray(table_nbytes))
        _recv_exactly(recv_into, table, None, "tensor table")
        layout = TensorLayout.parse(table, header.num_tensors)
        if layout.table_nbytes != table_nbytes:
            raise FrameError(
                f"tensor table of {layout.table_nbytes} bytes where {table_nbytes} were expected"
            )
        table_bytes = bytes(table)
    else:
        grown = bytearray()
        for index in range(header.num_tensors):
            prefix = memoryview(bytearray(ENTRY_PREFIX.size))
            _recv_exactly(recv_into, prefix, None, f"tensor table entry {index}")
            if prefix[1] > MAX_NDIM:
                raise FrameError(
                    f"tensor {index}: ndim {prefix[1]} exceeds the maximum of {MAX_NDIM}"
                )
            rest = memoryview(bytearray(entry_nbytes(prefix[1]) - prefix.nbytes))
            if len(grown) + prefix.nbytes + rest.nbytes > room:
                raise FrameError(
                    f"tensor frame exceeds the {max_frame_bytes} byte ceiling in its table"
                )
            grown += prefix
            _recv_exactly(recv_into, rest, None, f"tensor table entry {index}")
            grown += rest
        layout = TensorLayout.parse(grown, header.num_tensors)
        table_bytes = bytes(grown)
    if layout.frame_nbytes > max_frame_bytes:
        raise FrameError(
            f"tensor frame of {layout.frame_nbytes} bytes exceeds the {max_frame_bytes} byte "
            "ceiling"
        )
    return FramePrefix(header, layout, _head_mac(secret, bytes(head) + table_bytes, sender))


def read_frame_payloads(
    recv_into: Callable[[memoryview], int],
    prefix: FramePrefix,
    out: Sequence[torch.Tensor],
    *,
    scratch: torch.Tensor | None = None,
    zero_elided: bool = True,
) -> None:
    """Receive the payloads and tag of the frame ``prefix`` began, into ``out``.

    Same placement rules as :func:`read_tensor_frame` (direct receive, or staging through
    ``scratch`` for a bf16 payload bound for float32). On a :class:`FrameError` the contents of
    ``out`` are unspecified.

    Args:
        recv_into: the reader :func:`read_frame_prefix` read from.
        prefix: what :func:`read_frame_prefix` returned for this frame (use it once).
        out: one destination per tensor of the frame, same shapes.
        scratch: optional uint8 staging buffer, grown in place when too small.
        zero_elided: write zeros into the destination of an elided (all-zero) tensor;
            ``False`` leaves such a destination untouched, for a receiver that will not read
            it (an upload of weight 0).

    Raises:
        FrameError: a count, shape or dtype mismatch against ``out`` (before any byte is
            written), EOF, or a bad tag.
        LocalProtocolError: ``scratch`` is not a contiguous uint8 CPU tensor.
    """
    if prefix.header.flags & FLAG_SHM:
        raise FrameError("a shared-memory frame carries no payloads on the stream")
    if scratch is not None:
        _check_scratch(scratch)
    layout = prefix.layout
    if len(out) != len(layout.specs):
        raise FrameError(
            f"tensor count mismatch: frame has {len(layout.specs)}, out has {len(out)}"
        )
    for index, (spec, dst) in enumerate(zip(layout.specs, out, strict=True)):
        if spec.shape != tuple(dst.shape):
            raise FrameError(
                f"tensor {index}: shape mismatch: frame {spec.shape}, out {tuple(dst.shape)}"
            )
        if not accepts(spec.dtype, dst.dtype):
            raise FrameError(
                f"tensor {index}: dtype mismatch: frame {spec.dtype.name}, out {dst.dtype}"
            )
    _read_payloads(recv_into, layout, out, prefix.mac, scratch, zero_elided=zero_elided)


def read_frame_tag(recv_into: Callable[[memoryview], int], prefix: FramePrefix) -> None:
    """Receive and check the tag of the shared-memory frame ``prefix`` began (its payloads are
    in the connection's segment: :mod:`flodl.wire.shm`; the tag covers header and table).

    Raises:
        FrameError: the frame is not a shared-memory one, EOF, or a bad tag.
    """
    if not prefix.header.flags & FLAG_SHM:
        raise FrameError("a frame without the shared-memory flag carries its payloads")
    tag = memoryview(bytearray(TAG_BYTES))
    _recv_exactly(recv_into, tag, None, "auth tag")
    if not hmac.compare_digest(prefix.mac.finalize(), tag):
        raise FrameError(
            "bad tensor frame auth tag (not keyed to this run, server and connection, or corrupted)"
        )


def _check_scratch(scratch: torch.Tensor) -> None:
    if scratch.dtype != torch.uint8 or scratch.device.type != "cpu" or not scratch.is_contiguous():
        raise LocalProtocolError("scratch must be a contiguous uint8 CPU tensor")


def _ready_scratch(scratch: torch.Tensor | None, nbytes: int) -> torch.Tensor:
    """Return a contiguous uint8 CPU tensor of at least ``nbytes``, growing ``scratch``."""
    if scratch is None:
        return torch.empty(nbytes, dtype=torch.uint8)
    if scratch.numel() < nbytes:
        logger.debug("growing tensor frame scratch from %d to %d bytes", scratch.numel(), nbytes)
        scratch.resize_(nbytes)
    return scratch


class _MemoryReader:
    """``recv_into`` over an in-memory frame, handing out cache-sized chunks."""

    __slots__ = ("_pos", "_view")

    def __init__(self, data: bytes | bytearray | memoryview) -> None:
        self._view = memoryview(data).cast("B")
        self._pos = 0

    @property
    def remaining(self) -> int:
        return self._view.nbytes - self._pos

    def recv_into(self, buffer: memoryview) -> int:
        n = min(buffer.nbytes, self.remaining, _MEMORY_CHUNK)
        buffer[:n] = self._view[self._pos : self._pos + n]
        self._pos += n
        return n


def decode_tensor_frame(
    data: bytes | bytearray | memoryview,
    out: Sequence[torch.Tensor],
    *,
    secret: bytes,
    max_frame_bytes: int,
    scratch: torch.Tensor | None = None,
    sender: bytes = b"",
) -> FrameHeader:
    """Decode one complete in-memory frame into ``out``: :func:`read_tensor_frame` on a buffer.

    Args:
        data: exactly one frame.
        out: as for :func:`read_tensor_frame`.
        secret: the key of this direction of the channel (derives the frame's Poly1305 key).
        max_frame_bytes: ceiling on the frame size.
        scratch: as for :func:`read_tensor_frame`.
        sender: as for :func:`read_tensor_frame`.

    Returns:
        The frame's header.

    Raises:
        FrameError: as :func:`read_tensor_frame`, and bytes left over after the frame.
    """
    reader = _MemoryReader(data)
    header = read_tensor_frame(
        reader.recv_into,
        out,
        secret=secret,
        max_frame_bytes=max_frame_bytes,
        scratch=scratch,
        sender=sender,
    )
    if reader.remaining:
        raise FrameError(f"{reader.remaining} trailing bytes after the tensor frame")
    return header
