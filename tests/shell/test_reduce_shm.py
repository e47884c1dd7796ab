"""The reduce server's shared-memory lane (docs/design.md §7): rank processes on the server's
host average through memory, with the same consensus as TCP; offers that name the wrong
memory are declined, bad frames refused, a slot rewritten under a reader is an error.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from test_reduce import (
    JOIN_S,
    RUN,
    SECRET,
    Worker,
    assert_closed_by_peer,
    clients,
    close_all,
    model,
    one_round,
    raw_rank,
    recv_exactly,
    serving,
    wait_until,
    weighted_mean,
)

from flodl.errors import CoordinatorLost
from flodl.outer import SlowMomentum
from flodl.rank.reduce_shm import LocalLane
from flodl.service.reduce_fold import FOLD_CHUNK_ELEMENTS
from flodl.wire.shm import (
    ANSWER_BYTES,
    PROBE_BYTES,
    Answer,
    encode_offer,
    parse_answer,
)
from flodl.wire.shm_segment import Segment, available
from flodl.wire.tensors import FLAG_SHM, TensorKind, encode_frame_parts, frame_tag, upload_sender

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(available() is not None, reason=f"no shared memory: {available()}"),
]

RANK_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    from flodl.rank.reduce_client import ReduceClient
    port, rank, world, shm, bf16, out, device = sys.argv[1:]
    rank, world = int(rank), int(world)
    gen = torch.Generator().manual_seed(1000 + rank)
    params = [torch.randn(64, 33, generator=gen), torch.randn(17, generator=gen),
              torch.randn(CHUNK + 3, generator=gen)]  # a fold and a rounding in pieces
    buffers = [torch.randn(5, generator=gen)]
    params, buffers = [p.to(device) for p in params], [b.to(device) for b in buffers]
    client = ReduceClient("127.0.0.1", int(port), SECRET, rank, world, run_id=RUN,
                          bf16_wire=bf16 == "1", shared_memory=shm == "1", timeout_s=60)
    client.connect(30.0)
    try:
        for cycle in (1, 2, 3):
            params[0].mul_(1.5).add_(rank)  # "training" between rounds
            client.reduce(cycle, params, float(rank + cycle), buffers, True)
        torch.save({"params": params, "buffers": buffers, "shm": client.in_shared_memory}, out)
    finally:
        client.close()
    """
)


def run_ranks(
    tmp: Path, world: int, *, shm: bool, bf16: bool = False, device: str = "cpu"
) -> list[dict[str, Any]]:
    """``world`` rank processes through a server of this process, three rounds, their model on
    ``device`` (``tests/gpu`` runs them on CUDA)."""
    script = f"SECRET = {SECRET!r}\nRUN = {RUN!r}\nCHUNK = {FOLD_CHUNK_ELEMENTS}\n" + RANK_SCRIPT
    outs = [tmp / f"rank{r}-{shm}-{bf16}.pt" for r in range(world)]
    with serving(world) as (server, done):
        for cycle in (1, 2, 3):
            server.open_round(cycle, range(world))
        procs = [
            subprocess.Popen(
                [
                    *(sys.executable, "-c", script, str(server.port), str(r), str(world)),
                    *("1" if shm else "0", "1" if bf16 else "0", str(outs[r]), device),
                ],
                env={**os.environ, "PYTHONWARNINGS": "ignore"},
            )
            for r in range(world)
        ]
        try:
            assert [p.wait(100) for p in procs] == [0] * world
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        assert [c[0] for c in done.wait(3)] == [1, 2, 3]
    return [torch.load(o, map_location="cpu") for o in outs]


def expected_params(world: int, *, bf16: bool = False) -> list[torch.Tensor]:
    """The rank script's parameters after its three rounds, computed here the way the server
    folds (each upload scaled by its weight, summed in rank order, divided by the total)."""
    gens = [torch.Generator().manual_seed(1000 + r) for r in range(world)]
    params = [
        [
            torch.randn(64, 33, generator=g),
            torch.randn(17, generator=g),
            torch.randn(FOLD_CHUNK_ELEMENTS + 3, generator=g),
        ]
        for g in gens
    ]
    for cycle in (1, 2, 3):
        weights = [float(r + cycle) for r in range(world)]
        for r in range(world):
            params[r][0].mul_(1.5).add_(r)
        consensus = []
        for i in range(3):
            ups = [torch.mul(params[r][i], weights[r]) for r in range(world)]
            if bf16:
                ups = [u.bfloat16().float() for u in ups]
            acc = ups[0] + ups[1]
            for u in ups[2:]:
                acc.add_(u)
            acc.div_(sum(weights))
            consensus.append(acc.bfloat16().float() if bf16 else acc)
        params = [[c.clone() for c in consensus] for _ in range(world)]
    return params[0]


