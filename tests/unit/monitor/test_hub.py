"""RecordHub: bounds, the child index, node() cost, the history/stream seam, slow subscribers."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import random
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from flodl.errors import ConfigError
from flodl.monitor.hub import MAX_HISTORY, RecordHub, Subscription, parent_of
from flodl.monitor.records import RecordLog, make_record, read_tree

LOGGER = "flodl.monitor.hub"
T0 = 1_700_000_000_000
WAIT_S = 5.0


def rec(path: str, i: int = 0, *, kind: str = "node", **data: Any) -> dict[str, Any]:
    return make_record(path, kind, {"i": i, **data}, ts_ms=T0 + i)


async def drain(sub: Subscription, until_seq: int) -> list[dict[str, Any]]:
    """Every record ``sub`` yields up to and including ``until_seq`` (bounded wait)."""
    got: list[dict[str, Any]] = []
    while not got or got[-1]["seq"] < until_seq:
        record = await asyncio.wait_for(sub.get(), WAIT_S)
        assert record is not None, "subscription ended early"
        got.append(record)
    return got


# -- publish ---------------------------------------------------------------------------------------


def test_publish_stamps_a_hub_wide_seq_on_a_copy() -> None:
    hub = RecordHub()
    first = rec("root/rank0", 1)
    assert hub.publish(first) == 1
    assert hub.publish(rec("root/rank1", 2)) == 2
    assert hub.publish(rec("root", 3)) == 3
    assert "seq" not in first  # the caller's dict is untouched
    assert hub.last_seq == 3
    [kept] = hub.history("root/rank0", 10)
    assert kept == {**first, "seq": 1}
    kept["data"]["i"] = 99  # readers get fresh dicts: mutating one changes nothing
    assert hub.history("root/rank0", 10)[0]["data"]["i"] == 1


def test_a_caller_supplied_seq_is_replaced() -> None:
    hub = RecordHub()
    hub.publish(rec("root", 1))
    assert hub.publish({**rec("root", 2), "seq": 1000}) == 2
    assert [r["seq"] for r in hub.history("root", 5)] == [1, 2]


BAD_RECORDS: list[tuple[str, Any]] = [
    ("not a dict", ["root"]),
    ("traversal path", {**rec("root"), "path": "root/../../etc/passwd"}),
    ("markup in path", {**rec("root"), "path": "root/rank0<script>"}),
    ("not rooted", {**rec("root"), "path": "etc/passwd"}),
    ("too deep", {**rec("root"), "path": "root/a/b/c/d"}),
    ("bad kind", {**rec("root"), "kind": "Node!"}),
    ("missing kind", {k: v for k, v in rec("root").items() if k != "kind"}),
    ("bad version", {**rec("root"), "v": 2}),
    ("negative ts", {**rec("root"), "ts": -1}),
    ("bool ts", {**rec("root"), "ts": True}),
    ("bad sev", {**rec("root"), "sev": "fatal"}),
    ("data not a dict", {**rec("root"), "data": [1, 2]}),
    ("unserializable", {**rec("root"), "data": {"x": object()}}),
]


@pytest.mark.parametrize(("why", "bad"), BAD_RECORDS, ids=[w for w, _ in BAD_RECORDS])
def test_bad_records_are_dropped_without_raising(why: str, bad: Any) -> None:
    del why
    hub = RecordHub()
    assert hub.publish(bad) is None
    assert hub.paths() == []
    assert hub.publish(rec("root")) == 1  # no seq was spent on the bad one


def test_a_circular_record_is_dropped() -> None:
    data: dict[str, Any] = {}
    data["self"] = data
    hub = RecordHub()
    assert hub.publish(make_record("root", "node", data, ts_ms=T0)) is None


def test_bad_records_are_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    hub = RecordHub()
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        for _, bad in BAD_RECORDS:
            hub.publish(bad)
    levels = [r.levelno for r in caplog.records if r.name == LOGGER]
    assert levels.count(logging.WARNING) == 1
    assert levels.count(logging.DEBUG) == len(BAD_RECORDS) - 1


def test_non_finite_floats_become_null() -> None:
    hub = RecordHub()
    hub.publish(rec("root", loss=math.nan, hi=math.inf, xs=[1.0, -math.inf], ok=0.5))
    data = hub.history("root", 1)[0]["data"]
    assert data == {"i": 0, "loss": None, "hi": None, "xs": [1.0, None], "ok": 0.5}


# -- bounds ----------------------------------------------------------------------------------------


def test_ring_is_bounded_by_count() -> None:
    hub = RecordHub(max_per_node=5)
    for i in range(12):
        hub.publish(rec("root/rank0", i))
    assert [r["data"]["i"] for r in hub.history("root/rank0", 100)] == [7, 8, 9, 10, 11]


def test_ring_is_bounded_by_bytes_and_keeps_the_newest() -> None:
    bound = 2000
    hub = RecordHub(max_bytes_per_node=bound)
    for i in range(50):
        hub.publish(rec("root/rank0", i, pad="x" * 100))
    kept = hub.history("root/rank0", 100)
    assert 1 < len(kept) < 50
    assert kept[-1]["data"]["i"] == 49
    assert [r["data"]["i"] for r in kept] == list(range(50 - len(kept), 50))
    assert sum(len(json.dumps(r, separators=(",", ":"))) for r in kept) <= bound


def test_a_record_larger_than_the_byte_bound_is_dropped() -> None:
    hub = RecordHub(max_bytes_per_node=1000)
    hub.publish(rec("root", 1))
    assert hub.publish(rec("root", 2, pad="x" * 2000)) is None
    assert [r["data"]["i"] for r in hub.history("root", 10)] == [1]


def test_latest_of_each_kind_survives_eviction() -> None:
    hub = RecordHub(max_per_node=3)
    hub.publish(make_record("root", "meta", {"reductions": {"loss": "mean"}}, ts_ms=T0))
    for i in range(10):
        hub.publish(rec("root", i))
    assert all(r["kind"] == "node" for r in hub.history("root", 10))
    meta = hub.meta()
    assert meta is not None and meta["seq"] == 1
    view = hub.node("root")
    assert view is not None and set(view["latest"]) == {"meta", "node"}


def test_new_paths_beyond_max_paths_are_dropped() -> None:
    hub = RecordHub(max_paths=3)
    assert hub.publish(rec("root/a")) is not None  # creates root and root/a
    assert hub.publish(rec("root/b")) is not None
    assert hub.publish(rec("root/c")) is None
    assert hub.publish(rec("root/a/rank0")) is None
    assert hub.publish(rec("root/a", 2)) is not None  # known paths still publish
    assert hub.paths() == ["root", "root/a", "root/b"]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_per_node": 0},
        {"max_bytes_per_node": -1},
        {"max_paths": 0},
        {"subscriber_bound": 0},
        {"max_per_node": True},
        {"max_per_node": 1.5},
    ],
)
def test_bad_bounds_are_refused(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ConfigError, match=next(iter(kwargs))):
        RecordHub(**kwargs)


@pytest.mark.parametrize(
    "retention",
    [
        {"Window": (10, 1000)},
        {"window": (0, 1000)},
        {"window": (10, True)},
        {"window": (10,)},
        {"window": [10, 1000]},
    ],
)
def test_bad_kind_retention_is_refused(retention: dict[str, Any]) -> None:
    with pytest.raises(ConfigError, match="kind_retention"):
        RecordHub(kind_retention=retention)


# -- kind rings ------------------------------------------------------------------------------------


def test_a_flood_of_one_kind_evicts_neither_the_evals_nor_the_node_records() -> None:
    """The coordinator writes a window record per averaging cycle at root: with a ring of its
    own it keeps its last records and leaves the run's evals and the loss chart alone."""
    hub = RecordHub(max_per_node=50)
    for epoch in range(30):
        hub.publish(rec("root", epoch, kind="eval", metric=0.1 * epoch))
        hub.publish(rec("root", epoch, loss=1.0 / (epoch + 1)))
        for cycle in range(100):
            hub.publish(rec("root", 100 * epoch + cycle, kind="window"))
    window_cap = hub.kind_retention["window"][0]
    kept = hub.history("root", MAX_HISTORY)
    by_kind = {k: [r["data"]["i"] for r in kept if r["kind"] == k] for k in ("eval", "node")}
    assert by_kind == {"eval": list(range(30)), "node": list(range(30))}
    windows = hub.history("root", MAX_HISTORY, kinds=["window"])
    assert [r["data"]["i"] for r in windows] == list(range(3000 - window_cap, 3000))
    assert [r["seq"] for r in kept] == sorted(r["seq"] for r in kept)  # one merged order


