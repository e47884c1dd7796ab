"""The CPU reduce server and client over real loopback sockets, ranks as threads.

Every test closes its server and clients in ``finally`` and runs under a 60 s timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import uvloop

from flodl.errors import CoordinatorLost, FrameError
from flodl.rank.reduce_client import ReduceClient
from flodl.service import reduce as reduce_module
from flodl.service.reduce import ReduceServer
from flodl.wire.data_hello import (
    HELLO_BYTES,
    DataKeys,
    check_data_ack,
    data_keys,
    encode_data_ack,
    encode_data_hello,
    run_fingerprint,
)
from flodl.wire.tensors import (
    CONSENSUS_SENDER,
    TensorKind,
    encode_tensor_frame,
    send_buffers,
    upload_sender,
)

pytestmark = pytest.mark.timeout(60)

SECRET = b"reduce-test-secret-0123456789abcdef"
RUN = "reduce-test-run"
JOIN_S = 30.0


# ---------------------------------------------------------------------- harness
@dataclass
class Done:
    """Records on_done calls (made on the server's fold thread)."""

    calls: list[tuple[int, tuple[int, ...], float]] = field(default_factory=list)
    changed: threading.Condition = field(default_factory=threading.Condition)

    def __call__(self, cycle: int, contributors: tuple[int, ...], weight: float) -> None:
        with self.changed:
            self.calls.append((cycle, contributors, weight))
            self.changed.notify_all()

    def wait(self, count: int) -> list[tuple[int, tuple[int, ...], float]]:
        """The calls once there are ``count`` (ranks get the consensus before on_done runs)."""
        with self.changed:
            assert self.changed.wait_for(lambda: len(self.calls) >= count, JOIN_S)
            return list(self.calls)


@contextlib.contextmanager
def serving(world_size: int, **kwargs: Any) -> Iterator[tuple[ReduceServer, Done]]:
    done = Done()
    server = ReduceServer(SECRET, run_id=RUN, world_size=world_size, on_done=done, **kwargs)
    try:
        server.start()
        yield server, done
    finally:
        server.close()


@contextlib.contextmanager
def clients(
    server: ReduceServer, ranks: list[int], **kwargs: Any
) -> Iterator[dict[int, ReduceClient]]:
    made: dict[int, ReduceClient] = {}
    try:
        for rank in ranks:
            client = ReduceClient(
                "127.0.0.1", server.port, SECRET, rank, server.world_size, run_id=RUN, **kwargs
            )
            made[rank] = client
            client.connect(10.0)
        yield made
    finally:
        for client in made.values():
            client.close()


class Worker(threading.Thread):
    """Runs ``fn`` on its own thread; ``result()`` joins and re-raises."""

    def __init__(self, fn: Callable[..., Any]) -> None:  # `...`: mypy infers `lambda r=r:`
        super().__init__(daemon=True)
        self.fn = fn
        self.value: Any = None
        self.error: Exception | None = None
        self.start()

    def run(self) -> None:
        try:
            self.value = self.fn()
        except Exception as exc:  # noqa: BLE001 - re-raised by result()
            self.error = exc

    def result(self) -> Any:
        self.join(JOIN_S)
        assert not self.is_alive(), "worker did not finish"
        if self.error is not None:
            raise self.error
        return self.value


def wait_until(predicate: Callable[[], bool], what: str) -> None:
    """Poll a condition of the server's threads (there is nothing to await)."""
    deadline = time.perf_counter() + JOIN_S
    while not predicate():
        assert time.perf_counter() < deadline, f"timed out waiting for {what}"
        time.sleep(0.002)


def model(
    rank: int, shapes: tuple[tuple[int, ...], ...] = ((3, 4), (7,), ())
) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + rank)
    return [torch.randn(shape, generator=gen) for shape in shapes]


def one_round(
    params: list[list[torch.Tensor]],
    wires: tuple[bool, bool],
    *,
    shared_memory: bool | tuple[bool, bool],
    **server_kwargs: Any,
) -> None:
    """Round 1 of ranks 0 and 1 (bf16 wire or not each, weights 2 and 3, shared memory offered
    by both or as given per rank) through a server of this process, the ranks as threads; their
    ``params`` become the consensus."""
    lanes = shared_memory if isinstance(shared_memory, tuple) else (shared_memory,) * 2
    made: list[ReduceClient] = []
    with serving(2, **server_kwargs) as (server, _):
        try:
            for rank, bf16 in enumerate(wires):
                client = ReduceClient(
                    "127.0.0.1",
                    server.port,
                    SECRET,
                    rank,
                    2,
                    run_id=RUN,
                    bf16_wire=bf16,
                    shared_memory=lanes[rank],
                )
                made.append(client)
                client.connect(10.0)
            server.open_round(1, [0, 1])
            workers = [
                Worker(lambda r=r: made[r].reduce(1, params[r], [2.0, 3.0][r], [], True))
                for r in range(2)
            ]
            assert [w.result() for w in workers] == [(5.0, 2.0)] * 2
            assert [c.in_shared_memory for c in made] == list(lanes)
        finally:
            for client in made:
                client.close()


