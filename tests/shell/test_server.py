"""CoordinatorServer over real loopback TCP, with fake ranks written here.

Each test binds a server on ``127.0.0.1:0`` around a real :class:`Coordinator` (world size 2)
and talks to it with ``asyncio.open_connection`` + :class:`FrameReader` / :class:`FrameWriter`,
as a rank's bridge would. Nothing sleeps to wait for a condition: frames are awaited with a
timeout, sink effects through a queue, server tasks with ``asyncio.wait``; a negative check is a
short bounded wait. Every connection and the server are closed in ``finally`` (the
:func:`serving` harness), and a callback error reported to the event loop's exception handler
fails the test.

``@pytest.mark.uvloop`` tests run on uvloop, the rest on the stdlib loop (tests/conftest.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import random
import socket
import struct
import sys
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import pytest

from flodl.config import CoordConfig, ElCheConfig, validated
from flodl.coord.effects import (
    Alert,
    BundleRequested,
    EpochDone,
    EvalDone,
    Record,
    Send,
    WriteMeta,
)
from flodl.coord.liveness import RankState
from flodl.coord.machine import Coordinator
from flodl.coord.phases import RunPhase
from flodl.errors import FrameError, LocalProtocolError
from flodl.service.heap import YOUNG_THRESHOLD, HeapFreeze
from flodl.service.server import CoordinatorServer
from flodl.timeouts import HEARTBEAT_INTERVAL_S, Timeouts
from flodl.wire.codec import AnyFrame, auth_tag, encode_frame
from flodl.wire.control_hello import CHALLENGE_BYTES, CHALLENGE_MAGIC, parse_challenge
from flodl.wire.frames import (
    PROTOCOL_VERSION,
    Accept,
    Batch,
    CoordHeartbeat,
    EpochAggregated,
    EpochMetrics,
    Heartbeat,
    Hello,
    RankExited,
    Reject,
    SetEpochCallbackRole,
    Shutdown,
    StartEpoch,
)
from flodl.wire.stream import FrameReader, FrameWriter, client_handshake

SECRET = b"server-test-secret-0123456789abcdef"
WRONG_SECRET = b"another-secret-0123456789abcdefghij"
RUN_ID = "server-test"
SIGNATURE = "ab" * 32
OTHER_SIGNATURE = "cd" * 32
STORE_PORT = 29_500
DATA_PORT = 29_501
WAIT_S = 5.0
"""Upper bound of any wait for something that should happen promptly."""

F = TypeVar("F", bound=AnyFrame)

SERVER_LOGGER = "flodl.service.server"


# ---------------------------------------------------------------------------------------------
# Harness
# ---------------------------------------------------------------------------------------------


class CollectingSink:
    """Keeps every sink effect; alerts also go to a queue, stamped with the loop time."""

    def __init__(self) -> None:
        self.metas: list[WriteMeta] = []
        self.bundles: list[BundleRequested] = []
        self.records: list[Record] = []
        self.alerts: list[Alert] = []
        self.epochs: list[EpochDone] = []
        self.evals: list[EvalDone] = []
        self._alert_queue: asyncio.Queue[tuple[float, Alert]] = asyncio.Queue()

    def write_meta(self, effect: WriteMeta) -> None:
        self.metas.append(effect)

    def bundle_requested(self, effect: BundleRequested) -> None:
        self.bundles.append(effect)

    def record(self, effect: Record) -> None:
        self.records.append(effect)

    def alert(self, effect: Alert) -> None:
        self.alerts.append(effect)
        self._alert_queue.put_nowait((asyncio.get_running_loop().time(), effect))

    def epoch_done(self, effect: EpochDone) -> None:
        self.epochs.append(effect)

    def eval_done(self, effect: EvalDone) -> None:
        self.evals.append(effect)

    async def next_alert(
        self, match: Callable[[Alert], bool], within: float = WAIT_S
    ) -> tuple[float, Alert]:
        """The next alert (by queue order) that ``match`` accepts, and when it was raised."""
        async with asyncio.timeout(within):
            while True:
                at, alert = await self._alert_queue.get()
                if match(alert):
                    return at, alert

    def lost(self, rank: int) -> list[Alert]:
        return [a for a in self.alerts if rank_lost(rank)(a)]


def rank_lost(rank: int) -> Callable[[Alert], bool]:
    return lambda a: a.cls == "rank_lost" and a.detail.startswith(f"rank {rank} declared dead")


@dataclass(eq=False)
class FakeRank:
    """One client connection speaking authenticated frames (under ``key``, the connection's)."""

    raw_reader: asyncio.StreamReader
    stream: asyncio.StreamWriter
    reader: FrameReader
    writer: FrameWriter
    key: bytes

    async def send(self, frame: AnyFrame) -> None:
        await self.writer.write(frame)

    async def send_raw(self, data: bytes) -> None:
        self.stream.write(data)
        await self.stream.drain()

    async def read(self, within: float = WAIT_S) -> AnyFrame | None:
        return await asyncio.wait_for(self.reader.read(), within)

    async def read_until(self, kind: type[F], within: float = WAIT_S) -> tuple[F, list[AnyFrame]]:
        """Read until a frame of type ``kind``; returns it and every frame read before it."""
        seen: list[AnyFrame] = []
        async with asyncio.timeout(within):
            while True:
                frame = await self.reader.read()
                assert frame is not None, f"EOF before a {kind.__name__}; got {seen}"
                if isinstance(frame, kind):
                    return frame, seen
                seen.append(frame)

    async def read_until_eof(self, within: float = WAIT_S) -> list[AnyFrame]:
        """Every frame until the server closes the connection (a clean EOF)."""
        seen: list[AnyFrame] = []
        async with asyncio.timeout(within):
            while (frame := await self.reader.read()) is not None:
                seen.append(frame)
        return seen

    def reset(self) -> None:
        """Close with a TCP reset (SO_LINGER 0)."""
        sock = self.stream.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.stream.close()

    async def close(self) -> None:
        self.stream.close()
        with contextlib.suppress(ConnectionError, OSError):
            await asyncio.wait_for(self.stream.wait_closed(), WAIT_S)


async def fake_rank(port: int, secret: bytes = SECRET, *, handshake: bool = True) -> FakeRank:
    """A connection to ``port`` that did the rank's side of the handshake (read the challenge,
    sent its nonce) unless ``handshake`` is false (then nothing is read or sent yet, and its
    frames are keyed with the secret itself, as no server accepts)."""
    r, w = await asyncio.open_connection("127.0.0.1", port)
    key = await asyncio.wait_for(client_handshake(r, w, secret), WAIT_S) if handshake else secret
    return FakeRank(r, w, FrameReader(r, key), FrameWriter(w, key), key)


def hello(rank: int, **fields: Any) -> Hello:
    values: dict[str, Any] = {
        "run_id": RUN_ID,
        "rank": rank,
        "world_size": 2,
        "model_signature": SIGNATURE,
    }
    values.update(fields)
    return Hello(**values)


@dataclass(eq=False)
class Harness:
    server: CoordinatorServer
    sink: CollectingSink
    machine: Coordinator
    conns: list[FakeRank] = field(default_factory=list)
    loop_errors: list[dict[str, Any]] = field(default_factory=list)

    async def connect(self, secret: bytes = SECRET, *, handshake: bool = True) -> FakeRank:
        conn = await fake_rank(self.server.port, secret, handshake=handshake)
        self.conns.append(conn)
        return conn

    async def hello(self, rank: int, *, secret: bytes = SECRET, **fields: Any) -> FakeRank:
        conn = await self.connect(secret)
        await conn.send(hello(rank, **fields))
        return conn

    async def join(self, rank: int, **fields: Any) -> tuple[FakeRank, Accept]:
        conn = await self.hello(rank, **fields)
        reply = await conn.read()
        assert isinstance(reply, Accept), reply
        return conn, reply

    async def form(self) -> tuple[FakeRank, FakeRank]:
        """Both ranks join; each reads up to its first ``start_epoch``."""
        r0, _ = await self.join(0)
        r1, _ = await self.join(1)
        await r0.read_until(StartEpoch)
        await r1.read_until(StartEpoch)
        return r0, r1


def make_config(*, heartbeat_timeout_s: float = 30.0) -> CoordConfig:
    return validated(
        CoordConfig,
        world_size=2,
        dataset_len=640,
        batch_size=32,
        elche=ElCheConfig.nccl_cadence(),
        timeouts=Timeouts(heartbeat_timeout_s),
        run_id=RUN_ID,
    )


@contextlib.asynccontextmanager
async def serving(*, heartbeat_timeout_s: float = 30.0, **server_kw: Any) -> AsyncIterator[Harness]:
    """A started server around a fresh machine; on exit every client connection is closed,
    then the server, and no callback error may have reached the loop's exception handler."""
    machine = Coordinator(make_config(heartbeat_timeout_s=heartbeat_timeout_s), random.Random(0))
    sink = CollectingSink()
    server = CoordinatorServer(
        machine, SECRET, sink=sink, store_port=STORE_PORT, data_port=DATA_PORT, **server_kw
    )
    h = Harness(server, sink, machine)
    loop = asyncio.get_running_loop()
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, context: h.loop_errors.append(context))
    try:
        await server.start()
        yield h
    finally:
        try:
            for conn in h.conns:
                await conn.close()
            await asyncio.wait_for(server.close(), WAIT_S)
        finally:
            loop.set_exception_handler(previous)
    assert h.loop_errors == []


