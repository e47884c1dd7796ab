"""The rank's control-plane bridge: a daemon thread whose asyncio loop owns the coordinator socket.

Threads (docs/design.md §0, "Threads"). The rank's main thread owns torch and never awaits;
the bridge thread owns the control connection. They meet only at
``loop.call_soon_threadsafe`` (main → bridge: :meth:`RankBridge.send`,
:meth:`RankBridge.close`) and one :class:`queue.SimpleQueue` inbox (bridge → main:
:meth:`RankBridge.recv`, :meth:`RankBridge.poll`). The step counter that heartbeats carry is a
plain ``int`` attribute the main thread writes (:meth:`RankBridge.set_step`).

Liveness, both ways (docs/design.md §2, §2b):

* rank → coordinator: a :class:`~flodl.wire.frames.Heartbeat` every ``heartbeat_s`` from the
  bridge thread, so a long forward pass never starves it;
* coordinator → rank: every frame refreshes the coordinator; :class:`CoordHeartbeat` frames do
  nothing else (they are never queued). No frame for ``liveness_timeout_s``, EOF, a socket
  error or a bad frame marks the bridge *lost*: :attr:`RankBridge.lost` is set,
  :attr:`RankBridge.lost_reason` says why, ``on_lost(reason)`` runs on the bridge thread, and the
  main thread's next :meth:`~RankBridge.recv` / :meth:`~RankBridge.poll` (once the frames that
  arrived before the loss are drained) or :meth:`~RankBridge.send` raises
  :class:`~flodl.errors.CoordinatorLost`.

No hang ever. A main thread stuck in a long forward pass or a hung collective would never see
the loss, so unless ``hard_exit_grace_s`` is ``None`` the bridge arms a hard exit when it marks
itself lost: if :meth:`RankBridge.close` has not been called ``hard_exit_grace_s`` later, it logs
the reason at CRITICAL and calls ``os._exit(3)`` (:data:`HARD_EXIT_CODE`), writing nothing else and
running no cleanup. A rank therefore never outlives its coordinator by more than
``liveness_timeout_s + hard_exit_grace_s``. The timer is a daemon :class:`threading.Timer` of the
bridge, independent of ``on_lost`` and of the event loop, so a callback that blocks cannot defuse
it. One exception: a connection that ends *after* the coordinator sent ``shutdown`` or
``shutdown_with_save`` is still reported as lost, but arms the hard exit only with the longer
``after_stop_grace_s`` (:meth:`RankBridge.set_hard_exit_grace`; none by default), since the
main thread is then finishing its step and writing its final files on the coordinator's orders
and must not be killed mid-write; the rank loop sets it to the stall ceiling, so a main thread
stuck for good (a callback that never returns) still ends its process instead of outliving the
run.

This module is stdlib-only on the rank side: it never imports torch (a test checks it), and uses
uvloop when it is importable.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import enum
import logging
import os
import queue
import socket
import threading
import time
from collections.abc import Callable, Coroutine, MutableMapping
from typing import Any, Final

from flodl.errors import (
    ConfigError,
    CoordinatorLost,
    FrameError,
    LocalProtocolError,
    RemoteProtocolError,
)
from flodl.rank.resources import RESOURCE_INTERVAL_S, ResourceProbe
from flodl.timeouts import heartbeat_interval_s
from flodl.wire.codec import check_secret
from flodl.wire.frames import (
    RANK_FRAME_KINDS,
    Accept,
    CoordFrame,
    CoordHeartbeat,
    Heartbeat,
    Hello,
    RankFrame,
    Reject,
)
from flodl.wire.stream import FrameReader, FrameWriter, client_handshake

__all__ = [
    "RankBridge",
    "HARD_EXIT_CODE",
    "CONNECT_RETRY_S",
    "MAX_BUFFERED_BYTES",
    "LINGER_S",
]

logger = logging.getLogger(__name__)

HARD_EXIT_CODE: Final = 3
"""Exit status of a rank process the bridge ends because its coordinator is gone."""
CONNECT_RETRY_S: Final = 0.5
"""Pause between connection attempts while the coordinator is not listening yet (seconds)."""
MAX_BUFFERED_BYTES: Final = 64 * 1024 * 1024
"""Outgoing bytes queued on the socket beyond which the coordinator counts as not reading."""
LINGER_S: Final = 1.0
"""Longest wait in :meth:`RankBridge.close`, after our EOF, for the coordinator to close its side
(reading on until it does, so unread input never turns our close into a reset)."""

_CLOCK_SLACK_S = 1e-3
"""Event loops may fire a timer up to their clock resolution early; a watchdog that fires this
close to its deadline counts as expired instead of re-arming for a few nanoseconds."""
_TERMINAL_KINDS = frozenset({"shutdown", "shutdown_with_save"})


class _Signal(enum.Enum):
    """Inbox sentinels: they follow every real frame and are put back when taken."""

    LOST = "lost"
    CLOSED = "closed"


class _LostFlag(threading.Event):
    """A :class:`threading.Event` that is also truthy once set, so ``if bridge.lost:`` reads as
    expected (a plain ``Event`` is always truthy)."""

    def __bool__(self) -> bool:
        return self.is_set()


class _RankLog(logging.LoggerAdapter[logging.Logger]):
    """Prefixes every message with the rank and attaches ``rank`` to the record."""

    def __init__(self, base: logging.Logger, rank: int) -> None:
        super().__init__(base, {"rank": rank})
        self._prefix = f"rank {rank}: "

    def process(
        self, msg: Any, kwargs: MutableMapping[str, Any]
    ) -> tuple[Any, MutableMapping[str, Any]]:
        kwargs["extra"] = self.extra
        return self._prefix + str(msg), kwargs


def _default_loop_factory() -> asyncio.AbstractEventLoop:
    """uvloop when importable, else the stdlib loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
    return loop


