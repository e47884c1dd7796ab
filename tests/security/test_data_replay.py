"""Replays on the data port: a rank's reduce connection recorded in one run and played back.

Real sockets, the real server and client: rank 0 of run A reduces through a recording proxy;
what it sent is then played to run B's server, which shares A's secret file (the case the
run-bound keys exist for), and to A's own server on a new connection (the rank's next
incarnation). Every replay is refused by name and changes nothing: B's round still averages
exactly its own ranks' uploads.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import torch

from flodl.errors import CoordinatorLost
from flodl.rank.reduce_client import ReduceClient
from flodl.service.reduce import ReduceServer
from flodl.wire.data_hello import HELLO_BYTES, check_data_ack, encode_data_hello
from flodl.wire.tensors import TensorKind, encode_tensor_frame

pytestmark = pytest.mark.timeout(60)

SECRET = b"one-secret-file-used-by-two-runs"
WAIT_S = 30.0


class Recorder:
    """A TCP proxy for one connection that keeps every byte the client sent; with
    ``swallow_frames`` it forwards the client's hello but none of its frames (they are only
    recorded)."""

    def __init__(self, upstream: int, *, swallow_frames: bool = False) -> None:
        self.upstream = upstream
        self.swallow_frames = swallow_frames
        self.sent = bytearray()
        self._listen = socket.create_server(("127.0.0.1", 0))
        self.port = self._listen.getsockname()[1]
        self._threads: list[threading.Thread] = []
        self._socks: list[socket.socket] = []
        accept = threading.Thread(target=self._accept, daemon=True)
        accept.start()
        self._threads.append(accept)

    def _accept(self) -> None:
        client, _ = self._listen.accept()
        server = socket.create_connection(("127.0.0.1", self.upstream))
        self._socks += [client, server]
        for src, dst, keep in ((client, server, True), (server, client, False)):
            t = threading.Thread(target=self._pump, args=(src, dst, keep), daemon=True)
            t.start()
            self._threads.append(t)

    def _pump(self, src: socket.socket, dst: socket.socket, keep: bool) -> None:
        with contextlib.suppress(OSError):
            while chunk := src.recv(1 << 16):
                if keep:
                    before = len(self.sent)
                    self.sent += chunk
                    if self.swallow_frames:
                        chunk = chunk[: max(0, HELLO_BYTES - before)]
                dst.sendall(chunk)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self._listen.close()
        for s in self._socks:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)  # wakes the pumps (close alone does not)
            s.close()
        for t in self._threads:
            t.join(WAIT_S)


def params(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(4, 3, generator=gen), torch.randn(5, generator=gen)]


@contextlib.contextmanager
def server(
    run_id: str, world_size: int
) -> Iterator[tuple[ReduceServer, list[tuple[int, tuple[int, ...], float]]]]:
    done: list[tuple[int, tuple[int, ...], float]] = []
    srv = ReduceServer(
        SECRET, run_id=run_id, world_size=world_size, on_done=lambda *a: done.append(a)
    )
    try:
        srv.start()
        yield srv, done
    finally:
        srv.close()


def reduce_once(
    srv: ReduceServer, port: int, run_id: str, cycle: int, tensors: list[torch.Tensor]
) -> None:
    client = ReduceClient("127.0.0.1", port, SECRET, 0, 1, run_id=run_id, timeout_s=WAIT_S)
    try:
        client.connect(10.0)
        srv.open_round(cycle, [0])
        assert client.reduce(cycle, tensors, 1.0, [], True) == (1.0, 1.0)
    finally:
        client.close()


def recorded_run_a(shared_memory: bool = False) -> bytes:
    """Everything rank 0 of run A sent on its data connection: a hello and two rounds (after
    a shared-memory offer with ``shared_memory``)."""
    with server("run-a", 1) as (srv, _):
        proxy = Recorder(srv.port)
        try:
            client = ReduceClient(
                "127.0.0.1",
                proxy.port,
                SECRET,
                0,
                1,
                run_id="run-a",
                timeout_s=WAIT_S,
                shared_memory=shared_memory,
            )
            try:
                client.connect(10.0)
                for cycle in (0, 1):
                    srv.open_round(cycle, [0])
                    assert client.reduce(cycle, params(cycle), 1.0, [], True) == (1.0, 1.0)
            finally:
                client.close()
        finally:
            proxy.close()
    assert len(proxy.sent) > HELLO_BYTES
    return bytes(proxy.sent)


def play(port: int, data: bytes) -> None:
    """Send ``data`` and wait until the server closes the connection."""
    with socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as sock:
        sock.sendall(data)
        with contextlib.suppress(ConnectionResetError, BrokenPipeError):
            assert sock.recv(1 << 16) == b""


def handshake(port: int, run_id: str) -> socket.socket:
    """A genuine hello of rank 0 of ``run_id`` (the test holds the secret), acked."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=WAIT_S)
    try:
        hello = encode_data_hello(SECRET, run_id, 0, 1)
        sock.sendall(hello)
        ack = b""
        while len(ack) < HELLO_BYTES:
            chunk = sock.recv(HELLO_BYTES - len(ack))
            assert chunk, "the server refused a genuine hello"
            ack += chunk
        check_data_ack(SECRET, run_id, hello, ack)
    except BaseException:
        sock.close()  # (a failed handshake leaves no socket for a later test's warning)
        raise
    return sock


def wait_for(condition: Callable[[], bool], what: str) -> None:
    """Poll a condition of the server's threads (there is nothing to await)."""
    for _ in range(int(WAIT_S / 0.01)):
        if condition():
            return
        time.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


def wait_refused(srv: ReduceServer, reason: str) -> None:
    wait_for(lambda: any(reason in r for r in srv.refusals.counts), f"a refusal {reason!r}")


