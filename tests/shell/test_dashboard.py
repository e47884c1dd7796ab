"""The dashboard HTTP server over real loopback sockets, and the saved (archive) dashboard.

Every test binds a :class:`DashboardServer` on ``127.0.0.1:0`` around a seeded
:class:`RecordHub` and talks raw HTTP/1.1 with ``asyncio.open_connection`` (the server answers
one request per connection and closes). Waits are bounded by ``WAIT_S``; a negative check is a
short bounded wait. The :func:`serving` harness closes the server on exit and fails the test if
any callback error reached the event loop's exception handler.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import json
import logging
import os
import re
import select
import socket
import struct
import sys
import threading
import urllib.request
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from flodl.errors import ConfigError
from flodl.monitor.archive import archive_json, save_dashboard, serve_directory
from flodl.monitor.dashboard import (
    THEME_LINE,
    DashboardServer,
    DashboardThread,
    page_csp,
    page_html,
)
from flodl.monitor.hub import RecordHub
from flodl.monitor.records import RecordLog, make_record

WAIT_S = 5.0
T0 = 1_700_000_000_000
SERVER_LOGGER = "flodl.monitor.dashboard"


# ---------------------------------------------------------------------------------------------
# Harness
# ---------------------------------------------------------------------------------------------


def seeded_hub() -> RecordHub:
    """A 2-rank run: meta, 5 steps of root/rank0/rank1 node records, one event."""
    hub = RecordHub()
    hub.publish(
        make_record(
            "root",
            "meta",
            {"reductions": {"loss": "mean", "throughput": "sum"}, "run": {"world_size": 2}},
            ts_ms=T0,
        )
    )
    for i in range(5):
        for r in (0, 1):
            hub.publish(
                make_record(
                    f"root/rank{r}",
                    "node",
                    {"loss": 1.0 / (i + 1), "throughput": 100.0 * (r + 1), "steps": i},
                    ts_ms=T0 + 1000 * i,
                )
            )
        hub.publish(make_record("root", "node", {"loss": 1.0 / (i + 1)}, ts_ms=T0 + 1000 * i))
    hub.publish(
        make_record(
            "root",
            "event",
            {"class": "rank_lost", "detail": "rank 1 <b>silent</b>", "count": 1},
            sev="critical",
            ts_ms=T0 + 5000,
        )
    )
    return hub


@dataclass
class Response:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def parse_response(raw: bytes) -> Response:
    head, sep, body = raw.partition(b"\r\n\r\n")
    assert sep, f"no complete response head in {raw[:200]!r}"
    lines = head.decode("ascii").split("\r\n")
    version, status, _ = lines[0].split(" ", 2)
    assert version == "HTTP/1.1"
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return Response(int(status), headers, body)


async def exchange(port: int, raw: bytes) -> Response | None:
    """Send ``raw``, read until the server closes; ``None`` if it closed without an answer."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        try:
            writer.write(raw)
            await writer.drain()
        except ConnectionError:
            pass
        try:
            data = await asyncio.wait_for(reader.read(), WAIT_S)
        except ConnectionError:
            return None
        return parse_response(data) if data else None
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


async def get(port: int, target: str, *headers: str) -> Response:
    extra = "".join(h + "\r\n" for h in headers)
    raw = f"GET {target} HTTP/1.1\r\nHost: 127.0.0.1\r\n{extra}\r\n".encode()
    response = await exchange(port, raw)
    assert response is not None, f"no answer to GET {target}"
    return response


@dataclass
class Served:
    server: DashboardServer
    hub: RecordHub
    loop_errors: list[dict[str, Any]]

    @property
    def port(self) -> int:
        return self.server.port


@contextlib.asynccontextmanager
async def serving(hub: RecordHub | None = None, **server_kw: Any) -> AsyncIterator[Served]:
    hub = seeded_hub() if hub is None else hub
    server = DashboardServer(hub, **server_kw)
    served = Served(server, hub, [])
    loop = asyncio.get_running_loop()
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, context: served.loop_errors.append(context))
    try:
        await server.start()
        yield served
    finally:
        try:
            await asyncio.wait_for(server.close(), WAIT_S)
        finally:
            loop.set_exception_handler(previous)
    assert served.loop_errors == []