def weighted_mean(models: list[list[torch.Tensor]], weights: list[float]) -> list[torch.Tensor]:
    """sum_k w_k theta_k / sum_k w_k, pre-scaled and summed in rank order in f32."""
    total = sum(weights)
    out = []
    for parts in zip(*models, strict=True):
        acc = torch.zeros_like(parts[0])
        for p, w in zip(parts, weights, strict=True):
            acc += p * w
        out.append(acc / total)
    return out


def close_all(expected: list[torch.Tensor], got: list[torch.Tensor], rtol: float = 1e-6) -> None:
    for e, g in zip(expected, got, strict=True):
        torch.testing.assert_close(g, e, rtol=rtol, atol=rtol)


def raw_rank(server: ReduceServer, rank: int) -> tuple[socket.socket, DataKeys]:
    """A hand-driven rank: connected and handshaken (its keys), nothing else."""
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    hello = encode_data_hello(SECRET, RUN, rank, server.world_size)
    sock.sendall(hello)
    ack = recv_exactly(sock, HELLO_BYTES)
    check_data_ack(SECRET, RUN, hello, ack)
    return sock, data_keys(SECRET, RUN, hello, ack)


def recv_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            break
        data += chunk
    return data


def assert_closed_by_peer(sock: socket.socket) -> None:
    sock.settimeout(JOIN_S)
    with contextlib.suppress(ConnectionResetError):
        assert sock.recv(1) == b""


# ---------------------------------------------------------------------- averaging math
def test_three_ranks_work_weighted_average_and_buffers_over_movers() -> None:
    weights = [1.0, 2.0, 0.5]
    movers = [True, False, True]
    params = [model(r) for r in range(3)]
    originals = [[p.clone() for p in ps] for ps in params]
    buffers = [[torch.full((5,), 10.0 * (r + 1)), torch.tensor(float(r))] for r in range(3)]
    with serving(3) as (server, done), clients(server, [0, 1, 2]) as cs:
        server.open_round(1, [0, 1, 2])
        ptrs = [[p.data_ptr() for p in ps] for ps in params]
        workers = [
            Worker(lambda r=r: cs[r].reduce(1, params[r], weights[r], buffers[r], movers[r]))
            for r in range(3)
        ]
        results = [w.result() for w in workers]
        assert done.wait(1) == [(1, (0, 1, 2), 3.5)]
    assert results == [(3.5, 2.0)] * 3
    expected = weighted_mean(originals, weights)
    for r in range(3):
        close_all(expected, params[r])
        assert [p.data_ptr() for p in params[r]] == ptrs[r]  # written in place
        assert all(torch.equal(a, b) for a, b in zip(params[0], params[r], strict=True))
        torch.testing.assert_close(buffers[r][0], torch.full((5,), 20.0))  # (10 + 30) / 2
        torch.testing.assert_close(buffers[r][1], torch.tensor(1.0))  # (0 + 2) / 2


def test_several_rounds_reuse_the_connection_and_stay_exact() -> None:
    params = [model(r, ((64,), (8, 8))) for r in range(2)]
    with serving(2) as (server, done), clients(server, [0, 1]) as cs:
        for cycle, weights in enumerate([[1.0, 0.0], [3.0, 1.0], [0.0, 2.0], [1.0, 1.0]]):
            before = [[p.clone() for p in ps] for ps in params]
            server.open_round(cycle, [0, 1])
            workers = [
                Worker(
                    lambda r=r, c=cycle, w=weights: cs[r].reduce(c, params[r], w[r], [], w[r] > 0)
                )
                for r in range(2)
            ]
            movers = float(sum(w > 0 for w in weights))
            assert [w.result() for w in workers] == [(sum(weights), movers)] * 2
            close_all(weighted_mean(before, weights), params[0])
            assert all(torch.equal(a, b) for a, b in zip(*params, strict=True))
        assert [c[0] for c in done.wait(4)] == [0, 1, 2, 3]


def test_elided_zeros_in_a_weighted_upload_and_f64_tensors() -> None:
    """A zero tensor rides elided; the server must not fold last round's values in its place.
    f64 tensors are accumulated and sent back in f64."""
    with serving(2) as (server, done), clients(server, [0, 1]) as cs:
        for cycle, zero_first in ((1, False), (2, True)):
            params = [
                [torch.full((4,), 1.0 + r), torch.arange(3, dtype=torch.float64) + r]
                for r in range(2)
            ]
            if zero_first:
                params[0][0].zero_()
            expected = weighted_mean([[p.clone() for p in ps] for ps in params], [1.0, 1.0])
            server.open_round(cycle, [0, 1])
            workers = [
                Worker(lambda r=r, c=cycle, ps=params: cs[r].reduce(c, ps[r], 1.0, [], True))
                for r in range(2)
            ]
            assert [w.result() for w in workers] == [(2.0, 2.0)] * 2
            assert params[0][1].dtype == torch.float64
            close_all(expected, params[0], rtol=0.0)
            close_all(expected, params[1], rtol=0.0)
        assert done.wait(2) == [(1, (0, 1), 2.0), (2, (0, 1), 2.0)]