def test_rank_processes_average_through_memory_exactly_as_over_tcp(tmp_path: Path) -> None:
    tcp = run_ranks(tmp_path, 3, shm=False)
    shm = run_ranks(tmp_path, 3, shm=True)
    assert [r["shm"] for r in tcp] == [False] * 3
    assert [r["shm"] for r in shm] == [True] * 3  # separate processes, through /proc/<pid>/fd
    for a, b in zip(tcp, shm, strict=True):  # the same f32 arithmetic, bit for bit
        assert all(torch.equal(x, y) for x, y in zip(a["params"], b["params"], strict=True))
        assert all(torch.equal(x, y) for x, y in zip(a["buffers"], b["buffers"], strict=True))
    first = shm[0]["params"]
    assert all(torch.equal(x, y) for r in shm[1:] for x, y in zip(first, r["params"], strict=True))
    # and that arithmetic is the plain weighted mean (the fold's pieces change nothing)
    assert all(torch.equal(x, y) for x, y in zip(first, expected_params(3), strict=True))


def test_bf16_wire_through_memory_carries_what_tcp_carries(tmp_path: Path) -> None:
    shm = run_ranks(tmp_path, 2, shm=True, bf16=True)
    tcp = run_ranks(tmp_path, 2, shm=False, bf16=True)
    for r in shm:
        assert r["shm"]
        for p in r["params"]:  # every value is a bf16 value: the consensus was rounded
            assert torch.equal(p, p.bfloat16().float())
    assert all(torch.equal(x, y) for x, y in zip(shm[0]["params"], shm[1]["params"], strict=True))
    # uploads narrowed to bf16 on both lanes: the same consensus, bit for bit
    for a, b in zip(shm, tcp, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a["params"], b["params"], strict=True))
    expected = expected_params(2, bf16=True)
    assert all(torch.equal(x, y) for x, y in zip(shm[0]["params"], expected, strict=True))


def test_a_server_without_the_lane_declines_and_the_rank_keeps_tcp() -> None:
    params = [model(r) for r in range(2)]
    expected = weighted_mean([[p.clone() for p in ps] for ps in params], [1.0, 2.0])
    with serving(2, shared_memory=False) as (server, _), clients(server, [0, 1]) as cs:
        server.open_round(1, [0, 1])
        workers = [
            Worker(lambda r=r: cs[r].reduce(1, params[r], [1.0, 2.0][r], [], True))
            for r in range(2)
        ]
        assert [w.result() for w in workers] == [(3.0, 2.0)] * 2
        assert [c.in_shared_memory for c in cs.values()] == [False, False]
    for r in range(2):
        for e, g in zip(expected, params[r], strict=True):
            torch.testing.assert_close(g, e)


def test_an_offer_naming_other_memory_is_declined_and_the_connection_goes_on() -> None:
    with serving(1) as (server, _), Segment.create(4096, "test") as seg:
        sock, keys = raw_rank(server, 0)
        with sock:
            for pid, fd, size, probe in (
                (os.getpid(), seg.fd, seg.size, bytes(PROBE_BYTES)),  # another probe
                (os.getpid(), seg.fd, seg.size + 64, seg.probe),  # another size
                (os.getpid(), 999_999, seg.size, seg.probe),  # no such descriptor
            ):
                offer = encode_offer(keys.upload, pid, fd, size, probe)
                sock.sendall(offer)
                answer = parse_answer(keys.upload, offer, recv_exactly(sock, ANSWER_BYTES))
                assert not answer.accepted
                # (a declined offer leaves the connection able to offer again)
                server_conn = server._by_rank[0]  # (the server's view of it)
                assert server_conn.shm is None and not server_conn.closed
            offer = encode_offer(b"another key", os.getpid(), seg.fd, seg.size, seg.probe)
            sock.sendall(offer)
            assert_closed_by_peer(sock)
        wait_until(
            lambda: server.refusals.counts["bad shared-memory offer auth tag"] == 1,
            "the bad offer's refusal",
        )


def test_a_shared_memory_frame_without_a_segment_is_refused() -> None:
    with serving(1) as (server, _):
        sock, keys = raw_rank(server, 0)
        with sock:
            server.open_round(1, [0])
            head, _ = encode_frame_parts(
                [torch.ones(3)],
                kind=TensorKind.MODEL_PARAMS,
                weight=1.0,
                round=1,
                elide_zeros=False,
                flags=FLAG_SHM,
            )
            sock.sendall(head + frame_tag(keys.upload, head, [], sender=upload_sender(0)))
            assert_closed_by_peer(sock)
        reason = "a shared-memory frame on a connection without a segment"
        wait_until(lambda: server.refusals.counts[reason] == 1, "the refusal")