def _set_nodelay(writer: asyncio.StreamWriter) -> None:
    """Small control frames must leave at once (asyncio and uvloop usually do this already)."""
    sock = writer.get_extra_info("socket")
    if sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except OSError:
        logger.debug("could not set TCP_NODELAY", exc_info=True)


class RankBridge:
    """Owns the rank's control connection on a daemon thread running its own event loop.

    The main thread calls :meth:`start` once, then :meth:`send`, :meth:`poll`, :meth:`recv` and
    :meth:`set_step` freely (none blocks on I/O; ``recv`` blocks only on the inbox, up to its
    timeout), and :meth:`close` at the end. Every public method may be called from any thread.

    Args:
        host: the coordinator's address.
        port: the coordinator's control port.
        secret: the run secret that authenticates every frame (at least 16 bytes).
        hello: the first frame of the connection; its ``rank`` is this rank.
        heartbeat_s: the longest interval of the bridge's :class:`Heartbeat` frames (seconds);
            from the ``accept`` on, a third of the coordinator's ``heartbeat_timeout_s`` where
            that is shorter (docs/design.md §2b, "Heartbeat cadence").
        liveness_timeout_s: the longest wait for the whole handshake (the coordinator's challenge
            and its reply, seconds); from the ``accept`` on, the coordinator's
            ``heartbeat_timeout_s`` is the silence after which it counts as lost.
        connect_timeout_s: how long :meth:`start` keeps retrying (every
            :data:`CONNECT_RETRY_S`) while nothing listens yet, since ranks may start before
            their coordinator (seconds).
        hard_exit_grace_s: after a loss, how long the main thread has to call :meth:`close`
            before the bridge ends the process with ``os._exit(3)`` (seconds); ``None`` never
            ends the process. See the module docstring.
        on_lost: called once with the reason when the coordinator is lost, on the bridge
            thread; it should return promptly. Exceptions it raises are logged.
        on_hard_exit: called with the reason just before the hard exit (timer thread), e.g. to
            write a death record; exceptions it raises are logged.
        loop_factory: builds the bridge thread's event loop (default: uvloop if importable,
            else the stdlib loop).

    Raises:
        ConfigError: a non-positive interval or timeout, or a secret shorter than 16 bytes.
    """

    def __init__(
        self,
        host: str,
        port: int,
        secret: bytes,
        hello: Hello,
        *,
        heartbeat_s: float = 1.0,
        liveness_timeout_s: float = 30.0,
        connect_timeout_s: float = 30.0,
        hard_exit_grace_s: float | None = 10.0,
        on_lost: Callable[[str], None] | None = None,
        on_hard_exit: Callable[[str], None] | None = None,
        loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = None,
        resource_s: float | None = RESOURCE_INTERVAL_S,
    ) -> None:
        if resource_s is not None and not resource_s > 0.0:
            raise ConfigError(f"resource_s must be > 0 or None, got {resource_s!r}")
        for name, value in (
            ("heartbeat_s", heartbeat_s),
            ("liveness_timeout_s", liveness_timeout_s),
        ):
            if not value > 0.0:
                raise ConfigError(f"{name} must be > 0, got {value!r}")
        if not connect_timeout_s >= 0.0:
            raise ConfigError(f"connect_timeout_s must be >= 0, got {connect_timeout_s!r}")
        if hard_exit_grace_s is not None and not hard_exit_grace_s >= 0.0:
            raise ConfigError(f"hard_exit_grace_s must be >= 0 or None, got {hard_exit_grace_s!r}")
        try:
            self._secret = check_secret(secret)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if not isinstance(hello, Hello):
            raise ConfigError(f"hello must be a Hello frame, got {type(hello).__name__}")
        self._host = host
        self._port = port
        self._hello = hello
        self._rank = hello.rank
        self._heartbeat_s = float(heartbeat_s)
        self._resource_s = resource_s
        self._probe = ResourceProbe(hello.rank, hello.device or "cpu") if resource_s else None
        self._liveness_timeout_s = float(liveness_timeout_s)
        self._connect_timeout_s = float(connect_timeout_s)
        self._hard_exit_grace_s = None if hard_exit_grace_s is None else float(hard_exit_grace_s)
        self._on_lost = on_lost
        self._on_hard_exit = on_hard_exit
        self._loop_factory = loop_factory or _default_loop_factory
        self._log = _RankLog(logger, hello.rank)

        # Shared between threads. Plain attribute reads and writes are atomic under the GIL; the
        # lock only orders start/close against each other.
        self._inbox: queue.SimpleQueue[CoordFrame | _Signal] = queue.SimpleQueue()
        self._lost = _LostFlag()
        self._lost_reason = ""
        self._beat_at: float | None = None
        """``time.monotonic()`` of the latest heartbeat (the bridge loop's own pulse)."""
        self._step = 0
        self._accept: Accept | None = None
        self._started: concurrent.futures.Future[Accept] = concurrent.futures.Future()
        self._state_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closing = False
        self._closed = False
        self._hard_exit_timer: threading.Timer | None = None
        self._terminal_seen = False
        self._after_stop_grace_s: float | None = None

        # Bridge thread only.
        self._stop: asyncio.Event | None = None
        self._flush_s = 0.0
        self._writer: asyncio.StreamWriter | None = None
        self._fw: FrameWriter | None = None
        self._reader_task: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._watchdog: asyncio.TimerHandle | None = None
        self._last_seen_at = 0.0

    # -------------------------------------------------------------------------------------
    # Main-thread API
    # -------------------------------------------------------------------------------------

    @property
    def accepted(self) -> Accept | None:
        """The coordinator's :class:`Accept`, once :meth:`start` succeeded; else ``None``."""
        return self._accept

    @property
    def lost(self) -> threading.Event:
        """Set (and truthy) once the coordinator is lost; wait on it with ``lost.wait(t)``."""
        return self._lost

    @property
    def lost_reason(self) -> str:
        """Why the coordinator counts as lost; empty until :attr:`lost` is set."""
        return self._lost_reason

    def start(self) -> Accept:
        """Connect, shake hands and start heartbeats, reader and watchdog on the bridge thread.

        Blocks the calling thread until the handshake ends: at most ``connect_timeout_s`` of
        connection attempts plus ``liveness_timeout_s`` for the reply.

        Returns:
            The coordinator's :class:`Accept`.

        Raises:
            CoordinatorLost: nothing accepted a connection within ``connect_timeout_s``, or the
                connection failed, closed or stayed silent during the handshake.
            RemoteProtocolError: the coordinator sent :class:`Reject` (the message holds its
                reason), a frame other than accept/reject, or an accept for another rank or run.
            FrameError: the reply failed authentication or decoding (e.g. a wrong run secret).
            LocalProtocolError: :meth:`start` was already called, or :meth:`close` was.
        """
        with self._state_lock:
            if self._closed:
                raise LocalProtocolError("start() after close()", rank=self._rank)
            if self._thread is not None:
                raise LocalProtocolError("start() called twice", rank=self._rank)
            thread = threading.Thread(
                target=self._thread_main, name=f"flodl-bridge-r{self._rank}", daemon=True
            )
            self._thread = thread
        thread.start()
        # The bridge thread bounds the handshake itself; this outer bound only guards a bug.
        bound = self._connect_timeout_s + self._liveness_timeout_s + 2 * CONNECT_RETRY_S + 10.0
        try:
            accept = self._started.result(timeout=bound)
        except BaseException as exc:
            if isinstance(exc, TimeoutError) and not self._started.done():
                self.close(timeout=1.0)
                raise CoordinatorLost(
                    f"the bridge thread did not finish the handshake within {bound:g} s"
                ) from None
            thread.join(timeout=5.0)  # it is closing the socket and its loop
            raise
        return accept

    def send(self, frame: RankFrame) -> None:
        """Queue ``frame`` for the coordinator; never blocks. Frames leave in ``send`` order.

        Raises:
            CoordinatorLost: the coordinator is lost (the frame is not sent).
            LocalProtocolError: called before :meth:`start` succeeded or after :meth:`close`,
                or ``frame`` is not a rank → coordinator frame.
        """
        if self._lost.is_set():
            raise CoordinatorLost(self._lost_reason)
        if self._closing:
            raise LocalProtocolError("send() after close()", rank=self._rank)
        loop = self._loop
        if loop is None or self._accept is None:
            raise LocalProtocolError("send() before start() returned", rank=self._rank)
        if frame.kind not in RANK_FRAME_KINDS:
            raise LocalProtocolError(f"{frame.kind!r} is not a rank frame", rank=self._rank)
        try:
            loop.call_soon_threadsafe(self._write, frame)
        except RuntimeError:  # the loop is closed: the bridge thread has ended
            if self._lost.is_set():
                raise CoordinatorLost(self._lost_reason) from None
            raise CoordinatorLost("the bridge thread has stopped") from None

    def poll(self) -> CoordFrame | None:
        """The next coordinator frame if one is waiting, else ``None``; never blocks.

        Raises:
            CoordinatorLost: the coordinator is lost and every frame that arrived before the
                loss has been taken.
            LocalProtocolError: called before :meth:`start` succeeded, or the bridge was
                closed and the inbox is drained.
        """
        self._check_started("poll")
        try:
            item = self._inbox.get_nowait()
        except queue.Empty:
            return None
        return self._unwrap(item)

    def recv(self, timeout: float | None = None) -> CoordFrame | None:
        """The next coordinator frame, waiting up to ``timeout`` seconds (``None``: no limit).

        Returns:
            The frame, or ``None`` if none arrived within ``timeout``.

        Raises:
            CoordinatorLost: the coordinator is lost and every frame that arrived before the
                loss has been taken (a blocked call wakes at the loss).
            LocalProtocolError: called before :meth:`start` succeeded, or the bridge was
                closed and the inbox is drained (a blocked call wakes at the close).
        """
        self._check_started("recv")
        try:
            item = self._inbox.get(timeout=None if timeout is None else max(0.0, timeout))
        except queue.Empty:
            return None
        return self._unwrap(item)

    def set_hard_exit_grace(self, grace_s: float, after_stop_s: float | None = None) -> None:
        """Change the hard-exit grace (the rank derives it from the coordinator's deadlines
        once ``accept`` arrived), and set the one for a loss after the coordinator's stop frame
        (``None``: no hard exit then); ignored when hard exits are off."""
        for name, value in (("hard_exit_grace_s", grace_s), ("after_stop_s", after_stop_s)):
            if value is not None and not value >= 0.0:
                raise ConfigError(f"{name} must be >= 0, got {value!r}")
        with self._state_lock:
            if self._hard_exit_grace_s is not None:
                self._hard_exit_grace_s = float(grace_s)
                self._after_stop_grace_s = None if after_stop_s is None else float(after_stop_s)

    def set_step(self, step: int) -> None:
        """Record the main thread's cumulative optimizer-step count for the next heartbeat.

        Raises:
            LocalProtocolError: ``step`` is negative.
        """
        if step < 0:
            raise LocalProtocolError(f"step must be >= 0, got {step}", rank=self._rank)
        self._step = step

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until every frame passed to :meth:`send` before this call has left the bridge
        for the kernel (the socket's buffer in the event loop is empty). Returns False when
        that did not happen within ``timeout`` seconds or the coordinator is lost."""
        loop = self._loop
        if loop is None or self._lost.is_set():
            return False
        written = threading.Event()

        def check() -> None:  # (after the writes queued before it: call_soon is FIFO)
            fw = self._fw
            if self._lost.is_set() or fw is None:
                return
            if fw.buffered == 0:
                written.set()
            else:
                loop.call_later(0.005, check)

        try:
            loop.call_soon_threadsafe(check)
        except RuntimeError:  # the loop is closed: the bridge thread has ended
            return False
        return written.wait(timeout)

    def close(self, timeout: float = 5.0) -> None:
        """Flush, close the connection, stop the loop and join the bridge thread.

        Frames passed to :meth:`send` before this call (a final ``exiting``, say) are written
        first; then the bridge sends EOF, reads on for up to :data:`LINGER_S` until the
        coordinator closes its side, and closes the socket. Disarms the hard exit. Idempotent;
        returns within about ``timeout`` seconds whatever the coordinator does (a thread still
        running then is left behind as a daemon, with a warning). Callable from ``on_lost``.
        """
        with self._state_lock:
            if self._closed:
                return
            self._closed = True
            self._closing = True
            timer = self._hard_exit_timer
        if timer is not None:
            timer.cancel()
        try:
            thread, loop = self._thread, self._loop
            if thread is None or not thread.is_alive():
                return
            budget = max(0.0, timeout)
            deadline = time.monotonic() + budget
            if loop is not None:
                # RuntimeError: the loop already closed, the thread is ending anyway
                with contextlib.suppress(RuntimeError):
                    loop.call_soon_threadsafe(self._request_stop, 0.8 * budget)
            if thread is threading.current_thread():
                return  # close() from on_lost: the loop winds down once this callback returns
            thread.join(max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                self._log.warning("bridge thread still running %.3g s after close()", budget)
            else:
                self._log.debug("bridge closed")
        finally:
            self._inbox.put(_Signal.CLOSED)

    # -------------------------------------------------------------------------------------
    # Main-thread helpers
    # -------------------------------------------------------------------------------------

    def _check_started(self, what: str) -> None:
        if self._accept is None and not self._closed:
            raise LocalProtocolError(f"{what}() before start() returned", rank=self._rank)

    def _unwrap(self, item: CoordFrame | _Signal) -> CoordFrame:
        if isinstance(item, _Signal):
            self._inbox.put(item)  # keep waking later callers
            if self._lost.is_set():
                raise CoordinatorLost(self._lost_reason)
            raise LocalProtocolError("the bridge is closed", rank=self._rank)
        return item

    # -------------------------------------------------------------------------------------
    # Bridge thread
    # -------------------------------------------------------------------------------------

    def _thread_main(self) -> None:
        try:
            with asyncio.Runner(loop_factory=self._loop_factory) as runner:
                runner.run(self._run())
        # A bug in the bridge: report it, never leave start() or recv() waiting.
        except BaseException as exc:  # noqa: BLE001
            if not self._started.done():
                self._started.set_exception(exc)
            else:
                self._log.critical("bridge thread failed", exc_info=exc)
                if self._accept is not None and not self._closing:
                    self._declare_lost(f"bridge thread failed: {exc!r}")
        finally:
            if not self._started.done():
                self._started.set_exception(
                    CoordinatorLost("the bridge thread ended before the handshake finished")
                )

    async def _run(self) -> None:
        """The bridge thread's one coroutine: connect, handshake, serve until close()."""
        self._stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        self._loop = loop
        try:
            reader, writer = await self._connect()
        except Exception as exc:  # noqa: BLE001 - handed to start() on the main thread
            self._started.set_exception(exc)
            return
        self._writer = writer
        try:
            accept, fr, fw = await self._handshake(reader, writer)
            if self._closing:
                raise LocalProtocolError("close() during start()", rank=self._rank)
        except Exception as exc:  # noqa: BLE001 - handed to start() on the main thread
            await self._close_writer(writer, 1.0)
            self._started.set_exception(exc)
            return
        self._fw = fw
        self._accept = accept
        # from accept on, the coordinator's liveness timeout rules (docs/reliability.md)
        self._liveness_timeout_s = accept.heartbeat_timeout_s
        # and sets the cadence: three heartbeats at least in every liveness window
        self._heartbeat_s = min(self._heartbeat_s, heartbeat_interval_s(accept.heartbeat_timeout_s))
        self._last_seen_at = loop.time()
        self._reader_task = self._spawn(self._read_loop(fr), "reader")
        self._spawn(self._heartbeat_loop(), "heartbeat")
        if self._resource_s is not None:
            self._spawn(self._resource_loop(self._resource_s), "resources")
        self._arm_watchdog()
        self._log.info(
            "accepted by the coordinator at %s:%d (session %d)",
            self._host,
            self._port,
            accept.session,
        )
        self._started.set_result(accept)
        try:
            await self._stop.wait()
        finally:
            await self._shutdown()

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._connect_timeout_s
        attempts = 0
        while True:
            attempts += 1
            try:
                # Each attempt gets at least one retry interval, so a zero timeout still tries.
                async with asyncio.timeout_at(max(deadline, loop.time() + CONNECT_RETRY_S)):
                    reader, writer = await asyncio.open_connection(self._host, self._port)
            except OSError as exc:  # refused, unreachable, unresolvable, or timed out
                remaining = deadline - loop.time()
                if remaining <= 0.0 or self._closing:
                    raise CoordinatorLost(
                        f"could not connect to the coordinator at {self._host}:{self._port} "
                        f"within {self._connect_timeout_s:g} s ({attempts} attempts; "
                        f"last error: {exc!r})"
                    ) from None
                if attempts == 1:
                    self._log.info(
                        "coordinator at %s:%d not reachable yet (%r); retrying every %g s",
                        self._host,
                        self._port,
                        exc,
                        CONNECT_RETRY_S,
                    )
                else:
                    self._log.debug("connect attempt %d failed (%r); retrying", attempts, exc)
                await asyncio.sleep(min(CONNECT_RETRY_S, remaining))
            else:
                _set_nodelay(writer)
                return reader, writer

    async def _handshake(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> tuple[Accept, FrameReader, FrameWriter]:
        """The coordinator's challenge, our nonce and hello, its reply: all within the liveness
        timeout (:mod:`flodl.wire.control_hello`)."""
        hello = self._hello
        try:
            async with asyncio.timeout(self._liveness_timeout_s):
                try:
                    key = await client_handshake(reader, writer, self._secret)
                except FrameError as exc:
                    raise CoordinatorLost(
                        f"bad handshake from {self._host}:{self._port}: {exc}"
                    ) from None
                fr, fw = FrameReader(reader, key), FrameWriter(writer, key)
                await fw.write(hello)
                reply = await fr.read()
        except TimeoutError:
            raise CoordinatorLost(
                f"no handshake reply from the coordinator within {self._liveness_timeout_s:g} s"
            ) from None
        except OSError as exc:
            raise CoordinatorLost(f"connection failed during the handshake: {exc!r}") from None
        if reply is None:
            raise CoordinatorLost(
                "the coordinator closed the connection during the handshake "
                "(a wrong run secret looks like this)"
            )
        if isinstance(reply, Reject):
            raise RemoteProtocolError(f"the coordinator rejected rank {hello.rank}: {reply.reason}")
        if not isinstance(reply, Accept):
            raise RemoteProtocolError(f"expected accept or reject, got {reply.kind!r}")
        if reply.rank != hello.rank or reply.run_id != hello.run_id:
            raise RemoteProtocolError(
                f"accept for rank {reply.rank} of run {reply.run_id!r}; "
                f"expected rank {hello.rank} of run {hello.run_id!r}"
            )
        return reply, fr, fw

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(coro, name=f"flodl-bridge-{name}")
        self._tasks.add(task)
        task.add_done_callback(self._on_task_done)
        return task

    def _on_task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            self._log.error("bridge task %s failed", task.get_name(), exc_info=exc)
            self._lose(f"bridge task {task.get_name()} failed: {exc!r}")

    async def _read_loop(self, fr: FrameReader) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                frame = await fr.read()
                if frame is None:
                    self._lose("the coordinator closed the connection (EOF)")
                    return
                self._last_seen_at = loop.time()
                if isinstance(frame, CoordHeartbeat):
                    continue
                if not isinstance(frame, CoordFrame):
                    self._lose(f"the coordinator sent a rank frame ({frame.kind!r})")
                    return
                if frame.kind in _TERMINAL_KINDS:
                    self._terminal_seen = True
                self._inbox.put(frame)
        except FrameError as exc:
            self._lose(f"bad frame from the coordinator: {exc}")
        except OSError as exc:
            self._lose(f"connection to the coordinator failed: {exc!r}")

    async def _heartbeat_loop(self) -> None:
        while not self._lost.is_set():
            step = self._step
            self._beat_at = time.monotonic()
            self._write(Heartbeat(rank=self._rank, step=step))
            self._log.debug("heartbeat step=%d", step)
            await asyncio.sleep(self._heartbeat_s)

    def send_resource_sample(self) -> None:
        """One ``resource_sample`` now (a rank sends its last one as it finishes, so a run
        shorter than the interval has one too); never raises."""
        if self._probe is None or self._lost.is_set() or self._closing:
            return
        try:
            self.send(self._probe.sample())
        except Exception:  # noqa: BLE001 - a sample is never worth a failing rank
            self._log.exception("the final resource sample failed")

    async def _resource_loop(self, every_s: float) -> None:
        """A ``resource_sample`` every ``every_s`` (docs/design.md §7); never fails the rank."""
        probe = self._probe
        assert probe is not None
        while not self._lost.is_set():
            await asyncio.sleep(every_s)
            try:
                sample = probe.sample()
            except Exception:  # noqa: BLE001 - a probe bug costs the samples, never the rank
                self._log.exception("resource sampling failed; no more samples")
                return
            self._write(sample)

    def _write(self, frame: RankFrame) -> None:
        fw = self._fw
        if fw is None or self._lost.is_set():
            self._log.debug("dropped a %s frame: the coordinator is lost", frame.kind)
            return
        try:
            fw.write_nowait(frame)
        except FrameError as exc:  # oversize: a frame the coordinator would refuse
            self._log.error("dropped a %s frame: %s", frame.kind, exc)
            return
        except (OSError, RuntimeError) as exc:
            self._lose(f"write to the coordinator failed: {exc!r}")
            return
        if fw.buffered > MAX_BUFFERED_BYTES:
            self._lose(
                f"the coordinator is not reading: {fw.buffered} B queued on the socket "
                f"(limit {MAX_BUFFERED_BYTES} B)"
            )

    def _arm_watchdog(self) -> None:
        assert self._loop is not None
        self._watchdog = self._loop.call_at(
            self._last_seen_at + self._liveness_timeout_s, self._on_watchdog
        )

    def _on_watchdog(self) -> None:
        assert self._loop is not None
        self._watchdog = None
        silent_s = self._loop.time() - self._last_seen_at
        if silent_s + _CLOCK_SLACK_S >= self._liveness_timeout_s:
            self._lose(
                f"no frame from the coordinator for {silent_s:.3g} s "
                f"(liveness timeout {self._liveness_timeout_s:g} s)"
            )
        else:
            self._arm_watchdog()

    def _cancel_watchdog(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None

    def abort(self, reason: str = "aborted") -> None:
        """Drop the control connection as a network failure would (fault injection: the
        coordinator sees the connection end; this side is marked lost). Any thread."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._lose, reason)

    def _lose(self, reason: str) -> None:
        """Loop-thread side of a loss: stop all I/O, then declare it. No-op while closing."""
        if self._lost.is_set() or self._closing:
            return
        self._cancel_watchdog()
        current = asyncio.current_task()
        for task in list(self._tasks):
            if task is not current:
                task.cancel()
        if self._writer is not None:
            self._writer.transport.abort()
        self._declare_lost(reason)

    def _declare_lost(self, reason: str) -> None:
        """Arm the hard exit, publish a loss to the main thread, run ``on_lost`` (once).

        The timer is armed first, so it runs whatever the main thread does once it sees the loss.
        """
        if self._lost.is_set():
            return
        reason += self._stalled_note()
        grace = self._hard_exit_grace_s
        if self._terminal_seen:
            self._log.info("connection to the coordinator ended after shutdown: %s", reason)
            grace = self._after_stop_grace_s
        else:
            self._log.warning("lost the coordinator: %s", reason)
        if grace is not None:
            with self._state_lock:
                if not self._closing:
                    timer = threading.Timer(grace, self._hard_exit, args=(reason, grace))
                    timer.name = f"flodl-bridge-r{self._rank}-hard-exit"
                    timer.daemon = True
                    timer.start()
                    self._hard_exit_timer = timer
        self._lost_reason = reason
        self._lost.set()
        self._inbox.put(_Signal.LOST)
        if self._on_lost is not None:
            try:
                self._on_lost(reason)
            except Exception:  # noqa: BLE001 - a user callback must not break the bridge
                self._log.exception("on_lost callback failed")

    def _stalled_note(self) -> str:
        """What to add to a loss that follows a stall of this process: its bridge loop did not
        run for a liveness timeout or more (SIGSTOP, a suspended machine, starved of CPU), so
        it sent nothing either, and it is this rank that went quiet (docs/reliability.md)."""
        beat = self._beat_at
        if beat is None:
            return ""
        stalled_s = time.monotonic() - beat - self._heartbeat_s
        if stalled_s < self._liveness_timeout_s:
            return ""
        return (
            f"; this process itself did not run for {stalled_s:.3g} s before it (stopped, "
            "suspended or starved of CPU), so the coordinator has most likely declared this "
            "rank dead"
        )

    def _hard_exit(self, reason: str, grace_s: float) -> None:
        """Timer thread: the main thread did not close() within the grace after the loss."""
        if self._closing:
            return
        self._log.critical(
            "coordinator lost (%s) and the main thread did not close the bridge within %g s: "
            "ending the process with exit code %d",
            reason,
            grace_s,
            HARD_EXIT_CODE,
        )
        if self._on_hard_exit is not None:
            try:  # best effort and quick (a death record), never a reason not to exit
                self._on_hard_exit(reason)
            except Exception:  # noqa: BLE001 - nothing may stop the exit
                self._log.exception("on_hard_exit failed")
        os._exit(HARD_EXIT_CODE)

    def _request_stop(self, flush_s: float) -> None:
        self._flush_s = flush_s
        if self._stop is not None:
            self._stop.set()

    async def _shutdown(self) -> None:
        """After close(): flush what send() queued, send EOF, linger, close the socket."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._flush_s
        self._cancel_watchdog()
        writer = self._writer
        reader_task = self._reader_task
        for task in list(self._tasks):
            if task is not reader_task:
                task.cancel()
        if writer is not None and not self._lost.is_set():
            try:
                async with asyncio.timeout_at(deadline):
                    await writer.drain()
                    if writer.can_write_eof():
                        writer.write_eof()
                if reader_task is not None and not reader_task.done():
                    # Read on until the coordinator closes too (bounded): closing a socket with
                    # unread input sends a reset, which may destroy our last frames in flight.
                    linger = min(LINGER_S, max(0.0, deadline - loop.time()))
                    await asyncio.wait({reader_task}, timeout=linger)
            except (TimeoutError, OSError, RuntimeError) as exc:
                self._log.debug("flush on close incomplete: %r", exc)
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        if writer is not None:
            await self._close_writer(writer, max(0.05, deadline - loop.time()))

    async def _close_writer(self, writer: asyncio.StreamWriter, limit_s: float) -> None:
        writer.close()
        try:
            async with asyncio.timeout(limit_s):
                await writer.wait_closed()
        except (TimeoutError, OSError):
            writer.transport.abort()
            await asyncio.sleep(0)  # let connection_lost run, which closes the socket