def test_zero_weight_round_keeps_local_state() -> None:
    params = [model(r) for r in range(2)]
    buffers = [[torch.full((3,), float(r))] for r in range(2)]
    saved = [[t.clone() for t in ps + bs] for ps, bs in zip(params, buffers, strict=True)]
    with serving(2) as (server, done), clients(server, [0, 1]) as cs:
        server.open_round(4, [0, 1])
        workers = [
            Worker(lambda r=r: cs[r].reduce(4, params[r], 0.0, buffers[r], False)) for r in range(2)
        ]
        assert [w.result() for w in workers] == [(0.0, 0.0)] * 2
        assert done.wait(1) == [(4, (0, 1), 0.0)]
    for r in range(2):
        assert all(torch.equal(a, b) for a, b in zip(saved[r], params[r] + buffers[r], strict=True))


def test_round_zero_broadcasts_rank_zero_exactly() -> None:
    params = [model(r) for r in range(3)]
    buffers = [[torch.randn(4)] for _ in range(3)]
    root = [t.clone() for t in params[0] + buffers[0]]
    with serving(3) as (server, done), clients(server, [0, 1, 2], bf16_wire=True) as cs:
        server.open_round(0, [0, 1, 2])
        workers = [
            Worker(lambda r=r: cs[r].reduce(0, params[r], float(r == 0), buffers[r], r == 0))
            for r in range(3)
        ]
        assert [w.result() for w in workers] == [(1.0, 1.0)] * 3
        assert done.wait(1) == [(0, (0, 1, 2), 1.0)]
    for r in range(3):  # f32 even with bf16_wire: the initial broadcast is exact
        assert all(torch.equal(a, b) for a, b in zip(root, params[r] + buffers[r], strict=True))


def test_uploads_before_open_round_wait_for_it() -> None:
    params = [model(r) for r in range(2)]
    expected = weighted_mean([[p.clone() for p in ps] for ps in params], [1.0, 1.0])
    with serving(2) as (server, done), clients(server, [0, 1]) as cs:
        workers = [Worker(lambda r=r: cs[r].reduce(7, params[r], 1.0, [], True)) for r in range(2)]
        wait_until(lambda: server.uploads(7) == (0, 1), "both uploads")
        assert server.waiting_for(7) is None  # not open yet
        assert all(w.is_alive() for w in workers)
        server.open_round(7, [0, 1])
        assert [w.result() for w in workers] == [(2.0, 2.0)] * 2
        assert done.wait(1) == [(7, (0, 1), 2.0)]
    close_all(expected, params[1])


# ---------------------------------------------------------------------- deaths
def test_dead_rank_that_never_uploads_does_not_block() -> None:
    params = [model(r) for r in range(3)]
    expected = weighted_mean([[p.clone() for p in ps] for ps in params[:2]], [1.0, 3.0])
    with serving(3) as (server, done), clients(server, [0, 1, 2]) as cs:
        server.open_round(2, [0, 1, 2])
        workers = [
            Worker(lambda r=r: cs[r].reduce(2, params[r], [1.0, 3.0][r], [], True))
            for r in range(2)
        ]
        wait_until(lambda: server.waiting_for(2) == (2,), "ranks 0 and 1 to upload")
        assert not done.calls and all(w.is_alive() for w in workers)
        server.rank_dead(2)
        assert [w.result() for w in workers] == [(4.0, 2.0)] * 2
        with pytest.raises(CoordinatorLost):  # its data connection was closed
            cs[2].reduce(2, params[2], 1.0, [], True)
        assert done.wait(1) == [(2, (0, 1), 4.0)]
    close_all(expected, params[0])


def test_rank_dead_after_upload_is_not_folded_in() -> None:
    params = [model(r) for r in range(3)]
    weights = [1.0, 2.0, 100.0]
    expected = weighted_mean([[p.clone() for p in ps] for ps in params[:2]], weights[:2])
    with serving(3) as (server, done), clients(server, [0, 1, 2]) as cs:
        server.open_round(3, [0, 1, 2])
        early = {
            r: Worker(lambda r=r: cs[r].reduce(3, params[r], weights[r], [], True)) for r in (0, 2)
        }
        wait_until(lambda: server.waiting_for(3) == (1,), "ranks 0 and 2 to upload")
        assert server.uploads(3) == (0, 2)
        server.rank_dead(2)
        assert server.waiting_for(3) == (1,)
        assert server.uploads(3) == (0,)
        late = Worker(lambda: cs[1].reduce(3, params[1], weights[1], [], False))
        assert early[0].result() == (3.0, 1.0)
        assert late.result() == (3.0, 1.0)
        with pytest.raises(CoordinatorLost):
            early[2].result()
        assert done.wait(1) == [(3, (0, 1), 3.0)]
    close_all(expected, params[0])
    close_all(expected, params[1])