def server_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == SERVER_LOGGER and r.levelno >= logging.WARNING
    ]


def _serves_a_connection(task: asyncio.Task[Any]) -> bool:
    return getattr(task.get_coro(), "__qualname__", "") == "CoordinatorServer._on_connection"


def big_frame() -> EpochAggregated:
    """About 1.8 MB on the wire: three 65,536-entry float lists."""
    n = 65_536
    metrics = EpochMetrics(
        epoch=0,
        avg_loss=0.5,
        epoch_ms=1.0,
        per_rank_loss=[0.5] * n,
        per_rank_throughput=[1.5] * n,
        per_rank_batch_share=[0.25] * n,
    )
    return EpochAggregated(metrics=metrics)


# ---------------------------------------------------------------------------------------------
# 1. Handshake
# ---------------------------------------------------------------------------------------------


@pytest.mark.uvloop
@pytest.mark.timeout(30)
async def test_accept_carries_rank_world_run_id_and_ports() -> None:
    async with serving() as h:
        _, accept = await h.join(1)
        assert accept.rank == 1
        assert accept.world_size == 2
        assert accept.run_id == RUN_ID
        assert accept.protocol == PROTOCOL_VERSION
        assert accept.store_port == STORE_PORT
        assert accept.data_port == DATA_PORT
        assert accept.heartbeat_timeout_s == 30.0
        assert h.machine.membership.liveness.state(1) is RankState.ALIVE