class SseClient:
    """One ``/stream`` connection: the response head, then events and comments."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.comments: list[str] = []

    @classmethod
    async def open(cls, port: int, target: str, *headers: str) -> tuple[SseClient, Response]:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        extra = "".join(h + "\r\n" for h in headers)
        writer.write(f"GET {target} HTTP/1.1\r\nHost: x\r\n{extra}\r\n".encode())
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), WAIT_S)
        return cls(reader, writer), parse_response(head)

    async def event(self) -> dict[str, str] | None:
        """The next event (``{"id", "data"}``); comments are collected; ``None`` at EOF."""
        fields: dict[str, str] = {}
        while True:
            line = await asyncio.wait_for(self.reader.readline(), WAIT_S)
            if not line:
                return None
            text = line.decode().rstrip("\n")
            if text == "":
                if fields:
                    return fields
                continue
            if text.startswith(":"):
                self.comments.append(text[1:].strip())
                continue
            name, _, value = text.partition(": ")
            fields[name] = value

    async def records(self, count: int) -> list[dict[str, Any]]:
        out = []
        for _ in range(count):
            ev = await self.event()
            assert ev is not None, "stream ended early"
            record = json.loads(ev["data"])
            assert ev["id"] == str(record["seq"])
            out.append(record)
        return out

    async def close(self) -> None:
        self.writer.close()
        with contextlib.suppress(ConnectionError):
            await self.writer.wait_closed()


def script_hash(html: str) -> str:
    [script] = re.findall(r"<script>(.*?)</script>", html, re.DOTALL)
    return base64.b64encode(hashlib.sha256(script.encode()).digest()).decode()


def assert_hardened(response: Response) -> None:
    h = response.headers
    assert h["cache-control"] == "no-store"
    assert h["x-content-type-options"] == "nosniff"
    assert "default-src 'none'" in h["content-security-policy"]
    assert "unsafe-inline" not in h["content-security-policy"]
    assert h["connection"] == "close"
    assert int(h["content-length"]) == len(response.body)


# ---------------------------------------------------------------------------------------------
# Endpoints
# ---------------------------------------------------------------------------------------------


async def test_root_serves_the_page_with_a_hash_pinned_csp() -> None:
    async with serving() as s:
        r = await get(s.port, "/")
    assert r.status == 200
    assert r.headers["content-type"] == "text/html; charset=utf-8"
    assert_hardened(r)
    html = r.body.decode()
    hooks = ("breadcrumb", "loss-chart", "throughput-chart", "children", "alerts", "cadence")
    run_hooks = ("run-panels", "eval-chart", "timeline", "roster", "resources", "contribution")
    for hook in hooks + run_hooks:
        assert f'id="{hook}"' in html
    assert html.count(THEME_LINE) == 1
    csp = r.headers["content-security-policy"]
    assert f"'sha256-{script_hash(html)}'" in csp
    assert "connect-src 'self'" in csp
    assert "frame-ancestors 'none'" in csp
    assert "http://" not in html.replace("http://www.w3.org/2000/svg", "")
    assert "https://" not in html


async def test_a_pinned_theme_replaces_the_theme_line() -> None:
    async with serving(theme="dark") as s:
        html = (await get(s.port, "/")).body.decode()
    assert 'const ARCHIVE_THEME="dark";' in html
    assert THEME_LINE not in html
    with pytest.raises(ConfigError, match="theme"):
        DashboardServer(RecordHub(), theme="blue")


async def test_paths_node_history_and_meta() -> None:
    async with serving() as s:
        paths = await get(s.port, "/paths")
        node = await get(s.port, "/node?path=root")
        leaf = await get(s.port, "/node?path=root%2Frank1")
        hist = await get(s.port, "/history?path=root/rank0&n=3")
        default_n = await get(s.port, "/history?path=root/rank0")
        scoped = await get(s.port, "/history?path=root&n=4&children=1")
        meta = await get(s.port, "/meta")
        empty_meta = None
    for r in (paths, node, leaf, hist, default_n, scoped, meta):
        assert r.status == 200
        assert r.headers["content-type"] == "application/json"
        assert_hardened(r)
    assert paths.json() == ["root", "root/rank0", "root/rank1"]
    view = node.json()
    assert view["path"] == "root"
    assert set(view["latest"]) == {"meta", "node", "event"}
    assert [c["path"] for c in view["children"]] == ["root/rank0", "root/rank1"]
    assert leaf.json()["children"] == []
    assert [rec["data"]["steps"] for rec in hist.json()] == [2, 3, 4]
    assert len(default_n.json()) == 5
    assert [rec["seq"] for rec in scoped.json()] == [14, 15, 16, 17]
    assert meta.json()["kind"] == "meta" and meta.json()["seq"] == 1
    async with serving(RecordHub()) as s:
        empty_meta = await get(s.port, "/meta")
        empty_paths = await get(s.port, "/paths")
    assert empty_meta.status == 200 and empty_meta.json() is None
    assert empty_paths.json() == []


async def test_stream_sends_published_records_as_sse() -> None:
    async with serving() as s:
        client, head = await SseClient.open(s.port, "/stream?path=root&children=1")
        try:
            assert head.status == 200
            assert head.headers["content-type"] == "text/event-stream; charset=utf-8"
            assert head.headers["cache-control"] == "no-store"
            assert "content-length" not in head.headers

            def publish() -> None:  # from another thread, as the coordinator does
                for i in range(3):
                    s.hub.publish(make_record("root/rank0", "node", {"i": i}, ts_ms=T0))
                s.hub.publish(make_record("root/x/rank9", "node", {"i": 9}, ts_ms=T0))
                s.hub.publish(make_record("root", "event", {"class": "drift"}, ts_ms=T0))

            await asyncio.to_thread(publish)
            got = await client.records(4)
        finally:
            await client.close()
    assert [r["path"] for r in got] == ["root/rank0"] * 3 + ["root"]
    assert [r["seq"] for r in got] == [18, 19, 20, 22]
    assert got[-1]["data"] == {"class": "drift"}


def run_hub() -> RecordHub:
    """A two-host run: root's run records and rank records two levels below root."""
    hub = RecordHub()
    rows: list[tuple[str, str, dict[str, Any]]] = [
        ("root", "node", {"loss": 1.0}),
        ("root", "window", {"cycle": 0, "ranks": [0, 1]}),
        ("root/h0", "node", {"loss": 1.0}),
        ("root/h0/rank0", "node", {"loss": 1.0}),
        ("root/h0/rank0", "callback", {"fn": "eval", "elapsed_ms": 12.0}),
        ("root", "eval", {"epoch": 0, "metric": 0.5, "rank": 0}),
        ("root/h1/rank1", "resource", {"cpu_percent": 50.0}),
        ("root/h1/rank1", "event", {"class": "rank_lost", "detail": "gone"}),
    ]
    for i, (path, kind, data) in enumerate(rows):
        hub.publish(make_record(path, kind, data, ts_ms=T0 + i))
    return hub