def test_every_rank_dead_completes_the_round_empty() -> None:
    with serving(2) as (server, done):
        server.open_round(1, [0, 1])
        server.rank_dead(0)
        server.rank_dead(1)
        assert done.wait(1) == [(1, (), 0.0)]
        server.open_round(2, [0, 1])  # dead ranks are dropped from later rounds at once
        assert done.wait(2) == [(1, (), 0.0), (2, (), 0.0)]


def test_dead_rank_cannot_reconnect() -> None:
    with serving(2) as (server, _):
        server.rank_dead(1)
        client = ReduceClient("127.0.0.1", server.port, SECRET, 1, 2, run_id=RUN)
        try:
            with pytest.raises(CoordinatorLost, match="refused"):
                client.connect(5.0)
        finally:
            client.close()


def test_a_rejoined_rank_is_served_again_and_nothing_of_its_old_incarnation_counts() -> None:
    """docs/design.md §2, "Rejoin": the old incarnation's connection was shut at its death;
    after rank_rejoined the new one connects, uploads at weight 0 and gets the consensus, and
    the old incarnation's frames (replayed under its old keys) count for nothing."""
    params = [model(r) for r in range(3)]
    with serving(3) as (server, done), clients(server, [0, 1]) as cs:
        old_sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
        old_hello = encode_data_hello(SECRET, RUN, 2, 3)
        old_sock.sendall(old_hello)
        old_ack = recv_exactly(old_sock, HELLO_BYTES)
        old_keys = data_keys(SECRET, RUN, old_hello, old_ack)
        server.rank_dead(2)
        assert_closed_by_peer(old_sock)  # shut at its death
        old_sock.close()
        server.rank_rejoined(2)
        server.open_round(5, [0, 1, 2])
        # The old incarnation's hello replayed (it would get the same ack, hence the same
        # upload key): refused at the hello, before any of its recorded frames is read.
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as replay:
            replay.sendall(old_hello)
            send_buffers(replay, frames(old_keys, 5, model(2)))
            assert recv_exactly(replay, HELLO_BYTES) == b""  # no ack: closed
        wait_until(
            lambda: any("replayed hello of rank 2" in r for r in server.refusals.counts),
            "the replayed hello to be refused",
        )
        assert server.uploads(5) == ()
        with clients(server, [2]) as new:
            fresh = [p.clone() for p in params[2]]
            workers = [
                Worker(lambda r=r: cs[r].reduce(5, params[r], [1.0, 3.0][r], [], True))
                for r in range(2)
            ]
            joiner = Worker(lambda: new[2].reduce(5, fresh, 0.0, [], False))
            assert [w.result() for w in workers] == [(4.0, 2.0)] * 2
            assert joiner.result() == (4.0, 2.0)
            assert done.wait(1) == [(5, (0, 1, 2), 4.0)]
    close_all(params[0], fresh)  # the rejoined rank holds the consensus