@pytest.mark.timeout(30)
async def test_accept_without_ports_announces_none() -> None:
    machine = Coordinator(make_config(), random.Random(0))
    server = CoordinatorServer(machine, SECRET, sink=CollectingSink())
    conn: FakeRank | None = None
    try:
        port = await server.start()
        assert port == server.port != 0
        conn = await fake_rank(port)
        await conn.send(hello(0))
        accept = await conn.read()
        assert isinstance(accept, Accept)
        assert accept.store_port is None and accept.data_port is None
    finally:
        if conn is not None:
            await conn.close()
        await server.close()


REFUSALS = [
    pytest.param({"run_id": "other-run"}, 1, "run id 'other-run' does not match", id="run-id"),
    pytest.param(
        {"protocol": PROTOCOL_VERSION + 1},
        1,
        f"protocol {PROTOCOL_VERSION + 1} not supported",
        id="protocol",
    ),
    pytest.param({}, 0, "already connected (duplicate rank)", id="duplicate-rank"),
    pytest.param({"model_signature": OTHER_SIGNATURE}, 1, "model signature", id="model-signature"),
    pytest.param({}, 2, "rank 2 out of range for world size 2", id="rank-out-of-range"),
    pytest.param({"world_size": 3}, 1, "world size 3 does not match", id="world-size"),
]


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("fields", "rank", "reason"), REFUSALS)
async def test_refused_hello_gets_reject_then_close_and_the_run_goes_on(
    fields: dict[str, Any], rank: int, reason: str
) -> None:
    async with serving() as h:
        first, _ = await h.join(0)  # rank 0 is connected (the duplicate case needs it)
        refused = await h.hello(rank, **fields)
        reply = await refused.read()
        assert isinstance(reply, Reject), reply
        assert reason in reply.reason
        assert await refused.read_until_eof() == []  # the server closed it after the Reject
        # the server keeps serving: the first rank 0 is untouched, rank 1 still joins
        assert h.machine.membership.liveness.state(0) is RankState.ALIVE
        second, accept = await h.join(1)
        assert accept.rank == 1
        await first.read_until(StartEpoch)
        await second.read_until(StartEpoch)
        assert h.sink.alerts == []


# ---------------------------------------------------------------------------------------------
# 2. Formation
# ---------------------------------------------------------------------------------------------