async def test_history_deep_and_kinds_widen_and_narrow_the_scope() -> None:
    async with serving(run_hub()) as s:
        scoped = await get(s.port, "/history?path=root&children=1&deep=callback,resource,event")
        deep_only = await get(
            s.port, "/history?path=root&deep=callback,resource,event&kinds=callback,resource,event"
        )
        evals = await get(s.port, "/history?path=root&kinds=eval&n=10000")
    for r in (scoped, deep_only, evals):
        assert r.status == 200
        assert_hardened(r)
    assert [(x["path"], x["kind"]) for x in scoped.json()] == [
        ("root", "node"),
        ("root", "window"),
        ("root/h0", "node"),
        ("root/h0/rank0", "callback"),
        ("root", "eval"),
        ("root/h1/rank1", "resource"),
        ("root/h1/rank1", "event"),
    ]
    assert [x["kind"] for x in deep_only.json()] == ["callback", "resource", "event"]
    assert [x["data"]["metric"] for x in evals.json()] == [0.5]


async def test_stream_deep_follows_those_kinds_below_the_children() -> None:
    async with serving(run_hub()) as s:
        client, head = await SseClient.open(
            s.port, "/stream?path=root&children=1&deep=callback,event&after=4"
        )
        try:
            assert head.status == 200

            def publish() -> None:
                for path, kind in (
                    ("root/h0/rank0", "node"),  # not in scope: a grandchild's node record
                    ("root/h0/rank0", "callback"),
                    ("root/h1", "node"),
                ):
                    s.hub.publish(make_record(path, kind, {}, ts_ms=T0))

            await asyncio.to_thread(publish)
            got = await client.records(4)
        finally:
            await client.close()
    assert [(r["path"], r["kind"], r["seq"]) for r in got] == [
        ("root/h0/rank0", "callback", 5),  # the backlog after seq 4
        ("root", "eval", 6),
        ("root/h1/rank1", "event", 8),
        ("root/h0/rank0", "callback", 10),
    ]