# ---------------------------------------------------------------------- bf16 wire
def test_bf16_wire_within_bf16_tolerance() -> None:
    params = [model(r, ((256,), (16, 16))) for r in range(2)]
    buffers = [[torch.randn(32)] for _ in range(2)]
    expected = weighted_mean([[p.clone() for p in ps] for ps in params], [2.0, 1.0])
    expected_buffers = (buffers[0][0] + buffers[1][0]) / 2
    with serving(2) as (server, _), clients(server, [0, 1], bf16_wire=True) as cs:
        server.open_round(5, [0, 1])
        workers = [
            Worker(lambda r=r: cs[r].reduce(5, params[r], [2.0, 1.0][r], buffers[r], True))
            for r in range(2)
        ]
        assert [w.result() for w in workers] == [(3.0, 2.0)] * 2
    for r in range(2):
        assert all(p.dtype == torch.float32 for p in params[r])
        close_all(expected, params[r], rtol=2e-2)
        torch.testing.assert_close(buffers[r][0], expected_buffers, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("shared_memory", [False, True], ids=["tcp", "shared-memory"])
def test_mixed_wire_dtypes_accumulate_in_f32_and_reply_in_kind(shared_memory: bool) -> None:
    """A bf16-wire rank's upload is rounded to bf16 and its consensus rounded through bf16, on
    both lanes alike (shared memory carries the same values as TCP, in half the bytes); an
    f32-wire rank of the same round gets the f32 consensus."""
    params = [model(r, ((300,),)) for r in range(2)]
    narrowed = (params[1][0] * 3.0).bfloat16().float()
    uploads = [params[0][0] * 2.0, narrowed]
    accumulated = (uploads[0] + uploads[1]) / 5.0  # what the server holds, in f32
    one_round(params, (False, True), shared_memory=shared_memory)
    torch.testing.assert_close(params[0][0], accumulated, rtol=1e-6, atol=1e-6)  # f32 reply
    assert torch.equal(params[1][0], accumulated.bfloat16().float())  # bf16 reply


# ---------------------------------------------------------------------- bad peers
def test_bad_hello_tag_is_rejected_and_others_still_served() -> None:
    with serving(2) as (server, done):
        intruder = socket.create_connection(("127.0.0.1", server.port), timeout=10)
        with intruder:
            intruder.sendall(encode_data_hello(b"wrong-secret", RUN, 0, 2))
            assert_closed_by_peer(intruder)
        wrong = ReduceClient("127.0.0.1", server.port, b"wrong-secret", 1, 2, run_id=RUN)
        try:
            with pytest.raises(CoordinatorLost, match="refused"):
                wrong.connect(5.0)
        finally:
            wrong.close()
        params = [model(r) for r in range(2)]
        with clients(server, [0, 1]) as cs:
            server.open_round(1, [0, 1])
            workers = [
                Worker(lambda r=r: cs[r].reduce(1, params[r], 1.0, [], True)) for r in range(2)
            ]
            assert [w.result() for w in workers] == [(2.0, 2.0)] * 2
        assert done.wait(1) == [(1, (0, 1), 2.0)]


@pytest.mark.parametrize(
    ("hello", "why"),
    [
        (lambda: encode_data_hello(SECRET, RUN, 0, 3), "world size"),
        (lambda: b"\x00" * HELLO_BYTES, "magic"),
        (lambda: encode_data_hello(SECRET, RUN, 0, 2)[:-1], "short hello"),
        (lambda: encode_data_hello(SECRET, "another-run", 0, 2), "another run"),
    ],
)
def test_bad_hello_is_refused(hello: Callable[[], bytes], why: str) -> None:
    with serving(2) as (server, _):
        sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
        with sock:
            sock.sendall(hello())
            if why == "short hello":
                sock.shutdown(socket.SHUT_WR)
            assert_closed_by_peer(sock)


def test_a_trickled_hello_is_cut_at_the_handshake_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    """One deadline covers the whole hello: a peer that sends it a byte at a time, each byte
    well within the deadline, is closed before its hello is complete (a slowloris cannot hold
    one of the few connection slots), and the refusal is counted with its reason."""
    monkeypatch.setattr(reduce_module, "HANDSHAKE_TIMEOUT_S", 0.5)
    hello = encode_data_hello(SECRET, RUN, 0, 2)  # a valid hello: only its pace is wrong
    with serving(2) as (server, _):
        sock = socket.create_connection(("127.0.0.1", server.port), timeout=JOIN_S)
        with sock:
            sock.settimeout(0.1)  # the pause between two bytes
            sent, closed = 0, False
            while sent < len(hello) and not closed:
                try:
                    sock.sendall(hello[sent : sent + 1])
                    sent += 1
                    closed = sock.recv(HELLO_BYTES) == b""
                except TimeoutError:
                    pass  # not closed yet: next byte
                except OSError:  # reset, or the write after the server's close
                    closed = True
            assert closed, "the whole hello went through a byte at a time"
        assert sent < len(hello)
        reason = "no hello within 0.5 s"
        wait_until(lambda: server.refusals.counts[reason] == 1, "the counted refusal")
        assert dict(server.refusals.counts) == {reason: 1}


def test_duplicate_live_rank_is_refused() -> None:
    with serving(2) as (server, _), clients(server, [0]):
        second = ReduceClient("127.0.0.1", server.port, SECRET, 0, 2, run_id=RUN)
        try:
            with pytest.raises(CoordinatorLost, match="refused"):
                second.connect(5.0)
        finally:
            second.close()


def test_garbage_frame_closes_only_that_connection() -> None:
    params = [model(r) for r in range(3)]
    with serving(3) as (server, done), clients(server, [0, 1]) as cs:
        bad, _ = raw_rank(server, 2)
        with bad:
            server.open_round(1, [0, 1, 2])
            bad.sendall(b"\xde\xad\xbe\xef" * 64)
            assert_closed_by_peer(bad)
        workers = [Worker(lambda r=r: cs[r].reduce(1, params[r], 1.0, [], True)) for r in range(2)]
        wait_until(lambda: server.waiting_for(1) == (2,), "ranks 0 and 1 to upload")
        assert all(w.is_alive() for w in workers)  # the round waits for the coordinator
        server.rank_dead(2)
        assert [w.result() for w in workers] == [(2.0, 2.0)] * 2
        server.open_round(2, [0, 1])  # and the server keeps serving
        workers = [Worker(lambda r=r: cs[r].reduce(2, params[r], 1.0, [], True)) for r in range(2)]
        assert [w.result() for w in workers] == [(2.0, 2.0)] * 2
        assert done.wait(2) == [(1, (0, 1), 2.0), (2, (0, 1), 2.0)]


def frames(
    keys: DataKeys, cycle: int, tensors: list[torch.Tensor], weight: float = 1.0
) -> list[Any]:
    """A rank's upload (PARAMS then BUFFERS) keyed to the connection ``keys`` belong to."""
    up = encode_tensor_frame(
        tensors,
        kind=TensorKind.MODEL_PARAMS,
        weight=weight,
        round=cycle,
        secret=keys.upload,
        sender=upload_sender(2),
    )
    down = encode_tensor_frame(
        [],
        kind=TensorKind.MODEL_BUFFERS,
        weight=1.0,
        round=cycle,
        secret=keys.upload,
        sender=upload_sender(2),
    )
    return [*up, *down]


def params_frame(key: bytes, sender: bytes, kind: TensorKind = TensorKind.MODEL_PARAMS) -> Any:
    return encode_tensor_frame(model(2), kind=kind, weight=1.0, round=1, secret=key, sender=sender)


@pytest.mark.parametrize(
    ("make", "why"),
    [
        (lambda k: frames(k, 0, model(2)), "stale round"),
        (lambda k: frames(k, 1, model(2, ((3, 4), (7,)))), "layout unlike the model's"),
        (lambda k: frames(k, 1, [t.double() for t in model(2)]), "dtype unlike the model's"),
        (
            lambda k: params_frame(k.upload, upload_sender(2), TensorKind.MODEL_BUFFERS),
            "BUFFERS where PARAMS are due",
        ),
        (lambda k: params_frame(b"other", upload_sender(2)), "bad frame tag"),
        (lambda k: params_frame(SECRET, upload_sender(2)), "keyed with the bare run secret"),
        (
            lambda k: params_frame(k.upload, upload_sender(0)),
            "rank 0's upload replayed on rank 2's connection",
        ),
        (
            lambda k: params_frame(k.upload, CONSENSUS_SENDER),
            "a consensus frame reflected back as an upload",
        ),
        (
            lambda k: params_frame(k.consensus, CONSENSUS_SENDER),
            "the server's own consensus replayed to it",
        ),
    ],
)
def test_bad_upload_closes_only_that_connection(
    make: Callable[[DataKeys], list[Any]], why: str
) -> None:
    params = [model(r) for r in range(3)]
    with serving(3) as (server, done), clients(server, [0, 1]) as cs:
        server.open_round(0, [0, 1])  # teaches the server the model layout
        workers = [Worker(lambda r=r: cs[r].reduce(0, params[r], 1.0, [], True)) for r in range(2)]
        assert [w.result() for w in workers] == [(2.0, 2.0)] * 2
        server.open_round(1, [0, 1, 2])
        bad, keys = raw_rank(server, 2)
        with bad:
            send_buffers(bad, make(keys))
            assert_closed_by_peer(bad)
        server.rank_dead(2)
        workers = [Worker(lambda r=r: cs[r].reduce(1, params[r], 1.0, [], True)) for r in range(2)]
        assert [w.result() for w in workers] == [(2.0, 2.0)] * 2
        assert done.wait(2) == [(0, (0, 1), 2.0), (1, (0, 1), 2.0)]


def test_raw_upload_tagged_as_its_own_rank_is_accepted() -> None:
    """The control of the replay cases above: the same frames, keyed to rank 2's connection,
    go through."""
    params = [model(r) for r in range(2)]
    with serving(3) as (server, done), clients(server, [0, 1]) as cs:
        server.open_round(0, [0, 1])
        workers = [Worker(lambda r=r: cs[r].reduce(0, params[r], 1.0, [], True)) for r in range(2)]
        assert [w.result() for w in workers] == [(2.0, 2.0)] * 2
        server.open_round(1, [0, 1, 2])
        raw, keys = raw_rank(server, 2)
        with raw:
            send_buffers(raw, frames(keys, 1, model(2)))
            workers = [
                Worker(lambda r=r: cs[r].reduce(1, params[r], 1.0, [], True)) for r in range(2)
            ]
            assert [w.result() for w in workers] == [(3.0, 3.0)] * 2
            assert done.wait(2) == [(0, (0, 1), 2.0), (1, (0, 1, 2), 3.0)]


def test_stalled_upload_times_out_and_closes() -> None:
    with serving(2, read_timeout_s=0.3) as (server, _):
        bad, keys = raw_rank(server, 1)
        with bad:
            buffers = frames(keys, 1, model(1))
            bad.sendall(b"".join(bytes(b) for b in buffers)[:40])  # header and a bit: then silence
            assert_closed_by_peer(bad)


def test_idle_connection_between_rounds_has_no_deadline() -> None:
    params = [model(r) for r in range(2)]
    with serving(2, read_timeout_s=0.2) as (server, _), clients(server, [0, 1]) as cs:
        time.sleep(0.5)  # longer than the read deadline: a long training window
        server.open_round(1, [0, 1])
        workers = [Worker(lambda r=r: cs[r].reduce(1, params[r], 1.0, [], True)) for r in range(2)]
        assert [w.result() for w in workers] == [(2.0, 2.0)] * 2


def test_upload_to_a_round_that_does_not_expect_the_rank_closes_it() -> None:
    params = [model(r) for r in range(2)]
    with serving(2) as (server, done), clients(server, [0, 1]) as cs:
        server.open_round(1, [0])
        outsider = Worker(lambda: cs[1].reduce(1, params[1], 1.0, [], True))
        with pytest.raises(CoordinatorLost):
            outsider.result()
        assert Worker(lambda: cs[0].reduce(1, params[0], 1.0, [], True)).result() == (1.0, 1.0)
        assert done.wait(1) == [(1, (0,), 1.0)]


# ---------------------------------------------------------------------- client side
def test_client_raises_coordinator_lost_on_timeout_and_on_server_close() -> None:
    params = model(0)
    with serving(2) as (server, _):
        server.open_round(1, [0, 1])
        slow = ReduceClient("127.0.0.1", server.port, SECRET, 0, 2, run_id=RUN, timeout_s=0.3)
        try:
            slow.connect(5.0)
            with pytest.raises(CoordinatorLost, match="timed out"):
                slow.reduce(1, params, 1.0, [], True)  # rank 1 never uploads
        finally:
            slow.close()
    with serving(2) as (server, _), clients(server, [0]) as cs:
        server.open_round(1, [0, 1])
        pending = Worker(lambda: cs[0].reduce(1, params, 1.0, [], True))
        wait_until(lambda: server.waiting_for(1) == (1,), "rank 0 to upload")
        server.close()
        with pytest.raises(CoordinatorLost):
            pending.result()


def test_client_connect_gives_up_when_nobody_listens() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    client = ReduceClient("127.0.0.1", port, SECRET, 0, 1, run_id=RUN)
    try:
        with pytest.raises(CoordinatorLost, match="unreachable"):
            client.connect(0.6)
    finally:
        client.close()


def test_client_does_not_touch_params_before_the_consensus() -> None:
    params = model(0)
    snapshot = [p.clone() for p in params]
    with serving(2) as (server, _), clients(server, [0, 1]) as cs:
        server.open_round(1, [0, 1])
        first = Worker(lambda: cs[0].reduce(1, params, 3.0, [], True))
        wait_until(lambda: server.waiting_for(1) == (1,), "rank 0 to upload")
        assert all(torch.equal(a, b) for a, b in zip(snapshot, params, strict=True))
        other = model(1)
        Worker(lambda: cs[1].reduce(1, other, 1.0, [], True)).result()
        assert first.result() == (4.0, 2.0)


# ---------------------------------------------------------------------- lifecycle
def test_close_leaves_no_threads_and_is_idempotent() -> None:
    before = set(threading.enumerate())
    params = [model(r) for r in range(3)]
    with serving(3) as (server, _), clients(server, [0, 1, 2]) as cs:
        server.open_round(1, [0, 1, 2])
        workers = [Worker(lambda r=r: cs[r].reduce(1, params[r], 1.0, [], True)) for r in range(3)]
        assert [w.result() for w in workers] == [(3.0, 3.0)] * 3
        server.open_round(2, [0, 1, 2])
        pending = Worker(lambda: cs[0].reduce(2, params[0], 1.0, [], True))
        wait_until(lambda: server.waiting_for(2) == (1, 2), "rank 0 to upload")
        # and a connection stuck in its handshake
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as lingering:
            lingering.sendall(b"\xf1")
            server.close()
            server.close()
            assert_closed_by_peer(lingering)
        with pytest.raises(CoordinatorLost):
            pending.result()
    leftover = [t for t in threading.enumerate() if t not in before and t.is_alive()]
    assert leftover == []


def test_close_from_on_done_does_not_deadlock() -> None:
    before = set(threading.enumerate())
    closed = threading.Event()

    def on_done(cycle: int, contributors: tuple[int, ...], weight: float) -> None:
        server.close()
        closed.set()

    server = ReduceServer(SECRET, run_id=RUN, world_size=1, on_done=on_done)
    try:
        server.start()
        server.open_round(1, [])
        assert closed.wait(JOIN_S)
    finally:
        server.close()
    assert [t for t in threading.enumerate() if t not in before and t.is_alive()] == []


def test_context_manager_and_start_twice() -> None:
    done = Done()
    with ReduceServer(SECRET, run_id=RUN, world_size=1, on_done=done) as server:
        server.start()
        with pytest.raises(Exception, match="twice"):
            server.start()


# ---------------------------------------------------------------------- the event loop
@pytest.mark.uvloop
async def test_event_loop_keeps_running_during_a_256_mib_round() -> None:
    """A 1 ms ticker task on uvloop in this thread (the coordinator's loop) keeps ticking while
    the server receives, folds and sends a 256 MiB model (world 2, ranks as threads of this
    process): the round runs on the server's and the ranks' threads, never on this loop. How late
    the ticks are (p99 < 50 ms) is a figure: ``python benchmarks/bench_reduce.py --lag-only``."""
    assert isinstance(asyncio.get_running_loop(), uvloop.Loop)
    numel = 256 * (1 << 20) // 4 // 4
    params = [[torch.full((numel,), float(r + 1)) for _ in range(4)] for r in range(2)]
    ticks = 0
    with (  # over TCP: the heavier path (the shared-memory lane is a lighter load on the loop)
        serving(2, max_frame_bytes=600 << 20) as (server, done),
        clients(server, [0, 1], shared_memory=False) as cs,
    ):
        server.open_round(1, [0, 1])
        workers = [
            Worker(lambda r=r: cs[r].reduce(1, params[r], float(r + 1), [], True)) for r in range(2)
        ]
        while any(w.is_alive() for w in workers):
            await asyncio.sleep(0.001)
            ticks += 1
        assert [w.result() for w in workers] == [(3.0, 2.0)] * 2
        assert done.wait(1) == [(1, (0, 1), 3.0)]
    assert torch.allclose(params[0][0][:10], torch.full((10,), 5.0 / 3.0))
    # the loop ticked throughout the round: a loop held by the round would tick once or twice
    assert ticks >= 20, f"the event loop ticked {ticks} times during the round"


def test_hello_layout_and_keys() -> None:
    nonce, server_nonce = bytes(range(16)), bytes(range(16, 32))
    hello = encode_data_hello(SECRET, RUN, 3, 8, nonce)
    assert len(hello) == HELLO_BYTES == 53
    assert struct.unpack("!IBII", hello[:13]) == (0xF10D17C0, 3, 3, 8)
    assert hello[13:21] == run_fingerprint(RUN) and hello[21:37] == nonce
    ack = encode_data_ack(SECRET, RUN, hello, server_nonce)
    assert struct.unpack("!IBII", ack[:13]) == (0xF10D17C1, 3, 3, 8)
    assert ack[21:37] == server_nonce
    check_data_ack(SECRET, RUN, hello, ack)
    with pytest.raises(FrameError, match="tag"):
        check_data_ack(SECRET, RUN, hello, encode_data_ack(b"other", RUN, hello, server_nonce))
    other = encode_data_hello(SECRET, RUN, 2, 8)
    with pytest.raises(FrameError, match="tag"):  # an ack for another hello
        check_data_ack(SECRET, RUN, hello, encode_data_ack(SECRET, RUN, other, server_nonce))
    with pytest.raises(FrameError, match="magic"):
        check_data_ack(SECRET, RUN, hello, hello)
    with pytest.raises(FrameError, match="another run"):
        check_data_ack(SECRET, RUN, hello, encode_data_ack(SECRET, "b", hello, server_nonce))
    keys = data_keys(SECRET, RUN, hello, ack)
    # every input of the upload key changes it: the run, the rank, either nonce
    assert keys.upload != keys.consensus
    for run, rank, n1, n2 in (
        ("b", 3, nonce, server_nonce),
        (RUN, 2, nonce, server_nonce),
        (RUN, 3, server_nonce, server_nonce),
        (RUN, 3, nonce, nonce),
    ):
        h = encode_data_hello(SECRET, run, rank, 8, n1)
        other_keys = data_keys(SECRET, run, h, encode_data_ack(SECRET, run, h, n2))
        assert other_keys.upload != keys.upload
        assert (other_keys.consensus == keys.consensus) == (run == RUN and n2 == server_nonce)
    # fresh nonces by default: two hellos of one rank never agree the same keys
    assert encode_data_hello(SECRET, RUN, 3, 8) != encode_data_hello(SECRET, RUN, 3, 8)


def test_the_broadcast_round_keeps_the_lowest_live_ranks_state() -> None:
    """The initial broadcast survives rank 0 dying first: rank 1's state goes to everyone."""
    params = [model(r, ((16,), (4, 4))) for r in range(3)]
    rank1 = [p.clone() for p in params[1]]
    with serving(3) as (server, done), clients(server, [1, 2]) as cs:
        server.broadcast_round = 0
        server.open_round(0, [0, 1, 2])
        server.rank_dead(0)  # rank 0 died before it uploaded
        workers = [Worker(lambda r=r: cs[r].reduce(0, params[r], 1.0, [], True)) for r in (1, 2)]
        assert [w.result() for w in workers] == [(1.0, 1.0)] * 2
        for r in (1, 2):
            assert all(torch.equal(a, b) for a, b in zip(params[r], rank1, strict=True))
        assert [c[1] for c in done.wait(1)] == [(1, 2)]
