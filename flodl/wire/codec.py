"""Control-frame codec: ``[u32 big-endian length][msgpack body][16-byte auth tag]``.

Pure module (no I/O). The tag is HMAC-SHA256 keyed by the run secret over
``seq (u64 big-endian) ‖ length ‖ body``, truncated to :data:`TAG_BYTES`, and compared in constant
time. ``seq`` is the per-direction frame counter of a connection (see :mod:`flodl.wire.stream`):
it is never sent, both ends count, so a frame replayed or reordered on a connection fails its
tag; with ``seq=0`` (the default) the tag covers exactly ``length ‖ body`` as DESIGN.md §5 states.

The length is checked against a ceiling before any buffer is sized from it; every decoding
failure (truncated, oversize, bad tag, not msgpack, not a map, unknown kind, invalid or extra
field) raises :class:`~flodl.errors.FrameError` and nothing else.
"""

from __future__ import annotations

import hashlib
import hmac
import struct

import msgpack
from pydantic import ValidationError

from flodl.errors import FrameError
from flodl.wire.frames import FRAME_ADAPTER, CoordFrame, RankFrame

__all__ = [
    "TAG_BYTES",
    "HEADER_BYTES",
    "MAX_CONTROL_FRAME_BYTES",
    "MIN_SECRET_BYTES",
    "AnyFrame",
    "auth_tag",
    "check_secret",
    "encode_frame",
    "decode_frame",
    "decode_body",
    "body_length",
    "verify_tag",
]

AnyFrame = RankFrame | CoordFrame

TAG_BYTES = 16
HEADER_BYTES = 4
MAX_CONTROL_FRAME_BYTES = 16 * 1024 * 1024
"""Default ceiling of a control frame's msgpack body (16 MiB, as the original)."""
MIN_SECRET_BYTES = 16

_LEN = struct.Struct("!I")
_SEQ = struct.Struct("!Q")
# Nesting and container limits for the msgpack decoder: bounds memory before pydantic runs.
_UNPACK_LIMITS = {
    "max_str_len": MAX_CONTROL_FRAME_BYTES,
    "max_bin_len": MAX_CONTROL_FRAME_BYTES,
    "max_array_len": 1 << 20,
    "max_map_len": 1 << 16,
    "max_ext_len": 0,
}


def check_secret(secret: bytes) -> bytes:
    """Return ``secret`` if it is usable as a run secret, else raise ``ValueError``."""
    if not isinstance(secret, bytes | bytearray) or len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"run secret must be at least {MIN_SECRET_BYTES} bytes")
    return bytes(secret)


def auth_tag(secret: bytes, header: bytes, body: bytes | memoryview, seq: int = 0) -> bytes:
    """HMAC-SHA256(secret, seq ‖ header ‖ body) truncated to :data:`TAG_BYTES`."""
    mac = hmac.new(secret, _SEQ.pack(seq), hashlib.sha256)
    mac.update(header)
    mac.update(body)
    return mac.digest()[:TAG_BYTES]


def encode_frame(
    frame: AnyFrame,
    secret: bytes,
    *,
    seq: int = 0,
    max_bytes: int = MAX_CONTROL_FRAME_BYTES,
) -> bytes:
    """Serialize ``frame`` to wire bytes (length, body, tag).

    Raises:
        FrameError: the encoded body exceeds ``max_bytes`` (a frame the peer would refuse).
    """
    body: bytes = msgpack.packb(frame.model_dump(mode="python"), use_bin_type=True)
    if len(body) > max_bytes:
        raise FrameError(
            f"{frame.kind} frame body is {len(body)} B, over the {max_bytes} B ceiling"
        )
    header = _LEN.pack(len(body))
    return header + body + auth_tag(secret, header, body, seq)


def body_length(header: bytes, *, max_bytes: int = MAX_CONTROL_FRAME_BYTES) -> int:
    """Parse the 4-byte length prefix and check it against the ceiling before any allocation.

    Raises:
        FrameError: wrong header size, empty body, or a length over ``max_bytes``.
    """
    if len(header) != HEADER_BYTES:
        raise FrameError(f"frame header must be {HEADER_BYTES} B, got {len(header)} B")
    length: int = _LEN.unpack(header)[0]
    if length == 0:
        raise FrameError("empty frame body")
    if length > max_bytes:
        raise FrameError(f"frame length {length} B exceeds the {max_bytes} B ceiling")
    return length


def decode_body(body: bytes | memoryview) -> AnyFrame:
    """Validate a msgpack body (already authenticated) into a frame.

    Raises:
        FrameError: not msgpack, not a map, unknown kind, invalid or extra field.
    """
    try:
        obj = msgpack.unpackb(body, raw=False, strict_map_key=True, **_UNPACK_LIMITS)
    # msgpack raises a zoo of types (ValueError, ExtraData, TypeError, …): all mean bad bytes.
    except Exception as exc:  # noqa: BLE001
        raise FrameError(f"undecodable frame body ({len(body)} B): {exc}") from None
    if not isinstance(obj, dict):
        raise FrameError(f"frame body is a {type(obj).__name__}, not a map")
    try:
        return FRAME_ADAPTER.validate_python(obj)
    except ValidationError as exc:
        kind = obj.get("kind")
        shown = kind if isinstance(kind, str) and len(kind) <= 64 else "?"
        errors = "; ".join(
            f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()[:5]
        )
        raise FrameError(f"invalid {shown!r} frame: {errors}") from None
    except (ValueError, TypeError, RecursionError) as exc:
        raise FrameError(f"invalid frame: {exc}") from None


def decode_frame(
    data: bytes | memoryview,
    secret: bytes,
    *,
    seq: int = 0,
    max_bytes: int = MAX_CONTROL_FRAME_BYTES,
) -> AnyFrame:
    """Decode exactly one complete wire frame (length, body, tag).

    Raises:
        FrameError: any defect (truncated, trailing bytes, oversize, bad tag, bad body).
    """
    view = memoryview(data)
    if len(view) < HEADER_BYTES:
        raise FrameError(f"truncated frame: {len(view)} B, shorter than its header")
    header = bytes(view[:HEADER_BYTES])
    length = body_length(header, max_bytes=max_bytes)
    expected = HEADER_BYTES + length + TAG_BYTES
    if len(view) != expected:
        what = "truncated" if len(view) < expected else "trailing bytes after"
        raise FrameError(f"{what} frame: {len(view)} B where the header says {expected} B")
    body = view[HEADER_BYTES : HEADER_BYTES + length]
    tag = bytes(view[HEADER_BYTES + length :])
    verify_tag(secret, header, body, tag, seq)
    return decode_body(body)


def verify_tag(
    secret: bytes, header: bytes, body: bytes | memoryview, tag: bytes, seq: int
) -> None:
    """Raise :class:`FrameError` unless ``tag`` authenticates ``header ‖ body`` at ``seq``."""
    if not hmac.compare_digest(auth_tag(secret, header, body, seq), tag):
        raise FrameError("bad auth tag (wrong run secret, replayed or corrupted frame)")
