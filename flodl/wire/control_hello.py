"""The control connection's handshake and the key it agrees, before any frame (pure module).

Bytes on a new control connection, in this order, fields in network byte order::

    challenge, server -> rank, as soon as the server accepts the TCP connection
      magic b"FDLC" (4) | control protocol version u32 (4) = PROTOCOL_VERSION
      | the server's nonce, 16 random bytes                    = CHALLENGE_BYTES = 24 bytes
    answer, rank -> server
      the rank's nonce, 16 random bytes, then its ``hello`` frame

From the rank's nonce on, every frame both ways is tagged (:mod:`flodl.wire.codec`) with the
connection key instead of the secret::

    connection key = HMAC-SHA256(secret, b"flodl-control-v3" ‖ server nonce ‖ rank nonce)

Both nonces are fresh for every connection, so a key never repeats: a hello (or any frame)
recorded on one connection fails its tag on every other one, of this run or of another run that
shares the secret file and the run id; a server's answers recorded on one connection fail their
tag at a rank that sent another nonce. Inside a connection the per-direction frame counter
refuses replays as before (docs/design.md §1). Version 2 of the control protocol had no
challenge and keyed frames with the secret itself.
"""

from __future__ import annotations

import hmac
import secrets
import struct

from flodl.errors import FrameError, LocalProtocolError
from flodl.wire.frames import PROTOCOL_VERSION

__all__ = [
    "CHALLENGE_MAGIC",
    "CONTROL_PROTOCOL_VERSION",
    "NONCE_BYTES",
    "CHALLENGE_BYTES",
    "new_nonce",
    "encode_challenge",
    "parse_challenge",
    "connection_key",
]

CHALLENGE_MAGIC = b"FDLC"
"""First four bytes a flodl coordinator sends on a control connection."""
CONTROL_PROTOCOL_VERSION = PROTOCOL_VERSION
"""The control protocol version the challenge announces (the ``hello``'s ``protocol`` too)."""
NONCE_BYTES = 16
_CHALLENGE = struct.Struct(f"!4sI{NONCE_BYTES}s")
CHALLENGE_BYTES = _CHALLENGE.size
"""Size of the server's challenge (24 bytes)."""
_KEY_LABEL = b"flodl-control-v3"


def new_nonce() -> bytes:
    """16 random bytes: one side's contribution to a connection's key."""
    return secrets.token_bytes(NONCE_BYTES)


def _check_nonce(nonce: bytes, whose: str) -> None:
    if len(nonce) != NONCE_BYTES:
        raise LocalProtocolError(f"{whose} nonce is {NONCE_BYTES} bytes, got {len(nonce)}")


def encode_challenge(server_nonce: bytes | None = None) -> bytes:
    """The challenge a server sends at accept, with a fresh nonce unless one is given.

    Raises:
        LocalProtocolError: a nonce that is not 16 bytes.
    """
    nonce = new_nonce() if server_nonce is None else server_nonce
    _check_nonce(nonce, "a server")
    return _CHALLENGE.pack(CHALLENGE_MAGIC, CONTROL_PROTOCOL_VERSION, nonce)


def parse_challenge(data: bytes | bytearray | memoryview) -> bytes:
    """Check a server's challenge; return its nonce.

    Raises:
        FrameError: wrong size, wrong magic (the peer is not a flodl coordinator) or another
            control protocol version (named with ours).
    """
    data = bytes(data)
    if len(data) != CHALLENGE_BYTES:
        raise FrameError(f"challenge of {len(data)} bytes, expected {CHALLENGE_BYTES}")
    magic, version, nonce = _CHALLENGE.unpack(data)
    if magic != CHALLENGE_MAGIC:
        raise FrameError(
            f"not a flodl coordinator: its first bytes are {magic!r}, not {CHALLENGE_MAGIC!r}"
        )
    if version != CONTROL_PROTOCOL_VERSION:
        raise FrameError(
            f"the coordinator speaks control protocol version {version}, "
            f"this build {CONTROL_PROTOCOL_VERSION}"
        )
    assert isinstance(nonce, bytes)
    return nonce


def connection_key(secret: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    """The key of every frame of the connection whose nonces are these (32 bytes).

    Raises:
        LocalProtocolError: a nonce that is not 16 bytes.
    """
    _check_nonce(server_nonce, "a server")
    _check_nonce(client_nonce, "a rank")
    return hmac.new(secret, _KEY_LABEL + server_nonce + client_nonce, "sha256").digest()
