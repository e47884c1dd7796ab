"""RankBridge against a real loopback coordinator stand-in.

The stand-in (:class:`FakeCoordinator`) is an asyncio TCP server on 127.0.0.1 speaking real
authenticated frames through FrameReader/FrameWriter, on its own thread and event loop; the
tests drive the bridge from the pytest thread, as a rank's main thread would. Nothing sleeps to
wait for a condition: every wait is an event or queue with a timeout. The hard-exit tests run
the bridge in a child interpreter, since it ends its process.

No test bounds how fast anything happens (a shared machine may be slow): a deadline the bridge
promises is checked from below (never earlier than promised), and everything else is waited for
with a generous overall timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import queue
import re
import socket
import struct
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from flodl.errors import (
    ConfigError,
    CoordinatorLost,
    FrameError,
    LocalProtocolError,
    RemoteProtocolError,
)
from flodl.rank.bridge import HARD_EXIT_CODE, RankBridge
from flodl.wire.codec import AnyFrame
from flodl.wire.control_hello import (
    CHALLENGE_BYTES,
    CHALLENGE_MAGIC,
    CONTROL_PROTOCOL_VERSION,
    NONCE_BYTES,
    connection_key,
    encode_challenge,
    new_nonce,
)
from flodl.wire.frames import (
    Accept,
    CoordFrame,
    CoordHeartbeat,
    EpochPlan,
    Exiting,
    Heartbeat,
    Hello,
    Metrics,
    Reject,
    ResourceSample,
    SetGlobalStep,
    Shutdown,
    StartEpoch,
    SyncNow,
    Throttle,
)
from flodl.wire.stream import FrameReader, FrameWriter

pytestmark = pytest.mark.timeout(30)

ROOT = Path(__file__).resolve().parents[2]
SECRET = b"bridge-test-secret-0123456789abcdef"
SIGNATURE = "ab" * 32
WAIT_S = 5.0
"""Upper bound of any wait for something that should happen promptly."""

LOOPS = pytest.mark.parametrize(
    "loop_factory",
    [None, asyncio.new_event_loop],
    ids=["default-uvloop", "stdlib"],
)


def _hello(rank: int = 0) -> Hello:
    return Hello(run_id="bridge-test", rank=rank, world_size=2, model_signature=SIGNATURE)


def _accept(hello: Hello, heartbeat_timeout_s: float = 30.0) -> Accept:
    return Accept(
        run_id=hello.run_id,
        rank=hello.rank,
        world_size=hello.world_size,
        session=4,
        heartbeat_timeout_s=heartbeat_timeout_s,
    )


def announcing(heartbeat_timeout_s: float) -> Callable[[Hello], CoordFrame | None]:
    """A handshake reply announcing this liveness timeout (the rank obeys the coordinator)."""
    return lambda hello: _accept(hello, heartbeat_timeout_s)


def _free_port() -> int:
    """A port nothing listens on (bound, read back, released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class FakeCoordinator:
    """Plays the coordinator on 127.0.0.1, on a background thread with its own event loop.

    ``received`` gets ``(time.monotonic(), frame)`` for every frame from a rank, and
    ``(time, None)`` when a connection ends. ``reply`` maps the Hello to the handshake answer
    (``None``: stay silent); a Reject closes the connection after it is sent. ``challenge``
    makes the bytes it sends at accept (a real challenge by default; the frames are then keyed
    with the connection key, else with the secret). ``eof_seen`` is
    set when a rank half-closes its side; with ``close_on_eof=False`` the coordinator then
    keeps its own side open (and silent) until :meth:`stop`.
    """

    def __init__(
        self,
        *,
        reply: Callable[[Hello], CoordFrame | None] = _accept,
        secret: bytes = SECRET,
        port: int = 0,
        close_on_eof: bool = True,
        challenge: Callable[[], bytes] = encode_challenge,
    ) -> None:
        self._reply = reply
        self._challenge = challenge
        self._secret = secret
        self._port = port
        self._close_on_eof = close_on_eof
        self.received: queue.SimpleQueue[tuple[float, AnyFrame | None]] = queue.SimpleQueue()
        self.connected = threading.Event()
        self.eof_seen = threading.Event()
        self._ready: queue.SimpleQueue[int | BaseException] = queue.SimpleQueue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._handlers: set[asyncio.Task[None]] = set()
        self._conn: tuple[asyncio.StreamWriter, FrameWriter] | None = None
        self._beat: asyncio.Task[None] | None = None
        self._thread = threading.Thread(target=self._main, name="fake-coordinator", daemon=True)
        self.port = 0

    # -- test thread ------------------------------------------------------------------------
    def start(self) -> FakeCoordinator:
        self._thread.start()
        ready = self._ready.get(timeout=WAIT_S)
        if isinstance(ready, BaseException):
            raise ready
        self.port = ready
        return self

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(WAIT_S)
        assert not self._thread.is_alive(), "fake coordinator did not stop"

    def _call(self, fn: Callable[[], object]) -> None:
        async def run() -> None:
            fn()
            if self._conn is not None:
                with contextlib.suppress(OSError):
                    await self._conn[0].drain()

        assert self._loop is not None
        asyncio.run_coroutine_threadsafe(run(), self._loop).result(WAIT_S)

    def send(self, *frames: CoordFrame) -> None:
        """Write frames on the current connection, in order."""

        def write() -> None:
            assert self._conn is not None
            for frame in frames:
                self._conn[1].write_nowait(frame)

        self._call(write)

    def write_raw(self, data: bytes) -> None:
        self._call(lambda: self._conn[0].write(data) if self._conn else None)

    def send_eof(self) -> None:
        """Half-close the current connection: the bridge sees a clean EOF (a full close could
        reset the connection instead, if a rank heartbeat is still unread)."""
        self._call(lambda: self._conn[0].write_eof() if self._conn else None)

    def reset_connection(self) -> None:
        """Abort the current connection with a TCP reset (SO_LINGER 0)."""

        def reset() -> None:
            assert self._conn is not None
            sock = self._conn[0].get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self._conn[0].transport.abort()

        self._call(reset)

    def still_open(self) -> bool:
        """Whether the coordinator's side of the current connection is still open."""
        answer: list[bool] = []
        self._call(lambda: answer.append(self._conn is not None and not self._conn[0].is_closing()))
        return answer[0]

    def start_heartbeats(self, interval_s: float) -> None:
        def begin() -> None:
            self._beat = asyncio.get_running_loop().create_task(self._beat_loop(interval_s))

        self._call(begin)

    def stop_heartbeats(self) -> None:
        self._call(lambda: self._beat.cancel() if self._beat else None)

    def next_frame(
        self, kind: type[AnyFrame] | None = None, timeout: float = WAIT_S
    ) -> tuple[float, AnyFrame | None]:
        """The next received frame of type ``kind``, or the next end of a connection; with no
        ``kind``, the next frame that is neither a Hello, a rank heartbeat nor a resource
        sample."""
        deadline = time.monotonic() + timeout
        while True:
            at, frame = self.received.get(timeout=max(0.0, deadline - time.monotonic()))
            periodic = Hello | Heartbeat | ResourceSample
            if frame is None or (kind is None and not isinstance(frame, periodic)):
                return at, frame
            if kind is not None and isinstance(frame, kind):
                return at, frame

    # -- server thread ----------------------------------------------------------------------
    def _main(self) -> None:
        try:
            with asyncio.Runner(loop_factory=asyncio.new_event_loop) as runner:
                runner.run(self._serve())
        except BaseException as exc:  # noqa: BLE001 - surfaces in start(), not as a thread warning
            self._ready.put(exc)

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        server = await asyncio.start_server(self._handle, "127.0.0.1", self._port)
        try:
            self._ready.put(server.sockets[0].getsockname()[1])
            await self._stop.wait()
        finally:
            server.close()
            if self._beat is not None:
                self._beat.cancel()
            for task in list(self._handlers):
                task.cancel()
            await asyncio.gather(*self._handlers, return_exceptions=True)
            await server.wait_closed()

    async def _beat_loop(self, interval_s: float) -> None:
        while True:
            if self._conn is not None:
                self._conn[1].write_nowait(CoordHeartbeat())
            await asyncio.sleep(interval_s)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        try:
            challenge = self._challenge()
            writer.write(challenge)
            nonce = await reader.readexactly(NONCE_BYTES)
            key = self._secret
            if len(challenge) == CHALLENGE_BYTES:
                key = connection_key(self._secret, challenge[-NONCE_BYTES:], nonce)
            fr, fw = FrameReader(reader, key), FrameWriter(writer, key)
            hello = await fr.read()
            if not isinstance(hello, Hello):
                return
            self.received.put((time.monotonic(), hello))
            reply = self._reply(hello)
            if reply is not None:
                await fw.write(reply)
            if isinstance(reply, Reject):
                return
            self._conn = (writer, fw)
            self.connected.set()
            while (frame := await fr.read()) is not None:
                self.received.put((time.monotonic(), frame))
            self.eof_seen.set()
            if not self._close_on_eof:
                assert self._stop is not None
                await self._stop.wait()
        except (FrameError, OSError, asyncio.IncompleteReadError):
            pass
        finally:
            self._handlers.discard(task)
            self.received.put((time.monotonic(), None))
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()


@pytest.fixture
def coord() -> Iterator[FakeCoordinator]:
    server = FakeCoordinator().start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def fast_coord() -> Iterator[FakeCoordinator]:
    """A coordinator that announces a 0.3 s liveness timeout in its accept."""
    server = FakeCoordinator(reply=announcing(LIVENESS_S)).start()
    try:
        yield server
    finally:
        server.stop()


BridgeFactory = Callable[..., RankBridge]


@pytest.fixture
def make_bridge() -> Iterator[BridgeFactory]:
    """Builds bridges (hard exit off: an in-process bridge must never end pytest) and closes
    every one of them at teardown."""
    made: list[RankBridge] = []

    def make(port: int, **kwargs: object) -> RankBridge:
        kwargs.setdefault("hard_exit_grace_s", None)
        bridge = RankBridge("127.0.0.1", port, SECRET, _hello(), **kwargs)  # type: ignore[arg-type]
        made.append(bridge)
        return bridge

    try:
        yield make
    finally:
        for bridge in made:
            bridge.close(timeout=2.0)
            assert bridge._thread is None or not bridge._thread.is_alive()


# ---------------------------------------------------------------------------------------------
# Handshake
# ---------------------------------------------------------------------------------------------


@LOOPS
def test_handshake_returns_the_accept(
    coord: FakeCoordinator,
    make_bridge: BridgeFactory,
    loop_factory: Callable[[], asyncio.AbstractEventLoop] | None,
) -> None:
    bridge = make_bridge(coord.port, loop_factory=loop_factory)
    accept = bridge.start()
    assert accept == _accept(_hello())
    assert bridge.accepted == accept
    assert not bridge.lost
    assert bridge.lost_reason == ""
    _, hello = coord.received.get(timeout=WAIT_S)
    assert hello == _hello()
    with pytest.raises(LocalProtocolError, match="twice"):
        bridge.start()


def test_reject_raises_with_the_coordinators_reason(make_bridge: BridgeFactory) -> None:
    server = FakeCoordinator(reply=lambda h: Reject(reason=f"duplicate rank {h.rank}")).start()
    try:
        bridge = make_bridge(server.port)
        with pytest.raises(RemoteProtocolError, match="duplicate rank 0"):
            bridge.start()
        assert bridge.accepted is None
        assert bridge._thread is not None and not bridge._thread.is_alive()
        bridge.close()  # no-op after a failed start
    finally:
        server.stop()


def test_wrong_secret_fails_the_handshake(make_bridge: BridgeFactory) -> None:
    server = FakeCoordinator(secret=b"another-secret-0123456789abcdef!!").start()
    try:
        bridge = make_bridge(server.port)
        with pytest.raises(CoordinatorLost, match="handshake"):
            bridge.start()
    finally:
        server.stop()


@pytest.mark.parametrize(
    ("challenge", "match"),
    [
        (
            b"HTTP/1.1 400 " + new_nonce()[:11],
            r"not a flodl coordinator: its first bytes are b'HTTP'",
        ),
        (
            CHALLENGE_MAGIC + struct.pack("!I", 2) + new_nonce(),
            f"speaks control protocol version 2, this build {CONTROL_PROTOCOL_VERSION}",
        ),
    ],
    ids=["wrong-magic", "other-version"],
)
def test_a_bad_challenge_fails_the_handshake_with_a_clear_error(
    make_bridge: BridgeFactory, challenge: bytes, match: str
) -> None:
    server = FakeCoordinator(challenge=lambda: challenge).start()
    try:
        bridge = make_bridge(server.port)
        with pytest.raises(
            CoordinatorLost, match=rf"bad handshake from 127\.0\.0\.1:\d+: .*{match}"
        ):
            bridge.start()
        assert server.next_frame(Hello)[1] is None  # the connection ended without a hello
    finally:
        server.stop()


@pytest.mark.parametrize(
    "silent",
    [
        pytest.param({"challenge": lambda: b""}, id="no-challenge"),
        pytest.param({"reply": lambda h: None}, id="no-reply-to-the-hello"),
    ],
)
def test_silent_coordinator_fails_the_handshake_after_liveness_timeout(
    silent: dict[str, Any], make_bridge: BridgeFactory
) -> None:
    server = FakeCoordinator(**silent).start()
    try:
        # the handshake (challenge, hello, reply) gives up on the liveness timeout (0.3 s), not
        # on the 30 s connect timeout, and never before it
        bridge = make_bridge(server.port, liveness_timeout_s=0.3, connect_timeout_s=30.0)
        t0 = time.monotonic()
        with pytest.raises(CoordinatorLost, match=r"no handshake reply .* within 0\.3 s"):
            bridge.start()
        assert time.monotonic() - t0 >= 0.29
    finally:
        server.stop()


def test_connecting_before_the_coordinator_listens(make_bridge: BridgeFactory) -> None:
    port = _free_port()
    retried = threading.Event()

    class _OnRetry(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "retrying" in record.getMessage():
                retried.set()

    log = logging.getLogger("flodl.rank.bridge")
    handler, old_level = _OnRetry(logging.DEBUG), log.level
    log.addHandler(handler)
    log.setLevel(logging.DEBUG)
    server: FakeCoordinator | None = None
    try:
        bridge = make_bridge(port, connect_timeout_s=20.0)
        with ThreadPoolExecutor(1) as pool:
            started = pool.submit(bridge.start)
            assert retried.wait(WAIT_S), "the bridge never retried"
            assert not started.done()
            server = FakeCoordinator(port=port).start()
            assert started.result(WAIT_S) == _accept(_hello())
        bridge.close(timeout=2.0)
    finally:
        log.removeHandler(handler)
        log.setLevel(old_level)
        if server is not None:
            server.stop()


def test_connect_timeout_raises_coordinator_lost(make_bridge: BridgeFactory) -> None:
    port = _free_port()
    bridge = make_bridge(port, connect_timeout_s=0.6)
    t0 = time.monotonic()
    with pytest.raises(CoordinatorLost, match=rf"127\.0\.0\.1:{port} within 0\.6 s"):
        bridge.start()
    assert time.monotonic() - t0 >= 0.5  # it kept retrying: never gave up before its timeout


# ---------------------------------------------------------------------------------------------
# Heartbeats and frames
# ---------------------------------------------------------------------------------------------


@LOOPS
def test_heartbeats_arrive_every_heartbeat_s_with_the_latest_step(
    coord: FakeCoordinator,
    make_bridge: BridgeFactory,
    loop_factory: Callable[[], asyncio.AbstractEventLoop] | None,
) -> None:
    """The bridge thread keeps sending heartbeats on its own (the main thread only sets the
    step), each carrying the latest step, and never more often than every ``heartbeat_s``: it
    sleeps ``heartbeat_s`` between two, so ``n`` heartbeats take at least ``(n - 1)`` intervals
    from before ``start()`` (delivery delays only ever add time)."""
    heartbeat_s = 0.05
    bridge = make_bridge(coord.port, heartbeat_s=heartbeat_s, loop_factory=loop_factory)
    beats = 0

    def next_beat() -> tuple[float, AnyFrame | None]:
        nonlocal beats
        at, beat = coord.next_frame(Heartbeat)
        beats += 1
        return at, beat

    started_at = time.monotonic()
    bridge.start()
    bridge.set_step(7)
    while (beat := next_beat()[1]) != Heartbeat(rank=0, step=7):
        assert beat == Heartbeat(rank=0, step=0)
    bridge.set_step(9)
    while (beat := next_beat()[1]) != Heartbeat(rank=0, step=9):
        assert beat == Heartbeat(rank=0, step=7)
    for _ in range(8):  # they keep coming while the main thread does nothing
        at, beat = next_beat()
        assert beat == Heartbeat(rank=0, step=9)
    # 0.9: uvloop's timers have 1 ms resolution
    assert (beats - 1) * 0.9 * heartbeat_s <= at - started_at, (beats, at - started_at)
    with pytest.raises(LocalProtocolError):
        bridge.set_step(-1)


def test_resource_samples_arrive_every_resource_s(
    coord: FakeCoordinator, make_bridge: BridgeFactory
) -> None:
    """The bridge thread samples the process's resources on its own (docs/design.md §7):
    CPU %, RSS out of the host's memory, no GPU figures on a CPU rank."""
    bridge = make_bridge(coord.port, resource_s=0.05)
    bridge.start()
    deadline = time.monotonic() + 0.3
    while time.monotonic() < deadline:  # burn CPU on the main thread: the process is busy
        sum(i * i for i in range(10_000))
    samples = [coord.next_frame(ResourceSample)[1] for _ in range(3)]
    assert all(isinstance(s, ResourceSample) and s.rank == 0 for s in samples)
    busy = [s.cpu_percent for s in samples if isinstance(s, ResourceSample)]
    assert max(busy) > 10.0, busy
    first = samples[0]
    assert isinstance(first, ResourceSample)
    assert 0 < first.ram_used < first.ram_total
    assert first.vram_allocated is None and first.gpu_util_percent is None


def test_resource_samples_can_be_turned_off(make_bridge: BridgeFactory) -> None:
    with pytest.raises(ConfigError, match="resource_s must be > 0 or None"):
        make_bridge(1, resource_s=0.0)


@LOOPS
def test_coordinator_frames_arrive_in_order_then_eof_is_lost(
    coord: FakeCoordinator,
    make_bridge: BridgeFactory,
    loop_factory: Callable[[], asyncio.AbstractEventLoop] | None,
) -> None:
    bridge = make_bridge(coord.port, loop_factory=loop_factory)
    bridge.start()
    assert bridge.poll() is None
    assert bridge.recv(timeout=0.0) is None
    sent: list[CoordFrame] = []
    for i in range(200):
        sent.append(SetGlobalStep(global_step=i) if i % 2 else SyncNow(cycle=i))
    sent.append(StartEpoch(plan=EpochPlan(epoch=1, partition_offset=64, partition_size=128)))
    coord.send(*sent)
    got = [bridge.recv(timeout=WAIT_S) for _ in sent]
    assert got == sent
    coord.send(Throttle())
    coord.send_eof()
    assert bridge.lost.wait(WAIT_S)
    # frames that arrived before the loss are still delivered, then the loss is raised
    assert bridge.poll() == Throttle()
    with pytest.raises(CoordinatorLost, match="EOF"):
        bridge.poll()
    with pytest.raises(CoordinatorLost, match="EOF"):
        bridge.recv(timeout=WAIT_S)
    with pytest.raises(CoordinatorLost):
        bridge.send(Exiting(rank=0))


def test_server_eof_marks_lost_at_once(coord: FakeCoordinator, make_bridge: BridgeFactory) -> None:
    """The EOF itself is the loss: the bridge does not wait for its liveness timeout (30 s,
    announced in the accept; the reason would then name it)."""
    reasons: queue.SimpleQueue[str] = queue.SimpleQueue()
    bridge = make_bridge(coord.port, on_lost=reasons.put)
    assert bridge.start().heartbeat_timeout_s == 30.0
    assert coord.connected.wait(WAIT_S)
    coord.send_eof()
    assert bridge.lost.wait(WAIT_S)
    assert "EOF" in bridge.lost_reason
    assert "liveness timeout" not in bridge.lost_reason
    assert reasons.get(timeout=WAIT_S) == bridge.lost_reason
    with pytest.raises(queue.Empty):
        reasons.get(timeout=0.1)  # called once


def test_connection_reset_marks_lost_at_once(
    coord: FakeCoordinator, make_bridge: BridgeFactory
) -> None:
    """The reset itself is the loss, not the 30 s liveness timeout that would follow it."""
    bridge = make_bridge(coord.port)
    assert bridge.start().heartbeat_timeout_s == 30.0
    assert coord.connected.wait(WAIT_S)
    coord.reset_connection()
    assert bridge.lost.wait(WAIT_S)
    assert "ConnectionResetError" in bridge.lost_reason
    assert "liveness timeout" not in bridge.lost_reason
    with pytest.raises(CoordinatorLost, match="reset"):
        bridge.recv(timeout=WAIT_S)


def test_blocked_recv_wakes_at_the_loss(coord: FakeCoordinator, make_bridge: BridgeFactory) -> None:
    bridge = make_bridge(coord.port)
    bridge.start()
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(bridge.recv, None)
        coord.send_eof()
        with pytest.raises(CoordinatorLost, match="EOF"):
            waiting.result(WAIT_S)


def test_bad_frame_marks_lost(coord: FakeCoordinator, make_bridge: BridgeFactory) -> None:
    bridge = make_bridge(coord.port)
    bridge.start()
    assert coord.connected.wait(WAIT_S)
    coord.write_raw(b"\x00\x00\x00\x05hello" + bytes(16))  # well-formed length, bad tag
    assert bridge.lost.wait(WAIT_S)
    assert "bad frame" in bridge.lost_reason
    with pytest.raises(CoordinatorLost, match="auth tag"):
        bridge.recv(timeout=WAIT_S)


# ---------------------------------------------------------------------------------------------
# Coordinator liveness
# ---------------------------------------------------------------------------------------------


def test_coord_heartbeats_keep_it_alive_and_are_not_queued(
    fast_coord: FakeCoordinator, make_bridge: BridgeFactory
) -> None:
    coord = fast_coord
    bridge = make_bridge(coord.port)  # the coordinator's announced 0.3 s rules
    bridge.start()
    coord.start_heartbeats(0.05)
    assert not bridge.lost.wait(1.0), bridge.lost_reason  # > 3 liveness timeouts
    coord.send(Throttle())
    assert bridge.recv(timeout=WAIT_S) == Throttle()  # ~20 coord heartbeats came before it
    assert bridge.poll() is None
    coord.stop_heartbeats()
    assert bridge.lost.wait(WAIT_S)
    assert "liveness timeout 0.3 s" in bridge.lost_reason


def test_a_short_liveness_timeout_sets_a_faster_heartbeat(
    fast_coord: FakeCoordinator, make_bridge: BridgeFactory
) -> None:
    """The coordinator announces 0.3 s: the rank's heartbeats come every 0.1 s from then on
    (docs/design.md §2b, "Heartbeat cadence"), not at its 1 s setting, so a coordinator that
    hears nothing else from it (a rank waiting in a round) does not declare it dead. Eight
    heartbeats at the 1 s setting take at least 6.3 s (the 0.9 of the test above)."""
    coord = fast_coord
    bridge = make_bridge(coord.port, heartbeat_s=1.0)
    bridge.start()
    coord.start_heartbeats(0.05)  # (keeps the bridge from losing the coordinator meanwhile)
    first, _ = coord.next_frame(Heartbeat)
    for _ in range(7):
        at, beat = coord.next_frame(Heartbeat)
        assert beat == Heartbeat(rank=0, step=0)
    assert at - first < 7 * 0.9 * 1.0, at - first
    assert not bridge.lost.is_set(), bridge.lost_reason


def test_silence_marks_lost_after_liveness_timeout(
    fast_coord: FakeCoordinator, make_bridge: BridgeFactory
) -> None:
    coord = fast_coord
    reasons: queue.SimpleQueue[str] = queue.SimpleQueue()
    # the rank's own (longer) setting bounds only the handshake: the coordinator's 0.3 s rules
    bridge = make_bridge(coord.port, liveness_timeout_s=30.0, on_lost=reasons.put)
    t0 = time.monotonic()
    bridge.start()
    assert bridge.lost.wait(WAIT_S)
    assert time.monotonic() - t0 >= 0.29  # never before the timeout (1 ms timer resolution)
    assert "no frame from the coordinator" in bridge.lost_reason
    assert "liveness timeout 0.3 s" in bridge.lost_reason
    assert "did not run" not in bridge.lost_reason  # (this process ran all along)
    assert reasons.get(timeout=WAIT_S) == bridge.lost_reason
    with pytest.raises(CoordinatorLost, match="liveness timeout"):
        bridge.recv(timeout=WAIT_S)
    with pytest.raises(CoordinatorLost, match="liveness timeout"):
        bridge.recv(timeout=WAIT_S)  # stays raised
    with pytest.raises(CoordinatorLost, match="liveness timeout"):
        bridge.send(Exiting(rank=0))
    # the bridge dropped the connection: the coordinator sees it end
    assert coord.next_frame()[1] is None


def test_a_loss_after_this_process_did_not_run_says_it_was_this_rank_that_went_quiet(
    fast_coord: FakeCoordinator, make_bridge: BridgeFactory
) -> None:
    """A rank process stopped (SIGSTOP, a suspended machine) or starved for longer than the
    liveness timeout sent nothing either: the coordinator has most likely declared it dead, and
    the loss says so instead of only blaming the coordinator's silence. Here the bridge's own
    loop is held for 1 s, over three 0.3 s timeouts (as a stopped process's is)."""
    coord = fast_coord
    bridge = make_bridge(coord.port)
    bridge.start()
    coord.next_frame(Heartbeat)  # its heartbeats run
    assert bridge._loop is not None
    bridge._loop.call_soon_threadsafe(time.sleep, 1.0)
    assert bridge.lost.wait(WAIT_S)
    assert "no frame from the coordinator" in bridge.lost_reason
    found = re.search(
        r"; this process itself did not run for ([0-9.]+) s before it \(stopped, suspended or "
        r"starved of CPU\), so the coordinator has most likely declared this rank dead$",
        bridge.lost_reason,
    )
    assert found is not None, bridge.lost_reason
    assert float(found[1]) >= 0.85  # the 1 s held, less at most one 0.1 s heartbeat interval


# ---------------------------------------------------------------------------------------------
# close()
# ---------------------------------------------------------------------------------------------


@LOOPS
def test_close_flushes_frames_sent_just_before_it(
    coord: FakeCoordinator,
    make_bridge: BridgeFactory,
    loop_factory: Callable[[], asyncio.AbstractEventLoop] | None,
) -> None:
    bridge = make_bridge(coord.port, loop_factory=loop_factory)
    bridge.start()
    metrics = [
        Metrics(
            rank=0,
            epoch=0,
            avg_loss=0.5,
            batches_processed=i,
            samples_processed=i,
            epoch_ms=1.0,
            share_complete_ms=1.0,
            compute_only_ms=1.0,
        )
        for i in range(50)
    ]
    for m in metrics:
        bridge.send(m)
    bridge.send(Exiting(rank=0))
    bridge.close()
    # close() returned with its thread joined: it did not give up on a stuck bridge thread
    assert bridge._thread is not None and not bridge._thread.is_alive()
    got: list[AnyFrame] = []
    while (frame := coord.next_frame()[1]) is not None:
        got.append(frame)
    assert got == [*metrics, Exiting(rank=0)]
    assert not bridge.lost
    bridge.close()  # idempotent
    with pytest.raises(LocalProtocolError, match="after close"):
        bridge.send(Exiting(rank=0))
    with pytest.raises(LocalProtocolError, match="closed"):
        bridge.recv(timeout=WAIT_S)


def test_close_is_bounded_when_the_coordinator_never_closes(make_bridge: BridgeFactory) -> None:
    """The coordinator ignores our EOF (it keeps its side open and silent): close() stops
    lingering at its bound and closes the socket itself, and the coordinator falling silent
    during the linger does not count as a loss."""
    server = FakeCoordinator(reply=announcing(LIVENESS_S), close_on_eof=False).start()
    try:
        bridge = make_bridge(server.port)
        bridge.start()
        server.send(Shutdown())
        assert bridge.recv(timeout=WAIT_S) == Shutdown()
        # close() may linger up to 0.8 s of its 1 s: longer than the 0.3 s liveness timeout
        bridge.close(timeout=1.0)
        assert server.eof_seen.wait(WAIT_S)  # the bridge flushed and sent its EOF
        thread = bridge._thread
        assert thread is not None
        thread.join(WAIT_S)
        assert not thread.is_alive(), "the bridge thread still lingers"
        assert server.still_open()  # the coordinator never closed its side
        assert not bridge.lost
    finally:
        server.stop()


def test_send_before_start_is_a_local_error(make_bridge: BridgeFactory) -> None:
    bridge = make_bridge(_free_port())
    with pytest.raises(LocalProtocolError, match="before start"):
        bridge.send(Exiting(rank=0))
    with pytest.raises(LocalProtocolError, match="before start"):
        bridge.recv(timeout=None)
    with pytest.raises(LocalProtocolError, match="before start"):
        bridge.poll()
    bridge.close()
    with pytest.raises(LocalProtocolError, match="after close"):
        bridge.start()


def test_a_loss_arms_the_hard_exit_until_close(
    coord: FakeCoordinator, make_bridge: BridgeFactory
) -> None:
    """In process, so with a grace far beyond the test: only the timer's state is checked."""
    bridge = make_bridge(coord.port, hard_exit_grace_s=60.0)
    bridge.start()
    coord.send_eof()
    assert bridge.lost.wait(WAIT_S)
    timer = bridge._hard_exit_timer
    assert timer is not None and timer.is_alive()
    bridge.close(timeout=2.0)
    timer.join(WAIT_S)
    assert not timer.is_alive()


def test_eof_after_shutdown_is_lost_but_arms_no_hard_exit(
    coord: FakeCoordinator, make_bridge: BridgeFactory
) -> None:
    """After shutdown the main thread writes its files on the coordinator's orders: a
    coordinator that then closes must not get the rank killed mid-write."""
    bridge = make_bridge(coord.port, hard_exit_grace_s=60.0)
    bridge.start()
    coord.send(Shutdown())
    coord.send_eof()
    assert bridge.lost.wait(WAIT_S)
    assert bridge._hard_exit_timer is None
    assert bridge.recv(timeout=WAIT_S) == Shutdown()
    with pytest.raises(CoordinatorLost, match="EOF"):
        bridge.recv(timeout=WAIT_S)


def test_eof_after_shutdown_arms_the_after_stop_grace_when_one_is_set(
    coord: FakeCoordinator, make_bridge: BridgeFactory
) -> None:
    """A main thread stuck for good after the stop (a callback that never returns) would
    otherwise outlive the run: the rank loop sets a longer grace for a loss after the stop."""
    bridge = make_bridge(coord.port, hard_exit_grace_s=60.0)
    bridge.start()
    bridge.set_hard_exit_grace(60.0, after_stop_s=120.0)
    coord.send(Shutdown())
    coord.send_eof()
    assert bridge.lost.wait(WAIT_S)
    timer = bridge._hard_exit_timer
    assert timer is not None and timer.is_alive() and timer.interval == 120.0
    assert list(timer.args)[1] == 120.0  # (the grace its message names)
    bridge.close(timeout=2.0)  # the main thread finished its files in time: no exit
    timer.join(WAIT_S)
    assert not timer.is_alive()


def test_bad_hard_exit_graces_are_config_errors(
    coord: FakeCoordinator, make_bridge: BridgeFactory
) -> None:
    bridge = make_bridge(coord.port, hard_exit_grace_s=60.0)
    with pytest.raises(ConfigError, match="after_stop_s"):
        bridge.set_hard_exit_grace(1.0, after_stop_s=-1.0)
    with pytest.raises(ConfigError, match="hard_exit_grace_s"):
        bridge.set_hard_exit_grace(float("nan"))


# ---------------------------------------------------------------------------------------------
# Child processes: hard exit, and no torch
# ---------------------------------------------------------------------------------------------

_CHILD = textwrap.dedent(
    """
    import logging, sys, threading
    from flodl.rank.bridge import RankBridge
    from flodl.wire.frames import Hello

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    port, mode = int(sys.argv[1]), sys.argv[2]
    bridge = RankBridge(
        "127.0.0.1", port, {secret!r},
        Hello(run_id="bridge-test", rank=0, world_size=2, model_signature={sig!r}),
        heartbeat_s=0.05, liveness_timeout_s={timeout!r}, hard_exit_grace_s={grace!r},
        on_lost=lambda reason: print("lost:", reason, flush=True),
    )
    bridge.start()
    print("accepted", flush=True)
    if mode == "hang":
        threading.Event().wait()  # a main thread stuck forever
    assert bridge.lost.wait(10.0)
    bridge.close()
    threading.Event().wait({grace!r} + 0.5)  # outlive the grace: no hard exit after close()
    print("survived", flush=True)
    """
)
LIVENESS_S = 0.3
GRACE_S = 0.5
CHILD_WAIT_S = 20.0
"""Generous bound on a child's run after its accept (the test's own timeout is 30 s)."""


def _run_child(port: int, mode: str) -> tuple[float, int, str, str]:
    """Run the child until it exits; return (seconds from its accept to its exit, exit code,
    stdout after the accept line, stderr)."""
    script = _CHILD.format(secret=SECRET, sig=SIGNATURE, timeout=LIVENESS_S, grace=GRACE_S)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-c", script, str(port), mode],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()  # bounded by the test timeout; '' if the child died
        t0 = time.monotonic()
        assert first == "accepted\n", (first, proc.stderr.read() if proc.stderr else "")
        out, err = proc.communicate(timeout=CHILD_WAIT_S)
        return time.monotonic() - t0, proc.returncode, out, err
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


def test_hard_exit_when_the_main_thread_never_closes(fast_coord: FakeCoordinator) -> None:
    """The process ends itself, and not before the liveness timeout plus the grace."""
    elapsed, code, out, err = _run_child(fast_coord.port, "hang")
    assert code == HARD_EXIT_CODE, err
    assert elapsed >= LIVENESS_S + GRACE_S - 0.05
    assert "lost: no frame from the coordinator" in out
    assert "exit code 3" in err


def test_close_after_the_loss_disarms_the_hard_exit(fast_coord: FakeCoordinator) -> None:
    elapsed, code, out, err = _run_child(fast_coord.port, "close")
    assert code == 0, err
    assert "survived" in out
    assert elapsed >= LIVENESS_S + GRACE_S


_FLUSH_CHILD = textwrap.dedent(
    """
    import os, signal, sys
    from flodl.rank.bridge import RankBridge
    from flodl.wire.frames import Hello, Metrics

    bridge = RankBridge(
        "127.0.0.1", int(sys.argv[1]), {secret!r},
        Hello(run_id="bridge-test", rank=0, world_size=2, model_signature={sig!r}),
        hard_exit_grace_s=None,
    )
    bridge.start()
    for i in range({n}):
        bridge.send(Metrics(rank=0, epoch=0, avg_loss=0.5, batches_processed=i,
                            samples_processed=i, epoch_ms=1.0, share_complete_ms=1.0,
                            compute_only_ms=1.0))
    if not bridge.flush(10.0):
        print("not flushed", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
    """
)


def test_frames_sent_before_a_flush_survive_a_sigkill_right_after_it(
    coord: FakeCoordinator,
) -> None:
    """``flush()`` returns once the frames sent before it are in the kernel (chaos
    ``kill_after_ack`` relies on it): a process SIGKILLed right after loses none of them."""
    n = 3000
    script = _FLUSH_CHILD.format(secret=SECRET, sig=SIGNATURE, n=n)
    out = subprocess.run(
        [sys.executable, "-c", script, str(coord.port)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=CHILD_WAIT_S,
        check=False,
    )
    assert out.returncode == -9 and out.stdout == "", (out.stdout, out.stderr)
    got = []
    while (frame := coord.next_frame()[1]) is not None:
        got.append(frame)
    assert [f.batches_processed for f in got if isinstance(f, Metrics)] == list(range(n))


def test_flush_after_the_loss_returns_false(
    coord: FakeCoordinator, make_bridge: BridgeFactory
) -> None:
    bridge = make_bridge(coord.port)
    bridge.start()
    assert bridge.flush(WAIT_S)  # nothing queued: at once
    coord.stop()
    assert bridge.lost.wait(WAIT_S)
    assert bridge.flush(WAIT_S) is False


def test_importing_the_bridge_does_not_import_torch() -> None:
    probe = (
        "import sys\n"
        "import flodl.rank.bridge\n"
        "loaded = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
        "assert not loaded, loaded\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=25,
        check=False,
    )
    assert result.returncode == 0, result.stderr