def test_a_slot_rewritten_under_its_reader_is_an_error_not_a_mix() -> None:
    params, buffers = [torch.ones(4, 4)], [torch.zeros(2)]
    lane = LocalLane(params, buffers)
    try:
        size = lane.consensus_layout.nbytes
        with Segment.create(size, "test-consensus") as cons:
            stamps = cons.data[PROBE_BYTES : PROBE_BYTES + 16].view(torch.int64)
            lane.accept(Answer(True, cons.pid, cons.fd, cons.size, cons.probe))
            stamps[1] = 7
            lane.check_stamp(1, 7)
            stamps[1] = 9  # the server folded two rounds on while this rank copied
            with pytest.raises(CoordinatorLost, match="slot 1 holds round 9 while reading round 7"):
                lane.check_stamp(1, 7)
            with pytest.raises(OSError, match="bytes, this model needs"):
                LocalLane(params, buffers).accept(Answer(True, cons.pid, cons.fd, 64, cons.probe))
    finally:
        lane.close()


def mappings(name: str, perms: str) -> int:
    """How many mappings of memfd ``name`` with permissions ``perms`` this process has."""
    with open("/proc/self/maps") as maps:
        return sum(1 for line in maps if f"/memfd:{name} " in line and line.split()[1] == perms)


def test_a_closed_segment_stays_mapped_while_a_tensor_views_it() -> None:
    seg = Segment.create(1 << 16, "test-viewed")
    view = seg.data[4096:8192].view(torch.int32)
    view.fill_(7)
    seg.close()
    seg.close()  # idempotent
    assert mappings("test-viewed", "rw-s") == 1, "close unmapped pages a tensor still views"
    assert int(view.sum()) == 7 * 1024
    del view
    assert mappings("test-viewed", "rw-s") == 0, "the last view freed, the mapping stays"
    with Segment.create(4096, "test-unviewed"):
        assert mappings("test-unviewed", "rw-s") == 1
    assert mappings("test-unviewed", "rw-s") == 0


DYING_RANK = textwrap.dedent(
    """
    import sys, torch
    from flodl.rank.reduce_client import ReduceClient
    port, chunk = int(sys.argv[1]), int(sys.argv[2])
    gen = torch.Generator().manual_seed(1001)  # (test_reduce.model(1, …))
    params = [torch.randn(shape, generator=gen) for shape in ((chunk + 5,), (9,))]
    client = ReduceClient("127.0.0.1", port, SECRET, 1, 2, run_id=RUN, shared_memory=True,
                          timeout_s=60)
    client.connect(30.0)
    client.reduce(1, params, 3.0, [], True)  # (the test kills this process during the fold)
    """
)


@pytest.mark.parametrize("killed", [False, True], ids=["declared-dead", "process-killed"])
def test_a_rank_dying_while_the_fold_reads_its_segment_is_folded_safely(
    monkeypatch: pytest.MonkeyPatch, killed: bool
) -> None:
    """A round complete with a rank's upload keeps it when the rank dies (declared dead, or
    its process SIGKILLed and then declared dead, as the launcher does): its connection thread
    ends and closes the segment while the fold still reads it in place. The fold must still
    see the upload (until stop 47 this unmapped it under the fold and crashed the launcher)."""
    params = [model(r, ((FOLD_CHUNK_ELEMENTS + 5,), (9,))) for r in range(2)]
    expected = weighted_mean([[p.clone() for p in ps] for ps in params], [2.0, 3.0])
    folding, release, mapped = threading.Event(), threading.Event(), threading.Event()
    threaded = [0] if killed else [0, 1]
    with serving(2) as (server, done), clients(server, threaded, shared_memory=True) as cs:
        fold = server._folder.fold

        def held(*args: Any) -> None:
            folding.set()
            assert release.wait(JOIN_S), "the test never released the fold"
            if not mapped.is_set():  # (folding unmapped memory would crash the test process)
                raise RuntimeError("not folding: the segment was unmapped under the fold")
            fold(*args)

        monkeypatch.setattr(server._folder, "fold", held)
        server.open_round(1, [0, 1])
        proc = None
        if killed:
            script = f"SECRET = {SECRET!r}\nRUN = {RUN!r}\n" + DYING_RANK
            proc = subprocess.Popen(
                [sys.executable, "-c", script, str(server.port), str(FOLD_CHUNK_ELEMENTS)],
                env={**os.environ, "PYTHONWARNINGS": "ignore"},
            )
        workers = {
            r: Worker(lambda r=r: cs[r].reduce(1, params[r], [2.0, 3.0][r], [], True))
            for r in threaded
        }
        try:
            assert folding.wait(JOIN_S), "the round never reached the fold"
            dying = server._by_rank[1]
            if proc is not None:
                proc.kill()
                assert proc.wait(JOIN_S) == -signal.SIGKILL
            server.rank_dead(1)
            assert dying.thread is not None
            dying.thread.join(JOIN_S)
            assert not dying.thread.is_alive() and dying.shm is None  # its segment is closed
            assert mappings("flodl-upload", "r--s") == 2, "the fold's views lost their mapping"
            mapped.set()
        finally:
            release.set()
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
        assert workers[0].result() == (5.0, 2.0)
        if not killed:
            with pytest.raises(CoordinatorLost):
                workers[1].result()
        assert done.wait(1) == [(1, (0, 1), 5.0)]
        assert cs[0].in_shared_memory
    close_all(expected, params[0])