def test_a_kind_ring_is_bounded_by_its_own_count_and_bytes() -> None:
    hub = RecordHub(kind_retention={"window": (5, 10_000), "eval": (1000, 700)})
    for i in range(12):
        hub.publish(rec("root", i, kind="window"))
        hub.publish(rec("root", i, kind="eval", pad="x" * 60))
    assert [r["data"]["i"] for r in hub.history("root", 100, kinds=["window"])] == list(
        range(7, 12)
    )
    evals = hub.history("root", 100, kinds=["eval"])
    assert 1 < len(evals) < 12 and evals[-1]["data"]["i"] == 11
    assert sum(len(json.dumps(r, separators=(",", ":"))) for r in evals) <= 700
    # a record larger than its kind ring's bound is dropped; the main ring's bound is not it
    assert hub.publish(rec("root", 99, kind="eval", pad="x" * 800)) is None
    assert hub.publish(rec("root", 99, pad="x" * 800)) is not None
    # the kinds of no table entry share the main ring, as before
    assert hub.kind_retention.keys() == {"window", "eval"}


def test_history_kinds_keeps_only_those_kinds_of_the_scope() -> None:
    hub = RecordHub()
    for i, (path, kind) in enumerate(
        [
            ("root", "node"),
            ("root", "eval"),
            ("root/rank0", "callback"),
            ("root", "window"),
            ("root", "anchor"),  # a kind of the main ring
            ("root/rank0", "node"),
        ]
    ):
        hub.publish(rec(path, i, kind=kind))
    got = hub.history("root", 100, children=True, kinds=["eval", "anchor", "callback"])
    assert [(r["path"], r["kind"]) for r in got] == [
        ("root", "eval"),
        ("root/rank0", "callback"),
        ("root", "anchor"),
    ]
    assert hub.history("root", 100, kinds=[]) == []
    assert [r["kind"] for r in hub.history("root", 1, kinds=["node", "window"])] == ["window"]
    with pytest.raises(ConfigError, match="kinds"):
        hub.history("root", 10, kinds=["Bad kind"])
    with pytest.raises(ConfigError, match="kinds"):
        hub.history("root", 10, kinds="eval")  # a string is not a collection of kinds


