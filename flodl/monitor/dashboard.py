"""The live dashboard: a small asyncio HTTP/1.1 server over a record hub (docs/design.md §7).

Endpoints (``GET`` only; anything else is ``405``):

==============================  ===============================================================
``/``                           the page (``page.html``: one self-contained HTML/JS file)
``/paths``                      JSON list of node paths
``/node?path=P``                JSON :meth:`RecordHub.node` (the node + its direct children)
``/history?path=P&n=N``         JSON list, the last ``n`` records (default 200, 1..10000)
``/stream?path=P``              ``text/event-stream``: ``id: <seq>`` / ``data: <record JSON>``
``/meta``                       the run's ``meta`` record, or ``null``
==============================  ===============================================================

``/history`` and ``/stream`` take ``children=1`` to widen the scope to the direct children and
``deep=K1,K2`` (record kinds, at most 16) to add those kinds' records at every node below (see
:mod:`flodl.monitor.hub`); ``/history`` also takes ``kinds=K1,K2`` to keep only those kinds of
its scope. ``/stream`` takes ``after=<seq>`` (or the SSE
``Last-Event-ID`` header; the larger wins) to first replay the kept records with a larger
``seq``. Reading ``/history`` and then streaming ``after`` its last ``seq`` misses nothing and
repeats nothing: the hub registers the subscription and takes the backlog under one lock.

Rules:
    - **No framework, bounded parsing.** One request per connection (``Connection: close``;
      the page makes a handful of requests and one long-lived stream). The request line is at
      most 8 KiB (else ``414``), the header block at most 16 KiB and 100 lines (else ``431``),
      and the whole head must arrive within ``head_timeout_s`` (slowloris connections get
      ``408``). At most ``max_connections`` connections are served; more get ``503`` at once.
    - **No reset before the answer.** After every error answer (4xx, 503) the server
      half-closes and reads (and drops) what the client still sends until it closes, for at
      most 256 KiB and 5 s, then closes. Closing a socket that holds unread request bytes makes
      the kernel send a TCP reset, and a client that writes again before reading (a slowloris
      client, one whose request went on) then loses the answer it had been sent. The port
      listens with a backlog of :data:`LISTEN_BACKLOG`, so that a burst of connections is
      queued rather than dropped half-way by the kernel.
    - **Bad input is a 4xx, never a 500.** Error bodies are ``{"error": "..."}`` with a fixed
      message: nothing the client sent is echoed back. A bug in a handler closes that one
      connection (logged); the server keeps serving.
    - **Every response** carries ``Content-Type``, ``Cache-Control: no-store``,
      ``X-Content-Type-Options: nosniff`` and a ``Content-Security-Policy``. The page's policy
      allows exactly its own inline script and style (by SHA-256 hash, not
      ``'unsafe-inline'``) and connections to its own origin; JSON answers allow nothing.
    - Timeouts use ``asyncio.timeout`` rather than ``asyncio.wait_for``: on Python 3.11,
      ``wait_for`` can swallow a cancellation that races with the inner await finishing, which
      would leave :meth:`DashboardServer.close` waiting on a connection forever.
    - **A slow reader never slows training.** A stream that falls behind by the hub's
      subscriber bound is dropped by the hub; a write that does not drain within
      ``write_timeout_s`` closes the connection.

Threads: :class:`DashboardServer` lives on one event loop; :class:`DashboardThread` runs one on
its own loop thread for synchronous callers (the launcher).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import hashlib
import importlib.resources
import json
import logging
import re
import threading
import urllib.parse
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, Final, Self

from flodl.errors import ConfigError
from flodl.monitor.hub import MAX_HISTORY, RecordHub
from flodl.monitor.records import validate_kind, validate_path

__all__ = [
    "THEMES",
    "THEME_LINE",
    "ARCHIVE_MARKER",
    "MAX_REQUEST_LINE",
    "MAX_HEADER_BYTES",
    "MAX_HEADER_LINES",
    "validate_theme",
    "page_html",
    "page_csp",
    "DashboardServer",
    "DashboardThread",
]

logger = logging.getLogger(__name__)

THEMES: Final = ("light", "dark")
THEME_LINE: Final = "const ARCHIVE_THEME=null;"
"""The one line of ``page.html`` that :func:`page_html` replaces to pin a theme."""
ARCHIVE_MARKER: Final = "<!--flodl-archive-->"
"""Where the archive writer puts the embedded records (before the page script)."""

MAX_REQUEST_LINE: Final = 8 * 1024
MAX_HEADER_BYTES: Final = 16 * 1024
MAX_HEADER_LINES: Final = 100
MAX_QUERY_FIELDS: Final = 16
MAX_KINDS_PARAM: Final = 16
DEFAULT_HISTORY_N: Final = 200
_SEQ_LIMIT: Final = 2**63
_LINGER_BYTES: Final = 256 * 1024
_LINGER_S: Final = 5.0
LISTEN_BACKLOG: Final = 4096
"""Listen backlog (the kernel caps it at ``net.core.somaxconn``). asyncio's default of 100
overflows when a burst of connections meets a busy loop; Linux then drops some handshakes
half-way, leaving connections that are open on the client's side only."""

