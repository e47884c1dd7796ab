"""The coordinator service: an asyncio shell around the pure :class:`Coordinator` machine.

Single-threaded (one event loop, uvloop in production); the machine makes every decision and
this module only moves bytes and time:

* one reader task per connection: at accept the server sends its challenge (a fresh nonce,
  :mod:`flodl.wire.control_hello`); the rank's nonce and then its ``hello`` frame, tagged with
  the key both nonces give, must arrive within ``hello_timeout_s`` of the accept (one deadline
  for the whole handshake), else the connection is aborted; the machine's ``Reply``
  effect answers on that connection and an ``Accept`` binds it to its rank (or marks it a
  launcher supervisor);
* the port listens with a backlog of :data:`LISTEN_BACKLOG`, not asyncio's 100, so that the
  kernel queues a burst of connections until the loop accepts them instead of dropping some
  half-way (a connection dropped so is open on the client's side only: no deadline of ours
  can close it);
* every later frame is checked against its connection (a rank may only speak for itself, a
  supervisor may only report ``rank_exited``) and handed to ``machine.handle(frame,
  loop.time())``; effects are executed in order;
* one timer re-armed at ``machine.next_deadline()`` after every input (``now`` passed to
  ``tick`` is never earlier than the deadline, as aioquic does);
* a misbehaving peer (bad frame, wrong sender, a reader slower than the write-buffer high-water
  mark) is closed and reported to the machine as ``PeerLost``; everyone else keeps being served;
* the CPU reduce server (threads) reports finished rounds through
  ``loop.call_soon_threadsafe``, and so does a launcher's child supervisor
  (:meth:`CoordinatorServer.child_exited_threadsafe`).

Side effects the machine asks for (meta, records, alerts, epoch metrics, eval results) go to an
:class:`EffectSink`; the default one logs.

A server may start without a machine (``flodl coord``: the ranks bring the job): the first
``hello`` is then handed to its ``define`` hook, which either refuses it (the reason goes back
in a ``reject``; nothing else changes) or returns the machine and the data services built for
the job that hello describes; that hello then goes to the machine like any other.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from flodl.coord.effects import (
    Alert,
    BundleRequested,
    Close,
    Effect,
    EpochDone,
    EvalDone,
    OpenReduce,
    RankDead,
    RankLeft,
    RankRejoined,
    Record,
    RefusePeer,
    Reply,
    RunOver,
    Send,
    WriteMeta,
)
from flodl.coord.inputs import ChildExited, Input, PeerLost, ReduceDone
from flodl.coord.machine import Coordinator
from flodl.errors import FrameError
from flodl.service.heap import HeapFreeze
from flodl.service.refusals import Refusals
from flodl.wire.codec import MAX_CONTROL_FRAME_BYTES, AnyFrame, SharedBodies
from flodl.wire.control_hello import NONCE_BYTES, connection_key, encode_challenge, new_nonce
from flodl.wire.frames import (
    RANK_FRAME_KINDS,
    Accept,
    CoordFrame,
    Hello,
    RankExited,
    RankFrame,
    Reject,
)
from flodl.wire.stream import FrameReader, FrameWriter

__all__ = ["EffectSink", "LoggingSink", "ReduceHooks", "Defined", "CoordinatorServer"]

logger = logging.getLogger(__name__)

DEFAULT_HIGH_WATER = 4 * 1024 * 1024
"""Bytes queued to one peer beyond which it is a slow reader and gets disconnected."""
HELLO_MAX_BYTES = 64 * 1024
"""Ceiling on a connection's first frame: until it authenticated with a hello, a peer can make
the coordinator buffer no more than this (the full control ceiling applies afterwards)."""
LISTEN_BACKLOG = 4096
"""Listen backlog of the control port (the kernel caps it at ``net.core.somaxconn``, 4096 by
default on Linux >= 5.4). asyncio's default of 100 overflows when a burst of connections (2,000
idle ones in a second, in the fuzz test) meets a busy loop. With ``tcp_syncookies`` on, Linux
then completes some handshakes with a cookie and drops their last ACK: such a connection is
established on the client's side only. The server never holds it (no descriptor, no memory), so
no deadline of the server can close it, and an idle client sees it open until it gives up."""


class EffectSink(Protocol):
    """Where the machine's non-network effects go (the launcher, the record log, the handle)."""

    def write_meta(self, effect: WriteMeta) -> None: ...
    def bundle_requested(self, effect: BundleRequested) -> None: ...
    def record(self, effect: Record) -> None: ...
    def alert(self, effect: Alert) -> None: ...
    def epoch_done(self, effect: EpochDone) -> None: ...
    def eval_done(self, effect: EvalDone) -> None: ...