def test_deep_adds_those_kinds_at_every_depth_below() -> None:
    hub = RecordHub()
    layout = [
        ("root", "node"),
        ("root/h0", "node"),
        ("root/h0/rank0", "node"),
        ("root/h0/rank0", "callback"),
        ("root/h0/rank0", "event"),
        ("root/h1/rank1", "resource"),
        ("root/h1", "callback"),
        ("root/h1/rank1", "node"),
    ]
    for i, (path, kind) in enumerate(layout):
        hub.publish(rec(path, i, kind=kind))

    def scope(**kw: Any) -> list[tuple[str, str]]:
        return [(r["path"], r["kind"]) for r in hub.history("root", 100, **kw)]

    deep = ["callback", "resource", "event"]
    assert scope(children=True, deep=deep) == [
        ("root", "node"),
        ("root/h0", "node"),
        ("root/h0/rank0", "callback"),
        ("root/h0/rank0", "event"),
        ("root/h1/rank1", "resource"),
        ("root/h1", "callback"),
    ]
    assert scope(deep=["callback"]) == [
        ("root", "node"),
        ("root/h0/rank0", "callback"),
        ("root/h1", "callback"),  # a child's record of a deep kind, without children=True
    ]
    assert scope(deep=deep, kinds=deep) == [
        ("root/h0/rank0", "callback"),
        ("root/h0/rank0", "event"),
        ("root/h1/rank1", "resource"),
        ("root/h1", "callback"),
    ]
    assert [r["kind"] for r in hub.history("root/h0", 100, deep=deep)] == [
        "node",
        "callback",
        "event",
    ]
    with pytest.raises(ConfigError, match="deep"):
        hub.history("root", 10, deep=["no-dashes"])