@pytest.mark.uvloop
@pytest.mark.timeout(30)
async def test_formation_sends_roles_and_start_epoch_to_each_rank() -> None:
    async with serving() as h:
        r0, _ = await h.join(0)
        r1, _ = await h.join(1)
        plans = []
        for conn in (r0, r1):
            start, before = await conn.read_until(StartEpoch)
            roles = [f for f in before if isinstance(f, SetEpochCallbackRole)]
            assert roles, f"no set_epoch_callback_role before start_epoch: {before}"
            assert roles[-1].rank in (0, 1)
            assert start.plan.epoch == 0
            plans.append(start.plan)
        # disjoint slices of epoch 0's 640 samples
        spans = sorted((p.partition_offset, p.partition_offset + p.partition_size) for p in plans)
        assert spans[0][1] <= spans[1][0]
        assert all(0 <= a < b <= 640 for a, b in spans)


# ---------------------------------------------------------------------------------------------
# 3-5. Connections that never become ranks
# ---------------------------------------------------------------------------------------------


@pytest.mark.timeout(30)
async def test_wrong_secret_is_closed_without_reply(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger=SERVER_LOGGER)
    async with serving() as h:
        intruder = await h.hello(0, secret=WRONG_SECRET)
        assert await intruder.read_until_eof() == []  # nothing at all, then EOF
        assert any("bad first frame" in m and "bad auth tag" in m for m in server_warnings(caplog))
        assert h.machine.membership.liveness.state(0) is RankState.JOINING
        _, accept = await h.join(0)  # the run is unaffected
        assert accept.rank == 0


def _valid_tag_garbage_body(key: bytes) -> bytes:
    body = b"\xc1"  # a byte msgpack never uses
    header = struct.pack("!I", len(body))
    return header + body + auth_tag(key, header, body, 0)


BAD_FIRST_BYTES = [  # what follows the nonce, made of the connection's key
    pytest.param(
        lambda key: encode_frame(Heartbeat(rank=0, step=0), key),
        "first frame is 'heartbeat'",
        id="no-hello",
    ),
    pytest.param(
        lambda key: encode_frame(Shutdown(), key),
        "first frame is 'shutdown'",
        id="coordinator-frame",
    ),
    pytest.param(
        lambda key: struct.pack("!I", 8) + b"\xde\xad\xbe\xef" * 2 + b"\x00" * 16,
        "bad auth tag",
        id="garbage",
    ),
    pytest.param(
        lambda key: encode_frame(hello(0), SECRET),  # keyed with the secret, as protocol 2 did
        "bad auth tag",
        id="secret-keyed-hello",
    ),
    pytest.param(_valid_tag_garbage_body, "undecodable frame body", id="undecodable-body"),
    pytest.param(lambda key: b"\xff\xff\xff\xff", "exceeds", id="oversize-4GiB-prefix"),
    pytest.param(lambda key: b"\x00\x00\x00\x00", "empty frame body", id="empty-body"),
]


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("make", "reason"), BAD_FIRST_BYTES)
async def test_bad_first_frame_is_closed_and_the_run_goes_on(
    make: Callable[[bytes], bytes], reason: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger=SERVER_LOGGER)
    async with serving() as h:
        bad = await h.connect()
        await bad.send_raw(make(bad.key))
        assert await bad.read_until_eof() == []
        assert any(reason in m for m in server_warnings(caplog)), server_warnings(caplog)
        r0, _ = await h.join(0)
        r1, _ = await h.join(1)
        await r0.read_until(StartEpoch)
        await r1.read_until(StartEpoch)
        assert h.sink.alerts == []


@pytest.mark.timeout(30)
async def test_eof_inside_the_first_frame_is_closed(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger=SERVER_LOGGER)
    async with serving() as h:
        bad = await h.connect()
        await bad.send_raw(struct.pack("!I", 100) + b"x" * 10)
        bad.stream.write_eof()
        assert await bad.read_until_eof() == []
        assert any("EOF inside a frame" in m for m in server_warnings(caplog))
        _, accept = await h.join(0)
        assert accept.rank == 0


@pytest.mark.timeout(30)
async def test_eof_inside_the_nonce_is_closed(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger=SERVER_LOGGER)
    async with serving() as h:
        bad = await h.connect(handshake=False)
        await bad.send_raw(b"x" * 5)
        bad.stream.write_eof()
        got = await asyncio.wait_for(bad.raw_reader.read(), WAIT_S)
        assert len(got) == CHALLENGE_BYTES  # the challenge, and nothing else before EOF
        assert await asyncio.wait_for(bad.raw_reader.read(), WAIT_S) == b""
        assert any(
            "bad first frame: EOF after 5 of the 16 B of the rank's nonce" in m
            for m in server_warnings(caplog)
        ), server_warnings(caplog)
        _, accept = await h.join(0)
        assert accept.rank == 0


