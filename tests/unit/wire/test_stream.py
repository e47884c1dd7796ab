"""FrameReader / FrameWriter over in-memory streams: EOF handling, limits, replay and reorder."""

from __future__ import annotations

import asyncio
import struct
from typing import cast

import msgpack
import pytest

from flodl.errors import FrameError
from flodl.wire.codec import HEADER_BYTES, TAG_BYTES, AnyFrame, auth_tag, encode_frame
from flodl.wire.frames import Batch, Heartbeat, Metrics, Reject
from flodl.wire.stream import FrameReader, FrameWriter, read_frame, write_frame

SECRET = b"stream-test-secret-0123456789abcdef"

FRAMES: list[AnyFrame] = [
    Heartbeat(rank=1, step=10),
    Batch(rank=1, epoch=0, step=11, batch_ms=5.5, loss=0.25),
    Metrics(
        rank=1,
        epoch=0,
        avg_loss=0.5,
        batches_processed=12,
        samples_processed=384,
        epoch_ms=100.0,
        share_complete_ms=99.0,
        compute_only_ms=80.0,
        scalars={"acc": (10.5, 12)},
    ),
    Reject(reason="r" * 3000),
]


def _wire(frames: list[AnyFrame], first_seq: int = 0) -> list[bytes]:
    return [encode_frame(f, SECRET, seq=first_seq + i) for i, f in enumerate(frames)]


def _stream(data: bytes, *, eof: bool = True) -> asyncio.StreamReader:
    reader = asyncio.StreamReader()
    if data:
        reader.feed_data(data)
    if eof:
        reader.feed_eof()
    return reader


class _FakeTransport:
    def __init__(self) -> None:
        self.buffer = bytearray()

    def get_write_buffer_size(self) -> int:
        return len(self.buffer)


class _FakeWriter:
    """The slice of :class:`asyncio.StreamWriter` that FrameWriter uses."""

    def __init__(self) -> None:
        self.transport = _FakeTransport()
        self.drains = 0

    def write(self, data: bytes) -> None:
        self.transport.buffer += data

    async def drain(self) -> None:
        self.drains += 1


def _writer() -> tuple[FrameWriter, _FakeWriter]:
    fake = _FakeWriter()
    return FrameWriter(cast("asyncio.StreamWriter", fake), SECRET), fake


# ---------------------------------------------------------------------------------------------
# Normal operation and clean EOF
# ---------------------------------------------------------------------------------------------


async def test_reads_frames_in_order_then_none_at_clean_eof() -> None:
    reader = FrameReader(_stream(b"".join(_wire(FRAMES))), SECRET)
    got = [await reader.read() for _ in FRAMES]
    assert got == FRAMES
    assert reader.seq == len(FRAMES)
    assert await reader.read() is None
    assert await reader.read() is None  # stays at EOF
    assert reader.seq == len(FRAMES)


async def test_empty_stream_is_a_clean_eof() -> None:
    assert await FrameReader(_stream(b""), SECRET).read() is None


async def test_frames_arriving_byte_by_byte() -> None:
    data = b"".join(_wire(FRAMES))
    stream = _stream(b"", eof=False)
    reader = FrameReader(stream, SECRET)

    async def trickle() -> None:
        for i in range(len(data)):
            stream.feed_data(data[i : i + 1])
            await asyncio.sleep(0)
        stream.feed_eof()

    async with asyncio.TaskGroup() as tg:
        tg.create_task(trickle())
        got = [await reader.read() for _ in FRAMES]
        assert await reader.read() is None
    assert got == FRAMES


async def test_writer_output_is_read_back() -> None:
    writer, fake = _writer()
    for frame in FRAMES[:2]:
        writer.write_nowait(frame)
    for frame in FRAMES[2:]:
        await writer.write(frame)
    assert writer.seq == len(FRAMES)
    assert fake.drains == len(FRAMES) - 2
    assert writer.buffered == len(fake.transport.buffer)
    assert bytes(fake.transport.buffer) == b"".join(_wire(FRAMES))
    reader = FrameReader(_stream(bytes(fake.transport.buffer)), SECRET)
    assert [await reader.read() for _ in FRAMES] == FRAMES
    assert await reader.read() is None


async def test_stateless_helpers_use_the_given_seq() -> None:
    fake = _FakeWriter()
    await write_frame(cast("asyncio.StreamWriter", fake), FRAMES[0], SECRET, seq=41)
    data = bytes(fake.transport.buffer)
    assert data == encode_frame(FRAMES[0], SECRET, seq=41)
    assert await read_frame(_stream(data), SECRET, seq=41) == FRAMES[0]
    with pytest.raises(FrameError, match="auth tag"):
        await read_frame(_stream(data), SECRET, seq=0)
    assert await read_frame(_stream(b""), SECRET) is None