def test_kept_holds_every_ring_and_the_latest_of_each_kind() -> None:
    """What the saved dashboard embeds: more than MAX_HISTORY when the kind rings hold it,
    and the meta record the main ring evicted long ago."""
    hub = RecordHub(max_per_node=MAX_HISTORY)
    hub.publish(make_record("root", "meta", {"reductions": {}}, ts_ms=T0))
    for i in range(MAX_HISTORY + 5):
        hub.publish(rec("root", i))
    for i in range(3):
        hub.publish(rec("root", i, kind="eval"))
    hub.publish(rec("root/rank0", 0, kind="callback"))
    kept = hub.kept("root")
    assert len(kept) == 1 + MAX_HISTORY + 3
    assert kept[0]["kind"] == "meta" and kept[0]["seq"] == 1
    assert [r["seq"] for r in kept] == sorted(r["seq"] for r in kept)
    assert next(r["data"]["i"] for r in kept if r["kind"] == "node") == 5
    assert hub.kept("root/nope") == []
    tree = hub.tree()
    assert list(tree) == ["root", "root/rank0"]
    assert [r["kind"] for r in tree["root/rank0"]] == ["callback"]
    with pytest.raises(ConfigError):
        hub.kept("root/../x")


# -- tree and node() -------------------------------------------------------------------------------


def test_ancestors_are_created_and_paths_sort_naturally() -> None:
    hub = RecordHub()
    for r in (10, 2, 1):
        hub.publish(rec(f"root/h0/rank{r}"))
    hub.publish(rec("root/h1/rank0"))
    assert hub.paths() == [
        "root",
        "root/h0",
        "root/h0/rank1",
        "root/h0/rank2",
        "root/h0/rank10",
        "root/h1",
        "root/h1/rank0",
    ]
    assert "root/h0" in hub
    assert "root/h2" not in hub
    assert parent_of("root/h0/rank1") == "root/h0"
    assert parent_of("root") is None


def test_node_gives_latest_per_kind_of_the_node_and_its_direct_children() -> None:
    hub = RecordHub()
    hub.publish(rec("root", 1, loss=1.0))
    hub.publish(rec("root/h0", 2))
    hub.publish(rec("root/h0/rank0", 3, loss=2.0))
    hub.publish(rec("root/h0/rank0", 4, loss=1.5))
    hub.publish(rec("root/h0/rank1", 5, kind="event", detail="lost"))
    view = hub.node("root")
    assert view is not None
    assert view["path"] == "root"
    assert view["latest"]["node"]["data"]["loss"] == 1.0
    assert [c["path"] for c in view["children"]] == ["root/h0"]  # not the grandchildren
    host = hub.node("root/h0")
    assert host is not None
    kids = {c["path"]: c["latest"] for c in host["children"]}
    assert kids["root/h0/rank0"]["node"]["data"]["loss"] == 1.5
    assert kids["root/h0/rank0"]["node"]["seq"] == 4
    assert set(kids["root/h0/rank1"]) == {"event"}
    leaf = hub.node("root/h0/rank1")
    assert leaf is not None and leaf["children"] == []


def test_node_of_an_unknown_path_is_none_and_a_bad_path_raises() -> None:
    hub = RecordHub()
    hub.publish(rec("root"))
    assert hub.node("root/nope") is None
    with pytest.raises(ConfigError):
        hub.node("root/../etc")
    with pytest.raises(ConfigError):
        hub.history("root/a b", 1)