async def test_stream_replays_after_and_last_event_id() -> None:
    async with serving() as s:
        a, _ = await SseClient.open(s.port, "/stream?path=root&after=13")
        b, _ = await SseClient.open(s.port, "/stream?path=root&after=2", "Last-Event-ID: 16")
        c, _ = await SseClient.open(s.port, "/stream?path=root/rank0&after=0")
        try:
            assert [r["seq"] for r in await a.records(2)] == [16, 17]
            assert [r["seq"] for r in await b.records(1)] == [17]
            assert [r["data"]["steps"] for r in await c.records(5)] == [0, 1, 2, 3, 4]
        finally:
            for client in (a, b, c):
                await client.close()


async def test_stream_sends_keepalive_comments_and_ends_with_the_hub() -> None:
    async with serving(keepalive_s=0.05) as s:
        client, _ = await SseClient.open(s.port, "/stream?path=root")
        try:
            line = await asyncio.wait_for(client.reader.readline(), WAIT_S)
            assert line == b": flodl record stream\n"
            for _ in range(2):
                await asyncio.wait_for(client.reader.readuntil(b": keep-alive\n\n"), WAIT_S)
            s.hub.close()
            assert await client.event() is None  # the server ended the stream: EOF
        finally:
            await client.close()


async def test_stream_lifetime_ends_the_stream_and_after_resumes_it() -> None:
    async with serving(stream_lifetime_s=0.2) as s:
        client, _ = await SseClient.open(s.port, "/stream?path=root&after=16")
        try:
            [first] = await client.records(1)
            assert await client.event() is None
        finally:
            await client.close()
        s.hub.publish(make_record("root", "node", {"later": True}, ts_ms=T0))
        again, _ = await SseClient.open(s.port, f"/stream?path=root&after={first['seq']}")
        try:
            [later] = await again.records(1)
        finally:
            await again.close()
    assert first["seq"] == 17
    assert later["data"] == {"later": True}


async def test_closing_the_server_ends_open_streams() -> None:
    async with serving() as s:
        clients = [(await SseClient.open(s.port, "/stream?path=root"))[0] for _ in range(3)]
        await asyncio.wait_for(s.server.close(), WAIT_S)
        for client in clients:
            assert await client.event() is None
            await client.close()
        assert s.hub.subscriber_count() == 0


async def test_a_stream_whose_client_leaves_is_cleaned_up() -> None:
    async with serving() as s:
        client, _ = await SseClient.open(s.port, "/stream?path=root")
        assert s.hub.subscriber_count() == 1
        await client.close()
        for _ in range(round(WAIT_S / 0.02)):  # polls for at least WAIT_S
            if s.hub.subscriber_count() == 0:
                break
            await asyncio.sleep(0.02)
        assert s.hub.subscriber_count() == 0


# ---------------------------------------------------------------------------------------------
# Hostile input
# ---------------------------------------------------------------------------------------------

