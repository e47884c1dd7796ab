"""The collective backend on real processes: Gloo on 127.0.0.1, the store hosted in this process.

Ranks are ``spawn`` children that run named steps on command (``import torch`` costs ~2 s per
process, so one cohort serves several checks). Each child treats warnings as errors, like the test
process. Values are chosen so the weighted means are exact in float32.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import time
import traceback
from collections.abc import Callable, Iterator
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

import pytest
import torch
from torch.distributed import TCPStore  # type: ignore[attr-defined]
from worker_pipes import close_workers

from flodl.errors import CollectiveFailed, LocalProtocolError
from flodl.rank.collectives import Collective, _unpack, divergence
from flodl.service.store import StoreHost

pytestmark = pytest.mark.integration

CHILD_WARNINGS = "error,ignore:Failed to initialize NumPy:UserWarning"
THETA = [0.0, 3.0, 6.0]  # rank r's parameter value
WEIGHT = [1.0, 2.0, 3.0]  # rank r's work weight: mean = (0 + 6 + 18) / 6 = 4


# ---------------------------------------------------------------------- child side
class _State:
    def __init__(self, coll: Collective, rank: int) -> None:
        self.coll = coll
        self.rank = rank  # global rank
        self.saved: list[torch.Tensor] = []


def _params(theta: float) -> list[torch.Tensor]:
    return [
        torch.full((4,), theta),
        torch.arange(6.0).reshape(2, 3) * theta,
        torch.full((2,), theta, dtype=torch.float64),
        torch.full((3,), theta, dtype=torch.bfloat16),
    ]


def _step_form(s: _State, prefix: str, rank: int, world_size: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    try:
        s.coll.form(prefix, rank, world_size)
    except CollectiveFailed as exc:
        return {"failed": True, "elapsed": time.perf_counter() - t0, "error": str(exc)}
    return {
        "failed": False,
        "elapsed": time.perf_counter() - t0,
        "rank": s.coll.rank,
        "world_size": s.coll.world_size,
    }


def _step_broadcast(s: _State) -> dict[str, Any]:
    r = s.rank
    base = torch.arange(6.0).reshape(2, 3) * (r + 1)
    tensors = [
        torch.full((2, 3), r + 1.0),
        torch.arange(4, dtype=torch.float64) * (r + 1),
        torch.tensor(10 * r, dtype=torch.int64),  # a 0-d integer buffer
        torch.tensor([r % 2 == 0, r == 1]),
        base.t(),  # non-contiguous view: writes must land in `base`
    ]
    s.coll.broadcast(tensors, src=0)
    return {"tensors": [t.tolist() for t in tensors], "base": base.tolist()}


def _step_weighted(s: _State, weights: list[float]) -> dict[str, Any]:
    params = _params(THETA[s.rank])
    total = s.coll.weighted_average(params, weights[s.rank])
    return {"total": total, "params": [p.tolist() for p in params]}


def _step_buffers(s: _State, movers: list[int]) -> dict[str, Any]:
    r = s.rank
    buffers = [
        torch.full((3,), r + 1.0),  # running_mean
        torch.tensor(7 + 10 * r, dtype=torch.int64),  # num_batches_tracked
        torch.full((2,), 2.0 * (r + 1), dtype=torch.float64),
    ]
    count = s.coll.average_buffers(buffers, r in movers)
    return {"count": count, "buffers": [b.tolist() for b in buffers]}


def _step_sum(s: _State) -> float:
    t = torch.tensor([s.rank + 1.0])
    s.coll.all_reduce_sum(t)
    return float(t.item())


def _step_reduce_expecting_failure(s: _State) -> dict[str, Any]:
    params = _params(THETA[s.rank])
    s.saved = [p.clone() for p in params]  # the pre-sync copy
    t0 = time.perf_counter()
    try:
        s.coll.weighted_average(params, WEIGHT[s.rank])
    except CollectiveFailed as exc:
        first = time.perf_counter() - t0
        untouched = all(torch.equal(p, q) for p, q in zip(params, s.saved, strict=True))
        try:
            s.coll.all_reduce_sum(torch.zeros(1))
            again, again_error = "no error", ""
        except CollectiveFailed as again_exc:
            again, again_error = "CollectiveFailed", str(again_exc)
        return {
            "failed": True,
            "elapsed": first,
            "error": str(exc),
            "untouched": untouched,
            "broken": s.coll.broken,
            "again": again,
            "again_error": again_error,
        }
    return {"failed": False, "elapsed": time.perf_counter() - t0}


def _step_redo(s: _State) -> dict[str, Any]:
    params = [p.clone() for p in s.saved]
    total = s.coll.weighted_average(params, WEIGHT[s.rank])
    return {"total": total, "params": [p.tolist() for p in params]}


def _step_unformed(s: _State) -> dict[str, Any]:
    try:
        s.coll.all_reduce_sum(torch.zeros(1))
    except LocalProtocolError:
        return {"formed": s.coll.formed, "raises": "LocalProtocolError"}
    return {"formed": s.coll.formed, "raises": None}


def _step_form_members(s: _State, prefix: str, members: list[int]) -> dict[str, Any]:
    """Form the session of global ranks ``members`` (NewSession.ranks)."""
    s.coll.form(prefix, members.index(s.rank), len(members), members=members)
    return {"prefix": s.coll.prefix, "rank": s.coll.rank, "world_size": s.coll.world_size}


def _step_fail(s: _State) -> bool:
    """A collective after a peer's death fails (the session is then broken)."""
    try:
        s.coll.all_reduce_sum(torch.zeros(1))
    except CollectiveFailed:
        return s.coll.broken
    return False