@pytest.mark.timeout(30)
async def test_every_connection_gets_its_own_challenge_at_accept() -> None:
    async with serving() as h:
        nonces = set()
        for _ in range(3):
            conn = await h.connect(handshake=False)  # says nothing
            challenge = await asyncio.wait_for(conn.raw_reader.readexactly(CHALLENGE_BYTES), WAIT_S)
            assert challenge.startswith(CHALLENGE_MAGIC)
            nonces.add(parse_challenge(challenge))
        assert len(nonces) == 3


@pytest.mark.timeout(30)
async def test_a_hello_recorded_on_one_connection_fails_on_another(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger=SERVER_LOGGER)
    async with serving() as h:
        first = await h.connect()
        recorded = encode_frame(hello(0), first.key)
        await first.close()
        second = await h.connect()
        await second.send_raw(recorded)
        assert await second.read_until_eof() == []
        assert any("bad first frame: bad auth tag" in m for m in server_warnings(caplog))
        assert h.machine.membership.liveness.state(0) is RankState.JOINING


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("handshake", "partial"),
    [(True, b""), (True, b"\x00\x00"), (False, b""), (False, b"\x00" * 5)],
    ids=["silent", "half-a-header", "no-nonce", "half-a-nonce"],
)
async def test_no_hello_within_the_timeout_is_closed(
    handshake: bool, partial: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger=SERVER_LOGGER)
    async with serving(hello_timeout_s=0.3) as h:
        loop = asyncio.get_running_loop()
        started = loop.time()
        slow = await h.connect(handshake=handshake)
        if not handshake:
            await asyncio.wait_for(slow.raw_reader.readexactly(CHALLENGE_BYTES), WAIT_S)
        if partial:
            await slow.send_raw(partial)
        assert await slow.read_until_eof(within=WAIT_S) == []
        waited = loop.time() - started
        assert waited >= 0.29, waited  # never before the timeout (1 ms timer resolution)
        assert any("no hello within 0.3 s" in m for m in server_warnings(caplog))
        _, accept = await h.join(0)
        assert accept.rank == 0


SO_MEMINFO = 55
"""Linux ``getsockopt`` giving a socket's memory counters; index 8 is its drop count (for a
listening socket: the connections the kernel dropped because the accept queue was full)."""


def listen_drops(listener: Any) -> int:
    raw = listener.getsockopt(socket.SOL_SOCKET, SO_MEMINFO, 64)
    return int(struct.unpack(f"{len(raw) // 4}I", raw)[8])


def connect_burst(port: int, count: int) -> list[socket.socket]:
    """``count`` connections started without yielding to the loop, so that it accepts none of
    them meanwhile (on loopback the kernel completes each handshake inside ``connect``)."""
    socks = []
    for _ in range(count):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        sock.connect_ex(("127.0.0.1", port))
        socks.append(sock)
    return socks


@pytest.mark.skipif(sys.platform != "linux", reason="SO_MEMINFO is Linux's")
@pytest.mark.uvloop
@pytest.mark.timeout(60)
async def test_a_burst_of_connections_is_queued_not_dropped_and_each_is_closed() -> None:
    """300 connections arrive while the loop is busy: the listen backlog holds them all (with
    asyncio's default of 100, the kernel drops the surplus, and some of those end up open on
    the client's side only, where no deadline of the server can reach them); each is then
    accepted and closed at its hello deadline, with its reason counted."""
    async with serving(hello_timeout_s=0.5) as h:
        assert h.server._server is not None
        listener = h.server._server.sockets[0]
        before = listen_drops(listener)
        socks = connect_burst(h.server.port, 300)
        try:
            assert listen_drops(listener) == before
            reason = "no hello within 0.5 s"
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 30
            while h.server.refusals.counts[reason] < len(socks):
                assert loop.time() < deadline, dict(h.server.refusals.counts)
                await asyncio.sleep(0.05)
            assert h.server.refusals.counts[reason] == len(socks)
        finally:
            for sock in socks:
                sock.close()


# ---------------------------------------------------------------------------------------------
# 6-7. Accepted ranks that misbehave
# ---------------------------------------------------------------------------------------------


@pytest.mark.timeout(30)
async def test_impersonation_closes_the_connection_and_the_rank_is_lost() -> None:
    async with serving() as h:
        r0, _ = await h.join(0)
        await r0.send(Heartbeat(rank=1, step=0))
        frames = await r0.read_until_eof()
        assert not any(isinstance(f, StartEpoch) for f in frames)
        _, alert = await h.sink.next_alert(rank_lost(0))
        assert "rank 0 sent a frame claiming rank 1" in alert.detail
        assert h.machine.membership.liveness.state(0) is RankState.DEAD
        assert h.machine.membership.liveness.state(1) is RankState.JOINING
        # rank 0 died while the run was forming: the run is over, and says why
        over = await asyncio.wait_for(h.server.wait(), WAIT_S)
        assert not over.ok
        assert "rank 0 lost during formation" in over.reason


