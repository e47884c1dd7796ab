"""Control frames over real loopback TCP: 10,000 mixed frames each way, in order and intact.

Runs once on the stdlib event loop and once on uvloop (``@pytest.mark.uvloop``).
"""

from __future__ import annotations

import asyncio
import math

import pytest
import uvloop

from flodl.wire.codec import AnyFrame
from flodl.wire.frames import Batch, Heartbeat, Metrics, NewSession, Reject
from flodl.wire.stream import FrameReader, FrameWriter

pytestmark = pytest.mark.timeout(60)

SECRET = b"loopback-test-secret-0123456789abcdef"
N_FRAMES = 10_000
DRAIN_EVERY = 64


def _frames(n: int) -> list[AnyFrame]:
    """Mixed kinds with values that vary frame to frame, plus a few large ones that straddle
    TCP segments and the stream reader's buffer."""
    out: list[AnyFrame] = []
    for i in range(n):
        rank = i % 7
        match i % 3:
            case 0:
                out.append(Heartbeat(rank=rank, step=i))
            case 1:
                out.append(
                    Batch(
                        rank=rank,
                        epoch=i // 1000,
                        step=i,
                        batch_ms=i * 0.01,
                        data_ms=(i % 13) * 0.125,
                        loss=math.sin(i),
                        param_norm=None if i % 2 else i / 3,
                    )
                )
            case _:
                out.append(
                    Metrics(
                        rank=rank,
                        epoch=i // 1000,
                        avg_loss=math.cos(i),
                        batches_processed=i,
                        samples_processed=32 * i,
                        epoch_ms=i * 1.5,
                        share_complete_ms=i * 1.25,
                        compute_only_ms=float(i),
                        scalars={f"s{j}": (i / (j + 1), i + j) for j in range(i % 5)},
                    )
                )
        if i % 997 == 500:
            out.append(Reject(reason=f"{i}:" + "x" * 4000))
        if i % 2503 == 1000:
            out.append(
                NewSession(
                    session=i,
                    store_prefix=f"s{i}/",
                    new_world_size=4096,
                    spans=[(i % 7 + 2 * k, 1) for k in range(4096)],
                )
            )
    return out


async def _echo_exchange(frames: list[AnyFrame]) -> tuple[list[AnyFrame], list[AnyFrame]]:
    """Client sends ``frames``; the server records and echoes each one; the client collects
    the echoes. Returns (what the server received, what the client got back)."""
    server_got: list[AnyFrame] = []
    handler_done = asyncio.get_running_loop().create_future()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            frame_reader = FrameReader(reader, SECRET)
            frame_writer = FrameWriter(writer, SECRET)
            while (frame := await frame_reader.read()) is not None:
                server_got.append(frame)
                frame_writer.write_nowait(frame)
                if frame_writer.seq % DRAIN_EVERY == 0:
                    await writer.drain()
            await writer.drain()
            writer.write_eof()
        finally:
            writer.close()
            await writer.wait_closed()
            handler_done.set_result(None)

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    writer: asyncio.StreamWriter | None = None
    try:
        port = server.sockets[0].getsockname()[1]
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        frame_reader = FrameReader(reader, SECRET)
        frame_writer = FrameWriter(writer, SECRET)

        async def send() -> None:
            for frame in frames:
                frame_writer.write_nowait(frame)
                if frame_writer.seq % DRAIN_EVERY == 0:
                    await writer.drain()
            await writer.drain()
            writer.write_eof()

        async def receive() -> list[AnyFrame]:
            got: list[AnyFrame] = []
            while (frame := await frame_reader.read()) is not None:
                got.append(frame)
            return got

        async with asyncio.TaskGroup() as tg:
            tg.create_task(send())
            received = tg.create_task(receive())
        await handler_done
        assert frame_writer.seq == len(frames)
        assert frame_reader.seq == len(frames)
        return server_got, received.result()
    finally:
        if writer is not None:
            writer.close()
            await writer.wait_closed()
        server.close()
        await server.wait_closed()


async def _check_exchange() -> None:
    frames = _frames(N_FRAMES)
    assert len(frames) > N_FRAMES
    assert {f.kind for f in frames} == {"heartbeat", "batch", "metrics", "reject", "new_session"}
    server_got, echoed = await _echo_exchange(frames)
    assert len(server_got) == len(frames)
    assert server_got == frames
    assert len(echoed) == len(frames)
    assert echoed == frames


async def test_loopback_exchange_stdlib_loop() -> None:
    assert not isinstance(asyncio.get_running_loop(), uvloop.Loop)
    await _check_exchange()


@pytest.mark.uvloop
async def test_loopback_exchange_uvloop() -> None:
    assert isinstance(asyncio.get_running_loop(), uvloop.Loop)
    await _check_exchange()
