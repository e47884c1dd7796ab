"""The data channel's handshake: the hello a rank sends first on its reduce connection (before
any frame) and the server's ack; both are :data:`HELLO_BYTES` = 29 bytes, fields in network
byte order::

    hello, rank -> server
      magic u32 = 0xF10D17C0 | version u8 = DATA_PROTOCOL_VERSION | rank u32 | world_size u32
      | tag: HMAC-SHA256(secret, the 13 preceding bytes), first 16 bytes
    ack, server -> rank
      magic u32 = 0xF10D17C1 | version u8 | rank u32 | world_size u32 (echoed)
      | tag: HMAC-SHA256(secret, the 13 preceding bytes + the hello's tag), first 16 bytes

The ack's tag covers the hello's tag, so it answers that hello and proves the server holds the
secret; a refused hello gets no answer (the server logs why and closes the connection).
"""

from __future__ import annotations

import hmac
import struct

from flodl.errors import FrameError, LocalProtocolError
from flodl.wire.tensors import TAG_BYTES

__all__ = [
    "DATA_HANDSHAKE_TIMEOUT_S",
    "HELLO_MAGIC",
    "ACK_MAGIC",
    "DATA_PROTOCOL_VERSION",
    "HELLO_BYTES",
    "encode_data_hello",
    "parse_data_hello",
    "encode_data_ack",
    "check_data_ack",
]

DATA_HANDSHAKE_TIMEOUT_S = 10.0
"""How long either side of the data channel waits for the other's handshake (spec §7.4)."""
HELLO_MAGIC = 0xF10D17C0
"""First four bytes of a data channel hello (the original's handshake magic)."""
ACK_MAGIC = 0xF10D17C1
"""First four bytes of the server's answer to a hello."""
DATA_PROTOCOL_VERSION = 1
"""Version of the data channel (handshake and round protocol); a hello with another is refused."""
_HELLO = struct.Struct("!IBII")
HELLO_BYTES = _HELLO.size + TAG_BYTES
"""Size of a hello and of an ack (29 bytes)."""


def _handshake_message(
    magic: int, rank: int, world_size: int, secret: bytes, bound: bytes
) -> bytes:
    if not (0 <= rank < world_size <= 0xFFFFFFFF):
        raise LocalProtocolError(f"rank {rank} is not in a world of {world_size}")
    fields = _HELLO.pack(magic, DATA_PROTOCOL_VERSION, rank, world_size)
    return fields + hmac.new(secret, fields + bound, "sha256").digest()[:TAG_BYTES]


def _parse_handshake(
    data: bytes | bytearray | memoryview, magic: int, secret: bytes, bound: bytes, what: str
) -> tuple[int, int]:
    data = bytes(data)
    if len(data) != HELLO_BYTES:
        raise FrameError(f"{what} of {len(data)} bytes, expected {HELLO_BYTES}")
    got_magic, version, rank, world_size = _HELLO.unpack_from(data)
    if got_magic != magic:
        raise FrameError(f"bad {what} magic 0x{got_magic:08x} (expected 0x{magic:08x})")
    if version != DATA_PROTOCOL_VERSION:
        raise FrameError(
            f"{what} speaks data protocol version {version}, this build {DATA_PROTOCOL_VERSION}"
        )
    tag = hmac.new(secret, data[: _HELLO.size] + bound, "sha256").digest()[:TAG_BYTES]
    if not hmac.compare_digest(tag, data[_HELLO.size :]):
        raise FrameError(f"bad {what} auth tag (wrong run secret)")
    return rank, world_size


def encode_data_hello(secret: bytes, rank: int, world_size: int) -> bytes:
    """The hello a rank sends first on its reduce connection.

    Raises:
        LocalProtocolError: ``rank`` is not in ``range(world_size)``.
    """
    return _handshake_message(HELLO_MAGIC, rank, world_size, secret, b"")


def parse_data_hello(secret: bytes, data: bytes | bytearray | memoryview) -> tuple[int, int]:
    """Authenticate a hello; return its ``(rank, world_size)`` (not range-checked).

    Raises:
        FrameError: wrong size, bad magic, other protocol version, or bad tag.
    """
    return _parse_handshake(data, HELLO_MAGIC, secret, b"", "hello")


def encode_data_ack(secret: bytes, hello: bytes | bytearray | memoryview) -> bytes:
    """The server's answer to the (already parsed) ``hello``."""
    rank, world_size = _HELLO.unpack_from(hello)[2:]
    return _handshake_message(ACK_MAGIC, rank, world_size, secret, bytes(hello)[_HELLO.size :])


def check_data_ack(
    secret: bytes, hello: bytes | bytearray | memoryview, ack: bytes | bytearray | memoryview
) -> None:
    """Check that ``ack`` answers ``hello`` (same rank and world size, tag over both).

    Raises:
        FrameError: the ack is malformed, echoes another rank or world size, or fails its tag.
    """
    bound = bytes(hello)[_HELLO.size :]
    rank, world_size = _parse_handshake(ack, ACK_MAGIC, secret, bound, "ack")
    if (rank, world_size) != tuple(_HELLO.unpack_from(hello)[2:]):
        raise FrameError(f"ack for rank {rank} of {world_size} does not answer this hello")