def _step_shrinkable(s: _State, how: str) -> None:
    """Make this rank's backend report that it can shrink, as NCCL does, and choose what
    ``shrink_group`` does: ``real`` is torch's (on Gloo it raises TypeError, naming the
    backend); ``works`` and ``breaks`` stand in for NCCL's (the survivors' group, renumbered,
    becomes the default group), ``breaks`` then raising as a failed shrink would."""
    import torch.distributed as dist
    from torch.distributed import PrefixStore  # type: ignore[attr-defined]

    from flodl.rank import collectives

    collectives.shrink_supported = lambda device: True
    if how == "real":
        return
    base = s.coll._client()  # the coordinator's store, as NCCL's shrink would use its own

    def shrink_group(ranks_to_exclude: list[int], **_: Any) -> Any:
        me, size = dist.get_rank(), dist.get_world_size()
        new_rank = me - sum(1 for r in ranks_to_exclude if r < me)
        tag = f"fake-shrink/{s.coll.prefix}/{size}"
        dist.destroy_process_group()
        collectives._reset_group_counter()
        dist.init_process_group(
            "gloo",
            store=PrefixStore(tag, base),
            rank=new_rank,
            world_size=size - len(ranks_to_exclude),
        )
        if how == "breaks":
            raise RuntimeError("simulated ncclCommShrink failure")
        return dist.group.WORLD

    dist.shrink_group = shrink_group  # type: ignore[assignment]