async def test_writer_refuses_a_frame_over_its_ceiling() -> None:
    fake = _FakeWriter()
    writer = FrameWriter(cast("asyncio.StreamWriter", fake), SECRET, max_bytes=100)
    with pytest.raises(FrameError, match="ceiling"):
        writer.write_nowait(FRAMES[3])
    assert writer.seq == 0  # nothing was sent, so the counter did not move
    assert not fake.transport.buffer


# ---------------------------------------------------------------------------------------------
# EOF inside a frame, oversize header
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cut", range(1, HEADER_BYTES))
async def test_eof_mid_header(cut: int) -> None:
    first, second = _wire(FRAMES[:2])
    reader = FrameReader(_stream(first + second[:cut]), SECRET)
    assert await reader.read() == FRAMES[0]
    with pytest.raises(FrameError, match="header"):
        await reader.read()


async def test_eof_mid_body_at_every_byte() -> None:
    wire = _wire(FRAMES[2:3])[0]
    for cut in range(HEADER_BYTES, len(wire)):
        with pytest.raises(FrameError, match="EOF inside a frame"):
            await FrameReader(_stream(wire[:cut]), SECRET).read()


@pytest.mark.parametrize("length", [(16 << 20) + 1, 0x8000_0000, 0xFFFF_FFFF])
async def test_oversize_header_fails_without_reading_more(length: int) -> None:
    rest = b"x" * 100
    stream = _stream(struct.pack("!I", length) + rest, eof=False)
    with pytest.raises(FrameError, match="exceeds"):
        await asyncio.wait_for(FrameReader(stream, SECRET).read(), timeout=5)
    # only the 4-byte header was consumed; no EOF was fed, so waiting for the body would hang
    assert await stream.read(len(rest)) == rest


async def test_custom_ceiling_applies_to_the_header() -> None:
    wire = _wire(FRAMES[3:])[0]
    stream = _stream(wire, eof=False)
    with pytest.raises(FrameError, match="exceeds"):
        await FrameReader(stream, SECRET, max_bytes=1000).read()
    assert await stream.read(len(wire)) == wire[HEADER_BYTES:]


async def test_zero_length_header_is_refused() -> None:
    with pytest.raises(FrameError, match="empty"):
        await FrameReader(_stream(b"\x00\x00\x00\x00" + b"\x00" * TAG_BYTES), SECRET).read()


# ---------------------------------------------------------------------------------------------
# Replay, reorder, drop, tampering
# ---------------------------------------------------------------------------------------------


async def test_replayed_frame_fails_the_tag() -> None:
    wire = _wire(FRAMES[:1])[0]
    reader = FrameReader(_stream(wire + wire), SECRET)
    assert await reader.read() == FRAMES[0]
    with pytest.raises(FrameError, match="auth tag"):
        await reader.read()


async def test_reordered_frames_fail() -> None:
    first, second = _wire(FRAMES[:2])
    reader = FrameReader(_stream(second + first), SECRET)
    with pytest.raises(FrameError, match="auth tag"):
        await reader.read()


async def test_reordered_later_in_the_stream_fails() -> None:
    w = _wire(FRAMES)
    reader = FrameReader(_stream(w[0] + w[1] + w[3] + w[2]), SECRET)
    assert await reader.read() == FRAMES[0]
    assert await reader.read() == FRAMES[1]
    with pytest.raises(FrameError, match="auth tag"):
        await reader.read()


async def test_dropped_frame_fails() -> None:
    w = _wire(FRAMES)
    reader = FrameReader(_stream(w[0] + w[2]), SECRET)
    assert await reader.read() == FRAMES[0]
    with pytest.raises(FrameError, match="auth tag"):
        await reader.read()


async def test_frame_from_another_connection_fails() -> None:
    # same bytes, but the reader expects a later position in its own connection
    reader = FrameReader(_stream(b"".join(_wire(FRAMES[:1], first_seq=5))), SECRET)
    with pytest.raises(FrameError, match="auth tag"):
        await reader.read()


async def test_wrong_secret_fails() -> None:
    reader = FrameReader(_stream(_wire(FRAMES[:1])[0]), b"another-secret-0123456789abcdef!")
    with pytest.raises(FrameError, match="auth tag"):
        await reader.read()


async def test_authentic_bad_body_fails() -> None:
    body = msgpack.packb({"kind": "heartbeat", "rank": -1, "step": 0})
    header = struct.pack("!I", len(body))
    data = header + body + auth_tag(SECRET, header, body, 0)
    with pytest.raises(FrameError, match="heartbeat"):
        await FrameReader(_stream(data), SECRET).read()
