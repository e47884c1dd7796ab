"""The CPU reduce server: the coordinator's averaging plane (docs/design.md §2b, §1).

Shell module: threads and blocking sockets. It never imports asyncio: on loopback, blocking
sockets move bulk data 6-8 times faster than asyncio streams, and every heavy step (``recv_into``,
``sendmsg``, HMAC over large buffers, torch ops) releases the GIL, so the coordinator's event
loop keeps its 1 ms cadence while a 256 MiB round is in flight. The buffers (the model's layout,
flat per-dtype storage, a round's uploads and consensus frames) are in
:mod:`flodl.service.reduce_buffers`; a connection's record and frame reader in
:mod:`flodl.service.reduce_conn`.

Threads (all started by :meth:`ReduceServer.start`, all joined by :meth:`ReduceServer.close`):

* **accept thread**: accepts data connections and starts one connection thread for each.
* **connection thread**, one per rank: handshake (:mod:`flodl.wire.data_hello` layout), then
  per round: receive the rank's PARAMS and BUFFERS frames into that rank's preallocated
  buffers, report the upload, wait for the consensus, send it.
* **fold worker**: folds each complete round (sum in torch, one division), publishes the
  consensus frames, computes their auth tags *while* the connection threads already send the
  payloads (the tag ends a frame), waits for the sends, then calls ``on_done``.
* callers (the coordinator's event-loop thread): :meth:`~ReduceServer.open_round` and
  :meth:`~ReduceServer.rank_dead` only take a lock for a few microseconds; they never block.

A round (one averaging ``cycle``):

1. Each expected rank uploads a PARAMS frame (``weight = w_k = n_k^gamma``, tensors pre-scaled
   by ``w_k``; an idle rank sends weight 0 and elided zeros) and a BUFFERS frame (weight 1.0 for
   a rank that stepped, a *mover*, else 0.0; unscaled float buffers). Uploads may arrive before
   :meth:`~ReduceServer.open_round` (they wait for it); an upload to a round that is complete,
   superseded or does not expect the rank closes that connection. The ``broadcast_round`` (the
   coordinator's round 0) is the initial broadcast: its consensus is the lowest contributing
   rank's upload as is (ranks all upload their state, so it survives rank 0 dying first).
   Payloads land in per-rank buffers allocated from that rank's first frame (one flat tensor
   per dtype) and reused every round; a frame whose layout differs from the model's (the first
   frame of its kind from any rank) is refused.
2. The round is **complete** when every expected rank that is still live uploaded;
   :meth:`~ReduceServer.rank_dead` removes a rank from every open round (and may complete one).
   Completion freezes the contributor set: a rank declared dead before it is left out of the
   sum even if it had uploaded, a rank declared dead after it is folded in.
3. The worker sums, in rank order, the contributors' pre-scaled parameters and divides once by
   ``W = sum(w_k)`` (work never received never enters the divisor); buffers are summed over the
   movers and divided by their count. Accumulation is f32 (f64 tensors stay f64) whatever the
   wire dtype. ``W = 0`` sends weight 0 with every tensor elided: ranks keep their own state.
4. Each contributor still connected receives the consensus PARAMS frame (weight ``W``) and
   BUFFERS frame (weight = number of movers), each tensor in the dtype that rank sent it in
   (bf16 wire). Every distinct frame is encoded once and its buffers are shared by all sends.
5. ``on_done(cycle, contributors, W)`` runs on the worker thread once every send finished or
   failed; marshal it to the event loop (``loop.call_soon_threadsafe``).

Failures: a bad frame (:class:`~flodl.errors.FrameError`: bad tag, wrong kind, a layout unlike
the model's, bad buffers weight), a wrong round, a read timeout mid-frame (``read_timeout_s``;
waiting for a round's first byte has no deadline, since windows may be long) or a send timeout
closes **that** connection with a logged reason; the others keep being served. The server never
declares deaths: a rank whose connection closed still counts as expected until the coordinator
calls :meth:`~ReduceServer.rank_dead`, so the round waits. It cannot wedge for long, because
the rank's client sees EOF, raises :class:`~flodl.errors.CoordinatorLost` and exits, and the
child-exit report (or the heartbeat timeout, or at worst the reduce stall ceiling) reaches the
coordinator, which calls ``rank_dead``. ``rank_dead`` also closes that rank's data connection,
which aborts a send stuck on it.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import select
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Self

import torch

from flodl.coord.rounds import RoundBook
from flodl.errors import FrameError, LocalProtocolError
from flodl.outer import OuterConfig, OuterStep
from flodl.service.reduce_buffers import Consensus, Flat, Model, Outgoing, Round, Upload
from flodl.service.reduce_conn import Conn, PeerClosed, Reader, Refused
from flodl.service.reduce_fold import Folder, narrow_kinds
from flodl.service.reduce_shm import ShmLane
from flodl.service.refusals import Refusals
from flodl.wire.data_hello import (
    DATA_HANDSHAKE_TIMEOUT_S,
    HELLO_BYTES,
    consensus_key,
    data_keys,
    encode_data_ack,
    new_nonce,
    parse_data_hello,
)
from flodl.wire.shm import OFFER_BYTES, OFFER_MAGIC, parse_offer
from flodl.wire.tensor_read import read_frame_payloads, read_frame_prefix, read_frame_tag
from flodl.wire.tensors import (
    CONSENSUS_SENDER,
    DEFAULT_MAX_FRAME_BYTES,
    FLAG_SHM,
    INLINE_TAG_BYTES,
    FrameHeader,
    TensorKind,
    TensorLayout,
    WireDtype,
    encode_frame_parts,
    frame_tag,
    send_buffers,
    upload_sender,
)

__all__ = ["ReduceServer", "HANDSHAKE_TIMEOUT_S", "READ_TIMEOUT_S"]

logger = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT_S = DATA_HANDSHAKE_TIMEOUT_S
READ_TIMEOUT_S = 120.0
"""Default per-read deadline inside a frame, and per-send deadline (``REDUCE_READ_DEADLINE``)."""
_EXTRA_CONNECTIONS = 8
"""Connections allowed beyond one per rank and one reconnect each (handshakes in flight)."""


class ReduceServer:
    """Average ranks' parameters and buffers on the coordinator's CPUs.

    Args:
        secret: the run secret (with ``run_id``, keys the handshake and every frame:
            :mod:`flodl.wire.data_hello`).
        run_id: the run's id; a hello or frame of another run is refused.
        host: address to bind.
        port: port to bind, 0 for any.
        world_size: number of ranks; a hello for another world size is refused.
        on_done: ``on_done(cycle, contributors, weight_total)``, called on the fold worker
            thread after a round's consensus was sent; ``contributors`` are the ranks whose
            upload was folded in, sorted.
        max_frame_bytes: ceiling on any frame received; ``None`` is
            :data:`~flodl.wire.tensors.DEFAULT_MAX_FRAME_BYTES` (1 GiB). Pass
            ``frame_ceiling(model_nbytes)`` for models over 512 MiB.
        read_timeout_s: deadline of each read inside a frame and of each send, seconds.
        outer / outer_state: the outer optimizer applied to each folded consensus (CPU
            placement) and the momentum to restore.
        broadcast_round: see :attr:`broadcast_round`.
        shared_memory: accept the shared-memory offers of ranks on this host
            (:mod:`flodl.service.reduce_shm`); ``False`` keeps every rank on TCP.

    Thread safety: :meth:`open_round`, :meth:`rank_dead` and :meth:`close` may be called from
    any thread (the coordinator calls them from its event loop); they never block on I/O.
    """

    def __init__(
        self,
        secret: bytes,
        *,
        run_id: str,
        host: str = "127.0.0.1",
        port: int = 0,
        world_size: int,
        on_done: Callable[[int, tuple[int, ...], float], None],
        max_frame_bytes: int | None = None,
        read_timeout_s: float = READ_TIMEOUT_S,
        outer: OuterConfig | None = None,
        outer_state: dict[str, list[torch.Tensor]] | None = None,
        broadcast_round: int | None = None,
        shared_memory: bool = True,
    ) -> None:
        if world_size < 1:
            raise LocalProtocolError(f"world_size must be >= 1, got {world_size}")
        if read_timeout_s <= 0:
            raise LocalProtocolError(f"read_timeout_s must be > 0, got {read_timeout_s}")
        self.secret = secret
        self.run_id = run_id
        self._nonce = new_nonce()
        self._consensus_key = consensus_key(secret, run_id, self._nonce)
        self.host = host
        self.port = port
        self.world_size = world_size
        self.on_done = on_done
        self.max_frame_bytes = (
            DEFAULT_MAX_FRAME_BYTES if max_frame_bytes is None else max_frame_bytes
        )
        self.read_timeout_s = read_timeout_s
        self.broadcast_round = broadcast_round
        """The round whose consensus is the lowest contributor's upload as is (the initial
        broadcast; ``None``: every round averages)."""
        self._cond = threading.Condition(threading.Lock())
        self._closing = False
        self._started = False
        self._listen: socket.socket | None = None
        self._wake_r: socket.socket | None = None
        self._wake_w: socket.socket | None = None
        self._accept_thread: threading.Thread | None = None
        self._worker: threading.Thread | None = None
        self._jobs: queue.SimpleQueue[Round | None] = queue.SimpleQueue()
        # Everything below is guarded by self._cond.
        self._conns: set[Conn] = set()
        self._by_rank: dict[int, Conn] = {}
        self._hello_nonces: set[bytes] = set()
        """Every authenticated hello's nonce (one per genuine connection, so bounded by them):
        a replayed hello is refused."""
        self._book = RoundBook(world_size)
        self._rounds: dict[int, Round] = {}
        self._models: dict[TensorKind, Model] = {}
        self._inflight: Consensus | None = None
        # Owned by the worker thread.
        self._acc: dict[TensorKind, Flat] = {}  # the last fold's, private or a shared slot
        self._own: dict[TensorKind, Flat] = {}
        self._folder = Folder()
        self._mirror: dict[TensorKind, tuple[Flat, int]] = {}  # and the fold it mirrors
        self._folds = 0
        # The outer optimizer (CPU placement): applied by the worker to each folded consensus;
        # its lock lets the event loop snapshot it for a checkpoint between folds.
        self._outer = OuterStep(outer) if outer is not None and not outer.is_identity else None
        self._outer_resume = outer_state
        self._outer_lock = threading.Lock()
        self.refusals = Refusals(logger)
        """Every refused or cut data connection, counted by reason (logged within a budget)."""
        self._refusals_lock = threading.Lock()
        self._lane = ShmLane(enabled=shared_memory)
        """The shared-memory lane: offers, uploads read in place, the consensus slots."""

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> int:
        """Bind, listen and start the accept and fold threads.

        Returns:
            The bound port.
        """
        if self._started or self._closing:
            raise LocalProtocolError("ReduceServer.start() called twice, or after close()")
        self._started = True
        listen = socket.create_server((self.host, self.port), backlog=max(16, self.world_size))
        listen.setblocking(False)
        self._listen = listen
        self._wake_r, self._wake_w = socket.socketpair()
        self.port = listen.getsockname()[1]
        self._accept_thread = threading.Thread(
            target=self._accept_loop, name="flodl-reduce-accept", daemon=True
        )
        self._worker = threading.Thread(target=self._work, name="flodl-reduce-fold", daemon=True)
        self._accept_thread.start()
        self._worker.start()
        logger.info("reduce server listening on %s:%d", self.host, self.port)
        return self.port

    def close(self) -> None:
        """Stop serving: close every connection, join every thread. Idempotent.

        A round in flight is abandoned (``on_done`` is not called for it). May be called from
        any thread, ``on_done`` included.
        """
        with self._cond:
            self._closing = True
            for conn in self._conns:
                self._shut(conn)
            self._cond.notify_all()
        if self._wake_w is not None:
            with contextlib.suppress(OSError):
                self._wake_w.send(b"x")
        if self._accept_thread is not None:
            self._accept_thread.join()
        with self._cond:  # the accept thread may have registered one more before it saw closing
            for conn in self._conns:
                self._shut(conn)
            threads = [c.thread for c in self._conns if c.thread is not None]
        for thread in threads:
            thread.join()
        self._jobs.put(None)
        if self._worker is not None and self._worker is not threading.current_thread():
            self._worker.join()  # (close() may be called from on_done, on the worker itself)
        for sock in (self._listen, self._wake_r, self._wake_w):
            if sock is not None:
                sock.close()
        self._listen = self._wake_r = self._wake_w = None
        self._acc.clear()
        self._own.clear()
        self._folder.clear()
        self._mirror.clear()
        self._lane.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ coordinator calls
    def open_round(self, cycle: int, ranks: Sequence[int]) -> None:
        """Expect uploads for round ``cycle`` from ``ranks`` (ranks already gone are dropped).

        Uploads that arrived early for ``cycle`` count; early uploads from ranks not in
        ``ranks``, and uploads to an earlier round never opened, close those connections.

        Raises:
            LocalProtocolError: ``cycle`` is not above every round opened so far, or a rank is
                outside ``range(world_size)``.
        """
        with self._cond:
            if self._closing:
                return
            opened = self._book.open(cycle, ranks)
            self._reconcile([] if opened.complete is None else [(cycle, opened.complete)])
            for rank, reason in opened.refused:
                self._kick(rank, reason)
            self._cond.notify_all()

    def rank_dead(self, rank: int) -> None:
        """``rank`` left the run (declared dead, or exited): stop waiting for it and close its
        data connection.

        Every open round forgets the rank (its upload, if any, is not folded in) and may
        complete. A round already complete keeps it as a contributor.
        """
        with self._cond:
            if self._closing or rank in self._book.gone:
                return
            done = self._book.leave(rank)
            if self._inflight is not None:
                self._inflight.sending.discard(rank)
            conn = self._by_rank.get(rank)
            if conn is not None and not conn.closed:
                logger.info("rank %d left the run: closing its data connection", rank)
                self._shut(conn)
            self._reconcile(done)
            self._cond.notify_all()

    def rank_rejoined(self, rank: int) -> None:
        """A dead ``rank`` came back as a new incarnation: its data hello is taken again, and
        rounds opened from now on may expect it. The old incarnation's connection was shut by
        :meth:`rank_dead`, and its keys were bound to that connection's nonces, so nothing it
        sent can be taken for the new one's."""
        with self._cond:
            if self._closing:
                return
            self._book.rejoin(rank)
            old = self._by_rank.get(rank)
            if old is not None and old.closed:
                del self._by_rank[rank]
            self._cond.notify_all()

    def waiting_for(self, cycle: int) -> tuple[int, ...] | None:
        """The ranks open round ``cycle`` still waits for (for stall reports), sorted.

        Returns:
            The expected, live ranks whose upload has not arrived; ``None`` when ``cycle`` is
            not open (not opened yet, or already complete).
        """
        with self._cond:
            return self._book.waiting_for(cycle)

    def uploads(self, cycle: int) -> tuple[int, ...]:
        """The ranks whose upload for round ``cycle`` arrived and awaits the fold, sorted.

        Uploads to a round not opened yet count; a complete round has none left.
        """
        with self._cond:
            return self._book.uploads(cycle)

    # ------------------------------------------------------------------ state (lock held)
    def _shut(self, conn: Conn) -> None:
        conn.closed = True
        if not conn.released:
            with contextlib.suppress(OSError):
                conn.sock.shutdown(socket.SHUT_RDWR)

    def _refuse(self, reason: str, msg: str, *args: object) -> None:
        with self._refusals_lock:
            self.refusals.refuse(time.perf_counter(), reason, msg, *args)

    def _kick(self, rank: int, reason: str) -> None:
        conn = self._by_rank.get(rank)
        if conn is not None and not conn.closed:
            self._refuse(reason, "closing the data connection of rank %d: %s", rank, reason)
            self._shut(conn)

    def _reconcile(self, complete: list[tuple[int, tuple[int, ...]]]) -> None:
        """Bring the payloads in line with the round book after it changed: complete rounds go
        to the fold worker, payloads the book no longer holds are dropped."""
        for cycle, contributors in complete:
            rnd = self._rounds.pop(cycle, None) or Round(cycle)
            rnd.uploads = {r: rnd.uploads[r] for r in contributors}
            self._jobs.put(rnd)
        pending = set(self._book.pending())
        for cycle in [c for c in self._rounds if c not in pending]:
            del self._rounds[cycle]  # early uploads to a round that was never opened
        for cycle, rnd in self._rounds.items():
            held = set(self._book.uploads(cycle))
            for rank in [r for r in rnd.uploads if r not in held]:
                del rnd.uploads[rank]

    def _model(self, kind: TensorKind, layout: TensorLayout) -> Model:
        with self._cond:
            model = self._models.get(kind)
            if model is None:
                model = self._models[kind] = Model.of(kind, layout)
                return model
        model.check(kind, layout)
        return model

    # ------------------------------------------------------------------ accept thread
    def _accept_loop(self) -> None:
        assert self._listen is not None
        assert self._wake_r is not None
        limit = 2 * self.world_size + _EXTRA_CONNECTIONS
        while True:
            readable, _, _ = select.select([self._listen, self._wake_r], [], [])
            if self._wake_r in readable:
                return
            try:
                sock, address = self._listen.accept()
            except (BlockingIOError, InterruptedError):
                continue
            except OSError as exc:
                logger.warning("reduce server accept failed: %s", exc)
                continue
            peer = f"{address[0]}:{address[1]}"
            with self._cond:
                if self._closing:
                    sock.close()
                    return
                self._conns = {c for c in self._conns if not c.released or _alive(c.thread)}
                if len(self._conns) >= limit:
                    why = f"{limit} data connections already open"
                    self._refuse(why, "refused data connection from %s: %s", peer, why)
                    sock.close()
                    continue
                conn = Conn(sock, peer)
                conn.thread = threading.Thread(
                    target=self._serve, args=(conn,), name=f"flodl-reduce-{peer}", daemon=True
                )
                self._conns.add(conn)
            conn.thread.start()

    # ------------------------------------------------------------------ connection threads
    def _serve(self, conn: Conn) -> None:
        try:
            self._handshake(conn)
            reader = Reader(conn.sock, self.read_timeout_s)
            while True:
                reader.wait_for_frame()
                if reader.peek(4) == OFFER_MAGIC.to_bytes(4, "big"):
                    self._answer_offer(conn, reader)
                    continue
                cycle, upload = self._receive_upload(conn, reader)
                rnd = self._register(conn, cycle, upload)
                if not self._send_consensus(conn, rnd):
                    return
        except PeerClosed:
            logger.info("rank %s closed its data connection", conn.rank)
        except (Refused, FrameError, OSError) as exc:
            what = f"rank {conn.rank}" if conn.rank is not None else conn.peer
            if conn.closed:
                logger.debug("data connection of %s ended: %s", what, exc)
            elif isinstance(exc, TimeoutError):
                self._refuse(
                    "read timeout", "closing the data connection of %s: %s", what, "read timeout"
                )
            else:
                self._refuse(str(exc), "closing the data connection of %s: %s", what, exc)
        except Exception:
            logger.exception("reduce connection thread of %s failed", conn.peer)
        finally:
            with self._cond:
                self._shut(conn)
                conn.released = True
                conn.sock.close()
                if conn.rank is not None and self._by_rank.get(conn.rank) is conn:
                    del self._by_rank[conn.rank]
                if conn.rank is not None and self._inflight is not None:
                    self._inflight.sending.discard(conn.rank)
                shm, conn.shm = conn.shm, None
                self._cond.notify_all()
            if shm is not None:
                shm.close()  # (a round still folding its views keeps them mapped)

    def _consensus_tag(self, out: Outgoing) -> bytes:
        return frame_tag(self._consensus_key, out.head, out.payloads, sender=CONSENSUS_SENDER)

    def _handshake(self, conn: Conn) -> None:
        sock = conn.sock
        # One deadline for the whole hello, counted from the accept (this thread starts then):
        # a per-recv timeout would let a peer trickling a byte every few seconds hold its
        # connection slot for HELLO_BYTES times as long.
        deadline = time.perf_counter() + HANDSHAKE_TIMEOUT_S
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        hello = bytearray(HELLO_BYTES)
        view = memoryview(hello)
        got = 0
        while got < HELLO_BYTES:
            left = deadline - time.perf_counter()
            try:
                if left <= 0:
                    raise TimeoutError
                sock.settimeout(left)
                n = sock.recv_into(view[got:])
            except TimeoutError:
                raise Refused(f"no hello within {HANDSHAKE_TIMEOUT_S:g} s") from None
            if n == 0:
                raise Refused(f"closed after {got} of {HELLO_BYTES} hello bytes")
            got += n
        rank, world_size, nonce = parse_data_hello(self.secret, self.run_id, hello)
        if world_size != self.world_size:
            raise Refused(f"hello for a world of {world_size}, this run has {self.world_size}")
        if not 0 <= rank < world_size:
            raise Refused(f"hello from rank {rank}, outside a world of {world_size}")
        with self._cond:
            if self._closing:
                raise Refused("server closing")
            if nonce in self._hello_nonces:
                raise Refused(f"replayed hello of rank {rank} (its nonce was already used)")
            if rank in self._book.gone:
                raise Refused(f"rank {rank} left the run")
            if rank in self._by_rank:
                raise Refused(f"rank {rank} already has a live data connection")
            self._by_rank[rank] = conn
            self._hello_nonces.add(nonce)
            conn.rank = rank
        ack = encode_data_ack(self.secret, self.run_id, hello, self._nonce)
        conn.upload_key = data_keys(self.secret, self.run_id, hello, ack).upload
        sock.sendall(ack)
        logger.info("rank %d connected to the reduce server from %s", rank, conn.peer)

    def _answer_offer(self, conn: Conn, reader: Reader) -> None:
        """A rank offers its upload segment: map it and answer (accepted or declined)."""
        assert conn.rank is not None
        if conn.shm is not None:
            raise Refused("a second shared-memory offer on one connection")
        data = bytearray(OFFER_BYTES)
        view = memoryview(data)
        got = 0
        while got < OFFER_BYTES:
            n = reader(view[got:])
            if n == 0:
                raise Refused(f"closed after {got} of {OFFER_BYTES} offer bytes")
            got += n
        offer = parse_offer(conn.upload_key, data)
        answer, upload = self._lane.answer(conn.upload_key, offer, conn.rank)
        with self._cond:
            conn.shm = upload
        conn.sock.settimeout(self.read_timeout_s)
        conn.sock.sendall(answer)

    def _receive_upload(self, conn: Conn, reader: Reader) -> tuple[int, Upload]:
        assert conn.rank is not None
        params_header, params, param_wire = self._receive_frame(
            conn, reader, TensorKind.MODEL_PARAMS, None
        )
        cycle = params_header.round
        buffers_header, buffers, buffer_wire = self._receive_frame(
            conn, reader, TensorKind.MODEL_BUFFERS, cycle
        )
        return cycle, Upload(
            weight=params_header.weight,
            mover=buffers_header.weight == 1.0,
            params=params,
            buffers=buffers,
            param_wire=param_wire,
            buffer_wire=buffer_wire,
            shm=bool(params_header.flags & FLAG_SHM),
        )

    def _receive_frame(
        self,
        conn: Conn,
        reader: Reader,
        kind: TensorKind,
        cycle: int | None,
    ) -> tuple[FrameHeader, Flat, tuple[WireDtype, ...]]:
        """Receive one upload frame: its payloads into the connection's own buffers, or, a
        shared-memory frame, as views of the rank's segment."""
        assert conn.rank is not None
        with self._cond:
            model = self._models.get(kind)
        prefix = read_frame_prefix(
            reader,
            secret=conn.upload_key,
            max_frame_bytes=self.max_frame_bytes,
            table_nbytes=None if model is None else model.table_nbytes,
            sender=upload_sender(conn.rank),
        )
        header = prefix.header
        if header.kind is not kind:
            raise FrameError(f"expected a {kind.name} frame, got {header.kind.name}")
        if cycle is None:
            with self._cond:
                problem = self._book.problem(conn.rank, header.round)
            if problem is not None:
                raise Refused(problem)
        elif header.round != cycle:
            raise Refused(f"BUFFERS frame for round {header.round} after PARAMS of round {cycle}")
        if kind is TensorKind.MODEL_BUFFERS and header.weight not in (0.0, 1.0):
            raise FrameError(f"BUFFERS weight {header.weight} is not 0 or 1 (mover flag)")
        model = self._model(kind, prefix.layout)
        wire = tuple(spec.dtype for spec in prefix.layout.specs)
        if header.flags & FLAG_SHM:
            if conn.shm is None:
                raise FrameError("a shared-memory frame on a connection without a segment")
            with self._cond:
                models = dict(self._models)
            flat = self._lane.upload_flat(conn.shm, kind, models, prefix)
            read_frame_tag(reader, prefix)
            return header, flat, wire
        own = conn.params if kind is TensorKind.MODEL_PARAMS else conn.buffers
        if own is None:
            own = Flat.allocate(model)
            if kind is TensorKind.MODEL_PARAMS:
                conn.params = own
            else:
                conn.buffers = own
        read_frame_payloads(
            reader, prefix, own.views, scratch=conn.scratch, zero_elided=header.weight > 0
        )
        return header, own, wire

    def _register(self, conn: Conn, cycle: int, upload: Upload) -> Round:
        assert conn.rank is not None
        with self._cond:
            if self._closing or conn.closed:
                raise Refused("closing")
            problem = self._book.problem(conn.rank, cycle)
            if problem is not None:
                raise Refused(problem)
            rnd = self._rounds.setdefault(cycle, Round(cycle))
            rnd.uploads[conn.rank] = upload
            complete = self._book.upload(conn.rank, cycle)
            self._reconcile([] if complete is None else [(cycle, complete)])
            return rnd

    def _send_consensus(self, conn: Conn, rnd: Round) -> bool:
        """Wait for ``rnd``'s consensus and send it; False when this connection is done."""
        rank = conn.rank
        assert rank is not None
        with self._cond:
            while True:
                if self._closing or conn.closed or rnd.failed:
                    return False
                if rnd.consensus is not None:
                    consensus = rnd.consensus
                    break
                if rank not in rnd.uploads:
                    return False  # dropped by rank_dead / open_round (connection shut)
                self._cond.wait()
            frames = consensus.frames.get(rank)
        if frames is None:
            return False
        try:
            conn.sock.settimeout(self.read_timeout_s)
            for out in frames:
                send_buffers(conn.sock, [out.head, *out.payloads])
                with self._cond:
                    while out.tag is None and not (self._closing or conn.closed or rnd.failed):
                        self._cond.wait()
                    tag = out.tag
                if tag is None:
                    return False
                conn.sock.sendall(tag)
        finally:
            with self._cond:
                consensus.sending.discard(rank)
                self._cond.notify_all()
        return True

    # ------------------------------------------------------------------ fold worker
    def _work(self) -> None:
        while True:
            rnd = self._jobs.get()
            if rnd is None:
                return
            try:
                self._complete(rnd)
            except Exception:
                logger.exception("reduce round %d failed; closing its contributors", rnd.cycle)
                with self._cond:
                    rnd.failed = True
                    self._inflight = None
                    for rank in rnd.uploads:
                        self._kick(rank, f"round {rnd.cycle} failed on the server")
                    self._cond.notify_all()

    def _complete(self, rnd: Round) -> None:
        with self._cond:
            contributors = tuple(sorted(rnd.uploads))
            if self._closing:
                return
        uploads = [rnd.uploads[r] for r in contributors]
        # the initial broadcast folds only the lowest live rank's state, as is (every rank
        # uploads its own, so the round survives rank 0 dying before it uploaded)
        folded = uploads[:1] if rnd.cycle == self.broadcast_round else uploads
        weight_total = 0.0
        for upload in folded:
            weight_total += upload.weight
        movers = [u for u in folded if u.mover]
        frames: dict[int, tuple[Outgoing, Outgoing]] = {}
        outgoing: list[Outgoing] = []
        if uploads:
            kinds = (TensorKind.MODEL_PARAMS, TensorKind.MODEL_BUFFERS)
            weighted = [u.params for u in folded if u.weight > 0]
            divisors = (weight_total, float(len(movers)))
            self._folds += 1
            with self._cond:
                models = dict(self._models)
            # ranks on this host read the consensus in place: fold into a shared slot
            slot = None
            if any(u.shm for u in uploads):
                narrow = narrow_kinds(models, uploads, outer=self._outer is not None)
                slot = self._lane.slot(models, narrow)
            into = {} if slot is None else slot[1]
            with torch.no_grad():
                self._fold(kinds[0], weighted, weight_total, into.get(kinds[0]))
                self._fold(kinds[1], [u.buffers for u in movers], divisors[1], into.get(kinds[1]))
                if weight_total > 0 and self._outer is not None:
                    self._apply_outer(list(self._acc[kinds[0]].flats.values()))
            if slot is not None:
                self._lane.stamp(slot[0], rnd.cycle)
            variants: dict[tuple[object, ...], Outgoing] = {}
            for rank, upload in zip(contributors, uploads, strict=True):
                pair = []
                wires = (upload.param_wire, upload.buffer_wire)
                for kind, divisor, wire in zip(kinds, divisors, wires, strict=True):
                    in_place = slot is not None and upload.shm and divisor > 0
                    key: tuple[object, ...] = (kind, "shm") if in_place else (kind, wire)
                    out = variants.get(key)
                    if out is None:
                        if slot is not None and in_place:
                            head = self._lane.consensus_head(
                                kind, self._acc[kind], rnd.cycle, divisor, slot[0]
                            )
                            out = Outgoing(head, [])
                        else:
                            out = self._outgoing(kind, rnd.cycle, divisor, wire)
                        variants[key] = out
                        outgoing.append(out)
                    pair.append(out)
                frames[rank] = (pair[0], pair[1])
        for out in outgoing:
            if sum(p.nbytes for p in out.payloads) < INLINE_TAG_BYTES:
                out.tag = self._consensus_tag(out)
        with self._cond:
            if self._closing:
                return
            sending = {
                r
                for r in contributors
                if r in self._by_rank and not self._by_rank[r].closed and r not in self._book.gone
            }
            consensus = Consensus(contributors, weight_total, frames, sending)
            rnd.consensus = self._inflight = consensus
            self._cond.notify_all()
        for out in [o for o in outgoing if o.tag is None]:  # sent meanwhile
            tag = self._consensus_tag(out)
            with self._cond:
                out.tag = tag
                self._cond.notify_all()
        with self._cond:
            while consensus.sending and not self._closing:
                self._cond.wait()
            self._inflight = None
            if self._closing:
                return
        logger.debug(
            "round %d done: contributors %s, weight %g", rnd.cycle, contributors, weight_total
        )
        try:
            self.on_done(rnd.cycle, contributors, weight_total)
        except Exception:
            logger.exception("on_done failed for round %d", rnd.cycle)

    def _apply_outer(self, consensus: list[torch.Tensor]) -> None:
        assert self._outer is not None
        with self._outer_lock:
            if self._outer_resume is not None:
                state, self._outer_resume = self._outer_resume, None
                try:
                    self._outer.restore(state, consensus)
                except ValueError as exc:
                    logger.warning("outer optimizer state not restored (%s): zero momentum", exc)
            self._outer.apply(consensus)

    def outer_state(self) -> dict[str, list[torch.Tensor]]:
        """A copy of the outer optimizer's state (empty without one, or before the first
        round). Safe from any thread."""
        if self._outer is None:
            return {}
        with self._outer_lock:
            return self._outer.state()

    def _fold(
        self, kind: TensorKind, parts: list[Flat], divisor: float, into: Flat | None = None
    ) -> None:
        """acc[kind] = sum(parts) / divisor (:meth:`Folder.fold`), into ``into`` (a shared
        consensus slot) when given, else private memory."""
        if not parts:
            return  # nothing received: the frame goes out elided with weight 0
        acc = into if into is not None else self._own.get(kind)
        if acc is None:
            with self._cond:
                model = self._models[kind]
            acc = self._own[kind] = Flat.allocate(model)
        self._acc[kind] = acc
        self._folder.fold(acc, parts, divisor)

    def _outgoing(
        self, kind: TensorKind, cycle: int, divisor: float, wire: tuple[WireDtype, ...]
    ) -> Outgoing:
        """The consensus frame of ``kind`` in the wire dtypes ``wire`` (one per tensor)."""
        with self._cond:
            model = self._models[kind]
        if divisor == 0:
            # Nothing realized: every payload elided; shapes, and dtypes as the rank sent them.
            shells = [
                torch.zeros((), dtype=w.torch_dtype).expand(shape)
                for w, shape in zip(wire, model.shapes, strict=True)
            ]
            head, payloads = encode_frame_parts(
                shells, kind=kind, weight=0.0, round=cycle, all_zero=True
            )
            return Outgoing(head, payloads)
        acc = self._acc[kind]
        tensors = acc.views
        if any(w.torch_dtype != a.dtype for w, a in zip(wire, tensors, strict=True)):
            mirror = self._mirror_of(kind, model, acc)
            tensors = [
                m if w is WireDtype.BF16 else a
                for w, a, m in zip(wire, acc.views, mirror.views, strict=True)
            ]
        head, payloads = encode_frame_parts(tensors, kind=kind, weight=divisor, round=cycle)
        return Outgoing(head, payloads)

    def _mirror_of(self, kind: TensorKind, model: Model, acc: Flat) -> Flat:
        """The bf16 copy of this round's accumulator of ``kind`` (filled once per round)."""
        mirror, filled = self._mirror.get(kind, (None, -1))
        if mirror is None or any(
            mirror.flats[d] is not t for d, t in acc.flats.items() if d != torch.float32
        ):  # (its other tensors are the accumulator's, which alternates with shared slots)
            mirror = Flat.bf16_mirror(model, acc)
        if filled != self._folds:
            if torch.float32 in acc.flats:
                mirror.flats[torch.float32].copy_(acc.flats[torch.float32])
            self._mirror[kind] = (mirror, self._folds)
        return mirror


def _alive(thread: threading.Thread | None) -> bool:
    return thread is not None and thread.is_alive()