class LoggingSink:
    """The default sink: alerts at WARNING, everything else at DEBUG/INFO."""

    def write_meta(self, effect: WriteMeta) -> None:
        logger.info("meta (%s): epoch %s", effect.reason, effect.meta.get("epoch"))

    def bundle_requested(self, effect: BundleRequested) -> None:
        logger.debug("bundle %d requested", effect.version)

    def record(self, effect: Record) -> None:
        logger.debug("record %s %s %s", effect.path, effect.kind, effect.data)

    def alert(self, effect: Alert) -> None:
        logger.warning("[%s] %s: %s", effect.cls, effect.path, effect.detail)

    def epoch_done(self, effect: EpochDone) -> None:
        m = effect.metrics
        logger.info("epoch %d: loss %.6g in %.0f ms", m.epoch, m.avg_loss, m.epoch_ms)

    def eval_done(self, effect: EvalDone) -> None:
        logger.info("eval after epoch %d: %.6g", effect.epoch, effect.metric)


class ReduceHooks(Protocol):
    """What the control loop tells the CPU reduce server (see :mod:`flodl.service.reduce`)."""

    def open_round(self, cycle: int, ranks: tuple[int, ...]) -> None: ...
    def rank_dead(self, rank: int) -> None: ...
    def rank_rejoined(self, rank: int) -> None: ...


@dataclass(frozen=True)
class Defined:
    """What a ``define`` hook built for the job of the first hello."""

    machine: Coordinator
    reduce: ReduceHooks | None = None
    data_port: int | None = None
    store_port: int | None = None


Define = Callable[[Hello], "Defined | str"]
"""A server's hook for the first hello when it has no machine yet: what it built, or why the
hello is refused."""


@dataclass(eq=False)
class _Peer:
    source: asyncio.StreamReader
    stream: asyncio.StreamWriter
    address: str
    nonce: bytes
    """The server's nonce of this connection (sent in its challenge)."""
    writer: FrameWriter | None = None
    """Set once the rank's nonce arrived (the connection key is known)."""
    rank: int | None = None
    role: str = "rank"
    supervisor: bool = False
    closed: bool = False
    reason: str = ""
    task: asyncio.Task[None] | None = field(default=None, repr=False)


