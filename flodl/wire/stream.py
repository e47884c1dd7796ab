"""Control frames over asyncio streams (the only asyncio code in :mod:`flodl.wire`).

A :class:`FrameReader` / :class:`FrameWriter` pair wraps one connection. Each direction keeps
its own frame counter, mixed into every auth tag (see :mod:`flodl.wire.codec`), so a replayed,
dropped or reordered frame fails authentication. EOF at a frame boundary is a clean end
(:meth:`FrameReader.read` returns ``None``); EOF inside a frame is a :class:`FrameError`.

Before any frame the connection agrees its key (:mod:`flodl.wire.control_hello`): the server
sends its challenge, the rank answers with its nonce (:func:`client_handshake`), and both wrap
the connection with the key the two nonces give.
"""

from __future__ import annotations

import asyncio

from flodl.errors import FrameError
from flodl.wire.codec import (
    HEADER_BYTES,
    MAX_CONTROL_FRAME_BYTES,
    TAG_BYTES,
    AnyFrame,
    body_length,
    decode_body,
    encode_body,
    seal_body,
    verify_tag,
)
from flodl.wire.control_hello import CHALLENGE_BYTES, connection_key, new_nonce, parse_challenge

__all__ = ["FrameReader", "FrameWriter", "client_handshake", "read_frame", "write_frame"]


class FrameReader:
    """Reads authenticated frames from an :class:`asyncio.StreamReader`."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        secret: bytes,
        *,
        max_bytes: int = MAX_CONTROL_FRAME_BYTES,
    ) -> None:
        self._reader = reader
        self._secret = secret
        self._max_bytes = max_bytes
        self.seq = 0
        """Number of frames read so far (the next frame's expected sequence number)."""

    @property
    def max_bytes(self) -> int:
        """Ceiling on the next frame's body; raise it once the peer has authenticated."""
        return self._max_bytes

    @max_bytes.setter
    def max_bytes(self, value: int) -> None:
        self._max_bytes = value

    async def read(self) -> AnyFrame | None:
        """Return the next frame, or ``None`` on a clean EOF at a frame boundary.

        Raises:
            FrameError: EOF inside a frame, oversize length, bad tag or bad body.
        """
        try:
            header = await self._reader.readexactly(HEADER_BYTES)
        except asyncio.IncompleteReadError as exc:
            if not exc.partial:
                return None
            raise FrameError(f"EOF inside a frame header after {len(exc.partial)} B") from None
        length = body_length(header, max_bytes=self._max_bytes)
        try:
            rest = await self._reader.readexactly(length + TAG_BYTES)
        except asyncio.IncompleteReadError as exc:
            raise FrameError(
                f"EOF inside a frame: got {len(exc.partial)} of {length + TAG_BYTES} B"
            ) from None
        view = memoryview(rest)
        verify_tag(self._secret, header, view[:length], bytes(view[length:]), self.seq)
        self.seq += 1
        return decode_body(view[:length])


class FrameWriter:
    """Writes authenticated frames to an :class:`asyncio.StreamWriter`."""

    def __init__(
        self,
        writer: asyncio.StreamWriter,
        secret: bytes,
        *,
        max_bytes: int = MAX_CONTROL_FRAME_BYTES,
    ) -> None:
        self._writer = writer
        self._secret = secret
        self._max_bytes = max_bytes
        self.seq = 0
        """Number of frames written so far (the next frame's sequence number)."""

    def write_nowait(self, frame: AnyFrame, body: bytes | None = None) -> None:
        """Queue ``frame`` on the transport without waiting for the buffer to drain; ``body``
        is its :func:`~flodl.wire.codec.encode_body` where the caller has it already (a frame
        sent to many peers is encoded once, :class:`~flodl.wire.codec.SharedBodies`).

        Raises:
            FrameError: the body is over this writer's ceiling (nothing is written).
        """
        data = seal_body(
            encode_body(frame) if body is None else body,
            self._secret,
            kind=frame.kind,
            seq=self.seq,
            max_bytes=self._max_bytes,
        )
        self.seq += 1
        self._writer.write(data)

    async def write(self, frame: AnyFrame) -> None:
        """Write ``frame`` and wait until the transport's buffer is below its high-water mark."""
        self.write_nowait(frame)
        await self._writer.drain()

    @property
    def buffered(self) -> int:
        """Bytes queued in the transport and not yet sent."""
        return self._writer.transport.get_write_buffer_size()


async def read_frame(
    reader: asyncio.StreamReader,
    secret: bytes,
    *,
    seq: int = 0,
    max_bytes: int = MAX_CONTROL_FRAME_BYTES,
) -> AnyFrame | None:
    """Read one frame authenticated at ``seq`` (stateless form of :class:`FrameReader`)."""
    fr = FrameReader(reader, secret, max_bytes=max_bytes)
    fr.seq = seq
    return await fr.read()


async def write_frame(
    writer: asyncio.StreamWriter,
    frame: AnyFrame,
    secret: bytes,
    *,
    seq: int = 0,
    max_bytes: int = MAX_CONTROL_FRAME_BYTES,
) -> None:
    """Write one frame tagged at ``seq`` (stateless form of :class:`FrameWriter`)."""
    fw = FrameWriter(writer, secret, max_bytes=max_bytes)
    fw.seq = seq
    await fw.write(frame)


async def client_handshake(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, secret: bytes
) -> bytes:
    """The rank's side of a control connection's handshake: read the server's challenge, send a
    fresh nonce; return the connection key (for :class:`FrameReader` / :class:`FrameWriter`).

    The caller bounds it in time; the hello is the caller's next write.

    Raises:
        FrameError: EOF before the whole challenge, or a challenge that is not a flodl
            coordinator's or is of another control protocol version.
    """
    try:
        challenge = await reader.readexactly(CHALLENGE_BYTES)
    except asyncio.IncompleteReadError as exc:
        raise FrameError(
            f"EOF after {len(exc.partial)} of the {CHALLENGE_BYTES} B of the challenge"
        ) from None
    server_nonce = parse_challenge(challenge)
    client_nonce = new_nonce()
    writer.write(client_nonce)
    return connection_key(secret, server_nonce, client_nonce)
