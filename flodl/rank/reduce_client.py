"""The rank side of CPU averaging: upload parameters and buffers, apply the consensus.

One :class:`ReduceClient` per rank process, used from the rank's main thread (the one that owns
the model): :meth:`ReduceClient.reduce` blocks until the coordinator's reduce server
(:mod:`flodl.service.reduce`) answers the round. Blocking sockets, never asyncio: the data
channel moves whole models, and blocking ``sendmsg``/``recv_into`` on loopback are several
times faster than asyncio streams.

Per round (docs/design.md §2b): the parameters are pre-scaled by the rank's weight
``w = n^gamma`` into a preallocated scratch copy (the caller's tensors are not touched until
the consensus arrives) and uploaded as a PARAMS frame of weight ``w``; an idle rank (``w = 0``)
uploads elided zeros. The float buffers go unscaled in a BUFFERS frame of weight 1 for a rank
that stepped (a *mover*) and elided zeros of weight 0 otherwise. With ``bf16_wire`` every f32
tensor rides as bfloat16, except in round 0 (the initial broadcast stays f32). While the
payloads are on the wire a helper thread computes their auth tag, which ends the frame, so
authentication overlaps the transfer. The consensus is received into preallocated tensors and
then copied into the caller's parameters (when its weight is > 0) and buffers (when some rank
moved).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import socket
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Self

import torch

from flodl.errors import CoordinatorLost, FrameError, LocalProtocolError
from flodl.rank.reduce_shm import STAGE_ELEMENTS, LocalLane, lane_problem, through_stage
from flodl.wire.data_hello import (
    DATA_HANDSHAKE_TIMEOUT_S,
    HELLO_BYTES,
    DataKeys,
    check_data_ack,
    data_keys,
    encode_data_hello,
)
from flodl.wire.shm import ANSWER_BYTES, encode_offer, parse_answer
from flodl.wire.tensor_read import (
    FramePrefix,
    read_frame_payloads,
    read_frame_prefix,
    read_frame_tag,
)
from flodl.wire.tensors import (
    CONSENSUS_SENDER,
    FLAG_SHM,
    INLINE_TAG_BYTES,
    TensorKind,
    encode_frame_parts,
    frame_ceiling,
    frame_tag,
    send_buffers,
    upload_sender,
)

__all__ = ["ReduceClient", "CONNECT_RETRY_S", "HANDSHAKE_TIMEOUT_S"]

logger = logging.getLogger(__name__)

CONNECT_RETRY_S = 0.5
"""Pause between connection attempts (the original's 60 attempts x 500 ms)."""
HANDSHAKE_TIMEOUT_S = DATA_HANDSHAKE_TIMEOUT_S
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float64)
DEVICE_STAGE_ELEMENTS = 1 << 22
"""Elements per piece when a device tensor's scaled upload is narrowed: a 16 MiB f32 stage on
the device, so a large model crosses to the host in a few hundred copies, not thousands."""