class CoordinatorServer:
    """Serve one run's control plane.

    Args:
        machine: the pure coordinator (owned: only this server calls it); ``None`` until
            ``define`` built it from the first hello.
        secret: the run secret (each connection's frame key is derived from it).
        host: address to bind (127.0.0.1 unless ranks are on other hosts).
        port: port to bind, 0 for any.
        sink: destination of meta/records/alerts/metrics effects.
        reduce: the CPU reduce server, when the mode averages on the CPU.
        high_water: bytes queued to one peer before it counts as a slow reader.
        hello_timeout_s: how long a new connection may take to send its nonce and ``hello``.
        data_port: the CPU reduce server's port, announced in every ``accept``.
        store_port: the torch.distributed store's port, announced in every ``accept``.
        define: builds the machine from the first hello (with ``machine=None``).
        freeze_heap: freeze the process's heap once the run trains, until it ends
            (:class:`~flodl.service.heap.HeapFreeze`; only for a process that is the
            coordinator's alone, as ``flodl coord``'s).
    """

    def __init__(
        self,
        machine: Coordinator | None,
        secret: bytes,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        sink: EffectSink | None = None,
        reduce: ReduceHooks | None = None,
        high_water: int = DEFAULT_HIGH_WATER,
        hello_timeout_s: float = 10.0,
        data_port: int | None = None,
        store_port: int | None = None,
        define: Define | None = None,
        freeze_heap: bool = False,
    ) -> None:
        if machine is None and define is None:
            raise ValueError("a server without a machine needs a define hook")
        self._accept_extras = {"data_port": data_port, "store_port": store_port}
        self._machine = machine
        self._define = define
        self._secret = secret
        self._host = host
        self._port = port
        self.sink: EffectSink = sink if sink is not None else LoggingSink()
        self.reduce = reduce
        self._high_water = high_water
        self._hello_timeout_s = hello_timeout_s
        self.refusals = Refusals(logger)
        """Every refused or cut connection, counted by reason (logged within a budget)."""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.Server | None = None
        self._peers: set[_Peer] = set()
        self._by_rank: dict[int, _Peer] = {}
        self._current: _Peer | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at: float | None = None
        self._done: asyncio.Future[RunOver] | None = None
        self._broken: str | None = None
        """Set once the machine raised (our own bug): the run is over."""
        self._heap = HeapFreeze() if freeze_heap else None
        self.port = 0

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> int:
        """Bind and start serving; returns the bound port."""
        self._loop = asyncio.get_running_loop()
        self._done = self._loop.create_future()
        self._server = await asyncio.start_server(
            self._on_connection,
            self._host,
            self._port,
            reuse_address=True,
            backlog=LISTEN_BACKLOG,
        )
        self.port = int(self._server.sockets[0].getsockname()[1])
        if self._machine is not None:
            self._apply(self._machine.tick(self._loop.time()))
        logger.info("coordinator listening on %s:%d", self._host, self.port)
        return self.port

    @property
    def machine(self) -> Coordinator:
        """The pure coordinator (only once it exists: see :attr:`defined`)."""
        assert self._machine is not None, "the job is not defined yet"
        return self._machine

    @property
    def defined(self) -> bool:
        """Whether the machine exists (always, unless a ``define`` hook waits for a hello)."""
        return self._machine is not None

    async def wait(self) -> RunOver:
        """Until the machine says the run is over."""
        assert self._done is not None, "start() first"
        return await asyncio.shield(self._done)

    async def close(self) -> None:
        """Stop accepting, close every connection, cancel every task, give the heap back to
        the collector (idempotent)."""
        if self._heap is not None:
            self._heap.release()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
        peers = list(self._peers)
        for peer in peers:
            self._close_peer(peer, "coordinator shutting down", report=False)
        tasks = [p.task for p in peers if p.task is not None and not p.task.done()]
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        for peer in peers:
            await _wait_closed(peer.stream)

    # ------------------------------------------------------------------ thread-safe inputs
    def child_exited_threadsafe(self, rank: int, exit_code: int) -> None:
        """From a supervisor thread: the process of ``rank`` exited (the fast death path)."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._dispatch, ChildExited(rank, exit_code))

    def may_rejoin_threadsafe(self, rank: int, timeout_s: float) -> bool:
        """From a supervisor thread, after :meth:`child_exited_threadsafe` for ``rank``: whether
        a new incarnation of it would be admitted now (the exit was handled first: the loop
        runs callbacks in order). False when the loop is gone or does not answer in time."""
        loop = self._loop
        if loop is None or loop.is_closed() or self._machine is None:
            return False
        machine = self._machine

        async def ask() -> bool:
            return machine.may_rejoin(rank)

        try:
            return asyncio.run_coroutine_threadsafe(ask(), loop).result(timeout=timeout_s)
        except (TimeoutError, RuntimeError, concurrent.futures.CancelledError):
            return False

    def reduce_done_threadsafe(
        self, cycle: int, contributors: tuple[int, ...], weight: float
    ) -> None:
        """From the reduce server's worker thread: a CPU round finished."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._dispatch, ReduceDone(cycle, contributors, weight))

    # ------------------------------------------------------------------ connections
    async def _on_connection(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        peername = writer.get_extra_info("peername")
        address = f"{peername[0]}:{peername[1]}" if peername else "?"
        writer.transport.set_write_buffer_limits(high=self._high_water)
        peer = _Peer(reader, writer, address, new_nonce())
        with contextlib.suppress(ConnectionError, OSError, RuntimeError):
            writer.write(encode_challenge(peer.nonce))  # never waits: 24 B into a fresh buffer
        peer.task = asyncio.current_task()
        self._peers.add(peer)
        try:
            await self._serve(peer)
        except asyncio.CancelledError:
            pass
        finally:
            self._peers.discard(peer)
            if not peer.closed:
                self._close_peer(peer, peer.reason or "connection ended")
            await _wait_closed(writer)

    async def _handshake(self, peer: _Peer) -> tuple[FrameReader, AnyFrame | None] | None:
        """The rank's nonce, then its first frame under the connection key; ``None`` when the
        peer left before sending a byte (the caller bounds it in time)."""
        try:
            client_nonce = await peer.source.readexactly(NONCE_BYTES)
        except asyncio.IncompleteReadError as exc:
            if not exc.partial:
                return None
            raise FrameError(
                f"EOF after {len(exc.partial)} of the {NONCE_BYTES} B of the rank's nonce"
            ) from None
        key = connection_key(self._secret, peer.nonce, client_nonce)
        reader = FrameReader(peer.source, key, max_bytes=HELLO_MAX_BYTES)
        peer.writer = FrameWriter(peer.stream, key)
        return reader, await reader.read()

    async def _serve(self, peer: _Peer) -> None:
        try:
            # one deadline for the whole handshake (nonce and hello), as on the data port
            async with asyncio.timeout(self._hello_timeout_s):
                handshake = await self._handshake(peer)
        except TimeoutError:
            peer.reason = f"no hello within {self._hello_timeout_s:g} s"
            self._refuse(peer.address, peer.reason)
            return
        except FrameError as exc:
            peer.reason = f"bad first frame: {exc}"
            self._refuse(peer.address, peer.reason)
            return
        except (ConnectionError, OSError) as exc:
            peer.reason = f"connection error before hello: {exc}"
            return
        if handshake is None:
            return
        reader, first = handshake
        if first is None:
            return
        if not isinstance(first, Hello):
            peer.reason = f"first frame is {first.kind!r}, not 'hello'"
            self._refuse(peer.address, peer.reason)
            return
        peer.role = first.role
        if self._machine is None and not self._define_from(first, peer):
            return
        self._dispatch(first, peer)
        if peer.closed:
            return
        reader.max_bytes = MAX_CONTROL_FRAME_BYTES  # authenticated and accepted
        while not peer.closed:
            try:
                frame = await reader.read()
            except FrameError as exc:
                peer.reason = f"bad frame: {exc}"
                self._refuse(peer.address, peer.reason, peer.rank)
                return
            except (ConnectionError, OSError) as exc:
                peer.reason = f"connection error: {exc}"
                return
            if frame is None:
                peer.reason = "EOF"
                return
            problem = self._check_sender(peer, frame)
            if problem is not None:
                peer.reason = problem
                self._refuse(peer.address, problem, peer.rank)
                return
            self._dispatch(frame, peer)  # type: ignore[arg-type]

    def _define_from(self, hello: Hello, peer: _Peer) -> bool:
        """The first hello of a server without a machine: build it, or refuse the hello."""
        assert self._define is not None
        assert self._loop is not None
        try:
            outcome = self._define(hello)
        except Exception as exc:  # noqa: BLE001 - our own bug, never blamed on the peer
            self._internal_error(exc, "defining the job")
            return False
        if isinstance(outcome, str):
            peer.reason = outcome
            self._refuse(peer.address, outcome)
            self._write(peer, Reject(reason=outcome))
            self._close_peer(peer, outcome, report=False)
            return False
        self._machine = outcome.machine
        self.reduce = outcome.reduce
        self._accept_extras = {"data_port": outcome.data_port, "store_port": outcome.store_port}
        self._apply(outcome.machine.tick(self._loop.time()))
        return True

    def _refuse(self, address: str, reason: str, rank: int | None = None) -> None:
        loop = self._loop
        now = loop.time() if loop is not None else 0.0
        if rank is None:
            self.refusals.refuse(now, reason, "closing %s: %s", address, reason)
        else:
            self.refusals.refuse(now, reason, "closing %s (rank %s): %s", address, rank, reason)

    def _check_sender(self, peer: _Peer, frame: AnyFrame) -> str | None:
        if frame.kind not in RANK_FRAME_KINDS or isinstance(frame, Hello):
            return f"unexpected {frame.kind!r} frame from a peer"
        if peer.supervisor:
            return None if isinstance(frame, RankExited) else f"supervisor sent {frame.kind!r}"
        if isinstance(frame, RankExited):
            return "a rank may not report rank_exited"
        rank = getattr(frame, "rank", None)
        if rank != peer.rank:
            return f"rank {peer.rank} sent a frame claiming rank {rank}"
        return None

    def _close_peer(self, peer: _Peer, reason: str, *, report: bool = True) -> None:
        if peer.closed:
            return
        peer.closed = True
        peer.reason = peer.reason or reason
        if report or peer.stream.transport.get_write_buffer_size() > self._high_water:
            # A lost or slow peer gets no graceful flush: close() would keep the socket open
            # until its queue drains, i.e. forever for a reader that stopped reading.
            peer.stream.transport.abort()
        else:
            peer.stream.close()
        if peer.rank is not None and self._by_rank.get(peer.rank) is peer:
            del self._by_rank[peer.rank]
            if report:
                self._dispatch(PeerLost(peer.rank, peer.reason))

    # ------------------------------------------------------------------ machine plumbing
    def _dispatch(self, event: RankFrame | Input, peer: _Peer | None = None) -> None:
        loop = self._loop
        assert loop is not None
        if self._broken is not None or self._machine is None:
            return
        previous, self._current = self._current, peer
        try:
            try:
                effects = self._machine.handle(event, loop.time())
            except Exception as exc:  # noqa: BLE001 - our own bug, never blamed on the peer
                self._internal_error(exc, f"handling {event.kind!r}")
                return
            self._apply(effects)
            heap = self._heap
            if heap is not None and heap.pending:
                heap.on_phase(self._machine.phase)
        finally:
            self._current = previous

    def _on_timer(self) -> None:
        loop = self._loop
        assert loop is not None
        at, self._timer, self._timer_at = self._timer_at, None, None
        if self._broken is not None or self._machine is None:
            return
        now = loop.time() if at is None else max(at, loop.time())
        try:
            effects = self._machine.tick(now)
        except Exception as exc:  # noqa: BLE001 - our own bug: the run ends with it
            self._internal_error(exc, "a deadline")
            return
        self._apply(effects)

    def _internal_error(self, exc: Exception, during: str) -> None:
        """The machine raised: a bug of ours (a peer's bad input is an effect, never an
        exception). Its state can no longer be trusted, so the run ends with the error
        (every rank sees its coordinator go away and exits with a death record); no rank is
        evicted for it."""
        logger.critical("coordinator internal error while %s", during, exc_info=exc)
        self._broken = f"coordinator internal error while {during}: {type(exc).__name__}: {exc}"
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for peer in list(self._peers):
            self._close_peer(peer, self._broken, report=False)
        if self._done is not None and not self._done.done():
            self._done.set_result(RunOver(ok=False, reason=self._broken))

    def _rearm(self) -> None:
        loop = self._loop
        if loop is None or self._machine is None:
            return
        at = self._machine.next_deadline()
        if self._timer is not None and self._timer_at != at:
            self._timer.cancel()
            self._timer = None
        if self._timer is None and at is not None:
            self._timer_at = at
            self._timer = loop.call_at(at, self._on_timer)

    def _apply(self, effects: list[Effect]) -> None:
        # A frame sent to many ranks (a heartbeat, a new_session, set_global_step) is the
        # same instance in every Send: its body is encoded once per batch of effects. (Made
        # at the first Send: most inputs, a rank's batch frame, send nothing.)
        bodies: SharedBodies | None = None
        for effect in effects:
            match effect:
                case Send(rank=rank, frame=frame):
                    if bodies is None:
                        bodies = SharedBodies()
                    self._send(rank, frame, bodies)
                case Reply(frame=frame):
                    self._reply(frame)
                case RefusePeer(reason=reason):
                    if self._current is not None:
                        self._refuse(self._current.address, reason)
                        self._current.reason = reason
                        self._close_peer(self._current, reason, report=False)
                case Close(rank=rank, reason=reason):
                    peer = self._by_rank.get(rank)
                    if peer is not None:
                        self._close_peer(peer, reason, report=False)
                case RankDead(rank=rank, reason=reason):
                    logger.warning("rank %d declared dead: %s", rank, reason)
                    if self.reduce is not None:
                        self.reduce.rank_dead(rank)
                case RankLeft(rank=rank):
                    if self.reduce is not None:
                        self.reduce.rank_dead(rank)
                case RankRejoined(rank=rank, incarnation=incarnation):
                    logger.warning("rank %d rejoined (incarnation %d)", rank, incarnation)
                    if self.reduce is not None:
                        self.reduce.rank_rejoined(rank)
                case OpenReduce(cycle=cycle, ranks=ranks):
                    if self.reduce is not None:
                        self.reduce.open_round(cycle, ranks)
                case WriteMeta():
                    self._safe(self.sink.write_meta, effect)
                case BundleRequested():
                    self._safe(self.sink.bundle_requested, effect)
                case Record():
                    self._safe(self.sink.record, effect)
                case Alert():
                    self._safe(self.sink.alert, effect)
                case EpochDone():
                    self._safe(self.sink.epoch_done, effect)
                case EvalDone():
                    self._safe(self.sink.eval_done, effect)
                case RunOver():
                    logger.info("run over (ok=%s): %s", effect.ok, effect.reason)
                    if self._done is not None and not self._done.done():
                        self._done.set_result(effect)
        self._rearm()

    def _safe(self, fn: Callable[[Any], None], effect: Effect) -> None:
        """A failing sink costs observability, never the run."""
        try:
            fn(effect)
        except Exception:
            logger.exception("effect sink failed on %s", type(effect).__name__)

    def _send(self, rank: int, frame: CoordFrame, bodies: SharedBodies) -> None:
        peer = self._by_rank.get(rank)
        if peer is None or peer.closed:
            return  # the machine learns of the loss from PeerLost / ChildExited
        self._write(peer, frame, bodies.body(frame))

    def _reply(self, frame: CoordFrame) -> None:
        peer = self._current
        if peer is None or peer.closed:
            return
        if isinstance(frame, Accept):
            frame = frame.model_copy(update=self._accept_extras)
            if peer.role == "supervisor":
                peer.supervisor = True
            else:
                peer.rank = frame.rank
                self._by_rank[frame.rank] = peer
        self._write(peer, frame)

    def _write(self, peer: _Peer, frame: CoordFrame, body: bytes | None = None) -> None:
        writer = peer.writer
        assert writer is not None, "a frame to a peer before its handshake"
        try:
            writer.write_nowait(frame, body)
        except (ConnectionError, OSError, RuntimeError) as exc:
            self._drop(peer, frame, f"write failed: {exc}")
            return
        if writer.buffered > self._high_water:
            self._drop(
                peer,
                frame,
                f"slow reader: {writer.buffered} B queued (high-water {self._high_water})",
            )

    def _drop(self, peer: _Peer, frame: CoordFrame, reason: str) -> None:
        """A control frame could not be delivered: say so (``control_drop``), then cut the peer
        (the machine hears PeerLost and declares the rank dead)."""
        if peer.rank is not None and self._machine is not None:
            path = self._machine.paths[peer.rank]
            alert = Alert("control_drop", path, f"{frame.kind} to rank {peer.rank}: {reason}")
            self._safe(self.sink.alert, alert)
        self._close_peer(peer, reason)


async def _wait_closed(writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(ConnectionError, OSError):
        await writer.wait_closed()
