"""Control-frame codec: ``[u32 big-endian length][msgpack body][16-byte auth tag]``.

Pure module (no I/O). The tag is HMAC-SHA256 keyed by the connection's key (derived from the
run secret and both ends' nonces by :mod:`flodl.wire.control_hello`; these functions take any
key, called ``secret`` here) over ``seq (u64 big-endian) ‖ length ‖ body``, truncated to
:data:`TAG_BYTES`, and compared in constant time. ``seq`` is the per-direction frame counter of
a connection (see :mod:`flodl.wire.stream`): it is never sent, both ends count, so a frame
replayed or reordered on a connection fails its tag. The 8-byte counter is always part of the
MAC input, ``seq=0`` (the default) included, so a tag is never HMAC(``length ‖ body``) alone:
this extends the original's design, which omits ``seq`` (docs/design.md §1).

The length is checked against a ceiling before any buffer is sized from it; every decoding
failure (truncated, oversize, bad tag, not msgpack, not a map, unknown kind, invalid or extra
field) raises :class:`~flodl.errors.FrameError` and nothing else.
"""

from __future__ import annotations

import functools
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
    "encode_body",
    "encode_frame",
    "decode_frame",
    "decode_body",
    "body_length",
    "seal_body",
    "SharedBodies",
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
# Container limits for the msgpack decoder: bound memory before pydantic runs. They are passed
# to ``unpackb`` as literal keywords: expanding a dict (``**limits``) costs more than the unpack
# of a small frame.
_MAX_STR = MAX_CONTROL_FRAME_BYTES
_MAX_ARRAY = 1 << 20
_MAX_MAP = 1 << 16


def check_secret(secret: bytes) -> bytes:
    """Return ``secret`` if it is usable as a run secret, else raise ``ValueError``."""
    if not isinstance(secret, bytes | bytearray) or len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"run secret must be at least {MIN_SECRET_BYTES} bytes")
    return bytes(secret)


@functools.lru_cache(maxsize=4096)
def _keyed(secret: bytes) -> hmac.HMAC:
    """An HMAC-SHA256 object keyed with ``secret`` and fed nothing yet, per key.

    Every control connection has its own key (:mod:`flodl.wire.control_hello`), so the cache
    holds one entry per live connection of a large world (a few hundred bytes each) and a miss
    costs one key schedule.

    ``hmac.new`` redoes the key schedule on every call, a large part of the cost of tagging a
    small frame; :meth:`hmac.HMAC.copy` of a keyed object skips it. The cached objects are
    only ever copied, never updated, so threads may share them.
    """
    return hmac.new(secret, digestmod=hashlib.sha256)


def auth_tag(secret: bytes, header: bytes, body: bytes | memoryview, seq: int = 0) -> bytes:
    """HMAC-SHA256(secret, seq ‖ header ‖ body) truncated to :data:`TAG_BYTES`."""
    mac = _keyed(secret if type(secret) is bytes else bytes(secret)).copy()
    mac.update(_SEQ.pack(seq))
    mac.update(header)
    mac.update(body)
    return mac.digest()[:TAG_BYTES]


def encode_body(frame: AnyFrame) -> bytes:
    """``frame``'s msgpack body, to seal with :func:`seal_body` for each connection it goes to.

    A frame sent to many peers (a broadcast, one ``new_session`` for every member) is encoded
    once this way: the tag differs per connection (its key and ``seq``), the body does not.
    """
    # ``to_python`` is what ``model_dump(mode="python")`` calls, without its wrapper's overhead.
    body: bytes = msgpack.packb(frame.__pydantic_serializer__.to_python(frame), use_bin_type=True)
    return body


class SharedBodies:
    """The bodies of the frames of one batch of sends, each frame encoded once however many
    connections it goes to (a broadcast, a ``new_session`` for every member).

    Keyed by the frame's identity; each entry holds its frame, so no id is reused while the
    cache lives. Keep one per batch of sends, not longer (it holds every frame it saw).
    """

    __slots__ = ("_bodies",)

    def __init__(self) -> None:
        self._bodies: dict[int, tuple[AnyFrame, bytes]] = {}

    def body(self, frame: AnyFrame) -> bytes:
        """``frame``'s body (:func:`encode_body`), encoded on its first call only."""
        entry = self._bodies.get(id(frame))
        if entry is not None and entry[0] is frame:
            return entry[1]
        body = encode_body(frame)
        self._bodies[id(frame)] = (frame, body)
        return body


def seal_body(
    body: bytes,
    secret: bytes,
    *,
    kind: str,
    seq: int = 0,
    max_bytes: int = MAX_CONTROL_FRAME_BYTES,
) -> bytes:
    """Wire bytes (length, body, tag) of the body :func:`encode_body` made of a ``kind`` frame.

    Raises:
        FrameError: the body exceeds ``max_bytes`` (a frame the peer would refuse).
    """
    if len(body) > max_bytes:
        raise FrameError(f"{kind} frame body is {len(body)} B, over the {max_bytes} B ceiling")
    header = _LEN.pack(len(body))
    return header + body + auth_tag(secret, header, body, seq)


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
    return seal_body(encode_body(frame), secret, kind=frame.kind, seq=seq, max_bytes=max_bytes)


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
        obj = msgpack.unpackb(
            body,
            raw=False,
            strict_map_key=True,
            max_str_len=_MAX_STR,
            max_bin_len=_MAX_STR,
            max_array_len=_MAX_ARRAY,
            max_map_len=_MAX_MAP,
            max_ext_len=0,
        )
    # msgpack raises a zoo of types (ValueError, ExtraData, TypeError, …): all mean bad bytes.
    except Exception as exc:  # noqa: BLE001
        raise FrameError(f"undecodable frame body ({len(body)} B): {exc}") from None
    if not isinstance(obj, dict):
        raise FrameError(f"frame body is a {type(obj).__name__}, not a map")
    try:
        # the adapter's SchemaValidator directly: same result and errors, less Python overhead
        frame: AnyFrame = FRAME_ADAPTER.validator.validate_python(obj)
        return frame
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