FORBIDDEN_FROM_A_RANK = [
    pytest.param(Shutdown(), "unexpected 'shutdown' frame", id="shutdown"),
    pytest.param(CoordHeartbeat(), "unexpected 'coord_heartbeat' frame", id="coord-heartbeat"),
    pytest.param(Reject(reason="no"), "unexpected 'reject' frame", id="reject"),
    pytest.param(hello(0), "unexpected 'hello' frame", id="second-hello"),
    pytest.param(RankExited(rank=0, exit_code=0), "may not report rank_exited", id="rank-exited"),
]


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("frame", "reason"), FORBIDDEN_FROM_A_RANK)
async def test_rank_sending_a_frame_it_may_not_send_is_disconnected(
    frame: AnyFrame, reason: str
) -> None:
    async with serving() as h:
        r0, _ = await h.form()
        await r0.send(frame)
        await r0.read_until_eof()
        _, alert = await h.sink.next_alert(rank_lost(0))
        assert reason in alert.detail
        assert h.machine.membership.liveness.state(0) is RankState.DEAD
        assert h.machine.membership.liveness.state(1) is RankState.ALIVE
        assert h.sink.lost(1) == []


@pytest.mark.timeout(30)
async def test_replayed_frame_fails_auth_and_the_rank_is_lost() -> None:
    """Each direction numbers its frames: the hello's bytes sent again (tagged for seq 0,
    arriving as seq 1) fail authentication."""
    async with serving() as h:
        r0, _ = await h.join(0)
        await r0.send_raw(encode_frame(hello(0), r0.key, seq=0))
        await r0.read_until_eof()
        _, alert = await h.sink.next_alert(rank_lost(0))
        assert "bad frame" in alert.detail and "bad auth tag" in alert.detail
        assert h.machine.membership.liveness.state(0) is RankState.DEAD


# ---------------------------------------------------------------------------------------------
# 8. Slow readers
# ---------------------------------------------------------------------------------------------


@pytest.mark.uvloop
@pytest.mark.timeout(30)
async def test_slow_reader_is_disconnected_and_reported_lost() -> None:
    async with serving(high_water=1024) as h:
        r0, _ = await h.form()
        big = big_frame()
        # rank 0 stops reading; the kernel buffers absorb a few MB, then the transport's
        # queue passes the 1 KiB mark
        h.server._apply([Send(0, big)] * 64)
        _, alert = await h.sink.next_alert(rank_lost(0))
        assert "slow reader" in alert.detail and "high-water 1024" in alert.detail
        [drop] = [a for a in h.sink.alerts if a.cls == "control_drop"]
        assert (
            drop.path == "root/rank0" and "epoch_aggregated to rank 0: slow reader" in drop.detail
        )
        assert h.sink.alerts.index(drop) < h.sink.alerts.index(alert)
        assert h.machine.membership.liveness.state(0) is RankState.DEAD
        assert h.machine.membership.liveness.state(1) is RankState.ALIVE
        assert h.sink.lost(1) == []
        # the connection ends: after what was queued before the cut (a close that flushes),
        # or inside a frame or with a reset (an abort)
        frames: list[AnyFrame] = []
        with contextlib.suppress(ConnectionResetError, FrameError):
            async with asyncio.timeout(20):
                while (frame := await r0.reader.read()) is not None:
                    frames.append(frame)
        assert sum(isinstance(f, EpochAggregated) for f in frames) < 64


@pytest.mark.timeout(30)
async def test_close_does_not_wait_on_a_cut_off_slow_reader() -> None:
    async with serving(high_water=1024) as h:
        r0, _ = await h.join(0)
        closing: asyncio.Task[None] | None = None
        try:
            h.server._apply([Send(0, big_frame())] * 64)
            await h.sink.next_alert(rank_lost(0))
            # rank 0 is still connected and still not reading
            closing = asyncio.create_task(h.server.close())
            done, _ = await asyncio.wait({closing}, timeout=WAIT_S)
            assert closing in done, "close() still waiting on the cut-off slow reader"
        finally:
            await r0.close()  # its unread data makes this a reset: the server side ends too
            if closing is not None:
                await asyncio.wait_for(closing, WAIT_S)


# ---------------------------------------------------------------------------------------------
# 9-11. Time and deaths
# ---------------------------------------------------------------------------------------------