GET = "GET {} HTTP/1.1\r\nHost: x\r\n\r\n"
HOSTILE: list[tuple[str, bytes, set[int]]] = [
    ("post", b"POST /paths HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}", {405}),
    ("put", b"PUT / HTTP/1.1\r\n\r\n", {405}),
    ("delete", b"DELETE /node?path=root HTTP/1.1\r\n\r\n", {405}),
    ("head", b"HEAD / HTTP/1.1\r\n\r\n", {405}),
    ("unknown endpoint", GET.format("/nope").encode(), {404}),
    ("trailing slash", GET.format("/paths/").encode(), {404}),
    ("traversal endpoint", GET.format("/../../etc/passwd").encode(), {404}),
    (
        "markup in path",
        GET.format("/node?path=root/rank0<script>alert(1)</script>").encode(),
        {400},
    ),
    ("traversal path", GET.format("/node?path=root/../../etc/passwd").encode(), {400}),
    ("encoded traversal", GET.format("/node?path=root%2F..%2F..%2Fetc%2Fpasswd").encode(), {400}),
    ("not rooted", GET.format("/node?path=etc/passwd").encode(), {400}),
    ("too deep", GET.format("/node?path=root/a/b/c/d").encode(), {400}),
    ("invalid utf-8 query", GET.format("/node?path=root/%ff%fe").encode(), {400}),
    ("raw non-ascii target", b"GET /node?path=root/\xff HTTP/1.1\r\n\r\n", {400}),
    ("nul in target", b"GET /node?path=root\x00 HTTP/1.1\r\n\r\n", {400}),
    ("encoded nul", GET.format("/node?path=root%00").encode(), {400}),
    ("missing path", GET.format("/node").encode(), {400}),
    ("unknown path", GET.format("/node?path=root/rank7").encode(), {404}),
    ("unknown history path", GET.format("/history?path=root/rank7").encode(), {404}),
    ("unknown stream path", GET.format("/stream?path=root/rank7").encode(), {404}),
    ("n zero", GET.format("/history?path=root&n=0").encode(), {400}),
    ("n too big", GET.format("/history?path=root&n=10001").encode(), {400}),
    ("n text", GET.format("/history?path=root&n=abc").encode(), {400}),
    ("n negative", GET.format("/history?path=root&n=-1").encode(), {400}),
    ("n float", GET.format("/history?path=root&n=1e3").encode(), {400}),
    ("n empty", GET.format("/history?path=root&n=").encode(), {400}),
    ("n huge", GET.format("/history?path=root&n=" + "9" * 40).encode(), {400}),
    ("repeated param", GET.format("/history?path=root&n=5&n=6").encode(), {400}),
    ("bad children flag", GET.format("/history?path=root&children=yes").encode(), {400}),
    ("empty kinds", GET.format("/history?path=root&kinds=").encode(), {400}),
    ("bad kind", GET.format("/history?path=root&kinds=Eval").encode(), {400}),
    ("markup kind", GET.format("/history?path=root&kinds=%3Cscript%3E").encode(), {400}),
    ("trailing comma kind", GET.format("/history?path=root&deep=eval,").encode(), {400}),
    ("long kind", GET.format("/history?path=root&deep=" + "a" * 33).encode(), {400}),
    (
        "too many kinds",
        GET.format("/history?path=root&kinds=" + ",".join(f"k{i}" for i in range(17))).encode(),
        {400},
    ),
    ("bad stream deep", GET.format("/stream?path=root&deep=../x").encode(), {400}),
    ("bad after", GET.format("/stream?path=root&after=-1").encode(), {400}),
    ("bad last-event-id", b"GET /stream?path=root HTTP/1.1\r\nLast-Event-ID: x\r\n\r\n", {400}),
    (
        "too many params",
        GET.format("/paths?" + "&".join(f"a{i}=1" for i in range(40))).encode(),
        {400},
    ),
    ("overlong path param", GET.format("/node?path=root/" + "a" * 5000).encode(), {400}),
    ("overlong segment", GET.format("/node?path=root/" + "a" * 65).encode(), {400}),
    ("garbage request line", b"GARBAGE\r\n\r\n", {400}),
    ("http/2 version", b"GET /paths HTTP/2.0\r\n\r\n", {400}),
    ("absolute form", b"GET http://evil.example/paths HTTP/1.1\r\n\r\n", {400}),
    ("fragment", GET.format("/paths#x").encode(), {400}),
    ("header without colon", b"GET /paths HTTP/1.1\r\nNoColonHere\r\n\r\n", {400}),
    ("obs-fold header", b"GET /paths HTTP/1.1\r\nX-A: 1\r\n  folded\r\n\r\n", {400}),
    ("non-ascii header", b"GET /paths HTTP/1.1\r\nX-A: \xc3\xa9\r\n\r\n", {400}),
    ("overlong uri", GET.format("/paths?q=" + "a" * 9000).encode(), {414}),
    ("too many headers", b"GET /paths HTTP/1.1\r\n" + b"X-A: 1\r\n" * 101 + b"\r\n", {431}),
    ("big header", b"GET /paths HTTP/1.1\r\nX-A: " + b"a" * 20_000 + b"\r\n\r\n", {431}),
]


@pytest.mark.parametrize(("why", "raw", "statuses"), HOSTILE, ids=[h[0] for h in HOSTILE])
async def test_hostile_request_gets_a_4xx_and_the_server_keeps_serving(
    why: str, raw: bytes, statuses: set[int]
) -> None:
    del why
    async with serving() as s:
        r = await exchange(s.port, raw)
        assert r is not None
        assert r.status in statuses
        assert_hardened(r)
        assert r.headers["content-type"] == "application/json"
        error = r.json()["error"]
        assert isinstance(error, str) and 0 < len(error) < 200
        assert b"<" not in r.body and b"passwd" not in r.body and b"evil" not in r.body
        if r.status == 405:
            assert r.headers["allow"] == "GET"
        assert (await get(s.port, "/paths")).status == 200


def test_the_hostile_table_is_large() -> None:
    assert len(HOSTILE) >= 20


