"""The data channel's handshake and the keys it agrees: the hello a rank sends first on its
reduce connection (before any frame) and the server's ack; both are :data:`HELLO_BYTES` = 53
bytes, fields in network byte order::

    hello, rank -> server
      magic u32 = 0xF10D17C0 | version u8 = DATA_PROTOCOL_VERSION | rank u32 | world_size u32
      | run fingerprint, 8 bytes | the connection's nonce, 16 random bytes
      | tag: HMAC-SHA256(run key, the 37 preceding bytes), first 16 bytes
    ack, server -> rank
      magic u32 = 0xF10D17C1 | version u8 | rank u32 | world_size u32 (echoed)
      | run fingerprint | the server's nonce, 16 random bytes (one per server)
      | tag: HMAC-SHA256(run key, the 37 preceding bytes + the hello's tag), first 16 bytes

Keys (docs/design.md §7), all HMAC-SHA256:

* run key = HMAC(secret, ``"flodl-data-run-v2"`` + run id): a hello or frame of another run
  fails its tag even when the secret file is reused; the run fingerprint (SHA-256 of the run id,
  first 8 bytes; nothing secret) lets the server say so instead of "wrong secret";
* consensus key = HMAC(run key, ``"consensus"`` + server nonce): the key of every consensus
  frame one reduce server sends (all ranks get the same frames of a round, so one tag serves
  them all); a restarted server has a fresh nonce, so two servers of one run never share it;
* upload key = HMAC(run key, ``"upload"`` + rank u32 + hello nonce + server nonce): the key of
  the rank's uploads on this connection only: a rank's next incarnation (a new process, a new
  connection) has another, and frames recorded on one connection fail on any other. The
  server refuses a hello nonce it has already seen, so a recorded hello replayed on a new
  connection (which would get the same ack and key) is refused before any frame.

Each frame's one-time Poly1305 key is derived from these by
:func:`~flodl.wire.tensors.frame_key`, so a one-time key never repeats across runs, servers or
connections. The ack's tag covers the hello's tag, so it answers that hello and proves the server
holds the secret; a refused hello gets no answer (the server logs why and closes the
connection).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
from dataclasses import dataclass

from flodl.errors import FrameError, LocalProtocolError
from flodl.wire.tensors import TAG_BYTES

__all__ = [
    "DATA_HANDSHAKE_TIMEOUT_S",
    "HELLO_MAGIC",
    "ACK_MAGIC",
    "DATA_PROTOCOL_VERSION",
    "HELLO_BYTES",
    "NONCE_BYTES",
    "DataKeys",
    "run_fingerprint",
    "new_nonce",
    "encode_data_hello",
    "parse_data_hello",
    "encode_data_ack",
    "check_data_ack",
    "data_keys",
    "consensus_key",
]

DATA_HANDSHAKE_TIMEOUT_S = 10.0
"""How long either side of the data channel waits for the other's whole handshake."""
HELLO_MAGIC = 0xF10D17C0
"""First four bytes of a data channel hello (the original's handshake magic)."""
ACK_MAGIC = 0xF10D17C1
"""First four bytes of the server's answer to a hello."""
DATA_PROTOCOL_VERSION = 3
"""Version of the data channel (handshake, keys and round protocol); a hello with another is
refused. Version 1 keyed frames with the secret alone (no run id, no connection nonces);
version 2 had no shared-memory lane (:mod:`flodl.wire.shm`)."""
NONCE_BYTES = 16
FINGERPRINT_BYTES = 8
_FIELDS = struct.Struct(f"!IBII{FINGERPRINT_BYTES}s{NONCE_BYTES}s")
HELLO_BYTES = _FIELDS.size + TAG_BYTES
"""Size of a hello and of an ack (53 bytes)."""
_RUN_KEY_LABEL = b"flodl-data-run-v2"


@dataclass(frozen=True, slots=True)
class DataKeys:
    """What one data connection agreed: the keys of the frames each way."""

    upload: bytes
    """Keys the rank's uploads on this connection."""
    consensus: bytes
    """Keys the server's consensus frames (the same for every connection to that server)."""


def run_fingerprint(run_id: str) -> bytes:
    """First 8 bytes of SHA-256 of the run id: tells runs apart, reveals nothing secret."""
    return hashlib.sha256(b"flodl-run-id" + run_id.encode()).digest()[:FINGERPRINT_BYTES]


def new_nonce() -> bytes:
    """16 random bytes: a connection's or a server's contribution to the keys."""
    return os.urandom(NONCE_BYTES)


def _run_key(secret: bytes, run_id: str) -> bytes:
    return hmac.new(secret, _RUN_KEY_LABEL + run_id.encode(), "sha256").digest()


def consensus_key(secret: bytes, run_id: str, server_nonce: bytes) -> bytes:
    """The key of the consensus frames of the server whose nonce is ``server_nonce``."""
    return hmac.new(_run_key(secret, run_id), b"consensus" + server_nonce, "sha256").digest()


