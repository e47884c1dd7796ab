"""The outer optimizer gives the same parameters in its CPU and its collective placement.

docs/design.md §6: the outer step runs once at the coordinator for the CPU backend (on the folded
consensus inside :class:`~flodl.service.reduce.ReduceServer`) and on every rank for the collective
backend (after :meth:`~flodl.rank.collectives.Collective.weighted_average`). The same
deterministic uploads go through both real placements and one float64 reference:

* CPU: a real reduce server on 127.0.0.1 and two real :class:`ReduceClient` threads in this
  process; round 0 is the initial broadcast (rank 0 weight 1, rank 1 weight 0).
* collective: two ``spawn`` ranks over Gloo (one cohort serves every case; ``import torch`` costs
  seconds per process), rank 0's parameters broadcast, then ``OuterStep.apply`` after the
  broadcast and after every weighted average, as :mod:`flodl.rank.runtime` does. Each child treats
  warnings as errors, like the test process.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import threading
import traceback
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import Any

import pytest
import torch
from worker_pipes import close_workers

from flodl.outer import NesterovMomentum, OuterConfig, OuterStep, SlowMomentum
from flodl.rank.collectives import Collective
from flodl.rank.reduce_client import ReduceClient
from flodl.service.reduce import ReduceServer
from flodl.service.store import StoreHost

pytestmark = pytest.mark.integration

CHILD_WARNINGS = "error,ignore:Failed to initialize NumPy:UserWarning"
SECRET = b"outer-placement-secret-0123456789ab"
SHAPES = ((3, 4), (5,), (), (2, 3, 2))
# Per round k = 1..5, the work weight (steps) of rank 0 and rank 1; rank 0 idles in round 3.
WEIGHTS = ((3.0, 5.0), (3.0, 5.0), (0.0, 4.0), (2.0, 5.0), (3.0, 1.0))
ROUNDS = len(WEIGHTS)
ATOL = RTOL = 1e-5
JOIN_S = 30.0

Params = list[torch.Tensor]
State = dict[str, list[torch.Tensor]]


def theta(rank: int, k: int) -> Params:
    """What rank ``rank`` holds before round ``k`` (k = 0: its initial parameters)."""
    gen = torch.Generator().manual_seed(7919 * k + 31 * rank + 5)
    return [torch.randn(shape, generator=gen) + 0.5 * k for shape in SHAPES]


def as_lists(tensors: Params) -> list[Any]:
    return [t.tolist() for t in tensors]


def from_lists(values: list[Any]) -> Params:
    # f32 -> Python float -> f32 is exact
    return [torch.tensor(v, dtype=torch.float32) for v in values]


# ---------------------------------------------------------------------- collective ranks
def _run_collective(coll: Collective, rank: int, config: dict[str, Any]) -> dict[str, Any]:
    """One run of the collective placement, as flodl.rank.runtime performs it."""
    outer = OuterStep(OuterConfig.model_validate(config))
    params = theta(rank, 0)
    coll.broadcast(params, src=0)
    outer.apply(params)  # first window: sets prev
    history = [as_lists(params)]
    totals = []
    for k in range(1, ROUNDS + 1):
        for p, fresh in zip(params, theta(rank, k), strict=True):
            p.copy_(fresh)
        totals.append(coll.weighted_average(params, WEIGHTS[k - 1][rank]))
        outer.apply(params)
        history.append(as_lists(params))
    state = {key: as_lists(ts) for key, ts in outer.state().items()}
    return {"history": history, "totals": totals, "state": state}


def _worker(port: int, rank: int, conn: Connection) -> None:
    torch.set_num_threads(1)
    coll = Collective("127.0.0.1", port, device=torch.device("cpu"), timeout_s=20.0)
    try:
        coll.form("outer/s0", rank, 2)
        conn.send(("ok", None))
        while (config := conn.recv()) is not None:
            try:
                conn.send(("ok", _run_collective(coll, rank, config)))
            except Exception:  # noqa: BLE001 - every failure goes back to the test process
                conn.send(("error", traceback.format_exc()))
    except Exception:  # noqa: BLE001
        with contextlib.suppress(OSError):
            conn.send(("error", traceback.format_exc()))
    finally:
        coll.destroy()
        conn.close()


class Pair:
    """Two spawned ranks in one Gloo session; each run of a config is one message."""

    def __init__(self, port: int) -> None:
        ctx = mp.get_context("spawn")
        self.procs: list[Any] = []
        self.conns: list[Connection] = []
        with pytest.MonkeyPatch.context() as mpatch:
            mpatch.setenv("PYTHONWARNINGS", CHILD_WARNINGS)
            for rank in range(2):
                ours, theirs = ctx.Pipe()
                proc = ctx.Process(target=_worker, args=(port, rank, theirs))
                proc.start()
                theirs.close()
                self.procs.append(proc)
                self.conns.append(ours)

    def send(self, config: OuterConfig) -> None:
        for conn in self.conns:
            conn.send(config.model_dump())

    def recv(self, timeout: float = 60.0) -> list[Any]:
        answers = []
        for rank, conn in enumerate(self.conns):
            if not conn.poll(timeout):
                raise AssertionError(f"rank {rank} gave no answer within {timeout} s")
            status, value = conn.recv()
            if status != "ok":
                raise AssertionError(f"rank {rank} failed:\n{value}")
            answers.append(value)
        return answers

    def close(self) -> None:
        close_workers(self.procs, self.conns, grace_s=10.0)


@pytest.fixture(scope="module")
def pair() -> Iterator[Pair]:
    with StoreHost() as store:
        ranks = Pair(store.port)
        try:
            assert ranks.recv() == [None, None]  # the session formed
            yield ranks
        finally:
            ranks.close()


# ---------------------------------------------------------------------- CPU placement
def run_cpu(config: OuterConfig) -> tuple[list[list[Params]], list[float], State]:
    """Round 0 and rounds 1..ROUNDS through a real ReduceServer with the outer step.

    Returns each rank's parameters after each round, each round's total weight, and the
    server's outer state after the last round.
    """
    done: list[int] = []
    changed = threading.Condition()

    def on_done(cycle: int, contributors: tuple[int, ...], weight: float) -> None:
        with changed:
            done.append(cycle)
            changed.notify_all()

    history: list[list[Params]] = [[], []]
    totals: list[float] = []
    before = set(threading.enumerate())
    server = ReduceServer(SECRET, run_id="outer-test", world_size=2, on_done=on_done, outer=config)
    clients: list[ReduceClient] = []
    try:
        server.start()
        for rank in range(2):
            client = ReduceClient(
                "127.0.0.1", server.port, SECRET, rank, 2, run_id="outer-test", timeout_s=20.0
            )
            clients.append(client)
            client.connect(10.0)
        with ThreadPoolExecutor(max_workers=2, thread_name_prefix="rank") as pool:
            for cycle in range(ROUNDS + 1):
                weights = (1.0, 0.0) if cycle == 0 else WEIGHTS[cycle - 1]
                params = [theta(rank, cycle) for rank in range(2)]
                server.open_round(cycle, [0, 1])
                futures = [
                    pool.submit(clients[r].reduce, cycle, params[r], weights[r], [], weights[r] > 0)
                    for r in range(2)
                ]
                answers = [f.result(timeout=JOIN_S) for f in futures]
                assert answers[0] == answers[1]
                totals.append(answers[0][0])
                for rank in range(2):
                    history[rank].append(params[rank])
        with changed:
            assert changed.wait_for(lambda: len(done) == ROUNDS + 1, JOIN_S)
        assert done == list(range(ROUNDS + 1))
        state = server.outer_state()
    finally:
        for client in clients:
            client.close()
        server.close()
    leftover = [t for t in threading.enumerate() if t not in before and t.is_alive()]
    assert leftover == [], leftover
    return history, totals, state


# ---------------------------------------------------------------------- reference
def plain_average(k: int) -> Params:
    """Round ``k``'s weighted average in float64 (round 0: rank 0's parameters)."""
    if k == 0:
        return [t.double() for t in theta(0, 0)]
    w = WEIGHTS[k - 1]
    ranks = [theta(r, k) for r in range(2)]
    return [
        (w[0] * a.double() + w[1] * b.double()) / (w[0] + w[1])
        for a, b in zip(ranks[0], ranks[1], strict=True)
    ]


def reference(config: OuterConfig) -> tuple[list[Params], State]:
    """The original's outer step (docs/design.md §6) over the plain averages, in float64."""
    prev: Params = []
    v: Params = []
    out: list[Params] = []
    for k in range(ROUNDS + 1):
        cons = plain_average(k)
        if k == 0:
            prev, v = cons, [torch.zeros_like(t) for t in cons]
            out.append(cons)
            continue
        new: Params = []
        for i, c in enumerate(cons):
            g = prev[i] - c
            v[i] = config.mu * v[i] + g
            direction = config.mu * v[i] + g if config.kind == "nesterov" else v[i]
            new.append(prev[i] - config.lr * direction)
        prev = new
        out.append(new)
    return out, {"prev": prev, "velocity": v}