async def test_a_megabyte_header_is_refused_or_closed() -> None:
    async with serving() as s:
        raw = b"GET /paths HTTP/1.1\r\nX-Big: " + b"a" * (1 << 20) + b"\r\n\r\n"
        r = await exchange(s.port, raw)
        assert r is None or r.status == 431
        assert (await get(s.port, "/paths")).json() == ["root", "root/rank0", "root/rank1"]


async def test_slowloris_is_cut_off_by_the_head_timeout() -> None:
    """A header line every 50 ms never lets the head finish: the 0.3 s bound is on the whole
    head (an idle timeout would never fire), and it never cuts before 0.3 s."""
    async with serving(head_timeout_s=0.3) as s:
        loop = asyncio.get_running_loop()
        started = loop.time()
        reader, writer = await asyncio.open_connection("127.0.0.1", s.port)
        cut_at: float | None = None
        try:
            writer.write(b"GET /paths HTTP/1.1\r\n")
            data = b""
            with contextlib.suppress(ConnectionError):
                while not reader.at_eof() and loop.time() - started < WAIT_S:
                    writer.write(b"X-Slow: 1\r\n")  # one header line every 50 ms, never done
                    try:
                        data += await asyncio.wait_for(reader.read(4096), 0.05)
                    except TimeoutError:
                        continue
                    if data and cut_at is None:
                        cut_at = loop.time()
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()
        assert data.startswith(b"HTTP/1.1 408 "), data[:200]
        assert cut_at is not None and cut_at - started >= 0.29, cut_at
        assert (await get(s.port, "/paths")).status == 200


async def test_idle_connections_beyond_the_cap_are_refused_then_all_time_out() -> None:
    async with serving(head_timeout_s=0.5, max_connections=256) as s:
        conns = [await asyncio.open_connection("127.0.0.1", s.port) for _ in range(300)]
        try:
            answers = await asyncio.gather(
                *(asyncio.wait_for(reader.read(), WAIT_S) for reader, _ in conns)
            )
        finally:
            for _, writer in conns:
                writer.close()
            for _, writer in conns:
                with contextlib.suppress(ConnectionError):
                    await writer.wait_closed()
        statuses = [parse_response(a).status for a in answers]
        assert statuses.count(503) >= 300 - 256
        assert set(statuses) <= {503, 408}
        assert statuses.count(408) >= 200
        assert (await get(s.port, "/paths")).status == 200


def write_after_the_answer(port: int, first: bytes, more: bytes) -> bytes:
    """Send ``first``; once the answer has arrived (seen, not read), send ``more`` as a client
    still writing would, half-close, and read to the end. Raises ``ConnectionResetError`` (or
    another ``OSError``) if the server reset the connection: a client that writes before it
    reads then loses the answer, since a socket that received a reset fails its next write."""
    with socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as sock:
        sock.sendall(first)
        while b"\r\n\r\n" not in sock.recv(65536, socket.MSG_PEEK):
            select.select([sock], [], [], 0.01)
        sock.sendall(more)
        sock.shutdown(socket.SHUT_WR)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
        error = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        if error:
            raise OSError(error, os.strerror(error))
        return data


async def test_a_slowloris_client_still_writing_after_its_408_reads_it_without_a_reset() -> None:
    async with serving(head_timeout_s=0.3) as s:
        data = await asyncio.to_thread(
            write_after_the_answer, s.port, b"GET /paths HTTP/1.1\r\n", b"X-Late: 1\r\n"
        )
        assert parse_response(data).status == 408
        assert (await get(s.port, "/paths")).status == 200


async def test_a_request_over_the_cap_reads_its_503_without_a_reset() -> None:
    async with serving(max_connections=1) as s:
        _, holder = await asyncio.open_connection("127.0.0.1", s.port)  # takes the only slot
        try:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + WAIT_S
            while not s.server._conns:
                assert loop.time() < deadline, "the first connection was never accepted"
                await asyncio.sleep(0.01)
            data = await asyncio.to_thread(
                write_after_the_answer, s.port, GET.format("/paths").encode(), b"more"
            )
        finally:
            holder.close()
        assert parse_response(data).status == 503