def _step_backend_connections(s: _State, store_port: int) -> int:
    """This process's established TCP connections other than to the store: the backend's
    (Gloo's pairs), read from ``/proc``."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # (closed meanwhile)
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    count = 0
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        with open(table) as f:
            for line in f.read().splitlines()[1:]:
                fields = line.split()
                remote_port = int(fields[2].rsplit(":", 1)[1], 16)
                established = fields[3] == "01"
                if established and fields[9] in inodes and remote_port != store_port:
                    count += 1
    return count


def _step_exit(s: _State) -> None:
    os._exit(0)  # die without leaving the group: the peers' sockets see EOF


STEPS: dict[str, Callable[..., Any]] = {
    "form": _step_form,
    "broadcast": _step_broadcast,
    "weighted": _step_weighted,
    "buffers": _step_buffers,
    "sum": _step_sum,
    "reduce_expecting_failure": _step_reduce_expecting_failure,
    "redo": _step_redo,
    "unformed": _step_unformed,
    "exit": _step_exit,
    "backend_connections": _step_backend_connections,
    "form_members": _step_form_members,
    "fail": _step_fail,
    "shrinkable": _step_shrinkable,
}


def _worker(port: int, rank: int, timeout_s: float, conn: Connection) -> None:
    torch.set_num_threads(1)
    state = _State(
        Collective("127.0.0.1", port, device=torch.device("cpu"), timeout_s=timeout_s), rank
    )
    try:
        while (msg := conn.recv()) is not None:
            name, args = msg
            try:
                conn.send(("ok", STEPS[name](state, *args)))
            except Exception:  # noqa: BLE001 - report every failure to the test process
                conn.send(("error", traceback.format_exc()))
    finally:
        state.coll.destroy()
        conn.close()


# ---------------------------------------------------------------------- test side
class Cohort:
    """``n`` spawned ranks, each answering named steps over its own pipe."""

    def __init__(self, port: int, n: int, timeout_s: float) -> None:
        ctx = mp.get_context("spawn")
        self.procs: list[Any] = []
        self.conns: list[Connection] = []
        with pytest.MonkeyPatch.context() as mpatch:
            mpatch.setenv("PYTHONWARNINGS", CHILD_WARNINGS)
            for rank in range(n):
                ours, theirs = ctx.Pipe()
                proc = ctx.Process(target=_worker, args=(port, rank, timeout_s, theirs))
                proc.start()
                theirs.close()
                self.procs.append(proc)
                self.conns.append(ours)

    def send(self, rank: int, step: str, *args: Any) -> None:
        self.conns[rank].send((step, args))

    def recv(self, rank: int, timeout: float = 30.0) -> Any:
        conn = self.conns[rank]
        if not conn.poll(timeout):
            raise AssertionError(f"rank {rank} gave no answer within {timeout} s")
        status, value = conn.recv()
        if status != "ok":
            raise AssertionError(f"rank {rank} failed:\n{value}")
        return value

    def call(self, ranks: list[int], step: str, *args: Any) -> list[Any]:
        """Run ``step`` on ``ranks`` concurrently; answers in the order of ``ranks``."""
        for rank in ranks:
            self.send(rank, step, *args)
        return [self.recv(rank) for rank in ranks]

    def form(self, prefix: str, ranks: list[int]) -> None:
        for new_rank, rank in enumerate(ranks):
            self.send(rank, "form", prefix, new_rank, len(ranks))
        for rank in ranks:
            answer = self.recv(rank)
            assert not answer["failed"], answer

    def close(self) -> None:
        close_workers(self.procs, self.conns, grace_s=5.0)


@pytest.fixture(scope="module")
def store() -> Iterator[StoreHost]:
    with StoreHost() as host:
        yield host


@pytest.fixture(scope="module")
def trio(store: StoreHost) -> Iterator[Cohort]:
    """Three ranks in session ``t/s0`` for the happy-path tests (reused across them)."""
    cohort = Cohort(store.port, 3, timeout_s=20.0)
    try:
        cohort.form("trio/s0", [0, 1, 2])
        yield cohort
    finally:
        cohort.close()


# ---------------------------------------------------------------------- store and one rank
@pytest.mark.timeout(120)
def test_store_host_serves_clients_and_closes(store: StoreHost) -> None:
    assert 0 < store.port <= 65_535
    client = TCPStore("127.0.0.1", store.port, None, False, timedelta(seconds=5), False)
    client.set("probe", "1")
    assert client.get("probe") == b"1"
    assert not torch.cuda.is_initialized()

    other = StoreHost()
    assert other.port != store.port and not other.closed
    other.close()
    other.close()  # idempotent
    assert other.closed
    with pytest.raises(ValueError, match="port"):
        StoreHost(port=70_000)


@pytest.mark.timeout(120)
def test_one_rank_session_is_local(store: StoreHost) -> None:
    coll = Collective("127.0.0.1", store.port, device=torch.device("cpu"), timeout_s=5.0)
    with pytest.raises(LocalProtocolError):
        coll.weighted_average([torch.ones(2)], 1.0)
    with pytest.raises(ValueError, match="rank"):
        coll.form("solo/s0", 1, 1)
    coll.form("solo/s0", 0, 1)
    assert (coll.rank, coll.world_size, coll.backend) == (0, 1, "gloo")
    params = [torch.full((3,), 2.5)]
    assert coll.weighted_average(params, 4.0) == 4.0
    assert coll.weighted_average(params, 0.0) == 0.0
    assert params[0].tolist() == [2.5, 2.5, 2.5]
    assert coll.average_buffers([torch.ones(2)], mover=True) == 1
    assert coll.average_buffers([torch.ones(2)], mover=False) == 0
    coll.broadcast(params)
    t = torch.ones(1)
    coll.all_reduce_sum(t)
    assert t.item() == 1.0
    with pytest.raises(ValueError, match="weight"):
        coll.weighted_average(params, -1.0)
    with pytest.raises(TypeError):
        coll.weighted_average([torch.ones(2, dtype=torch.int64)], 1.0)
    coll.destroy()
    assert not coll.formed
    with pytest.raises(ValueError, match="timeout_s"):
        Collective("127.0.0.1", store.port, device=torch.device("cpu"), timeout_s=0.0)


# ---------------------------------------------------------------------- three ranks
@pytest.mark.timeout(120)
def test_broadcast_from_rank0_makes_ranks_identical(trio: Cohort) -> None:
    answers = trio.call([0, 1, 2], "broadcast")
    expected = answers[0]
    assert expected["tensors"][2] == 0 and expected["tensors"][3] == [True, False]
    assert expected["base"] == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
    for answer in answers[1:]:
        assert answer == expected


@pytest.mark.timeout(120)
def test_weighted_average_is_the_exact_weighted_mean(trio: Cohort) -> None:
    answers = trio.call([0, 1, 2], "weighted", WEIGHT)
    mean = sum(w * t for w, t in zip(WEIGHT, THETA, strict=True)) / sum(WEIGHT)
    assert mean == 4.0
    for answer in answers:
        assert answer["total"] == 6.0
        assert answer["params"] == [p.tolist() for p in _params(mean)]
    # a rank with weight 0 adopts the others' average and adds nothing to the divisor
    answers = trio.call([0, 1, 2], "weighted", [0.0, 1.0, 2.0])
    mean = (1.0 * 3.0 + 2.0 * 6.0) / 3.0
    assert mean == 5.0
    for answer in answers:
        assert answer["total"] == 3.0
        assert answer["params"] == [p.tolist() for p in _params(mean)]


@pytest.mark.timeout(120)
def test_all_zero_weights_leave_params_unchanged(trio: Cohort) -> None:
    answers = trio.call([0, 1, 2], "weighted", [0.0, 0.0, 0.0])
    for rank, answer in enumerate(answers):
        assert answer["total"] == 0.0
        assert answer["params"] == [p.tolist() for p in _params(THETA[rank])]


@pytest.mark.timeout(120)
def test_buffers_average_over_movers_only(trio: Cohort) -> None:
    answers = trio.call([0, 1, 2], "buffers", [0, 2])  # rank 1 did not step
    for rank, answer in enumerate(answers):
        assert answer["count"] == 2
        running_mean, tracked, second = answer["buffers"]
        assert running_mean == [2.0, 2.0, 2.0]  # (1 + 3) / 2, rank 1's 2.0 never counted
        assert second == [4.0, 4.0]  # (2 + 6) / 2
        assert tracked == 7 + 10 * rank  # integer buffers are never averaged
    answers = trio.call([0, 1, 2], "buffers", [])  # nobody moved: unchanged
    for rank, answer in enumerate(answers):
        assert answer["count"] == 0
        assert answer["buffers"] == [[rank + 1.0] * 3, 7 + 10 * rank, [2.0 * (rank + 1)] * 2]
    assert trio.call([0, 1, 2], "sum") == [6.0, 6.0, 6.0]


# ---------------------------------------------------------------------- failures
@pytest.mark.timeout(120)
def test_peer_death_raises_collective_failed_then_reform_and_redo(store: StoreHost) -> None:
    timeout_s = 5.0
    cohort = Cohort(store.port, 3, timeout_s=timeout_s)
    try:
        cohort.form("death/s0", [0, 1, 2])
        assert cohort.call([0, 1, 2], "sum") == [6.0, 6.0, 6.0]
        assert all(n >= 2 for n in cohort.call([0, 1], "backend_connections", store.port))
        cohort.send(2, "exit")
        cohort.procs[2].join(10.0)
        assert cohort.procs[2].exitcode == 0

        for answer in cohort.call([0, 1], "reduce_expecting_failure"):
            assert answer["failed"], answer
            # the peer's EOF failed it (Gloo: "Connection closed by peer"), not the timeout
            assert "timed out" not in answer["error"].lower(), answer
            assert answer["untouched"] and answer["broken"], answer
            assert answer["again"] == "CollectiveFailed", answer
            # a broken session refuses before touching the network
            assert "broke in an earlier collective" in answer["again_error"], answer
        # and it holds no connection to the survivors: one blocked on this rank (Gloo's
        # ring waits on a neighbour, not on the dead rank) fails at once, not at its timeout
        assert cohort.call([0, 1], "backend_connections", store.port) == [0, 0]

        cohort.form("death/s1", [0, 1])  # NewSession{ranks: [0, 1]}: positions 0 and 1
        mean = (WEIGHT[0] * THETA[0] + WEIGHT[1] * THETA[1]) / (WEIGHT[0] + WEIGHT[1])
        for answer in cohort.call([0, 1], "redo"):
            assert answer["total"] == WEIGHT[0] + WEIGHT[1]
            assert answer["params"] == [p.tolist() for p in _params(mean)]
    finally:
        cohort.close()


@pytest.mark.timeout(120)
def test_silent_peer_and_missing_member_fail_after_the_timeout(store: StoreHost) -> None:
    timeout_s = 2.0
    cohort = Cohort(store.port, 2, timeout_s=timeout_s)
    try:
        cohort.form("silent/s0", [0, 1])
        # rank 1 stays alive but never enters the collective
        [answer] = cohort.call([0], "reduce_expecting_failure")
        assert answer["failed"], answer
        assert "timed out" in answer["error"].lower(), answer  # Gloo's own timeout fired
        assert answer["elapsed"] >= timeout_s * 0.9, answer  # and not before it
        assert "broke in an earlier collective" in answer["again_error"], answer

        # rank 1 never joins the next session: form() gives up after twice the timeout (the
        # member barrier lets survivors that saw the failure late still arrive)
        [answer] = cohort.call([0], "form", "silent/s1", 0, 2)
        assert answer["failed"], answer
        assert answer["elapsed"] >= 2 * timeout_s * 0.9, answer  # not before twice the timeout
        assert f"not every member arrived within {2 * timeout_s:g} s" in answer["error"]
        assert cohort.call([0], "unformed") == [{"formed": False, "raises": "LocalProtocolError"}]

        cohort.form("silent/s2", [0, 1])  # both recover in a fresh session
        assert cohort.call([0, 1], "sum") == [3.0, 3.0]
    finally:
        cohort.close()


@pytest.mark.timeout(120)
def test_a_superseded_session_stops_gathering_when_told(store: StoreHost) -> None:
    """A member that died before the barrier never arrives; once a newer session is announced
    (``superseded()`` says so), the waiting member gives up at once, naming why, instead of
    at twice the collective timeout (60 s here)."""
    collective = Collective("127.0.0.1", store.port, device=torch.device("cpu"), timeout_s=30.0)
    asked: list[int] = []

    def superseded() -> bool:
        asked.append(1)
        return len(asked) >= 3  # the newer session arrives while it gathers

    try:
        with pytest.raises(CollectiveFailed, match="a newer session was announced"):
            collective.form("gone/s1", 0, 2, superseded=superseded)
        assert len(asked) == 3
        with pytest.raises(LocalProtocolError):
            _ = collective.rank  # no session was formed
    finally:
        collective.destroy()


@pytest.mark.timeout(180)
def test_an_eviction_shrinks_the_group_only_when_every_survivor_could(store: StoreHost) -> None:
    """docs/design.md §2, "Rejoin": where the backend can shrink a group (NCCL), an eviction
    shrinks it; every survivor says whether its shrink worked, and unless all did, all form
    the session anew under one prefix. Here on Gloo: torch's own ``shrink_group`` (which
    Gloo refuses), then one that fails on one survivor only, then one that works."""
    cohort = Cohort(store.port, 5, timeout_s=3.0)
    try:
        members = [0, 1, 2, 3, 4]
        cohort.call(members, "unformed")  # every child is up (the gathers below allow 6 s)
        answers = cohort.call(members, "form_members", "shrink/s0", members)
        assert [a["world_size"] for a in answers] == [5] * 5
        for n, (victim, how) in enumerate([(4, "real"), (3, "breaks"), (2, "works")], start=1):
            members.remove(victim)
            # (before the failure: a group that can shrink is kept for the shrink, a Gloo
            # group that cannot is torn down as its collective fails)
            for r in members:  # rank 1 is the one whose shrink breaks
                cohort.call([r], "shrinkable", "works" if how == "breaks" and r != 1 else how)
            cohort.send(victim, "exit")
            cohort.procs[victim].join(10.0)
            assert cohort.call(members, "fail") == [True] * len(members)
            answers = cohort.call(members, "form_members", f"shrink/s{n}", members)
            assert [a["rank"] for a in answers] == list(range(len(members)))
            fell_back = {a["prefix"] for a in answers}
            expected = f"shrink/s{n}" + ("" if how == "works" else "/reform")
            assert fell_back == {expected}, (how, answers)
            total = sum(r + 1.0 for r in members)
            assert cohort.call(members, "sum") == [total] * len(members)
    finally:
        cohort.close()


# ---------------------------------------------------------------------- divergence
@pytest.mark.timeout(120)
def test_divergence_on_known_tensors() -> None:
    pre = [torch.tensor([3.0, 0.0]), torch.tensor([[0.0], [4.0]])]  # ‖pre‖ = 5
    post = [torch.tensor([0.0, 0.0]), torch.tensor([[0.0], [2.0]])]  # ‖post‖ = 2
    d, pre_norm, post_norm = divergence(pre, post)
    assert (pre_norm, post_norm) == (5.0, 2.0)
    assert math.isclose(d, math.sqrt(9.0 + 4.0) / 2.0, rel_tol=1e-12)
    assert divergence(post, post) == (0.0, 2.0, 2.0)
    assert divergence(pre, [torch.zeros(2), torch.zeros(2, 1)]) == (0.0, 5.0, 0.0)
    assert divergence([], []) == (0.0, 0.0, 0.0)
    half = [torch.tensor([3.0, 4.0], dtype=torch.bfloat16)]
    assert divergence(half, [torch.tensor([0.0, 4.0])]) == (0.75, 5.0, 4.0)
    with pytest.raises(ValueError, match="tensors"):
        divergence(pre, post[:1])
    with pytest.raises(ValueError, match="shape"):
        divergence([torch.ones(2)], [torch.ones(3)])


@pytest.mark.timeout(120)
def test_divergence_is_accurate_on_long_tensors() -> None:
    # float32 tensors long enough that a running float32 sum of squares drifts by ~1e-4: the
    # norms agree with a float64 reference to ~1e-7
    gen = torch.Generator().manual_seed(7)
    pre = [torch.randn(1 << 21, generator=gen), torch.randn(3, 1000, generator=gen)]
    post = [p + 1e-3 * torch.randn(p.shape, generator=gen) for p in pre]
    pairs = zip(pre, post, strict=True)
    ref = [
        math.sqrt(sum(float(((a.double() - b.double()) ** 2).sum()) for a, b in pairs)),
        math.sqrt(sum(float((a.double() ** 2).sum()) for a in pre)),
        math.sqrt(sum(float((b.double() ** 2).sum()) for b in post)),
    ]
    d, pre_norm, post_norm = divergence(pre, post)
    assert math.isclose(pre_norm, ref[1], rel_tol=1e-6)
    assert math.isclose(post_norm, ref[2], rel_tol=1e-6)
    assert math.isclose(d, ref[0] / ref[2], rel_tol=1e-6)


@pytest.mark.timeout(120)
def test_divergence_consuming_pre_gives_the_same_bits() -> None:
    # the reduce passes its pre-sync copy as scratch: the difference is taken in place, and
    # the figures must be exactly those of the allocating path, for every dtype mix
    gen = torch.Generator().manual_seed(11)
    pre = [
        torch.randn(1 << 16, generator=gen),
        torch.randn(7, 300, generator=gen).double(),
        torch.randn(33, generator=gen).to(torch.bfloat16),  # a half pair: never in place
        torch.randn(5, generator=gen),
    ]
    post = [p.float() + 1e-2 * torch.randn(p.shape, generator=gen) for p in pre]
    post[1] = post[1].double()
    post[3] = post[3].double()  # dtypes differ: not in place either
    expected = divergence(pre, post)
    scratch = [p.clone() for p in pre]
    kept = [q.clone() for q in post]
    assert divergence(scratch, post, consume_pre=True) == expected
    assert all(torch.equal(q, k) for q, k in zip(post, kept, strict=True))  # post untouched
    assert torch.equal(scratch[0], pre[0] - post[0])  # the same-dtype pairs were scratch
    assert torch.equal(scratch[2], pre[2]) and torch.equal(scratch[3], pre[3])


@pytest.mark.timeout(120)
def test_scaled_pack_and_divided_unpack_are_the_two_pass_bits() -> None:
    # the flat buffer is filled with one scaled copy per tensor (and emptied with one divided
    # copy) where dtypes agree; the bits must be those of copy-then-scale / divide-then-copy
    gen = torch.Generator().manual_seed(5)
    cases = {
        "f32": [torch.randn(1000, generator=gen), torch.randn(3, 17, generator=gen)],
        "f64 flat": [torch.randn(64, generator=gen), torch.randn(9, generator=gen).double()],
        "bf16 in f32": [torch.randn(40, generator=gen).bfloat16(), torch.randn(8, generator=gen)],
    }
    coll = Collective("127.0.0.1", 1, device=torch.device("cpu"), timeout_s=1.0)
    for name, tensors in cases.items():
        for weight, divisor in ((0.37, 2.9), (1.0, 1.0), (3.0, 7.0)):
            flat = coll._pack(name, tensors, weight).clone()
            ref = torch.cat([t.to(flat.dtype).reshape(-1) for t in tensors])
            last = torch.tensor([weight], dtype=flat.dtype)
            ref = torch.cat([ref * weight if weight != 1.0 else ref, last])
            assert torch.equal(flat, ref), (name, weight)
            outs = [torch.empty_like(t) for t in tensors]
            _unpack(flat[:-1], outs, divisor)
            body = ref[:-1] / divisor if divisor != 1.0 else ref[:-1]
            offset = 0
            for t, out in zip(tensors, outs, strict=True):
                piece = body[offset : offset + t.numel()].view(t.shape).to(t.dtype)
                assert torch.equal(out, piece), (name, weight, divisor)
                offset += t.numel()