def assert_close_all(got: Params, want: Params, what: str) -> None:
    assert len(got) == len(want), what
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert a.shape == b.shape, f"{what}, tensor {i}"
        torch.testing.assert_close(
            a.double(), b.double(), atol=ATOL, rtol=RTOL, msg=lambda m: f"{what}: {m}"
        )


# ---------------------------------------------------------------------- the test
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "config",
    [SlowMomentum(lr=0.8, mu=0.5), NesterovMomentum(lr=0.7, mu=0.9)],
    ids=["slowmo", "nesterov"],
)
def test_cpu_and_collective_placements_agree(pair: Pair, config: OuterConfig) -> None:
    pair.send(config)  # the ranks compute while this process runs the CPU placement
    cpu_history, cpu_totals, server_state = run_cpu(config)
    answers = pair.recv()
    expected, expected_state = reference(config)

    weight_totals = [1.0] + [sum(w) for w in WEIGHTS]
    assert cpu_totals == weight_totals
    for answer in answers:
        assert answer["totals"] == weight_totals[1:]
    coll_history = [[from_lists(p) for p in answer["history"]] for answer in answers]
    for k in range(ROUNDS + 1):
        for rank in range(2):
            cpu, coll = cpu_history[rank][k], coll_history[rank][k]
            assert_close_all(cpu, coll, f"round {k}, rank {rank}: CPU vs collective placement")
            assert_close_all(cpu, expected[k], f"round {k}, rank {rank}: CPU vs reference")
            assert_close_all(coll, expected[k], f"round {k}, rank {rank}: collective vs reference")
        # the collective ranks hold identical replicas
        assert all(
            torch.equal(a, b) for a, b in zip(coll_history[0][k], coll_history[1][k], strict=True)
        )
        plain = plain_average(k)
        gap = max(
            float((a.double() - b).abs().max()) for a, b in zip(expected[k], plain, strict=True)
        )
        if k == 0:
            assert gap == 0.0  # the first window is the identity: rank 0's parameters
        else:
            assert gap > 0.1, f"round {k}: the outer step is indistinguishable from averaging"

    # the outer state: the server keeps it over its flat per-dtype accumulator (one f32 here),
    # each rank over its parameter list; flattened in model order they hold the same numbers
    coll_states = [
        {key: from_lists(ts) for key, ts in answer["state"].items()} for answer in answers
    ]
    assert set(server_state) == set(coll_states[0]) == set(coll_states[1]) == {"prev", "velocity"}
    for key in ("prev", "velocity"):
        assert [t.dtype for t in server_state[key]] == [torch.float32]
        flat_ref = torch.cat([t.reshape(-1) for t in expected_state[key]])
        for rank, state in enumerate(coll_states):
            flat = torch.cat([t.reshape(-1) for t in state[key]])
            what = f"outer state {key!r}, rank {rank}"
            assert_close_all([server_state[key][0]], [flat], f"{what} vs the server's")
            assert_close_all([flat], [flat_ref], f"{what} vs the reference")
    assert float(flat_ref.abs().max()) > 0.1  # non-trivial momentum