class ReduceClient:
    """A rank's connection to the coordinator's CPU reduce server.

    Args:
        host: the coordinator's host.
        port: the reduce server's port (``Accept.data_port``).
        secret: the run secret.
        rank: this rank.
        world_size: number of ranks in the run.
        run_id: the run's id (with the secret, keys the handshake; the connection's own keys
            come from it: :mod:`flodl.wire.data_hello`).
        bf16_wire: send (and receive) f32 tensors as bfloat16 after round 0.
        timeout_s: deadline of each read and send on the connection, seconds; it bounds the
            wait for a round's consensus too, so it must exceed the slowest rank's window.
        shared_memory: offer the server a shared-memory segment before the first round
            (:mod:`flodl.rank.reduce_shm`): on the server's host the parameters then move
            through memory instead of loopback TCP; elsewhere the server declines and the
            rank keeps TCP.

    Thread: the rank's main thread (not thread-safe).
    """

    def __init__(
        self,
        host: str,
        port: int,
        secret: bytes,
        rank: int,
        world_size: int,
        *,
        run_id: str,
        bf16_wire: bool = False,
        timeout_s: float = 120.0,
        shared_memory: bool = True,
    ) -> None:
        if not 0 <= rank < world_size:
            raise LocalProtocolError(f"rank {rank} is not in a world of {world_size}")
        if timeout_s <= 0:
            raise LocalProtocolError(f"timeout_s must be > 0, got {timeout_s}")
        self.host = host
        self.port = port
        self.secret = secret
        self.run_id = run_id
        self._keys: DataKeys | None = None
        self.rank = rank
        self.world_size = world_size
        self.bf16_wire = bf16_wire
        self.timeout_s = timeout_s
        self._sock: socket.socket | None = None
        self._tagger: ThreadPoolExecutor | None = None
        self._closed = False
        self._lost: str | None = None  # why the connection broke, once it did
        # Preallocated per model layout (set by the first reduce).
        self._signature: tuple[tuple[tuple[int, ...], torch.dtype], ...] | None = None
        self._shapes: dict[TensorKind, list[tuple[int, ...]]] = {}
        self._max_frame_bytes = 0
        self._scratch: dict[tuple[TensorKind, int], torch.Tensor] = {}
        self._received: dict[TensorKind, list[torch.Tensor]] = {}
        self._tables: dict[TensorKind, int] = {}
        self._staging = torch.empty(0, dtype=torch.uint8)
        self._stages: dict[torch.device, torch.Tensor] = {}  # per source device
        self.shared_memory = shared_memory
        self._lane: LocalLane | None = None
        self._lane_tried = False

    # ------------------------------------------------------------------ lifecycle
    def connect(self, timeout_s: float = 30.0) -> None:
        """Connect and handshake, retrying the connection every 0.5 s for ``timeout_s``.

        Raises:
            CoordinatorLost: the server could not be reached in time, or closed the
                connection during the handshake (it refused this rank: see its log).
            FrameError: the server's answer is not a valid ack (wrong secret, another run).
        """
        if self._sock is not None or self._closed:
            raise LocalProtocolError("ReduceClient.connect() called twice")
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = deadline - time.monotonic()
            try:
                sock = socket.create_connection((self.host, self.port), timeout=max(remaining, 0.1))
                break
            except OSError as exc:
                if remaining <= CONNECT_RETRY_S:
                    raise CoordinatorLost(
                        f"rank {self.rank}: reduce server {self.host}:{self.port} unreachable "
                        f"for {timeout_s:g} s: {exc}"
                    ) from exc
                time.sleep(CONNECT_RETRY_S)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.settimeout(min(HANDSHAKE_TIMEOUT_S, self.timeout_s))
            hello = encode_data_hello(self.secret, self.run_id, self.rank, self.world_size)
            sock.sendall(hello)
            ack = bytearray(HELLO_BYTES)
            view = memoryview(ack)
            got = 0
            while got < HELLO_BYTES:
                n = sock.recv_into(view[got:])
                if n == 0:
                    raise CoordinatorLost(
                        f"rank {self.rank}: the reduce server refused the data connection "
                        "(see the coordinator's log)"
                    )
                got += n
            check_data_ack(self.secret, self.run_id, hello, ack)
            self._keys = data_keys(self.secret, self.run_id, hello, ack)
            sock.settimeout(self.timeout_s)
        except BaseException as exc:
            sock.close()
            if isinstance(exc, OSError):
                raise CoordinatorLost(f"rank {self.rank}: reduce handshake failed: {exc}") from exc
            raise
        self._sock = sock
        self._tagger = ThreadPoolExecutor(1, thread_name_prefix=f"flodl-reduce-tag-{self.rank}")
        logger.info("rank %d connected to the reduce server %s:%d", self.rank, self.host, self.port)

    def abort(self) -> None:
        """Cut the data connection as a network failure would (fault injection): the next
        round fails on this side and the server sees the connection end."""
        sock = self._sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        """Close the connection and stop the helper thread. Idempotent."""
        self._closed = True
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self._lane is not None:
            self._lane.close()
            self._lane = None
        if self._tagger is not None:
            self._tagger.shutdown(wait=True)
            self._tagger = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ one round
    def reduce(
        self,
        cycle: int,
        params: list[torch.Tensor],
        weight: float,
        buffers: list[torch.Tensor],
        mover: bool,
    ) -> tuple[float, float]:
        """Average ``params`` and ``buffers`` with the other ranks for round ``cycle``.

        Args:
            cycle: the averaging cycle (0 is the initial broadcast: rank 0 passes weight 1
                and ``mover=True``, the others weight 0 and ``mover=False``).
            params: the parameters, overwritten in place with the consensus when its weight is
                > 0 (under ``torch.no_grad``; CPU or any device).
            weight: this rank's work weight ``n^gamma`` (>= 0; 0 for an idle rank).
            buffers: floating-point buffers (integer buffers are not averaged), overwritten
                with the movers' average when some rank moved.
            mover: whether this rank stepped since the last round.

        Returns:
            ``(param_weight_total, movers)``: the summed weight of the consensus (0: nothing
            was realized and ``params`` are unchanged) and the number of movers.

        Raises:
            CoordinatorLost: the server closed the connection or missed the deadline.
            FrameError: the server's answer is not a valid consensus frame.
            LocalProtocolError: not connected, a bad weight, or tensors unlike the first call's.
        """
        sock, tagger = self._sock, self._tagger
        if self._lost is not None:
            raise CoordinatorLost(self._lost)
        if sock is None or tagger is None:
            raise LocalProtocolError("ReduceClient.reduce() before connect() or after close()")
        if not math.isfinite(weight) or weight < 0:
            raise LocalProtocolError(f"weight must be finite and >= 0, got {weight}")
        self._check_layout(params, buffers)
        bf16 = self.bf16_wire and cycle != 0
        try:
            if not self._lane_tried:
                self._negotiate(sock, params, buffers)
            with torch.no_grad():
                frames = [
                    self._frame(TensorKind.MODEL_PARAMS, params, weight, cycle, bf16),
                    self._frame(TensorKind.MODEL_BUFFERS, buffers, float(mover), cycle, bf16),
                ]
            self._upload(sock, tagger, frames)
            total, received, slot = self._download(TensorKind.MODEL_PARAMS, cycle)
            movers, received_buffers, buffer_slot = self._download(TensorKind.MODEL_BUFFERS, cycle)
            with torch.no_grad():
                if total > 0:
                    self._apply(params, received, slot, cycle, bf16)
                if movers > 0:
                    self._apply(buffers, received_buffers, buffer_slot, cycle, bf16)
        except OSError as exc:  # includes TimeoutError
            what = "timed out" if isinstance(exc, TimeoutError) else f"failed: {exc}"
            lost = CoordinatorLost(f"rank {self.rank}: reduce round {cycle} {what}")
            self._break(sock, str(lost))
            raise lost from exc
        except Exception as exc:  # CoordinatorLost (EOF), FrameError
            self._break(sock, str(exc))
            raise
        return total, movers

    def _apply(
        self,
        dst: Sequence[torch.Tensor],
        src: Sequence[torch.Tensor],
        slot: int | None,
        cycle: int,
        bf16: bool,
    ) -> None:
        """Copy the consensus into the caller's tensors; from a shared slot, between two checks
        that the slot still holds this round."""
        if slot is None:
            for d, s in zip(dst, src, strict=True):
                d.copy_(s)
            return
        assert self._lane is not None
        self._lane.check_stamp(slot, cycle)
        self._lane.apply(dst, src, bf16)
        self._lane.check_stamp(slot, cycle)

    @property
    def in_shared_memory(self) -> bool:
        """Whether the server accepted this rank's shared-memory offer."""
        return self._lane is not None

    def _negotiate(
        self, sock: socket.socket, params: Sequence[torch.Tensor], buffers: Sequence[torch.Tensor]
    ) -> None:
        """Offer a shared-memory segment once, before the first upload; keep TCP when the
        tensors, the platform or the server say no."""
        self._lane_tried = True
        if not self.shared_memory:
            return
        why = lane_problem(params, buffers)
        if why is not None:
            logger.info("rank %d uploads over TCP: %s", self.rank, why)
            return
        try:
            lane = LocalLane(params, buffers)
        except OSError as exc:
            logger.info("rank %d uploads over TCP: no shared memory (%s)", self.rank, exc)
            return
        assert self._keys is not None
        try:
            up = lane.upload
            offer = encode_offer(self._keys.upload, os.getpid(), up.fd, up.size, up.probe)
            sock.sendall(offer)
            data = bytearray(ANSWER_BYTES)
            view = memoryview(data)
            got = 0
            while got < ANSWER_BYTES:
                got += self._recv_into(view[got:])
            answer = parse_answer(self._keys.upload, offer, data)
            if not answer.accepted:
                logger.info("rank %d uploads over TCP: shared memory declined", self.rank)
                lane.close()
                return
            lane.accept(answer)
        except OSError as exc:
            if isinstance(exc, (TimeoutError, ConnectionError)):
                lane.close()
                raise
            # the server's segment could not be mapped: uploads stay on TCP, and the server
            # answers a TCP upload over TCP
            logger.info("rank %d uploads over TCP: %s", self.rank, exc)
            lane.close()
            return
        except BaseException:
            lane.close()
            raise
        self._lane = lane
        logger.info("rank %d averages through shared memory", self.rank)

    def _break(self, sock: socket.socket, reason: str) -> None:
        """The stream is out of step with the server: later calls raise CoordinatorLost."""
        self._lost = reason
        sock.close()

    def _frame(
        self,
        kind: TensorKind,
        tensors: Sequence[torch.Tensor],
        weight: float,
        cycle: int,
        bf16: bool,
    ) -> tuple[bytes, list[memoryview]]:
        """Head and payloads of the upload of ``tensors`` scaled by ``weight`` (no payloads on
        the stream when they go into the shared segment)."""
        if self._lane is not None and weight > 0:
            views = self._lane.upload_views(kind, bf16)
            for t, v in zip(tensors, views, strict=True):
                self._fill(v, t.detach(), weight)
            head, _ = encode_frame_parts(
                views, kind=kind, weight=weight, round=cycle, elide_zeros=False, flags=FLAG_SHM
            )
            return head, []
        sent = self._outgoing(kind, tensors, weight, bf16)
        return encode_frame_parts(sent, kind=kind, weight=weight, round=cycle, all_zero=weight == 0)

    def _check_layout(
        self, params: Sequence[torch.Tensor], buffers: Sequence[torch.Tensor]
    ) -> None:
        for index, b in enumerate(buffers):
            if b.dtype not in _FLOAT_DTYPES:
                raise LocalProtocolError(
                    f"buffer {index}: {b.dtype} is not averaged; pass float buffers only"
                )
        for index, p in enumerate(params):
            if p.dtype not in _FLOAT_DTYPES:
                raise LocalProtocolError(f"param {index}: unsupported dtype {p.dtype}")
        signature = (
            *((tuple(t.shape), t.dtype) for t in params),
            ((-1,), torch.float32),  # the boundary: moving a tensor across it is a change
            *((tuple(t.shape), t.dtype) for t in buffers),
        )
        if self._signature is None:
            self._signature = signature
            self._shapes[TensorKind.MODEL_PARAMS] = [tuple(t.shape) for t in params]
            self._shapes[TensorKind.MODEL_BUFFERS] = [tuple(t.shape) for t in buffers]
            model_nbytes = sum(t.numel() * t.element_size() for t in [*params, *buffers])
            self._max_frame_bytes = frame_ceiling(model_nbytes)
        elif signature != self._signature:
            raise LocalProtocolError("params/buffers differ from the first reduce() call's")

    def _outgoing(
        self, kind: TensorKind, tensors: Sequence[torch.Tensor], weight: float, bf16: bool
    ) -> list[torch.Tensor]:
        """What to send for ``tensors`` scaled by ``weight``: the tensors themselves when no
        scaling, conversion or copy is needed, else the (preallocated) scratch copy."""
        out: list[torch.Tensor] = []
        for index, t in enumerate(tensors):
            wire = torch.bfloat16 if bf16 and t.dtype == torch.float32 else t.dtype
            if weight == 0:
                out.append(torch.zeros((), dtype=wire).expand(t.shape))  # shape only: elided
                continue
            t = t.detach()
            if weight == 1.0 and wire == t.dtype and t.device.type == "cpu" and t.is_contiguous():
                out.append(t)  # zero-copy: the caller's memory is only read
                continue
            key = (kind, index)
            scratch = self._scratch.get(key)
            if scratch is None or scratch.dtype != wire:
                scratch = self._scratch[key] = torch.empty(t.shape, dtype=wire)
            self._fill(scratch, t, weight)
            out.append(scratch)
        return out

    def _fill(self, dst: torch.Tensor, src: torch.Tensor, weight: float) -> None:
        """``dst = src * weight`` in ``dst``'s dtype, the product rounded once: the one rule for
        both lanes and every device, so a shared-memory upload holds the values a TCP upload of
        the same wire carries and a CUDA rank's upload those of a CPU rank."""
        if weight == 1.0:
            dst.copy_(src)
        elif dst.dtype == src.dtype and dst.device == src.device:
            torch.mul(src, weight, out=dst)
        elif dst.dtype == src.dtype:  # from a device: copied exactly, then scaled once
            dst.copy_(src)
            dst.mul_(weight)
        else:
            self._scale_into(dst, src, weight)

    def _scale_into(self, dst: torch.Tensor, src: torch.Tensor, weight: float) -> None:
        """``dst = src * weight`` into a narrower ``dst``: the product is taken in ``src``'s
        dtype on ``src``'s device, in a stage chunk by chunk, and rounded once as it is copied
        into ``dst``. (A CUDA source copied to bf16 first and scaled there rounded twice;
        ``torch.mul(out=bf16)`` of an f32 CPU tensor is about 20 times slower than the two
        passes.)"""
        if not src.is_contiguous():
            if src.device == dst.device:
                torch.mul(src, weight, out=dst)
                return
            src = src.contiguous()
        n = src.numel()
        piece = STAGE_ELEMENTS if src.device.type == "cpu" else DEVICE_STAGE_ELEMENTS
        stage = self._stages.get(src.device)
        if stage is None or stage.dtype != src.dtype or stage.numel() < min(n, piece):
            stage = torch.empty(min(n, piece), dtype=src.dtype, device=src.device)
            self._stages[src.device] = stage
        through_stage(
            dst.view(-1), src.view(-1), stage, lambda p, out: torch.mul(p, weight, out=out)
        )

    def _upload(
        self,
        sock: socket.socket,
        tagger: ThreadPoolExecutor,
        frames: list[tuple[bytes, list[memoryview]]],
    ) -> None:
        """Send both frames; large frames are authenticated on the helper thread meanwhile."""
        tags: list[Future[bytes] | bytes] = []
        sender = upload_sender(self.rank)
        assert self._keys is not None
        key = self._keys.upload
        for head, payloads in frames:
            if sum(p.nbytes for p in payloads) < INLINE_TAG_BYTES:
                tags.append(frame_tag(key, head, payloads, sender=sender))
            else:
                tags.append(tagger.submit(frame_tag, key, head, payloads, sender=sender))
        try:
            for (head, payloads), tag in zip(frames, tags, strict=True):
                send_buffers(sock, [head, *payloads])
                sock.sendall(tag if isinstance(tag, bytes) else tag.result())
        finally:
            for tag in tags:  # never leave the helper reading memory the caller may reuse
                if not isinstance(tag, bytes):
                    with contextlib.suppress(Exception):
                        tag.result()

    def _recv_into(self, view: memoryview) -> int:
        assert self._sock is not None
        n = self._sock.recv_into(view)
        if n == 0:
            raise CoordinatorLost(f"rank {self.rank}: the reduce server closed the connection")
        return n

    def _download(
        self, kind: TensorKind, cycle: int
    ) -> tuple[float, list[torch.Tensor], int | None]:
        """Receive one consensus frame into the preallocated tensors; return its weight, the
        tensors, and the shared slot they are in (``None``: received from the stream)."""
        assert self._keys is not None
        prefix = read_frame_prefix(
            self._recv_into,
            secret=self._keys.consensus,
            max_frame_bytes=self._max_frame_bytes,
            table_nbytes=self._tables.get(kind),
            sender=CONSENSUS_SENDER,
        )
        header = prefix.header
        if header.kind is not kind:
            raise FrameError(f"expected a consensus {kind.name} frame, got {header.kind.name}")
        if header.round != cycle:
            raise FrameError(f"consensus for round {header.round} while in round {cycle}")
        shapes = [spec.shape for spec in prefix.layout.specs]
        if shapes != self._shapes[kind]:
            raise FrameError(f"consensus {kind.name} shapes {shapes} are not the model's")
        self._tables[kind] = prefix.layout.table_nbytes
        if header.flags & FLAG_SHM:
            if self._lane is None:
                raise FrameError("a shared-memory consensus on a connection without a segment")
            slot, views = self._lane.consensus_views(kind, prefix)
            read_frame_tag(self._recv_into, prefix)
            return header.weight, views, slot
        out = self._receive_tensors(kind, prefix)
        read_frame_payloads(
            self._recv_into, prefix, out, scratch=self._staging, zero_elided=header.weight > 0
        )
        return header.weight, out, None

    def _receive_tensors(self, kind: TensorKind, prefix: FramePrefix) -> list[torch.Tensor]:
        """Preallocated destinations in the frame's wire dtypes (reallocated if they change)."""
        specs = prefix.layout.specs
        current = self._received.get(kind)
        if (
            current is not None
            and len(current) == len(specs)
            and all(
                t.dtype == s.dtype.torch_dtype and tuple(t.shape) == s.shape
                for t, s in zip(current, specs, strict=True)
            )
        ):
            return current
        current = self._received[kind] = [
            torch.empty(s.shape, dtype=s.dtype.torch_dtype) for s in specs
        ]
        return current
