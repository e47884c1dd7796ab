"""The live record store behind the dashboard: bounded rings of recent records per node.

:class:`RecordHub` keeps, for every node path of the record tree (``root``, ``root/<host>``,
``root/<host>/rank3``), the most recent records in rings bounded by count and by bytes (the
length of each record's JSON text), the latest record of each ``kind``, and an index of the
node's direct children. Most kinds share the node's main ring; the kinds of
:data:`DEFAULT_KIND_RETENTION` (``window``, ``eval``, ``contribution``, ``callback``,
``resource``, ``event``, ``job``) each have a ring of their own, so that a flood of one kind
(a ``window`` record per averaging cycle) never evicts another (the run's ``eval`` records,
the loss chart's ``node`` records). Producers :meth:`~RecordHub.publish` from any thread;
the dashboard reads snapshots (:meth:`~RecordHub.node`, :meth:`~RecordHub.history`) and
follows new records through :class:`Subscription` objects on its asyncio loop.

Rules:
    - **One sequence.** :meth:`~RecordHub.publish` stamps every record it keeps with ``seq``,
      increasing by one per kept record across the whole hub. Every reader sees records with
      their ``seq``, so readers dedupe and resume by it.
    - **No seam between history and stream.** Appending a record to its ring and handing it
      to the subscribers happen under one lock, and :meth:`~RecordHub.subscribe` takes its
      backlog (``seq > after`` from the rings) and registers under the same lock. So for any
      ``after``, the records a subscription yields are exactly the records of its scope with
      ``seq > after``, in ``seq`` order, without gap or duplicate (as long as the rings still
      hold them), and :meth:`~RecordHub.history` returns the newest kept records of that
      sequence (a contiguous tail while no ring of the scope has evicted: a kind with a ring
      of its own can keep records older than the main ring's oldest).
    - **Publishing never blocks and never raises.** A bad record is dropped (logged once per
      hub, then at DEBUG). A subscriber whose undelivered records reach its bound is dropped
      (its :meth:`Subscription.get` returns ``None``) instead of slowing the publisher.
    - **Reads cost what they return.** :meth:`~RecordHub.node` looks up one node and walks its
      direct children (a per-node child index), never the whole path table.

Scope (a choice; the original is silent): a node's *scope* is the node itself, plus its
direct children with ``children=True``, plus, with ``deep=kinds``, the records of those kinds
at any node below it (children included). It is the same for :meth:`~RecordHub.history` and
:meth:`~RecordHub.subscribe`; :meth:`~RecordHub.history` can also keep only some ``kinds`` of
its scope. The page subscribes with ``children=True`` and ``deep`` = the kinds its run panels
read at rank nodes of any depth (``callback``, ``resource``, ``event``): it shows a node and a
table of its children, and one stream per page keeps browsers under their
six-connections-per-host limit.

Other choices:
    - Records are stored as their JSON text (``allow_nan=False``; NaN and ±inf become ``null``
      so a browser's ``JSON.parse`` accepts them) and decoded on every read: a reader never
      shares a dict with the hub or another reader, and text costs a fraction of the memory of
      nested dicts.
    - Publishing a record also creates its ancestors (``root/a/rank0`` creates ``root/a`` and
      ``root``) so the tree can be walked from ``root`` before interior nodes report.
    - The latest record of each kind survives ring eviction (``meta`` is the first record of a
      run and must outlive the ring); :meth:`~RecordHub.kept` (what the saved dashboard
      embeds) returns it with the rings.
    - Memory per node is bounded by ``max_bytes_per_node`` plus the byte bounds of the kind
      rings it uses (the coordinator writes ``window``, ``eval``, ``contribution`` and ``job``
      at ``root`` only).
    - A record whose text alone exceeds its ring's byte bound, and any record for a new path
      once ``max_paths`` paths exist, is dropped.

Threads: every method may be called from any thread. A :class:`Subscription` is consumed on
the event loop it was created for.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import json
import logging
import threading
from collections import deque
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from types import MappingProxyType
from typing import Any, Final, Self

from flodl.errors import ConfigError
from flodl.monitor.hub_entries import (
    Dropped,
    Entry,
    Node,
    Ring,
    check,
    encode,
    finite,
    kind_set,
    natural_key,
    parent_of,
)
from flodl.monitor.records import validate_kind, validate_path

__all__ = [
    "DEFAULT_MAX_PER_NODE",
    "DEFAULT_MAX_BYTES_PER_NODE",
    "DEFAULT_MAX_PATHS",
    "DEFAULT_SUBSCRIBER_BOUND",
    "DEFAULT_KIND_RETENTION",
    "MAX_HISTORY",
    "RecordHub",
    "Subscription",
    "parent_of",
    "finite",
]

logger = logging.getLogger(__name__)

DEFAULT_MAX_PER_NODE: Final = 10_000
DEFAULT_MAX_BYTES_PER_NODE: Final = 2 * 2**20
DEFAULT_MAX_PATHS: Final = 4096
DEFAULT_SUBSCRIBER_BOUND: Final = 4096
MAX_HISTORY: Final = 10_000
"""The most records one :meth:`RecordHub.history` call or subscription backlog returns."""
DEFAULT_KIND_RETENTION: Final[Mapping[str, tuple[int, int]]] = MappingProxyType(
    {
        # kind: (most records, most bytes) of its own ring at each node
        # one per averaging cycle (~110 bytes a rank); the page draws the last 20
        "window": (256, 16 * 2**20),
        "eval": (4096, 2**20),  # one per eval: all of a run's (one per epoch: 4096 epochs)
        "contribution": (64, 8 * 2**20),  # one per epoch, a row per rank (~400 bytes)
        "callback": (1024, 2**18),  # eval, checkpoint, epoch_fn wall times
        "resource": (64, 2**17),  # resource samples of one rank
        "event": (1000, 2**19),  # alerts (collapsed by the alert lane)
        "job": (16, 2**18),  # one per training start (a resumed segment too)
    }
)
"""Kinds kept in a ring of their own at each node, apart from the node's main ring."""