@pytest.mark.skipif(sys.platform != "linux", reason="SO_MEMINFO is Linux's")
async def test_a_burst_of_connections_is_queued_not_dropped() -> None:
    """300 connections arrive while the loop is busy: the listen backlog holds them all (with
    asyncio's default of 100 the kernel drops the surplus half-way)."""
    async with serving(head_timeout_s=0.5, max_connections=512) as s:
        assert s.server._server is not None
        listener = s.server._server.sockets[0]
        before = listen_drops(listener)
        socks = []
        try:
            for _ in range(300):  # no await: the loop accepts none of them meanwhile
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                sock.setblocking(False)
                socks.append(sock)
                sock.connect_ex(("127.0.0.1", s.port))
            assert listen_drops(listener) == before
        finally:
            for sock in socks:
                sock.close()
        assert (await get(s.port, "/paths")).status == 200


def listen_drops(listener: Any) -> int:
    """A listening socket's drop count (Linux ``SO_MEMINFO``, index 8): connections the kernel
    dropped because the accept queue was full."""
    raw = listener.getsockopt(socket.SOL_SOCKET, 55, 64)
    return int(struct.unpack(f"{len(raw) // 4}I", raw)[8])


async def test_a_bug_in_a_handler_costs_one_connection(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with serving() as s:

        def broken() -> list[str]:
            raise RuntimeError("boom")

        monkeypatch.setattr(s.hub, "paths", broken)
        with caplog.at_level(logging.ERROR, logger=SERVER_LOGGER):
            assert await exchange(s.port, GET.format("/paths").encode()) is None
        assert [r.levelno for r in caplog.records if r.name == SERVER_LOGGER] == [logging.ERROR]
        assert (await get(s.port, "/meta")).status == 200


@pytest.mark.parametrize(
    "kwargs",
    [
        {"head_timeout_s": 0},
        {"max_connections": 0},
        {"keepalive_s": -1},
        {"write_timeout_s": 0},
        {"stream_lifetime_s": 0},
    ],
)
def test_bad_server_limits_are_refused(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ConfigError, match=next(iter(kwargs))):
        DashboardServer(RecordHub(), **kwargs)


# ---------------------------------------------------------------------------------------------
# The thread wrapper and the saved dashboard
# ---------------------------------------------------------------------------------------------


def http_get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=WAIT_S) as resp:
        return json.loads(resp.read())


def test_dashboard_thread_serves_from_its_own_loop() -> None:
    hub = seeded_hub()
    with DashboardThread(hub) as dash:
        assert dash.port > 0
        assert dash.url == f"http://127.0.0.1:{dash.port}/"
        assert http_get(dash.url + "paths") == ["root", "root/rank0", "root/rank1"]
        hub.publish(make_record("root/rank2", "node", {}, ts_ms=T0))  # from this thread
        assert "root/rank2" in http_get(dash.url + "paths")
    dash.stop()  # idempotent
    with pytest.raises(OSError), socket.create_connection(("127.0.0.1", dash.port), 0.5):
        pass


def test_dashboard_thread_start_reports_a_bind_failure() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        dash = DashboardThread(RecordHub(), port=busy.getsockname()[1])
        with pytest.raises(OSError):
            dash.start()
        dash.stop()


def test_dashboard_thread_stop_ends_a_live_stream() -> None:
    with DashboardThread(seeded_hub()) as dash:
        sock = socket.create_connection(("127.0.0.1", dash.port), WAIT_S)
        with sock:
            sock.sendall(b"GET /stream?path=root HTTP/1.1\r\n\r\n")
            sock.settimeout(WAIT_S)
            first = b""
            while b"\r\n" not in first:
                first += sock.recv(4096)
            assert first.startswith(b"HTTP/1.1 200 OK\r\n")
            stopper = threading.Thread(target=dash.stop)
            stopper.start()
            while sock.recv(4096):
                pass
            stopper.join(WAIT_S)
            assert not stopper.is_alive()


def test_serve_directory_loads_a_record_log(tmp_path: Path) -> None:
    with RecordLog(tmp_path) as log:
        log.write(make_record("root", "meta", {"reductions": {"loss": "mean"}}, ts_ms=T0))
        for i in range(3):
            log.write(make_record("root/rank0", "node", {"loss": 1.0 / (i + 1)}, ts_ms=T0 + i))
    dash = serve_directory(tmp_path)
    try:
        assert http_get(dash.url + "paths") == ["root", "root/rank0"]
        assert [r["seq"] for r in http_get(dash.url + "history?path=root/rank0")] == [2, 3, 4]
    finally:
        dash.stop()
    with pytest.raises(ConfigError):
        serve_directory(tmp_path / "missing")