def one_round_seen(
    monkeypatch: pytest.MonkeyPatch,
    params: list[list[torch.Tensor]],
    wires: tuple[bool, bool],
    lanes: tuple[bool, bool] = (True, True),
    **server: Any,
) -> list[list[torch.dtype]]:
    """Round 1 of two ranks (bf16 wire or not, weights 2 and 3, shared memory or TCP); the
    dtypes of the parameters' consensus each shared-memory rank read from memory."""
    seen: list[list[torch.dtype]] = []
    apply = LocalLane.apply

    def spy(lane: LocalLane, dst: Any, src: Any, bf16: bool) -> None:
        if src:  # the parameters (these rounds average no buffers)
            seen.append([s.dtype for s in src])
        apply(lane, dst, src, bf16)

    monkeypatch.setattr(LocalLane, "apply", spy)
    one_round(params, wires, shared_memory=lanes, **server)
    return seen


@pytest.mark.parametrize(
    ("wires", "received"),
    [
        ((True, True), torch.bfloat16),  # every rank bf16: the slot holds bf16, half the bytes
        ((False, True), torch.float32),  # an f32 rank in the round: the slot stays f32
    ],
)
def test_a_round_every_rank_sends_as_bf16_is_written_to_memory_as_bf16(
    monkeypatch: pytest.MonkeyPatch, wires: tuple[bool, bool], received: torch.dtype
) -> None:
    params = [model(r, ((FOLD_CHUNK_ELEMENTS + 5,), (9,))) for r in range(2)]
    uploads = [
        [t * w if not bf16 else (t * w).bfloat16().float() for t in p]
        for p, w, bf16 in zip(params, (2.0, 3.0), wires, strict=True)
    ]
    seen = one_round_seen(monkeypatch, params, wires)
    assert seen == [[received, received]] * 2
    for i, (a, b) in enumerate(zip(*uploads, strict=True)):
        mean = (a + b) / 5.0
        assert torch.equal(params[1][i], mean.bfloat16().float())  # the bf16 rank's replica
        if not wires[0]:
            torch.testing.assert_close(params[0][i], mean)  # the f32 rank's, unrounded
        else:
            assert torch.equal(params[0][i], mean.bfloat16().float())


def test_an_outer_optimizer_keeps_the_slot_f32(monkeypatch: pytest.MonkeyPatch) -> None:
    """The outer step runs on the f32 consensus, so even an all-bf16 round is not narrowed."""
    params = [model(r, ((300,), (9,))) for r in range(2)]
    seen = one_round_seen(monkeypatch, params, (True, True), outer=SlowMomentum(lr=0.5, mu=0.5))
    assert seen == [[torch.float32, torch.float32]] * 2
    assert torch.equal(params[0][0], params[1][0])
    assert torch.equal(params[0][0], params[0][0].bfloat16().float())  # still rounded on receipt


def test_a_tcp_rank_of_a_narrowed_round_gets_the_same_bf16_consensus(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Rank 0 on TCP, rank 1 in memory, both bf16: the slot holds bf16, rank 1 reads it there,
    rank 0 is sent it over TCP, and their replicas are identical."""
    params = [model(r, ((FOLD_CHUNK_ELEMENTS + 5,), (9,))) for r in range(2)]
    seen = one_round_seen(monkeypatch, params, (True, True), (False, True))
    assert seen == [[torch.bfloat16, torch.bfloat16]]  # (only rank 1 reads memory)
    assert all(torch.equal(a, b) for a, b in zip(params[0], params[1], strict=True))
    assert all(torch.equal(p, p.bfloat16().float()) for p in params[0])