class Subscription:
    """Records published after a point, for one consumer on one asyncio loop.

    Created by :meth:`RecordHub.subscribe`. The hub appends to a private buffer under its lock
    and wakes the consumer with one ``loop.call_soon_threadsafe`` per empty→non-empty
    transition, so a stalled loop never accumulates one callback per record. When the buffer
    holds ``bound`` undelivered records the subscription is dropped: the buffer is cleared,
    :attr:`dropped` becomes true and :meth:`get` returns ``None``.

    Consume with ``await sub.get()`` / ``await sub.get_json()`` or ``async for record in sub``;
    call :meth:`close` when done (also usable as a context manager).
    """

    def __init__(
        self,
        hub: RecordHub,
        path: str,
        children: bool,
        loop: asyncio.AbstractEventLoop,
        bound: int,
        deep: frozenset[str] = frozenset(),
    ) -> None:
        self.path = path
        self.children = children
        self.deep = deep
        self._hub = hub
        self._loop = loop
        self._bound = bound
        self._buffer: deque[Entry] = deque()
        self._wakeup = asyncio.Event()
        self._wake_pending = False
        self._closed = False
        self.dropped = False
        """True when the hub dropped this subscriber for falling ``bound`` records behind."""

    # -- hub side (called with the hub lock held, from any thread) -----------------------------

    def _offer(self, entry: Entry) -> bool:
        """Buffer ``entry``; False when this subscriber is (now) dropped."""
        if self._closed:
            return False
        if len(self._buffer) >= self._bound:
            self.dropped = True
            self._end_locked()
            return False
        self._buffer.append(entry)
        self._wake()
        return True

    def _end_locked(self) -> None:
        self._closed = True
        self._buffer.clear()
        self._wake()

    def _wake(self) -> None:
        if self._wake_pending:
            return
        self._wake_pending = True
        try:
            self._loop.call_soon_threadsafe(self._on_wake)
        except RuntimeError:  # the consumer's loop is closed: nobody will read this again
            self._closed = True
            self._buffer.clear()

    # -- consumer side (on the loop) ----------------------------------------------------------

    def _on_wake(self) -> None:
        with self._hub._lock:
            self._wake_pending = False
        self._wakeup.set()

    async def get_json(self) -> tuple[int, str] | None:
        """The next record as ``(seq, JSON text)``, waiting for one; ``None`` once closed."""
        while True:
            with self._hub._lock:
                if self._buffer:
                    entry = self._buffer.popleft()
                    return entry.seq, entry.text
                if self._closed:
                    return None
                self._wakeup.clear()
            await self._wakeup.wait()

    async def get(self) -> dict[str, Any] | None:
        """The next record (a fresh dict with ``seq``), waiting for one; ``None`` once closed."""
        item = await self.get_json()
        if item is None:
            return None
        decoded: dict[str, Any] = json.loads(item[1])
        return decoded

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> dict[str, Any]:
        record = await self.get()
        if record is None:
            raise StopAsyncIteration
        return record

    @property
    def closed(self) -> bool:
        """True once closed by the consumer, dropped, or ended by :meth:`RecordHub.close`."""
        return self._closed

    def close(self) -> None:
        """Unsubscribe. Records already buffered are discarded. Idempotent; any thread."""
        self._hub._unsubscribe(self)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class RecordHub:
    """Thread-safe in-memory store of recent records per node, with live subscriptions.

    Args:
        max_per_node: most records kept in one node's ring.
        max_bytes_per_node: most bytes of record JSON text kept in one node's ring; a record
            larger than this on its own is dropped.
        max_paths: most distinct node paths (ancestors included); a record for a new path
            beyond it is dropped.
        subscriber_bound: undelivered records after which a subscriber is dropped.
        kind_retention: kind → ``(most records, most bytes)`` of the ring of its own each node
            keeps for it (default :data:`DEFAULT_KIND_RETENTION`); other kinds share the main
            ring (``max_per_node``, ``max_bytes_per_node``).

    Raises:
        ConfigError: a bound below 1, or a bad kind in ``kind_retention``.
    """

    def __init__(
        self,
        *,
        max_per_node: int = DEFAULT_MAX_PER_NODE,
        max_bytes_per_node: int = DEFAULT_MAX_BYTES_PER_NODE,
        max_paths: int = DEFAULT_MAX_PATHS,
        subscriber_bound: int = DEFAULT_SUBSCRIBER_BOUND,
        kind_retention: Mapping[str, tuple[int, int]] = DEFAULT_KIND_RETENTION,
    ) -> None:
        bounds = [
            ("max_per_node", max_per_node),
            ("max_bytes_per_node", max_bytes_per_node),
            ("max_paths", max_paths),
            ("subscriber_bound", subscriber_bound),
        ]
        retention: dict[str, tuple[int, int]] = {}
        for kind, pair in kind_retention.items():
            try:
                validate_kind(kind)
            except ConfigError as exc:
                raise ConfigError(f"RecordHub kind_retention: {exc}") from None
            if not isinstance(pair, tuple) or len(pair) != 2:
                raise ConfigError(
                    f"RecordHub kind_retention[{kind!r}]={pair!r} must be (records, bytes)"
                )
            bounds += [(f"kind_retention[{kind!r}] records", pair[0])]
            bounds += [(f"kind_retention[{kind!r}] bytes", pair[1])]
            retention[kind] = pair
        for name, value in bounds:
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"RecordHub {name}={value!r} must be an int >= 1")
        self.kind_retention: Mapping[str, tuple[int, int]] = MappingProxyType(retention)
        self.max_per_node = max_per_node
        self.max_bytes_per_node = max_bytes_per_node
        self.max_paths = max_paths
        self.subscriber_bound = subscriber_bound
        self._lock = threading.Lock()
        self._nodes: dict[str, Node] = {}
        self._subs: dict[str, set[Subscription]] = {}
        self._seq = 0
        self._closed = False
        self._warned = False

    # -- writing -------------------------------------------------------------------------------

    def publish(self, record: Mapping[str, Any]) -> int | None:
        """Keep ``record`` (a copy stamped with ``seq``) and hand it to the subscribers.

        Never raises: a malformed, non-serializable or oversize record, a record for a new
        path beyond ``max_paths``, or any record after :meth:`close` is dropped.

        Returns:
            the record's ``seq``, or ``None`` when it was dropped.
        """
        try:
            path, kind = check(record)
            body = dict(record)
            body.pop("seq", None)
            text = encode(body)  # checks serializability before a seq is spent
        except Dropped as exc:
            self._warn_bad(str(exc))
            return None
        with self._lock:
            if self._closed:
                return None
            node = self._nodes.get(path)
            if node is None:
                node = self._create_locked(path)
                if node is None:
                    self._warn_bad(f"more than {self.max_paths} node paths")
                    return None
            seq = self._seq + 1
            # `seq` first, then the body: a JSON object with the body's fields plus seq.
            entry = Entry(seq, kind, f'{{"seq":{seq},{text[1:]}')
            ring = self._ring_locked(node, kind)
            if len(entry.text) > ring.max_bytes:
                self._warn_bad(
                    f"a {len(entry.text)}-byte {kind} record exceeds its ring's byte bound "
                    f"({ring.max_bytes})"
                )
                return None
            self._seq = seq
            ring.add(entry)
            node.latest[kind] = entry
            dropped: list[Subscription] = []
            for sub in self._subs.get(path, ()):
                if not sub._offer(entry):
                    dropped.append(sub)
            # Ancestors' subscribers whose scope holds it: the parent's with children=True,
            # and any ancestor's whose deep kinds name it (the scope rule of _scope_locked).
            up, depth = parent_of(path), 1
            while up is not None:
                for sub in self._subs.get(up, ()):
                    if ((depth == 1 and sub.children) or kind in sub.deep) and not sub._offer(
                        entry
                    ):
                        dropped.append(sub)
                up, depth = parent_of(up), depth + 1
            for sub in dropped:
                self._discard_locked(sub)
                logger.warning(
                    "dropped a dashboard subscriber of %s: %d records behind", sub.path, sub._bound
                )
            return seq

    def _create_locked(self, path: str) -> Node | None:
        """Create ``path`` and any missing ancestors; ``None`` if that passes ``max_paths``."""
        missing = [path]
        parent = parent_of(path)
        while parent is not None and parent not in self._nodes:
            missing.append(parent)
            parent = parent_of(parent)
        if len(self._nodes) + len(missing) > self.max_paths:
            return None
        for p in reversed(missing):  # ancestors first
            node = self._nodes[p] = Node(p, Ring(self.max_per_node, self.max_bytes_per_node))
            up = parent_of(p)
            if up is not None:
                self._nodes[up].children[p] = node
        return self._nodes[path]

    def load(self, records_by_path: Mapping[str, Sequence[Mapping[str, Any]]]) -> int:
        """Seed the hub from a saved tree (as :func:`flodl.monitor.records.read_tree` returns).

        Records are published in timestamp order (stable: per-node order kept on ties), so
        ``seq`` follows time across nodes. Bad records are dropped as in :meth:`publish`.

        Returns:
            how many records were kept.
        """

        def keyed(path: str, records: Sequence[Mapping[str, Any]]) -> Iterator[tuple[Any, ...]]:
            for i, rec in enumerate(records):
                ts = rec.get("ts") if isinstance(rec, Mapping) else None
                yield (ts if isinstance(ts, int) and not isinstance(ts, bool) else 0, path, i, rec)

        merged = heapq.merge(
            *(keyed(p, recs) for p, recs in sorted(records_by_path.items())),
            key=lambda t: t[:3],
        )
        return sum(self.publish(t[3]) is not None for t in merged)

    def _ring_locked(self, node: Node, kind: str) -> Ring:
        """The ring ``kind``'s records go to at ``node`` (created on first use)."""
        bounds = self.kind_retention.get(kind)
        if bounds is None:
            return node.ring
        ring = node.kind_rings.get(kind)
        if ring is None:
            ring = node.kind_rings[kind] = Ring(*bounds)
        return ring

    def _warn_bad(self, why: str) -> None:
        if self._warned:
            logger.debug("dropped a record: %s", why)
            return
        self._warned = True
        logger.warning("dropped a record: %s (further drops are logged at DEBUG)", why)

    # -- reading -------------------------------------------------------------------------------

    def paths(self) -> list[str]:
        """Every node path, sorted (``root`` first, ``rank2`` before ``rank10``)."""
        with self._lock:
            keys = list(self._nodes)
        return sorted(keys, key=lambda p: [natural_key(s) for s in p.split("/")])

    def __contains__(self, path: object) -> bool:
        with self._lock:
            return path in self._nodes

    @property
    def last_seq(self) -> int:
        """``seq`` of the newest kept record; 0 before the first."""
        with self._lock:
            return self._seq

    def node(self, path: str) -> dict[str, Any] | None:
        """The latest record of each kind at ``path`` and at each direct child.

        Costs one lookup plus the node's direct children (never a scan of all paths).

        Returns:
            ``{"path", "latest": {kind: record}, "children": [{"path", "latest"}, ...]}`` with
            children in natural order, or ``None`` for an unknown path.

        Raises:
            ConfigError: ``path`` is not a valid node path.
        """
        validate_path(path)
        with self._lock:
            node = self._nodes.get(path)
            if node is None:
                return None
            own = dict(node.latest)
            kids = [(child.path, dict(child.latest)) for child in node.children.values()]
        kids.sort(key=lambda kid: natural_key(kid[0]))
        return {
            "path": path,
            "latest": _decode_latest(own),
            "children": [{"path": p, "latest": _decode_latest(lt)} for p, lt in kids],
        }

    def history(
        self,
        path: str,
        n: int = 200,
        *,
        children: bool = False,
        deep: Collection[str] = (),
        kinds: Collection[str] | None = None,
    ) -> list[dict[str, Any]]:
        """The last ``n`` records in the scope of ``path``, oldest first (by ``seq``).

        Args:
            path: node path.
            n: how many, 1 to :data:`MAX_HISTORY`.
            children: include the records of the direct children (merged by ``seq``).
            deep: include the records of these kinds at every node below ``path``.
            kinds: keep only records of these kinds (``None``: every kind of the scope).

        Returns:
            records with ``seq`` (fresh dicts); ``[]`` for an unknown path.

        Raises:
            ConfigError: a bad path, ``n`` out of range, or a bad kind.
        """
        texts = self._history_texts(path, n, children, deep, kinds)
        return [json.loads(t) for t in texts]

    def history_json(
        self,
        path: str,
        n: int = 200,
        *,
        children: bool = False,
        deep: Collection[str] = (),
        kinds: Collection[str] | None = None,
    ) -> str:
        """:meth:`history` as one JSON array text, joined from the kept texts (no re-encoding).

        Raises:
            ConfigError: a bad path, ``n`` out of range, or a bad kind.
        """
        return "[" + ",".join(self._history_texts(path, n, children, deep, kinds)) + "]"

    def _history_texts(
        self,
        path: str,
        n: int,
        children: bool,
        deep: Collection[str],
        kinds: Collection[str] | None,
    ) -> list[str]:
        validate_path(path)
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_HISTORY:
            raise ConfigError(f"history n={n!r} must be an int in [1, {MAX_HISTORY}]")
        deep_set = kind_set(deep, "history deep") or frozenset()
        only = kind_set(kinds, "history kinds")
        with self._lock:
            node = self._nodes.get(path)
            if node is None:
                return []
            entries = self._tail_locked(node, children, deep_set, n, after=0, kinds=only)
            texts = [e.text for e in entries]
        texts.reverse()
        return texts

    def _scope_locked(
        self, node: Node, children: bool, deep: frozenset[str], kinds: frozenset[str] | None
    ) -> list[Iterable[Entry]]:
        """Newest-first iterables over the kept entries of ``node``'s scope: the node's own
        records, its children's (``children``), the ``deep`` kinds' at every node below it;
        only ``kinds`` of them when given. The scope rule ``publish`` offers records by."""
        out: list[Iterable[Entry]] = []

        def take(n: Node, allowed: frozenset[str] | None) -> None:
            if kinds is not None:
                allowed = kinds if allowed is None else allowed & kinds
            if allowed is None:
                out.append(reversed(n.ring.entries))
                out.extend(reversed(r.entries) for r in n.kind_rings.values())
                return
            out.extend(reversed(r.entries) for k, r in n.kind_rings.items() if k in allowed)
            if any(k not in self.kind_retention for k in allowed):
                shared = allowed - self.kind_retention.keys()
                out.append(e for e in reversed(n.ring.entries) if e.kind in shared)

        take(node, None)
        level = list(node.children.values())
        first = True
        while level and (deep or (first and children)):
            for child in level:
                take(child, None if first and children else deep)
            level = [grand for child in level for grand in child.children.values()]
            first = False
        return out

    def _tail_locked(
        self,
        node: Node,
        children: bool,
        deep: frozenset[str],
        n: int,
        after: int,
        kinds: frozenset[str] | None = None,
    ) -> list[Entry]:
        """Up to ``n`` newest entries of the scope with ``seq > after``, newest first."""
        rings = self._scope_locked(node, children, deep, kinds)
        newest_first = heapq.merge(*rings, key=_neg_seq)
        return list(itertools.islice(itertools.takewhile(lambda e: e.seq > after, newest_first), n))

    def kept(self, path: str) -> list[dict[str, Any]]:
        """Every record kept for the node ``path`` (all its rings, and the latest of each kind
        that its ring evicted), oldest first; ``[]`` for an unknown path. What the saved
        dashboard embeds: not capped at :data:`MAX_HISTORY` (the rings bound it).

        Raises:
            ConfigError: a bad path.
        """
        validate_path(path)
        with self._lock:
            node = self._nodes.get(path)
            if node is None:
                return []
            entries = {e.seq: e for e in node.latest.values()}
            for ring in (node.ring, *node.kind_rings.values()):
                entries.update((e.seq, e) for e in ring.entries)
            texts = [entries[s].text for s in sorted(entries)]
        return [json.loads(t) for t in texts]

    def tree(self) -> dict[str, list[dict[str, Any]]]:
        """:meth:`kept` of every node path (in :meth:`paths` order): the saved dashboard's
        record tree."""
        return {path: self.kept(path) for path in self.paths()}

    def meta(self) -> dict[str, Any] | None:
        """The latest ``meta`` record at ``root``, or ``None``."""
        with self._lock:
            root = self._nodes.get("root")
            entry = None if root is None else root.latest.get("meta")
        if entry is None:
            return None
        decoded: dict[str, Any] = json.loads(entry.text)
        return decoded

    # -- following -----------------------------------------------------------------------------

    def subscribe(
        self,
        path: str,
        *,
        after: int | None = None,
        children: bool = False,
        deep: Collection[str] = (),
        loop: asyncio.AbstractEventLoop | None = None,
        bound: int | None = None,
    ) -> Subscription:
        """Follow the records in the scope of ``path``.

        Args:
            path: node path; it need not exist yet.
            after: also deliver the kept records with ``seq > after`` first (at most
                :data:`MAX_HISTORY`, the newest), atomically with registering, so
                ``history`` then ``subscribe(after=last seq seen)`` has no gap and no
                duplicate. ``None``: only records published from now on.
            children: include the direct children's records.
            deep: include the records of these kinds at every node below ``path``.
            loop: the consumer's event loop; default the running loop.
            bound: undelivered records after which the subscriber is dropped (default the
                hub's ``subscriber_bound``), counted on top of the backlog.

        Raises:
            ConfigError: a bad path, ``after`` or kind.
            RuntimeError: no ``loop`` given and none running.
        """
        validate_path(path)
        if after is not None and (isinstance(after, bool) or not isinstance(after, int)):
            raise ConfigError(f"subscribe after={after!r} must be an int or None")
        deep_set = kind_set(deep, "subscribe deep") or frozenset()
        if loop is None:
            loop = asyncio.get_running_loop()
        sub = Subscription(self, path, children, loop, bound or self.subscriber_bound, deep_set)
        with self._lock:
            if self._closed:
                sub._end_locked()
                return sub
            node = self._nodes.get(path)
            if after is not None and node is not None:
                backlog = self._tail_locked(
                    node, children, deep_set, MAX_HISTORY, after=max(after, 0)
                )
                backlog.reverse()
                sub._buffer.extend(backlog)
                sub._bound += len(backlog)  # the bound counts records behind *after* the backlog
                if backlog:
                    sub._wake()
            self._subs.setdefault(path, set()).add(sub)
        return sub

    def _unsubscribe(self, sub: Subscription) -> None:
        with self._lock:
            self._discard_locked(sub)
            sub._closed = True
            sub._buffer.clear()

    def _discard_locked(self, sub: Subscription) -> None:
        subs = self._subs.get(sub.path)
        if subs is not None:
            subs.discard(sub)
            if not subs:
                del self._subs[sub.path]

    def subscriber_count(self) -> int:
        """How many live subscriptions the hub holds."""
        with self._lock:
            return sum(len(s) for s in self._subs.values())

    def close(self) -> None:
        """End every subscription (their ``get`` returns ``None``); later publishes are dropped.

        Reads keep working on what was kept. Idempotent.
        """
        with self._lock:
            self._closed = True
            for subs in self._subs.values():
                for sub in subs:
                    sub._end_locked()
            self._subs.clear()


def _neg_seq(entry: Entry) -> int:
    return -entry.seq


def _decode_latest(latest: dict[str, Entry]) -> dict[str, Any]:
    return {kind: json.loads(entry.text) for kind, entry in sorted(latest.items())}