def test_another_runs_recorded_connection_is_refused_at_its_hello() -> None:
    recorded = recorded_run_a()
    with server("run-b", 1) as (srv, done):
        play(srv.port, recorded)
        wait_refused(srv, "hello from another run")
        assert done == []
        mine = params(7)
        expected = [t.clone() for t in mine]
        reduce_once(srv, srv.port, "run-b", 0, mine)
        assert all(torch.equal(a, b) for a, b in zip(mine, expected, strict=True))
        wait_for(lambda: bool(done), "the round to end")  # on_done follows the consensus
        assert [d[:2] for d in done] == [(0, (0,))]


@pytest.mark.parametrize(
    ("shared_memory", "refusal"),
    [(False, "bad tensor frame auth tag"), (True, "bad shared-memory offer auth tag")],
    ids=["tcp", "shared-memory"],
)
def test_another_runs_frames_after_a_genuine_hello_fail_their_tag(
    shared_memory: bool, refusal: str
) -> None:
    """Even on a connection this run's hello opened, A's upload frames are not B's; on the
    shared-memory lane A's offer (keyed like its frames) is refused first."""
    frames = recorded_run_a(shared_memory)[HELLO_BYTES:]
    with server("run-b", 1) as (srv, done):
        srv.open_round(0, [0])
        with handshake(srv.port, "run-b") as sock:
            sock.sendall(frames)
            with contextlib.suppress(ConnectionResetError, BrokenPipeError):
                assert sock.recv(1 << 16) == b""
        wait_refused(srv, refusal)
        srv.rank_dead(0)
        wait_for(lambda: bool(done), "the round to end")
        assert [d[:2] for d in done] == [(0, ())]  # nothing of run A was folded


def upload_bytes(cycle: int, tensors: list[torch.Tensor]) -> int:
    """The size of one upload (PARAMS and BUFFERS frames) on the wire: keys do not change it."""
    frames = [
        encode_tensor_frame(
            tensors, kind=TensorKind.MODEL_PARAMS, weight=1.0, round=cycle, secret=b"k"
        ),
        encode_tensor_frame(
            [], kind=TensorKind.MODEL_BUFFERS, weight=1.0, round=cycle, secret=b"k"
        ),
    ]
    return sum(len(bytes(b)) for frame in frames for b in frame)


def test_a_previous_connections_upload_fails_on_the_ranks_next_connection() -> None:
    """The rank's next incarnation on the same run and server gets new keys: an upload
    recorded on its earlier connection does not authenticate on the new one, even for the
    round that is open and waits for exactly that rank."""
    with server("run-a", 1) as (srv, done):
        proxy = Recorder(srv.port, swallow_frames=True)
        client = ReduceClient(  # (TCP frames: the shared-memory offer would wait for an answer)
            "127.0.0.1", proxy.port, SECRET, 0, 1, run_id="run-a", shared_memory=False
        )
        try:
            client.connect(10.0)
            srv.open_round(5, [0])
            tensors = params(5)
            want = HELLO_BYTES + upload_bytes(5, tensors)
            lost: list[BaseException] = []

            def upload() -> None:
                try:
                    client.reduce(5, tensors, 1.0, [], True)
                except CoordinatorLost as exc:  # its connection is cut below
                    lost.append(exc)

            pending = threading.Thread(target=upload, daemon=True)
            pending.start()
            wait_for(lambda: len(proxy.sent) >= want, f"the upload to be recorded ({want} B)")
            assert len(proxy.sent) == want
        finally:
            proxy.close()  # the first incarnation's connection is gone
            client.close()
        pending.join(WAIT_S)
        assert not pending.is_alive() and len(lost) == 1
        assert srv.waiting_for(5) == (0,)  # the server never saw that upload
        # The server takes one live data connection per rank: the next incarnation's hello
        # is refused until its thread has seen the first connection's end (asynchronous).
        wait_for(lambda: 0 not in srv._by_rank, "the server to release the first connection")
        with handshake(srv.port, "run-a") as sock:
            sock.sendall(bytes(proxy.sent[HELLO_BYTES:]))
            with contextlib.suppress(ConnectionResetError, BrokenPipeError):
                assert sock.recv(1 << 16) == b""
        wait_refused(srv, "bad tensor frame auth tag")
        assert srv.waiting_for(5) == (0,) and done == []


def test_a_recorded_connection_replayed_whole_on_its_own_server_is_refused_at_its_hello() -> None:
    """The server's nonce is one per server, so a recorded hello replayed on the same server
    would get the same ack and the same upload key as the connection it was recorded on: the
    server refuses a hello nonce it has seen (docs/design.md §2, "Rejoin": nothing of an
    earlier incarnation is accepted), before any of the recorded frames is read."""
    with server("run-a", 1) as (srv, done):
        proxy = Recorder(srv.port)
        client = ReduceClient("127.0.0.1", proxy.port, SECRET, 0, 1, run_id="run-a")
        try:
            client.connect(10.0)
            srv.open_round(0, [0])
            assert client.reduce(0, params(0), 1.0, [], True) == (1.0, 1.0)
        finally:
            client.close()
            proxy.close()
        wait_for(lambda: len(done) == 1, "round 0 to end")  # on_done follows the consensus
        recorded = bytes(proxy.sent)
        srv.rank_dead(0)  # the incarnation that sent it is gone; the rank comes back
        srv.rank_rejoined(0)
        play(srv.port, recorded)  # its hello, then its round-0 upload
        wait_refused(srv, "replayed hello of rank 0")
        assert [d[0] for d in done] == [0]
        reduce_once(srv, srv.port, "run-a", 1, params(1))  # the genuine next incarnation
        wait_for(lambda: len(done) == 2, "round 1 to end")
        assert [d[0] for d in done] == [0, 1]