_TOKEN_RE: Final = re.compile(rb"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
_TARGET_RE: Final = re.compile(rb"/[\x21-\x7e]*")  # visible ASCII, no spaces, no controls
_DIGITS_RE: Final = re.compile(r"[0-9]{1,19}")
_INLINE_RE: Final = re.compile(r"<(script|style)>(.*?)</\1>", re.DOTALL)

_JSON_CSP: Final = "default-src 'none'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'"
_BAD_PATH: Final = (
    "invalid path: expected root or root/SEGMENT[/SEGMENT...], at most 4 segments of "
    "1-64 characters from A-Z a-z 0-9 . _ -"
)


# -------------------------------------------------------------------------------------------------
# The page
# -------------------------------------------------------------------------------------------------


def validate_theme(theme: object) -> str | None:
    """``None``, ``"light"`` or ``"dark"``.

    Raises:
        ConfigError: anything else.
    """
    if theme is None or (isinstance(theme, str) and theme in THEMES):
        return theme
    raise ConfigError(f"dashboard theme must be None, 'light' or 'dark', got {theme!r}")


@functools.cache
def _page_template() -> str:
    text = (importlib.resources.files("flodl.monitor") / "page.html").read_text(encoding="utf-8")
    if text.count(THEME_LINE) != 1 or text.count(ARCHIVE_MARKER) != 1:
        raise RuntimeError("flodl/monitor/page.html lost its theme line or archive marker")
    return text


def page_html(theme: str | None = None) -> str:
    """The dashboard page, with the theme pinned when ``theme`` is given.

    Raises:
        ConfigError: a theme other than ``None``, ``"light"`` or ``"dark"``.
    """
    theme = validate_theme(theme)
    text = _page_template()
    if theme is not None:
        text = text.replace(THEME_LINE, f'const ARCHIVE_THEME="{theme}";')
    return text


def _sha256_source(source: str) -> str:
    digest = hashlib.sha256(source.encode("utf-8")).digest()
    return "'sha256-" + base64.b64encode(digest).decode("ascii") + "'"


def page_csp(html: str, *, connect: bool) -> str:
    """A Content-Security-Policy allowing exactly the inline ``<script>``/``<style>`` of ``html``.

    Args:
        html: the page as served (hashes cover attribute-less ``<script>`` and ``<style>``
            blocks; a ``type="application/json"`` data block is never executed).
        connect: allow ``fetch``/``EventSource`` to the page's own origin (live mode);
            ``False`` forbids every network request (archive mode).
    """
    scripts = [_sha256_source(m[2]) for m in _INLINE_RE.finditer(html) if m[1] == "script"]
    styles = [_sha256_source(m[2]) for m in _INLINE_RE.finditer(html) if m[1] == "style"]
    return "; ".join(
        [
            "default-src 'none'",
            "script-src " + (" ".join(scripts) or "'none'"),
            "style-src " + (" ".join(styles) or "'none'"),
            "img-src data:",
            "connect-src " + ("'self'" if connect else "'none'"),
            "base-uri 'none'",
            "form-action 'none'",
            "frame-ancestors 'none'",
        ]
    )


# -------------------------------------------------------------------------------------------------
# HTTP plumbing
# -------------------------------------------------------------------------------------------------


class _HttpError(Exception):
    """A request we answer with a 4xx (or 503) and close."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(frozen=True, slots=True)
class _Request:
    method: str
    path: str
    query: dict[str, str]
    headers: dict[str, str]


def _head(status: int, content_type: str, csp: str, length: int | None, extra: str = "") -> bytes:
    lines = [
        f"HTTP/1.1 {status} {HTTPStatus(status).phrase}",
        f"Content-Type: {content_type}",
        "Cache-Control: no-store",
        "X-Content-Type-Options: nosniff",
        f"Content-Security-Policy: {csp}",
        "Referrer-Policy: no-referrer",
        "Connection: close",
    ]
    if length is not None:
        lines.append(f"Content-Length: {length}")
    if extra:
        lines.append(extra)
    return ("\r\n".join(lines) + "\r\n\r\n").encode("ascii")


_HTML_ESCAPES: Final = str.maketrans({"<": "\\u003c", ">": "\\u003e", "&": "\\u0026"})


def _json_bytes(obj: Any) -> bytes:
    """Compact ASCII JSON with ``<``, ``>`` and ``&`` escaped (same value; inert as HTML)."""
    text = json.dumps(obj, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    return text.translate(_HTML_ESCAPES).encode("ascii")


def _error_response(status: int, message: str) -> bytes:
    body = _json_bytes({"error": message})
    extra = "Allow: GET" if status == HTTPStatus.METHOD_NOT_ALLOWED else ""
    return _head(status, "application/json", _JSON_CSP, len(body), extra) + body


async def _read_line(reader: asyncio.StreamReader, limit: int, status: int, what: str) -> bytes:
    try:
        line = await reader.readuntil(b"\n")
    except asyncio.LimitOverrunError:
        raise _HttpError(status, f"{what} too long") from None
    if len(line) > limit:
        raise _HttpError(status, f"{what} too long")
    return line


async def _read_head(reader: asyncio.StreamReader) -> _Request:
    """Parse the request line and headers; raise :class:`_HttpError` for a bad request."""
    line = await _read_line(reader, MAX_REQUEST_LINE, HTTPStatus.REQUEST_URI_TOO_LONG, "URI")
    if line in (b"\r\n", b"\n"):  # RFC 9112 §2.2: ignore one empty line before the request
        line = await _read_line(reader, MAX_REQUEST_LINE, HTTPStatus.REQUEST_URI_TOO_LONG, "URI")
    headers: dict[str, str] = {}
    total = 0
    count = 0
    while True:
        hline = await _read_line(
            reader, MAX_HEADER_BYTES, HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE, "header"
        )
        if hline in (b"\r\n", b"\n"):
            break
        total += len(hline)
        count += 1
        if total > MAX_HEADER_BYTES or count > MAX_HEADER_LINES:
            raise _HttpError(HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE, "headers too large")
        name, sep, value = hline.rstrip(b"\r\n").partition(b":")
        if not sep or not _TOKEN_RE.fullmatch(name):
            raise _HttpError(HTTPStatus.BAD_REQUEST, "malformed header")
        try:
            text = value.strip(b" \t").decode("ascii")
        except UnicodeDecodeError:
            raise _HttpError(HTTPStatus.BAD_REQUEST, "non-ASCII header value") from None
        headers[name.decode("ascii").lower()] = text
    return _parse_request_line(line, headers)


def _parse_request_line(line: bytes, headers: dict[str, str]) -> _Request:
    parts = line.rstrip(b"\r\n").split(b" ")
    if len(parts) != 3 or not _TOKEN_RE.fullmatch(parts[0]):
        raise _HttpError(HTTPStatus.BAD_REQUEST, "malformed request line")
    method, target, version = parts
    if version not in (b"HTTP/1.1", b"HTTP/1.0"):
        raise _HttpError(HTTPStatus.BAD_REQUEST, "unsupported HTTP version")
    if not _TARGET_RE.fullmatch(target) or b"#" in target:
        raise _HttpError(HTTPStatus.BAD_REQUEST, "invalid request target")
    raw_path, _, raw_query = target.decode("ascii").partition("?")
    return _Request(method.decode("ascii"), raw_path, _parse_query(raw_query), headers)


def _parse_query(raw: str) -> dict[str, str]:
    query: dict[str, str] = {}
    if not raw:
        return query
    fields = raw.split("&")
    if len(fields) > MAX_QUERY_FIELDS:
        raise _HttpError(HTTPStatus.BAD_REQUEST, "too many query parameters")
    for field in fields:
        if not field:
            continue
        raw_name, _, raw_value = field.partition("=")
        try:
            name = urllib.parse.unquote_plus(raw_name, encoding="utf-8", errors="strict")
            value = urllib.parse.unquote_plus(raw_value, encoding="utf-8", errors="strict")
        except UnicodeDecodeError:
            raise _HttpError(HTTPStatus.BAD_REQUEST, "query is not valid UTF-8") from None
        if name in query:
            raise _HttpError(HTTPStatus.BAD_REQUEST, "repeated query parameter")
        query[name] = value
    return query


def _param_path(query: dict[str, str]) -> str:
    raw = query.get("path")
    if raw is None:
        raise _HttpError(HTTPStatus.BAD_REQUEST, "missing path parameter")
    try:
        return validate_path(raw)
    except ConfigError:
        raise _HttpError(HTTPStatus.BAD_REQUEST, _BAD_PATH) from None


def _param_int(raw: str | None, default: int, low: int, high: int, what: str) -> int:
    if raw is None:
        return default
    if not _DIGITS_RE.fullmatch(raw) or not low <= int(raw) <= high:
        raise _HttpError(HTTPStatus.BAD_REQUEST, f"{what} must be an integer in [{low}, {high}]")
    return int(raw)


def _param_kinds(query: dict[str, str], name: str) -> frozenset[str] | None:
    """A comma-separated list of record kinds (``None`` when the parameter is absent)."""
    raw = query.get(name)
    if raw is None:
        return None
    parts = raw.split(",")
    try:
        if len(parts) > MAX_KINDS_PARAM:
            raise ConfigError("too many kinds")
        return frozenset(validate_kind(k) for k in parts)
    except ConfigError:
        raise _HttpError(
            HTTPStatus.BAD_REQUEST,
            f"{name} must be 1 to {MAX_KINDS_PARAM} comma-separated record kinds ([a-z][a-z0-9_]*)",
        ) from None


def _param_flag(query: dict[str, str], name: str) -> bool:
    raw = query.get(name, "0")
    if raw not in ("0", "1"):
        raise _HttpError(HTTPStatus.BAD_REQUEST, f"{name} must be 0 or 1")
    return raw == "1"


# -------------------------------------------------------------------------------------------------
# The server
# -------------------------------------------------------------------------------------------------


class DashboardServer:
    """Serves the dashboard page and the record endpoints of one :class:`RecordHub`.

    Args:
        hub: the records to serve.
        host: bind address (loopback by default: the dashboard has no authentication).
        port: TCP port; ``0`` picks a free one (:meth:`start` returns it).
        theme: pin the page's theme (``"light"``/``"dark"``); ``None`` follows the viewer.
        head_timeout_s: seconds a client has to send its whole request head.
        max_connections: connections served at once; more are answered ``503`` and closed.
        keepalive_s: seconds between SSE keep-alive comments on an idle stream.
        write_timeout_s: seconds a response write may wait for the client to read.
        stream_lifetime_s: end each ``/stream`` after this many seconds (the page reconnects
            with ``after=`` its last ``seq``, so nothing is lost); ``None``: no limit.

    Raises:
        ConfigError: a bad theme or a non-positive limit.
    """

    def __init__(
        self,
        hub: RecordHub,
        host: str = "127.0.0.1",
        port: int = 0,
        theme: str | None = None,
        *,
        head_timeout_s: float = 10.0,
        max_connections: int = 256,
        keepalive_s: float = 15.0,
        write_timeout_s: float = 30.0,
        stream_lifetime_s: float | None = None,
    ) -> None:
        if stream_lifetime_s is not None and not stream_lifetime_s > 0:
            raise ConfigError(f"DashboardServer stream_lifetime_s={stream_lifetime_s!r} must be >0")
        for name, value in (
            ("head_timeout_s", head_timeout_s),
            ("max_connections", max_connections),
            ("keepalive_s", keepalive_s),
            ("write_timeout_s", write_timeout_s),
        ):
            if not value > 0:
                raise ConfigError(f"DashboardServer {name}={value!r} must be > 0")
        self.hub = hub
        self.host = host
        self.port = port
        self.theme = validate_theme(theme)
        self.head_timeout_s = head_timeout_s
        self.max_connections = max_connections
        self.keepalive_s = keepalive_s
        self.write_timeout_s = write_timeout_s
        self.stream_lifetime_s = stream_lifetime_s
        page = page_html(self.theme)
        self._page = page.encode("utf-8")
        self._page_csp = page_csp(page, connect=True)
        self._server: asyncio.Server | None = None
        self._conns: set[asyncio.Task[None]] = set()
        self._closing = False

    async def start(self) -> int:
        """Bind and start accepting; returns the bound port."""
        if self._server is not None:
            raise RuntimeError("DashboardServer already started")
        limit = max(MAX_REQUEST_LINE, MAX_HEADER_BYTES) + 2
        self._server = await asyncio.start_server(
            self._on_connect, self.host, self.port, limit=limit, backlog=LISTEN_BACKLOG
        )
        self.port = self._server.sockets[0].getsockname()[1]
        if self.host not in ("127.0.0.1", "::1", "localhost"):
            logger.warning(
                "dashboard listens on %s:%d, reachable from the network without authentication",
                self.host,
                self.port,
            )
        logger.info("dashboard at http://%s:%d/", self.host, self.port)
        return self.port

    async def close(self) -> None:
        """Stop accepting, end every open connection (streams included) and wait for them."""
        self._closing = True
        server, self._server = self._server, None
        if server is not None:
            server.close()
        pending = set(self._conns)
        while pending:  # cancel again should a task ever absorb a cancellation
            for task in pending:
                task.cancel()
            _, pending = await asyncio.wait(pending, timeout=1.0)
        if server is not None:
            await server.wait_closed()

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- one connection ---------------------------------------------------------------------

    async def _on_connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None  # start_server runs this callback as a task
        refuse = self._closing or len(self._conns) >= self.max_connections
        self._conns.add(task)  # refused ones too, so that close() waits for them
        try:
            if refuse:
                writer.write(
                    _error_response(HTTPStatus.SERVICE_UNAVAILABLE, "too many connections")
                )
                await self._linger(reader, writer)
            else:
                await self._serve(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError, TimeoutError):
            pass  # the client went away or stopped reading
        except asyncio.CancelledError:
            # Only close() cancels us. End normally: Python 3.11's StreamReaderProtocol calls
            # task.exception() on this task, which raises (and logs) for a cancelled one.
            pass
        except Exception:  # a bug here must cost one connection, never the server
            logger.exception("dashboard: unexpected error while serving a request")
        finally:
            self._conns.discard(task)
            await self._finish(writer)

    async def _finish(self, writer: asyncio.StreamWriter) -> None:
        writer.close()
        with contextlib.suppress(Exception, asyncio.CancelledError):
            async with asyncio.timeout(1.0):
                await writer.wait_closed()

    async def _send(self, writer: asyncio.StreamWriter, data: bytes) -> None:
        writer.write(data)
        async with asyncio.timeout(self.write_timeout_s):
            await writer.drain()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            try:
                async with asyncio.timeout(self.head_timeout_s):
                    request = await _read_head(reader)
            except TimeoutError:
                raise _HttpError(HTTPStatus.REQUEST_TIMEOUT, "request head timed out") from None
            await self._dispatch(request, reader, writer)
        except _HttpError as exc:
            await self._send(writer, _error_response(exc.status, exc.message))
            await self._linger(reader, writer)  # a 408 too: a slowloris client is still writing

    async def _linger(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Half-close, then read (and drop) what the client still sends until it closes, within
        a budget of bytes and time. Closing with unread bytes would make the kernel reset the
        connection, and a client that writes before it reads the answer (a slowloris client's
        next byte) would then lose the answer; after a half-close, such bytes are read here.
        """
        with contextlib.suppress(OSError, RuntimeError):
            if writer.can_write_eof():
                writer.write_eof()
        budget = _LINGER_BYTES
        loop = asyncio.get_running_loop()
        deadline = loop.time() + _LINGER_S
        while budget > 0:
            left = deadline - loop.time()
            if left <= 0:
                return
            async with asyncio.timeout(left):
                chunk = await reader.read(min(budget, 65536))
            if not chunk:
                return
            budget -= len(chunk)

    async def _dispatch(
        self, request: _Request, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        if request.method != "GET":
            raise _HttpError(HTTPStatus.METHOD_NOT_ALLOWED, "only GET is allowed")
        route = request.path
        if route == "/":
            head = _head(200, "text/html; charset=utf-8", self._page_csp, len(self._page))
            await self._send(writer, head + self._page)
        elif route == "/stream":
            await self._stream(request, reader, writer)
        else:
            text = self._json_endpoint(route, request.query)
            payload = text.translate(_HTML_ESCAPES).encode("ascii")
            await self._send(
                writer, _head(200, "application/json", _JSON_CSP, len(payload)) + payload
            )

    def _json_endpoint(self, route: str, query: dict[str, str]) -> str:
        """The JSON text answering ``route`` (ASCII; escaped for HTML by the caller)."""
        hub = self.hub
        body: Any
        if route == "/paths":
            body = hub.paths()
        elif route == "/meta":
            body = hub.meta()
        elif route == "/node":
            body = hub.node(_param_path(query))
            if body is None:
                raise _HttpError(HTTPStatus.NOT_FOUND, "unknown path")
        elif route == "/history":
            path = _param_path(query)
            n = _param_int(query.get("n"), DEFAULT_HISTORY_N, 1, MAX_HISTORY, "n")
            children = _param_flag(query, "children")
            deep = _param_kinds(query, "deep") or frozenset()
            kinds = _param_kinds(query, "kinds")
            if path not in hub:
                raise _HttpError(HTTPStatus.NOT_FOUND, "unknown path")
            # the kept texts, not re-encoded
            return hub.history_json(path, n, children=children, deep=deep, kinds=kinds)
        else:
            raise _HttpError(HTTPStatus.NOT_FOUND, "unknown endpoint")
        return json.dumps(body, separators=(",", ":"), ensure_ascii=True, allow_nan=False)

    async def _stream(
        self, request: _Request, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        query = request.query
        path = _param_path(query)
        children = _param_flag(query, "children")
        deep = _param_kinds(query, "deep") or frozenset()
        after = _param_int(query.get("after"), -1, 0, _SEQ_LIMIT - 1, "after")
        last_id = _param_int(
            request.headers.get("last-event-id") or None, -1, 0, _SEQ_LIMIT - 1, "Last-Event-ID"
        )
        if path not in self.hub:
            raise _HttpError(HTTPStatus.NOT_FOUND, "unknown path")
        start = max(after, last_id)
        sub = self.hub.subscribe(
            path, after=None if start < 0 else start, children=children, deep=deep
        )
        eof = asyncio.ensure_future(reader.read(1))  # the client sends nothing more: EOF = gone
        nxt: asyncio.Future[tuple[int, str] | None] | None = None
        loop = asyncio.get_running_loop()
        end_at = None if self.stream_lifetime_s is None else loop.time() + self.stream_lifetime_s
        try:
            head = _head(200, "text/event-stream; charset=utf-8", _JSON_CSP, None)
            await self._send(writer, head + b": flodl record stream\n\n")
            while True:
                timeout = self.keepalive_s
                if end_at is not None:
                    timeout = min(timeout, end_at - loop.time())
                    if timeout <= 0:
                        return
                if nxt is None:
                    nxt = asyncio.ensure_future(sub.get_json())
                waiting: set[asyncio.Future[Any]] = {nxt, eof}
                done, _ = await asyncio.wait(
                    waiting, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
                )
                if eof in done:
                    return
                if nxt not in done:
                    if end_at is None or loop.time() < end_at:
                        await self._send(writer, b": keep-alive\n\n")
                    continue
                item = nxt.result()
                nxt = None
                if item is None:  # dropped for falling behind, or the hub closed
                    return
                seq, text = item
                data = text.translate(_HTML_ESCAPES)
                await self._send(writer, f"id: {seq}\ndata: {data}\n\n".encode())
        finally:
            sub.close()
            for fut in (eof, nxt):
                if fut is not None and not fut.done():
                    fut.cancel()
            pending = [f for f in (eof, nxt) if f is not None]
            await asyncio.gather(*pending, return_exceptions=True)


class DashboardThread:
    """A :class:`DashboardServer` on its own event-loop thread, for synchronous callers.

    ``start()`` blocks until the server listens and returns its port; ``stop()`` closes every
    connection, stops the loop and joins the thread. Also a context manager. Arguments are
    those of :class:`DashboardServer`.
    """

    def __init__(
        self,
        hub: RecordHub,
        host: str = "127.0.0.1",
        port: int = 0,
        theme: str | None = None,
        **server_options: Any,
    ) -> None:
        self.server = DashboardServer(hub, host, port, theme, **server_options)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None

    @property
    def port(self) -> int:
        """The bound port (after :meth:`start`)."""
        return self.server.port

    @property
    def url(self) -> str:
        """``http://host:port/`` of the page."""
        host = self.server.host
        return f"http://[{host}]:{self.port}/" if ":" in host else f"http://{host}:{self.port}/"

    def start(self, timeout_s: float = 10.0) -> int:
        """Start the loop thread and the server; returns the bound port.

        Raises:
            OSError: the address could not be bound (the thread is gone again).
            RuntimeError: already started, or the server did not come up within ``timeout_s``.
        """
        if self._thread is not None:
            raise RuntimeError("DashboardThread already started")
        self._thread = threading.Thread(target=self._run, name="flodl-dashboard", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout_s):
            raise RuntimeError(f"dashboard did not start within {timeout_s} s")
        if self._error is not None:
            self._thread.join(timeout_s)
            self._thread = None
            raise self._error
        return self.port

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            try:
                loop.run_until_complete(self.server.start())
            except BaseException as exc:  # noqa: BLE001 (re-raised by start() on the caller)
                self._error = exc
                return
            finally:
                self._ready.set()
            loop.run_forever()
            loop.run_until_complete(self.server.close())
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            loop.close()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Close the server and join the thread. Idempotent."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        loop = self._loop
        if loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop already ended
                loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout_s)
        if thread.is_alive():
            logger.warning("dashboard thread did not stop within %.1f s", timeout_s)

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