def test_save_dashboard_embeds_escaped_records_atomically(tmp_path: Path) -> None:
    hostile = "</script><script>alert(1)</script><!-- & \u2028"
    tree = {
        "root": [
            make_record("root", "meta", {"reductions": {"loss": "mean"}}, ts_ms=T0),
            make_record("root", "event", {"class": "drift", "detail": hostile}, ts_ms=T0 + 1),
        ],
        "root/rank0": [make_record("root/rank0", "node", {"loss": float("nan")}, ts_ms=T0)],
    }
    out = save_dashboard(tmp_path / "run.html", tree, theme="light")
    assert out == tmp_path / "run.html"
    html = out.read_text(encoding="utf-8")
    assert [p.name for p in tmp_path.iterdir()] == ["run.html"]  # no temporary left behind
    assert html.count("</script>") == 2  # the data block and the page script, nothing else
    assert "<!-- &" not in html
    assert 'const ARCHIVE_THEME="light";' in html
    m = re.search(r'<script type="application/json" id="flodl-archive">(.*?)</script>', html)
    assert m is not None
    payload = json.loads(m[1])
    assert payload["records"]["root"][1]["data"]["detail"] == hostile
    assert payload["records"]["root/rank0"][0]["data"]["loss"] is None
    meta_csp = re.search(r'<meta http-equiv="Content-Security-Policy" content="([^"]+)">', html)
    assert meta_csp is not None
    assert "connect-src 'none'" in meta_csp[1]
    assert f"'sha256-{script_hash(html)}'" in meta_csp[1]
    assert "frame-ancestors" not in meta_csp[1]
    # A second save replaces the file in one rename.
    save_dashboard(out, {"root": tree["root"][:1]})
    assert THEME_LINE in out.read_text(encoding="utf-8")


def test_a_saved_hub_tree_embeds_every_kept_record(tmp_path: Path) -> None:
    """A run longer than a ring: the archive still holds the meta record (evicted from the
    main ring long ago), all evals and the last windows, not only MAX_HISTORY of the root."""
    hub = RecordHub(max_per_node=200)
    hub.publish(make_record("root", "meta", {"reductions": {"loss": "mean"}}, ts_ms=T0))
    for i in range(1000):
        hub.publish(make_record("root", "window", {"cycle": i}, ts_ms=T0 + i))
        hub.publish(make_record("root", "node", {"loss": 1.0}, ts_ms=T0 + i))
        if i % 100 == 0:
            hub.publish(make_record("root", "eval", {"epoch": i // 100}, ts_ms=T0 + i))
    html = save_dashboard(tmp_path / "run.html", hub.tree()).read_text(encoding="utf-8")
    m = re.search(r'<script type="application/json" id="flodl-archive">(.*?)</script>', html)
    assert m is not None
    kept = json.loads(m[1])["records"]["root"]
    kinds = [r["kind"] for r in kept]
    assert kinds[0] == "meta" and kinds.count("node") == 200 and kinds.count("eval") == 10
    assert [r["data"]["cycle"] for r in kept if r["kind"] == "window"][-1] == 999
    assert [r["seq"] for r in kept] == sorted(r["seq"] for r in kept)


def test_save_dashboard_refuses_bad_input(tmp_path: Path) -> None:
    target = tmp_path / "x.html"
    with pytest.raises(ConfigError, match="theme"):
        save_dashboard(target, {}, theme="solarized")
    with pytest.raises(ConfigError, match="path"):
        save_dashboard(target, {"root/../x": []})
    with pytest.raises(ConfigError, match="serializable"):
        save_dashboard(target, {"root": [{"x": object()}]})
    with pytest.raises(OSError):
        save_dashboard(tmp_path / "missing-dir" / "x.html", {})
    assert not target.exists()
    assert os.listdir(tmp_path) == []


def test_archive_json_escapes_everything_that_could_end_a_script() -> None:
    text = archive_json({"root": [{"s": "</SCRIPT ><!--<script>&\u2029"}]})
    assert "<" not in text and ">" not in text and "&" not in text and "\u2029" not in text
    assert json.loads(text)["records"]["root"][0]["s"] == "</SCRIPT ><!--<script>&\u2029"


def test_page_csp_hashes_each_inline_block() -> None:
    html = page_html()
    csp = page_csp(html, connect=False)
    assert csp.count("'sha256-") == 2  # one script, one style
    assert "connect-src 'none'" in csp
    with pytest.raises(ConfigError):
        page_html("neon")