class CountingDict(dict[str, Any]):
    """A dict that counts lookups and whole-table walks."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.lookups = 0
        self.walks = 0

    def get(self, key: str, default: Any = None) -> Any:
        self.lookups += 1
        return super().get(key, default)

    def __getitem__(self, key: str) -> Any:
        self.lookups += 1
        return super().__getitem__(key)

    def __contains__(self, key: object) -> bool:
        self.lookups += 1
        return super().__contains__(key)

    def __iter__(self) -> Iterator[str]:
        self.walks += 1
        return super().__iter__()

    def keys(self) -> Any:
        self.walks += 1
        return super().keys()

    def values(self) -> Any:
        self.walks += 1
        return super().values()

    def items(self) -> Any:
        self.walks += 1
        return super().items()


def test_node_touches_one_table_entry_and_the_direct_children_only() -> None:
    hub = RecordHub(max_paths=10_000)
    for h in range(40):  # 40 hosts x 100 ranks = 4041 paths
        for r in range(100):
            hub.publish(rec(f"root/h{h}/rank{r}"))
    table = CountingDict(hub._nodes)
    hub._nodes = table
    children_seen: list[int] = []
    target = table["root/h7"]
    table.lookups = 0

    # The child index of the node is the only collection walked besides the result.
    class CountingChildren(dict[str, Any]):
        def values(self) -> Any:
            children_seen.append(len(self))
            return super().values()

    target.children = CountingChildren(target.children)
    view = hub.node("root/h7")
    assert view is not None and len(view["children"]) == 100
    assert table.lookups == 1
    assert table.walks == 0
    assert children_seen == [100]


# -- history ---------------------------------------------------------------------------------------


def test_history_returns_the_last_n_oldest_first() -> None:
    hub = RecordHub()
    for i in range(30):
        hub.publish(rec("root", i))
    assert [r["data"]["i"] for r in hub.history("root", 4)] == [26, 27, 28, 29]
    assert len(hub.history("root", MAX_HISTORY)) == 30
    assert hub.history("root/unknown", 5) == []


@pytest.mark.parametrize("n", [0, -1, MAX_HISTORY + 1, True, 2.0])
def test_history_refuses_n_out_of_range(n: Any) -> None:
    hub = RecordHub()
    hub.publish(rec("root"))
    with pytest.raises(ConfigError, match="history n"):
        hub.history("root", n)


def test_history_with_children_merges_the_scope_by_seq() -> None:
    hub = RecordHub()
    paths = ["root", "root/rank0", "root/rank1", "root/rank0", "root/h/x", "root", "root/rank1"]
    for i, p in enumerate(paths):
        hub.publish(rec(p, i))
    scoped = hub.history("root", 100, children=True)
    assert [r["path"] for r in scoped] == [p for p in paths if p != "root/h/x"]
    assert [r["seq"] for r in scoped] == sorted(r["seq"] for r in scoped)
    assert [r["path"] for r in hub.history("root", 3, children=True)] == [
        "root/rank0",
        "root",
        "root/rank1",
    ]
    assert [r["path"] for r in hub.history("root", 100)] == ["root", "root"]


# -- subscriptions ---------------------------------------------------------------------------------


async def test_subscription_delivers_later_records_of_its_scope() -> None:
    hub = RecordHub()
    hub.publish(rec("root", 0))
    own = hub.subscribe("root")
    scoped = hub.subscribe("root", children=True)
    rank = hub.subscribe("root/rank0")
    for i, p in enumerate(["root/rank0", "root/h/rank1", "root", "root/rank0"], start=1):
        hub.publish(rec(p, i))
    last = hub.last_seq
    assert [r["path"] for r in await drain(own, 4)] == ["root"]
    assert [r["path"] for r in await drain(scoped, last)] == ["root/rank0", "root", "root/rank0"]
    assert [r["seq"] for r in await drain(rank, last)] == [2, 5]
    for sub in (own, scoped, rank):
        sub.close()
    assert hub.subscriber_count() == 0


async def test_a_deep_subscription_follows_those_kinds_below_its_node() -> None:
    hub = RecordHub()
    sub = hub.subscribe("root", children=True, deep=["callback", "event"])
    host = hub.subscribe("root/h0", deep=["event"])
    sent = [
        ("root/h0/rank0", "node"),  # out: a grandchild's node record
        ("root/h0/rank0", "callback"),
        ("root/h0", "node"),
        ("root/h0/rank1", "event"),
        ("root", "window"),
        ("root/h0/rank1", "resource"),  # out: not a deep kind
    ]
    for i, (path, kind) in enumerate(sent):
        hub.publish(rec(path, i, kind=kind))
    last = hub.last_seq
    got = await drain(sub, last - 1)
    assert [(r["path"], r["kind"]) for r in got] == [
        ("root/h0/rank0", "callback"),
        ("root/h0", "node"),
        ("root/h0/rank1", "event"),
        ("root", "window"),
    ]
    end = hub.publish(rec("root/h0", 99))
    assert end is not None
    assert [(r["path"], r["kind"]) for r in await drain(host, end)] == [
        ("root/h0", "node"),
        ("root/h0/rank1", "event"),
        ("root/h0", "node"),
    ]
    with pytest.raises(ConfigError, match="deep"):
        hub.subscribe("root", deep=["Bad"])
    sub.close()
    host.close()


async def test_subscribe_after_replays_the_kept_records_first() -> None:
    hub = RecordHub()
    for i in range(10):
        hub.publish(rec("root/rank0" if i % 2 else "root", i))
    with hub.subscribe("root", after=4, children=True) as sub:
        hub.publish(rec("root", 10))
        got = await drain(sub, 11)
    assert [r["seq"] for r in got] == [5, 6, 7, 8, 9, 10, 11]
    with hub.subscribe("root", after=0) as sub:
        got = await drain(sub, 11)
    assert [r["seq"] for r in got] == [1, 3, 5, 7, 9, 11]


async def test_history_then_stream_has_no_seam_under_concurrent_publishers() -> None:
    """Subscribers join at random moments while four threads publish; each one's history
    snapshot plus what it streams is exactly the whole scope, in seq order."""
    hub = RecordHub(
        max_per_node=100_000, max_bytes_per_node=2**30, kind_retention={"callback": (10**5, 2**30)}
    )
    hub.publish(make_record("root", "meta", {"reductions": {}}, ts_ms=T0))
    scope: dict[str, Any] = {"children": True, "deep": ["callback"]}
    from_start = hub.subscribe("root", **scope, bound=100_000)
    paths = ["root", "root/rank0", "root/rank1", "root/h/rank2"]  # root/h/rank2: deep only
    per_thread = 2000
    go = threading.Event()

    def publisher(path: str) -> None:
        go.wait()
        for i in range(per_thread):
            # the grandchild's records are in scope every other one (callback, not node)
            deep_one = path == "root/h/rank2" and i % 2 == 1
            hub.publish(rec(path, i, kind="callback" if deep_one else "node"))

    threads = [threading.Thread(target=publisher, args=(p,)) for p in paths]
    for t in threads:
        t.start()
    rng = random.Random(7)
    joins: list[tuple[list[dict[str, Any]], Subscription]] = []
    go.set()
    try:
        while any(t.is_alive() for t in threads) or len(joins) < 3:
            snapshot = hub.history("root", MAX_HISTORY, **scope)
            after = snapshot[-1]["seq"] if snapshot else 0
            sub = hub.subscribe("root", after=after, **scope, bound=100_000)
            joins.append((snapshot, sub))
            await asyncio.sleep(rng.uniform(0, 0.01))
    finally:
        for t in threads:
            t.join()
    end = hub.publish(rec("root", per_thread, kind="event"))
    assert end is not None
    everything = hub.history("root", MAX_HISTORY, **scope)
    # meta + three in-scope publishers + the grandchild's callbacks + end
    assert len(everything) == 1 + 3 * per_thread + per_thread // 2 + 1
    deep = [r for r in everything if r["path"] == "root/h/rank2"]
    assert len(deep) == per_thread // 2 and {r["kind"] for r in deep} == {"callback"}

    streamed_all = await drain(from_start, end)
    assert streamed_all == everything[1:]  # what the stream sent is exactly what history holds
    from_start.close()
    for snapshot, sub in joins:
        streamed = await drain(sub, end)
        sub.close()
        combined = snapshot + streamed
        assert [r["seq"] for r in combined] == [r["seq"] for r in everything]
        assert combined == everything
    assert len(joins) >= 3


async def test_a_slow_subscriber_is_dropped_and_publishing_goes_on() -> None:
    hub = RecordHub()
    slow = hub.subscribe("root", bound=10)
    fast = hub.subscribe("root", bound=1000)
    for i in range(25):
        assert hub.publish(rec("root", i)) == i + 1
    assert slow.dropped and slow.closed
    assert await asyncio.wait_for(slow.get(), WAIT_S) is None
    assert len(await drain(fast, 25)) == 25
    assert hub.subscriber_count() == 1  # the dropped one left the table
    fast.close()


async def test_one_wakeup_per_batch_not_per_record() -> None:
    """A loop that is busy while records pile up gets one callback, not one per record."""
    loop = asyncio.get_running_loop()
    calls = 0
    real = loop.call_soon_threadsafe

    def counting(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        return real(*args, **kwargs)

    hub = RecordHub()
    sub = hub.subscribe("root")
    loop.call_soon_threadsafe = counting  # type: ignore[method-assign,assignment]
    try:
        publisher = threading.Thread(
            target=lambda: [hub.publish(rec("root", i)) for i in range(500)]
        )
        publisher.start()
        publisher.join()
    finally:
        del loop.call_soon_threadsafe
    assert calls == 1
    assert len(await drain(sub, 500)) == 500
    sub.close()


def test_publishing_to_a_subscriber_on_a_closed_loop_does_not_raise() -> None:
    loop = asyncio.new_event_loop()
    hub = RecordHub()
    sub = hub.subscribe("root", loop=loop)
    loop.close()
    assert hub.publish(rec("root", 1)) == 1
    assert hub.publish(rec("root", 2)) == 2
    assert sub.closed
    sub.close()


async def test_close_ends_subscriptions_and_drops_later_publishes() -> None:
    hub = RecordHub()
    hub.publish(rec("root", 1))
    sub = hub.subscribe("root")
    getter = asyncio.ensure_future(sub.get())
    await asyncio.sleep(0)
    hub.close()
    assert await asyncio.wait_for(getter, WAIT_S) is None
    assert hub.publish(rec("root", 2)) is None
    assert [r["seq"] for r in hub.history("root", 5)] == [1]  # reads still work
    late = hub.subscribe("root")
    assert await late.get() is None
    hub.close()  # idempotent


async def test_async_iteration_stops_when_the_subscription_ends() -> None:
    hub = RecordHub()
    sub = hub.subscribe("root")
    for i in range(3):
        hub.publish(rec("root", i))
    hub.close()
    assert [r["data"]["i"] async for r in sub] == []  # close discards what was buffered
    sub2 = RecordHub().subscribe("root")
    sub2.close()
    assert [r async for r in sub2] == []


def test_subscribe_refuses_bad_arguments() -> None:
    hub = RecordHub()
    loop = asyncio.new_event_loop()
    try:
        with pytest.raises(ConfigError):
            hub.subscribe("root/<x>", loop=loop)
        with pytest.raises(ConfigError):
            hub.subscribe("root", after="3", loop=loop)  # type: ignore[arg-type]
    finally:
        loop.close()
    with pytest.raises(RuntimeError):
        hub.subscribe("root")  # no running loop and none given


# -- load ------------------------------------------------------------------------------------------


def test_load_seeds_from_a_record_directory_in_time_order(tmp_path: Path) -> None:
    with RecordLog(tmp_path) as log:
        log.write(make_record("root", "meta", {"reductions": {"loss": "mean"}}, ts_ms=T0))
        for i in range(5):
            log.write(make_record("root/rank1", "node", {"i": i}, ts_ms=T0 + 10 * i + 5))
            log.write(make_record("root/rank0", "node", {"i": i}, ts_ms=T0 + 10 * i))
            log.write(make_record("root", "node", {"i": i}, ts_ms=T0 + 10 * i + 7))
    tree = read_tree(tmp_path)
    tree["root"].append({"garbage": True})
    hub = RecordHub()
    assert hub.load(tree) == 16
    scoped = hub.history("root", 100, children=True)
    assert [r["ts"] for r in scoped] == sorted(r["ts"] for r in scoped)
    assert [r["seq"] for r in scoped] == list(range(1, 17))
    meta = hub.meta()
    assert meta is not None and meta["data"]["reductions"] == {"loss": "mean"}