@pytest.mark.uvloop
@pytest.mark.timeout(30)
async def test_accepted_rank_receives_coordinator_heartbeats() -> None:
    """A silent accepted rank keeps getting heartbeats, never more often than one per
    HEARTBEAT_INTERVAL_S: the machine's clock starts no earlier than the server, and the k-th
    broadcast is due k intervals after it (delivery only adds time)."""
    loop = asyncio.get_running_loop()
    started_at = loop.time()
    async with serving() as h:
        r0, _ = await h.join(0)
        for k in (1, 2):
            await r0.read_until(CoordHeartbeat)
            arrived = loop.time() - started_at
            # 0.99: uvloop's timers have 1 ms resolution
            assert arrived >= 0.99 * k * HEARTBEAT_INTERVAL_S, (k, arrived)


@pytest.mark.uvloop
@pytest.mark.timeout(30)
async def test_silent_rank_is_declared_dead_after_the_heartbeat_timeout() -> None:
    async with serving(heartbeat_timeout_s=0.5) as h:
        loop = asyncio.get_running_loop()
        joined_at = loop.time()  # rank 0 says nothing after its hello
        r0, accept = await h.join(0)
        assert accept.heartbeat_timeout_s == 0.5
        r1, _ = await h.join(1)

        async def beat() -> None:
            step = 0
            while True:
                await r1.send(Heartbeat(rank=1, step=step))
                step += 1
                await asyncio.sleep(0.1)

        beating = asyncio.create_task(beat())
        try:
            dead_at, alert = await h.sink.next_alert(rank_lost(0))
            assert "heartbeat timeout" in alert.detail
            assert dead_at - joined_at >= 0.49, dead_at - joined_at  # never before the timeout
            assert h.machine.membership.liveness.state(0) is RankState.DEAD
            await r0.read_until_eof()  # the server closed the dead rank's connection
            # rank 1 outlives the timeout by more than the timeout
            with pytest.raises(TimeoutError):
                await h.sink.next_alert(rank_lost(1), within=0.7)
            assert h.machine.membership.liveness.state(1) is RankState.ALIVE
        finally:
            beating.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await beating


@pytest.mark.timeout(30)
async def test_child_exited_threadsafe_marks_the_rank_dead() -> None:
    async with serving() as h:
        r0, _ = await h.form()
        thread = threading.Thread(target=h.server.child_exited_threadsafe, args=(0, 7))
        thread.start()
        thread.join(WAIT_S)
        assert not thread.is_alive()
        _, alert = await h.sink.next_alert(rank_lost(0))
        assert "process exited with code 7" in alert.detail
        assert h.machine.membership.liveness.state(0) is RankState.DEAD
        assert h.machine.membership.liveness.state(1) is RankState.ALIVE
        await r0.read_until_eof()  # the dead rank's connection is closed


@pytest.mark.timeout(30)
async def test_supervisor_reports_exits_and_may_send_nothing_else() -> None:
    async with serving() as h:
        supervisor, accept = await h.join(0, role="supervisor")
        assert accept.rank == 0
        assert h.machine.membership.liveness.state(0) is RankState.JOINING  # trains nothing
        _, r1 = await h.form()
        await supervisor.send(RankExited(rank=1, exit_code=-9))
        _, alert = await h.sink.next_alert(rank_lost(1))
        assert "process exited with code -9" in alert.detail
        await r1.read_until_eof()
        await supervisor.send(Heartbeat(rank=0, step=0))
        await supervisor.read_until_eof()
        # a supervisor's connection is no rank's: losing it kills nobody
        assert h.machine.membership.liveness.state(0) is RankState.ALIVE
        assert h.sink.lost(0) == []


@pytest.mark.timeout(30)
async def test_reset_before_hello_is_handled_by_the_server() -> None:
    async with serving() as h:
        doomed = await h.connect()
        await doomed.send_raw(b"\x00\x00")
        await h.join(0)  # accepted after `doomed`: its task is running
        connections = [t for t in asyncio.all_tasks() if _serves_a_connection(t)]
        assert len(connections) == 2
        doomed.reset()
        done, _ = await asyncio.wait(
            connections, timeout=WAIT_S, return_when=asyncio.FIRST_COMPLETED
        )
        assert len(done) == 1  # the doomed connection's task ended; rank 0's goes on
        assert h.loop_errors == [], [c.get("message") for c in h.loop_errors]
        assert h.machine.membership.liveness.state(0) is RankState.ALIVE


# ---------------------------------------------------------------------------------------------
# 12. close()
# ---------------------------------------------------------------------------------------------