def _message(
    magic: int, rank: int, world_size: int, run_id: str, nonce: bytes, key: bytes, bound: bytes
) -> bytes:
    if not (0 <= rank < world_size <= 0xFFFFFFFF):
        raise LocalProtocolError(f"rank {rank} is not in a world of {world_size}")
    if len(nonce) != NONCE_BYTES:
        raise LocalProtocolError(f"a nonce is {NONCE_BYTES} bytes, got {len(nonce)}")
    fields = _FIELDS.pack(
        magic, DATA_PROTOCOL_VERSION, rank, world_size, run_fingerprint(run_id), nonce
    )
    return fields + hmac.new(key, fields + bound, "sha256").digest()[:TAG_BYTES]


def _parse(
    data: bytes | bytearray | memoryview,
    magic: int,
    secret: bytes,
    run_id: str,
    bound: bytes,
    what: str,
) -> tuple[int, int, bytes]:
    data = bytes(data)
    if len(data) != HELLO_BYTES:
        raise FrameError(f"{what} of {len(data)} bytes, expected {HELLO_BYTES}")
    got_magic, version = struct.unpack_from("!IB", data)
    if got_magic != magic:
        raise FrameError(f"bad {what} magic 0x{got_magic:08x} (expected 0x{magic:08x})")
    if version != DATA_PROTOCOL_VERSION:
        raise FrameError(
            f"{what} speaks data protocol version {version}, this build {DATA_PROTOCOL_VERSION}"
        )
    _, _, rank, world_size, fingerprint, nonce = _FIELDS.unpack_from(data)
    if fingerprint != run_fingerprint(run_id):
        raise FrameError(  # nothing of the peer's in the text: refusals are counted by it
            f"{what} from another run (this is run {run_id!r}): do two runs share a secret file?"
        )
    key = _run_key(secret, run_id)
    tag = hmac.new(key, data[: _FIELDS.size] + bound, "sha256").digest()[:TAG_BYTES]
    if not hmac.compare_digest(tag, data[_FIELDS.size :]):
        raise FrameError(f"bad {what} auth tag (wrong run secret)")
    return rank, world_size, nonce


def encode_data_hello(
    secret: bytes, run_id: str, rank: int, world_size: int, nonce: bytes | None = None
) -> bytes:
    """The hello a rank sends first on its reduce connection, with a fresh nonce unless one is
    given.

    Raises:
        LocalProtocolError: ``rank`` is not in ``range(world_size)``, or a bad nonce.
    """
    nonce = new_nonce() if nonce is None else nonce
    return _message(HELLO_MAGIC, rank, world_size, run_id, nonce, _run_key(secret, run_id), b"")


def parse_data_hello(
    secret: bytes, run_id: str, data: bytes | bytearray | memoryview
) -> tuple[int, int, bytes]:
    """Authenticate a hello of run ``run_id``; return its ``(rank, world_size, nonce)`` (not
    range-checked). The server must refuse a nonce it has seen (a replayed hello would
    otherwise get the same ack, hence the same upload key, as the connection it was recorded
    on: the server's nonce is one per server).

    Raises:
        FrameError: wrong size, bad magic, other protocol version, another run, or bad tag.
    """
    return _parse(data, HELLO_MAGIC, secret, run_id, b"", "hello")


def encode_data_ack(
    secret: bytes, run_id: str, hello: bytes | bytearray | memoryview, server_nonce: bytes
) -> bytes:
    """The server's answer to the (already parsed) ``hello``, carrying its nonce."""
    rank, world_size = _FIELDS.unpack_from(hello)[2:4]
    bound = bytes(hello)[_FIELDS.size :]
    return _message(
        ACK_MAGIC, rank, world_size, run_id, server_nonce, _run_key(secret, run_id), bound
    )


def check_data_ack(
    secret: bytes,
    run_id: str,
    hello: bytes | bytearray | memoryview,
    ack: bytes | bytearray | memoryview,
) -> None:
    """Check that ``ack`` answers ``hello`` (same run, rank and world size, tag over both).

    Raises:
        FrameError: the ack is malformed, of another run, echoes another rank or world size,
            or fails its tag.
    """
    bound = bytes(hello)[_FIELDS.size :]
    rank, world_size, _ = _parse(ack, ACK_MAGIC, secret, run_id, bound, "ack")
    if (rank, world_size) != tuple(_FIELDS.unpack_from(hello)[2:4]):
        raise FrameError(f"ack for rank {rank} of {world_size} does not answer this hello")


def data_keys(
    secret: bytes,
    run_id: str,
    hello: bytes | bytearray | memoryview,
    ack: bytes | bytearray | memoryview,
) -> DataKeys:
    """The keys of a connection whose (checked) ``hello`` and ``ack`` were exchanged."""
    rank, _, _, hello_nonce = _FIELDS.unpack_from(hello)[2:]
    server_nonce = _FIELDS.unpack_from(ack)[5]
    run_key = _run_key(secret, run_id)
    upload = hmac.new(
        run_key, b"upload" + struct.pack("!I", rank) + hello_nonce + server_nonce, "sha256"
    ).digest()
    return DataKeys(upload=upload, consensus=consensus_key(secret, run_id, server_nonce))