@pytest.mark.uvloop
@pytest.mark.timeout(30)
async def test_close_closes_every_connection_and_task_and_is_idempotent() -> None:
    async with serving() as h:
        port = h.server.port
        lurker = await h.connect()  # never says hello
        r0, r1 = await h.form()  # accepted after the lurker: every connection is being served
        serving_tasks = asyncio.all_tasks() - {asyncio.current_task()}
        assert len(serving_tasks) >= 3  # one per connection (and the lurker's hello wait)
        await asyncio.wait_for(h.server.close(), WAIT_S)
        assert asyncio.all_tasks() == {asyncio.current_task()}
        assert all(t.done() for t in serving_tasks)
        for conn in (lurker, r0, r1):
            await conn.read_until_eof()
        await asyncio.wait_for(h.server.close(), WAIT_S)  # again: nothing left to do
        assert asyncio.all_tasks() == {asyncio.current_task()}
        with pytest.raises(OSError):
            await asyncio.open_connection("127.0.0.1", port)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("freeze", [False, True])
async def test_the_heap_is_frozen_while_the_run_trains_only_when_asked(freeze: bool) -> None:
    """``freeze_heap`` (``flodl coord``'s): once formation makes the machine train, the
    process's heap is frozen (the collector's full passes skip it); closing the server gives it
    back. Without it (a launcher-hosted coordinator, in the user's interpreter) the collector
    is left alone."""
    assert gc.get_freeze_count() == 0, "another test left the heap frozen"
    before = gc.get_threshold()
    try:
        async with serving(freeze_heap=freeze) as h:
            r0, _ = await h.join(0)
            assert gc.get_freeze_count() == 0  # still forming
            await h.join(1)
            await r0.read_until(StartEpoch)  # the second hello was handled: training
            assert (gc.get_freeze_count() > 0) is freeze
            assert (gc.get_threshold()[0] == YOUNG_THRESHOLD) is freeze
            await asyncio.wait_for(h.server.close(), WAIT_S)
            assert gc.get_freeze_count() == 0
            assert gc.get_threshold() == before
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)


def test_a_released_heap_policy_never_freezes_again() -> None:
    """An input that reaches a closed server (a reduce round's report queued from another
    thread) must not freeze the heap again: nobody would unfreeze it."""
    assert gc.get_freeze_count() == 0, "another test left the heap frozen"
    before = gc.get_threshold()
    assert before[0] < YOUNG_THRESHOLD, "another test left the collector's threshold raised"
    try:
        early = HeapFreeze()
        early.release()  # closed before it trained
        early.on_phase(RunPhase.TRAINING)
        assert gc.get_freeze_count() == 0 and not early.frozen
        assert gc.get_threshold() == before
        heap = HeapFreeze()
        heap.on_phase(RunPhase.FORMING)
        assert gc.get_freeze_count() == 0 and heap.pending
        assert gc.get_threshold() == before
        heap.on_phase(RunPhase.TRAINING)
        assert gc.get_freeze_count() > 0 and heap.frozen and not heap.pending
        # young passes are rarer while it trains; the older generations keep their ratios
        assert gc.get_threshold() == (YOUNG_THRESHOLD, *before[1:])
        heap.release()
        heap.release()  # idempotent
        heap.on_phase(RunPhase.TRAINING)
        assert gc.get_freeze_count() == 0 and not heap.frozen and not heap.pending
        assert gc.get_threshold() == before
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)


@pytest.mark.timeout(30)
async def test_our_own_bug_ends_the_run_and_is_never_blamed_on_the_rank(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A LocalProtocolError raised while handling a rank's frame is a bug of ours: the run
    ends with the error, and no rank is declared dead for it."""
    async with serving() as h:
        r0, r1 = await h.form()

        def broken(batch: Batch) -> None:
            raise LocalProtocolError("planted bug in the ledger")

        monkeypatch.setattr(h.machine.dispatch, "on_batch", broken)
        await r0.send(Batch(rank=0, epoch=0, step=1, batch_ms=1.0, loss=1.0))
        over = await asyncio.wait_for(h.server.wait(), WAIT_S)
        assert not over.ok
        assert "coordinator internal error while handling 'batch'" in over.reason
        assert "planted bug in the ledger" in over.reason
        assert h.machine.membership.liveness.state(0) is RankState.ALIVE
        assert [a for a in h.sink.alerts if a.cls == "rank_lost"] == []
        await r0.read_until_eof()  # every rank sees its coordinator go away
        await r1.read_until_eof()
        assert any("internal error" in r.getMessage() for r in caplog.records)
