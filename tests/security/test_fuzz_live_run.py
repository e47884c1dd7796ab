"""Hostile network input against a live 2-rank run: the coordinator's three listening ports.

A standalone coordinator process (``fuzz_coord_main.py``: control server, CPU reduce server,
dashboard) trains a small deterministic job with two real rank processes
(``fuzz_rank_main.py``). While they train, this process opens raw TCP connections to the
control port, the data (reduce) port and the dashboard port and sends at least
:data:`TARGET_INPUTS` hostile inputs: random bytes, truncated frames, length prefixes up to
``0xFFFFFFFF``, msgpack bodies with invalid fields under an HMAC of another secret, frames with
a wrong tag, a frame replayed from another run or from another connection of this run,
slowloris connections (one byte a second), thousands of idle connections and hostile HTTP
requests. One connection carries one input (the servers close a connection at its first bad
frame), so inputs and connections are counted alike. The control port sends its challenge at
accept (docs/design.md §1): every control input follows a 16-byte nonce, and those made with the
run secret are keyed for their own connection from that challenge (the challenge is not counted
as an answer).

Then the run must end as a reference run without the attack does: exit 0, every epoch covered
exactly once with the same sample counts, no rank declared dead, the two ranks on the same
consensus parameters (the parameter values themselves depend on timing in a cadence run, so
they are not compared with the reference). Every hostile control/data connection must be
closed by the server with a counted reason (the servers count every refusal by reason and log
only a budget of them a minute, so the attack cannot fill the disk), the idle and slowloris
ones included (no client may still see its connection open after ``CLIENT_TIMEOUT_S``); every
hostile HTTP request must be answered with a 4xx/503 that the client reads (no reset before
the answer); no port may have dropped a connection from its accept queue (the kernel's count,
reported by the coordinator: a dropped connection never reaches the server); the coordinator's
peak RSS must stay bounded (printed, for docs/reliability.md) and the run secret must not
appear in its output.

Connections come from many loopback source addresses (127.x.y.z) so that 100k connections
never run out of ephemeral ports; the test raises its own ``RLIMIT_NOFILE`` soft limit (the
coordinator inherits it) for the idle connections.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import json
import os
import random
import re
import resource
import secrets
import struct
import sys
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, TypedDict

import msgpack
import pytest
import torch

from flodl.wire.codec import MAX_CONTROL_FRAME_BYTES, auth_tag, encode_frame
from flodl.wire.control_hello import CHALLENGE_BYTES, NONCE_BYTES, connection_key, parse_challenge
from flodl.wire.data_hello import HELLO_MAGIC, encode_data_hello
from flodl.wire.frames import Heartbeat, Hello

pytestmark = [pytest.mark.integration, pytest.mark.uvloop]

HERE = Path(__file__).resolve().parent
COORD_MAIN = HERE / "fuzz_coord_main.py"
RANK_MAIN = HERE / "fuzz_rank_main.py"


class Job(TypedDict):
    world_size: int
    dataset_len: int
    batch_size: int
    epochs: int
    mode: str


JOB = Job(world_size=2, dataset_len=8192, batch_size=32, epochs=4, mode="cpu_cadence")
PACE_S = 0.3
"""Seconds each optimizer step sleeps while the attack lasts (the run must outlive it)."""
TARGET_INPUTS = 100_000
ATTACK_LIMIT_S = 480.0
"""A hang guard, not a speed bound: give up sending (and fail on the count) after this long.
The attack takes 20–100 s here; the run paces its steps while it lasts, so it never ends first."""
IDLE_CONTROL = 2000
IDLE_DASHBOARD = 150
IDLE_DATA = 4
SLOWLORIS = {"control": 40, "dashboard": 40, "data": 2}
CONCURRENCY = {"control": 48, "data": 4, "dashboard": 24}
SHARE = {"control": 0.66, "data": 0.14, "dashboard": 0.20}
"""Share of the fast inputs each port gets (the reduce server serves a thread per connection
and at most 12 connections, so it gets fewer)."""
CLIENT_TIMEOUT_S = 90.0
"""A hostile connection the server has not closed after this long counts as a failure."""
RSS_BOUND_MB = 600


# -------------------------------------------------------------------------------------------------
# The live run (coordinator process + 2 rank processes)
# -------------------------------------------------------------------------------------------------


@dataclass
class LiveRun:
    tmp: Path
    name: str
    paced: bool
    secret: bytes = field(default_factory=lambda: secrets.token_bytes(32))
    run_id: str = field(default_factory=lambda: f"fuzz-{uuid.uuid4().hex[:8]}")
    coord: asyncio.subprocess.Process | None = None
    ranks: list[asyncio.subprocess.Process] = field(default_factory=list)
    ports: dict[str, int] = field(default_factory=dict)

    @property
    def dir(self) -> Path:
        return self.tmp / self.name

    @property
    def log(self) -> Path:
        return self.dir / "coord.log"

    @property
    def hold(self) -> Path:
        return self.dir / "hold"

    async def start(self) -> None:
        self.dir.mkdir()
        secret_file = self.dir / "secret"
        fd = os.open(secret_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(self.secret.hex() + "\n")
        if self.paced:
            self.hold.touch()
        ports_file = self.dir / "ports.json"
        job = {
            **JOB,
            "run_id": self.run_id,
            "ports": str(ports_file),
            "summary": str(self.dir / "summary.json"),
        }
        env = {
            **os.environ,
            "FLODL_TEST_COORD": json.dumps(job),
            "FLODL_SECRET_FILE": str(secret_file),
        }
        env.pop("FLODL_SECRET", None)
        with _open_for_output(self.log) as out:
            self.coord = await asyncio.create_subprocess_exec(
                sys.executable, str(COORD_MAIN), env=env, stdout=out, stderr=out
            )
        await wait_until(lambda: ports_file.exists(), 60, "the coordinator's ports", self.coord)
        self.ports = _read_json(ports_file)
        for rank in range(JOB["world_size"]):
            rank_job = {
                **JOB,
                "run_id": self.run_id,
                "port": self.ports["control"],
                "rank": rank,
                "stem": str(self.dir / "run"),
                "out": str(self.dir / f"rank{rank}.pt"),
                "hold": str(self.hold),
                "pace_s": PACE_S,
            }
            rank_env = {
                **os.environ,
                "FLODL_TEST_RANK": json.dumps(rank_job),
                "FLODL_SECRET": self.secret.hex(),
            }
            with _open_for_output(self.dir / f"rank{rank}.log") as out:
                self.ranks.append(
                    await asyncio.create_subprocess_exec(
                        sys.executable, str(RANK_MAIN), env=rank_env, stdout=out, stderr=out
                    )
                )

    async def wait_training(self) -> None:
        """Until both ranks hold their data connection (the run is past formation)."""

        def connected() -> bool:
            text = self.log.read_text(errors="replace")
            return all(f"rank {r} connected to the reduce server" in text for r in range(2))

        await wait_until(connected, 90, "both ranks on the reduce server", self.coord)

    async def finish(self, limit_s: float = 120.0) -> tuple[int, list[int], dict[str, Any]]:
        assert self.coord is not None
        code = await asyncio.wait_for(self.coord.wait(), limit_s)
        codes = await asyncio.wait_for(asyncio.gather(*(p.wait() for p in self.ranks)), 30)
        return code, list(codes), _read_json(self.dir / "summary.json")

    def params(self, rank: int) -> list[torch.Tensor]:
        state = torch.load(self.dir / f"rank{rank}.pt", weights_only=True)
        return list(state["params"])

    async def cleanup(self) -> None:
        procs = [p for p in (self.coord, *self.ranks) if p is not None]
        for p in procs:
            if p.returncode is None:
                p.kill()
        for p in procs:
            await p.wait()


def _open_for_output(path: Path) -> BinaryIO:
    return open(path, "wb")


def _read_json(path: Path) -> Any:
    return json.loads(path.read_text())


async def wait_until(
    pred: Callable[[], bool],
    limit_s: float,
    what: str,
    proc: asyncio.subprocess.Process | None = None,
) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + limit_s
    while not pred():
        if proc is not None and proc.returncode is not None:
            raise AssertionError(f"process exited ({proc.returncode}) while waiting for {what}")
        if loop.time() > end:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.1)


def rss_kb(pid: int) -> int:
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


# -------------------------------------------------------------------------------------------------
# Hostile inputs
# -------------------------------------------------------------------------------------------------


def _frame(body: bytes, secret: bytes, seq: int = 0) -> bytes:
    header = struct.pack("!I", len(body))
    return header + body + auth_tag(secret, header, body, seq)


def _flip_last(data: bytes) -> bytes:
    return data[:-1] + bytes([data[-1] ^ 0x01])


INVALID_BODIES: list[object] = [
    {"kind": "hello"},
    {"kind": "hello", "protocol": 1, "run_id": "x", "rank": -1, "world_size": 2},
    {"kind": "hello", "protocol": 1, "run_id": "x" * 5000, "rank": 0, "world_size": 2},
    {"kind": "hello", "rank": 2**64 - 1, "world_size": 0, "run_id": None, "model_signature": 5},
    {"kind": "hello", "extra": 1, "rank": 0, "world_size": 2, "run_id": "r", "model_signature": ""},
    {"kind": "batch", "rank": "zero", "epoch": -3, "step": 1.5},
    {"kind": "heartbeat", "rank": 0, "step": float("nan")},
    {"kind": "sync_ack", "rank": 0, "session": [], "divergence": "inf"},
    {"kind": "shutdown"},
    {"kind": "rank_exited", "rank": 0, "exit_code": 0},
    {"kind": "no_such_kind", "rank": 0},
    {"kind": 7},
    {b"kind": b"hello"},
    {1: 2},
    [1, 2, 3],
    "hello",
    None,
    {"kind": "hello", "nested": functools.reduce(lambda acc, _: [acc], range(200), list[object]())},
]


Keyed = Callable[[bytes], bytes]
"""A control input made for one connection: the server's nonce (from its challenge) → the
bytes to send (our nonce, then frames under the connection key)."""
Payload = bytes | Keyed


@dataclass
class Payloads:
    """Every hostile message, built once (the attack picks among them); those under the run
    secret's connection keys are built per connection."""

    secret: bytes
    run_id: str
    rng: random.Random
    foreign: bytes = field(default_factory=lambda: secrets.token_bytes(32))

    def __post_init__(self) -> None:
        hello = Hello(run_id=self.run_id, rank=0, world_size=2, model_signature="f" * 64)
        self.hello = encode_frame(hello, self.secret)
        other = Hello(run_id="another-run", rank=0, world_size=2, model_signature="f" * 64)
        # a real hello of another run: its secret, its run id (what a captured frame would be)
        self.replayed = encode_frame(other, self.foreign)
        self.hello_frame = hello
        self.bodies = [msgpack.packb(b, use_bin_type=True) for b in INVALID_BODIES]
        self.foreign_invalid = [_frame(b, self.foreign) for b in self.bodies]
        dup = Hello(run_id=self.run_id, rank=1, world_size=2, model_signature="0" * 64)
        wrong_run = Hello(run_id="not-this-run", rank=0, world_size=2, model_signature="0" * 64)
        wrong_world = Hello(run_id=self.run_id, rank=0, world_size=3, model_signature="0" * 64)
        self.refused_hellos = [dup, wrong_run, wrong_world]
        # rank 0's real data hello
        self.data_hello = encode_data_hello(self.secret, self.run_id, 0, 2)

    # control port ----------------------------------------------------------------------------
    def nonce(self) -> bytes:
        """A rank nonce (what a control input starts with)."""
        return self.rng.randbytes(NONCE_BYTES)

    def _keyed(self, make: Callable[[bytes], bytes]) -> Keyed:
        """``make(connection key)`` after our nonce, for the connection whose challenge comes."""
        client_nonce = self.nonce()

        def build(server_nonce: bytes) -> bytes:
            return client_nonce + make(connection_key(self.secret, server_nonce, client_nonce))

        return build

    def control(self, kind: str) -> Payload:
        """A control input: a nonce then the hostile bytes, or one made for its connection."""
        rng = self.rng
        match kind:
            case "wrong_tag":  # a real hello of this connection, its tag damaged
                if rng.random() < 0.5:
                    return self._keyed(lambda k: _flip_last(encode_frame(self.hello_frame, k)))
                tag = rng.randbytes(16)
                return self._keyed(lambda k: encode_frame(self.hello_frame, k)[:-16] + tag)
            case "replayed_other_connection":  # this run's hello, keyed for another connection
                key = connection_key(self.secret, self.nonce(), self.nonce())
                return self.nonce() + encode_frame(self.hello_frame, key)
            case "authed_invalid_fields":
                body = rng.choice(self.bodies)
                return self._keyed(lambda k: _frame(body, k))
            case "authed_refused_hello":
                refused = rng.choice(self.refused_hellos)
                return self._keyed(lambda k: encode_frame(refused, k))
            case "authed_not_hello":
                return self._keyed(lambda k: encode_frame(Heartbeat(rank=0, step=5), k))
        return self.nonce() + self._unkeyed(kind)

    def _unkeyed(self, kind: str) -> bytes:
        rng = self.rng
        match kind:
            case "random_bytes":
                return rng.randbytes(rng.randint(1, 512))
            case "truncated_frame":
                return self.hello[: rng.randint(1, len(self.hello) - 1)]
            case "oversize_prefix":
                n = rng.choice(
                    [
                        MAX_CONTROL_FRAME_BYTES + 1,
                        2**31,
                        0xFFFFFFFF,
                        rng.randint(MAX_CONTROL_FRAME_BYTES + 1, 0xFFFFFFFF),
                    ]
                )
                return struct.pack("!I", n) + rng.randbytes(rng.randint(0, 64))
            case "zero_length":
                return b"\x00\x00\x00\x00" + rng.randbytes(16)
            case "short_body":
                n = rng.randint(64, 4096)
                return struct.pack("!I", n) + rng.randbytes(rng.randint(0, n - 1))
            case "foreign_secret_invalid_fields":
                return rng.choice(self.foreign_invalid)
            case "replayed_other_run":
                return self.replayed
            case "body_1mib_bad_tag":
                return struct.pack("!I", 1 << 20) + rng.randbytes((1 << 20) + 16)
            case "body_16mib_bad_tag":
                n = MAX_CONTROL_FRAME_BYTES
                return struct.pack("!I", n) + os.urandom(n + 16)
        raise AssertionError(kind)

    # data port -------------------------------------------------------------------------------
    def data(self, kind: str) -> bytes:
        rng = self.rng
        match kind:
            case "random_bytes":
                return rng.randbytes(rng.randint(1, 64))
            case "foreign_secret_hello":
                return encode_data_hello(self.foreign, self.run_id, rng.randint(0, 1), 2)
            case "wrong_tag_hello":
                return _flip_last(self.data_hello)
            case "replayed_hello":  # rank 0's hello again: rank 0 is connected already
                return self.data_hello
            case "world_mismatch_hello":
                return encode_data_hello(self.secret, self.run_id, 0, 3)
            case "other_run_hello":  # the real secret, another run's id (a reused secret file)
                return encode_data_hello(self.secret, "another-run", rng.randint(0, 1), 2)
            case "bad_version_hello":
                fields = struct.pack("!IBII", HELLO_MAGIC, 99, 0, 2)
                return fields + rng.randbytes(16)
            case "tensor_frame_first":
                return struct.pack("!IBBBBdQI", 0xF10D17F1, 2, 0, 0, 0, 1.0, 1, 0xFFFFFFFF)
        raise AssertionError(kind)

    # dashboard port --------------------------------------------------------------------------
    def http(self, kind: str) -> bytes:
        rng = self.rng
        match kind:
            case "random_bytes":
                return rng.randbytes(rng.randint(1, 600)) + b"\r\n\r\n"
            case "bad_method":
                method = rng.choice([b"POST", b"PUT", b"DELETE", b"TRACE", b"CONNECT", b"OPTIONS"])
                return method + b" / HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello"
            case "path_traversal":
                target = rng.choice(
                    [
                        b"/node?path=../../etc/passwd",
                        b"/history?path=root/../../../etc&n=5",
                        b"/node?path=root%2F..%2F..%2Fetc",
                        b"/stream?path=/etc/passwd",
                        b"/../../etc/passwd",
                        b"/node?path=root/%00",
                    ]
                )
                return b"GET " + target + b" HTTP/1.1\r\nHost: x\r\n\r\n"
            case "bad_params":
                target = rng.choice(
                    [
                        b"/history?path=root&n=99999999999999999999999",
                        b"/history?path=root&n=-1",
                        b"/stream?path=root&after=-5",
                        b"/node?path=%ff%fe",
                        b"/node?path=root&path=root",
                        b"/node?" + b"&".join(b"a%d=1" % i for i in range(40)),
                        b"/nope",
                        b"/history",
                    ]
                )
                return b"GET " + target + b" HTTP/1.1\r\nHost: x\r\n\r\n"
            case "long_request_line":
                return b"GET /" + b"A" * rng.randint(9000, 20000) + b" HTTP/1.1\r\n\r\n"
            case "too_many_headers":
                return b"GET / HTTP/1.1\r\n" + b"X-A: b\r\n" * 150 + b"\r\n"
            case "huge_header":
                return b"GET / HTTP/1.1\r\nX-A: " + b"b" * 20000 + b"\r\n\r\n"
            case "malformed":
                return rng.choice(
                    [
                        b"GET / HTTP/2.0\r\n\r\n",
                        b"GET /\r\n\r\n",
                        b"GET  /  HTTP/1.1\r\n\r\n",
                        b"GET http://evil/ HTTP/1.1\r\n\r\n",
                        b"GET / HTTP/1.1\r\nBad Header\r\n\r\n",
                        b"GET / HTTP/1.1\r\nX: \xff\xfe\r\n\r\n",
                        b"GET /stream?path=root HTTP/1.1\r\nLast-Event-ID: 1e99\r\n\r\n",
                        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03"  # a TLS hello
                        + rng.randbytes(64)
                        + b"\r\n\r\n",
                    ]
                )
        raise AssertionError(kind)


CONTROL_KINDS: dict[str, tuple[float, int | None]] = {
    # kind: (weight, cap on the number sent)
    "random_bytes": (20, None),
    "truncated_frame": (10, None),
    "oversize_prefix": (15, None),
    "zero_length": (3, None),
    "short_body": (5, None),
    "foreign_secret_invalid_fields": (15, None),
    "wrong_tag": (10, None),
    "replayed_other_run": (8, None),
    "replayed_other_connection": (8, None),
    "authed_invalid_fields": (5, None),
    "authed_refused_hello": (4, None),
    "authed_not_hello": (3, None),
    "body_1mib_bad_tag": (0.3, 200),
    "body_16mib_bad_tag": (0.05, 6),
}
DATA_KINDS: dict[str, tuple[float, int | None]] = {
    "random_bytes": (30, None),
    "foreign_secret_hello": (20, None),
    "wrong_tag_hello": (15, None),
    "replayed_hello": (10, None),
    "world_mismatch_hello": (8, None),
    "other_run_hello": (8, None),
    "bad_version_hello": (8, None),
    "tensor_frame_first": (9, None),
}
HTTP_KINDS: dict[str, tuple[float, int | None]] = {
    "random_bytes": (25, None),
    "bad_method": (15, None),
    "path_traversal": (15, None),
    "bad_params": (20, None),
    "long_request_line": (5, None),
    "too_many_headers": (5, None),
    "huge_header": (5, None),
    "malformed": (10, None),
}
# every hostile request (all end their head) must be refused with one of these; 408 is the
# answer to an idle or slowloris connection, 503 to one over the connection limit
HTTP_REFUSALS = {b"400", b"404", b"405", b"408", b"414", b"431", b"503"}


# -------------------------------------------------------------------------------------------------
# The attack
# -------------------------------------------------------------------------------------------------


class _Client(asyncio.Protocol):
    """One hostile connection: keeps the first bytes of the answer, notes how it ended. On the
    control port the server's challenge comes first: it is kept apart (``challenge``: the
    server's nonce, ``None`` if the connection ended first) and is no answer."""

    def __init__(self, ended: asyncio.Future[str], *, challenge: bool) -> None:
        self.ended = ended
        self.head = b""
        self._pre = b""
        self._skip = CHALLENGE_BYTES if challenge else 0
        self.challenge: asyncio.Future[bytes | None] = ended.get_loop().create_future()
        if not challenge:
            self.challenge.set_result(None)

    def data_received(self, data: bytes) -> None:
        if len(self._pre) < self._skip:
            need = self._skip - len(self._pre)
            self._pre, data = self._pre + data[:need], data[need:]
            if len(self._pre) == self._skip:
                self.challenge.set_result(parse_challenge(self._pre))
        if data and len(self.head) < 16:
            self.head += data[:16]

    def eof_received(self) -> bool:
        return False  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.challenge.done():
            self.challenge.set_result(None)
        if not self.ended.done():
            self.ended.set_result("reset" if exc is not None else "closed")


@dataclass
class Tally:
    sent: collections.Counter[tuple[str, str]] = field(default_factory=collections.Counter)
    ended: collections.Counter[tuple[str, str]] = field(default_factory=collections.Counter)
    http_status: collections.Counter[tuple[str, bytes]] = field(default_factory=collections.Counter)
    connect_errors: collections.Counter[str] = field(default_factory=collections.Counter)
    client_timeouts: collections.Counter[tuple[str, str]] = field(
        default_factory=collections.Counter
    )
    answered: collections.Counter[tuple[str, str]] = field(default_factory=collections.Counter)
    peak_rss_kb: int = 0
    bytes_sent: int = 0

    @property
    def total(self) -> int:
        return sum(self.sent.values())

    def by_port(self, port: str) -> int:
        return sum(n for (p, _), n in self.sent.items() if p == port)


class Attack:
    def __init__(self, ports: dict[str, int], payloads: Payloads, seed: int) -> None:
        self.ports = ports
        self.payloads = payloads
        self.rng = random.Random(seed)
        self.tally = Tally()
        self.stop = asyncio.Event()
        self.loop = asyncio.get_running_loop()

    def _source(self) -> str:
        rng = self.rng
        return f"127.{rng.randint(1, 254)}.{rng.randint(0, 255)}.{rng.randint(1, 254)}"

    async def _open(self, port: str, kind: str) -> tuple[asyncio.Transport, _Client] | None:
        ended: asyncio.Future[str] = self.loop.create_future()
        try:
            transport, proto = await self.loop.create_connection(
                lambda: _Client(ended, challenge=port == "control"),
                "127.0.0.1",
                self.ports[port],
                local_addr=(self._source(), 0),
            )
        except OSError as exc:
            self.tally.connect_errors[f"{port}: {type(exc).__name__}"] += 1
            return None
        self.tally.sent[port, kind] += 1
        return transport, proto

    async def _until_closed(
        self, port: str, kind: str, conn: tuple[asyncio.Transport, _Client]
    ) -> None:
        transport, proto = conn
        try:
            async with asyncio.timeout(CLIENT_TIMEOUT_S):
                how = await proto.ended
        except TimeoutError:
            self.tally.client_timeouts[port, kind] += 1
            transport.abort()
            return
        self.tally.ended[port, how] += 1
        if proto.head and port != "dashboard":
            self.tally.answered[port, kind] += 1
        if port == "dashboard":
            self.tally.http_status[kind, proto.head[9:12] or how.encode()] += 1

    async def one(self, port: str, kind: str, payload: Payload, *, eof: bool = True) -> None:
        conn = await self._open(port, kind)
        if conn is None:
            return
        transport, proto = conn
        if not isinstance(payload, bytes):  # made for this connection, from its challenge
            try:
                server_nonce = await asyncio.wait_for(proto.challenge, CLIENT_TIMEOUT_S)
            except TimeoutError:
                self.tally.client_timeouts[port, kind] += 1
                transport.abort()
                return
            payload = payload(server_nonce) if server_nonce is not None else b""
        with contextlib.suppress(Exception):
            transport.write(payload)
            self.tally.bytes_sent += len(payload)
            if eof and transport.can_write_eof():
                transport.write_eof()
        await self._until_closed(port, kind, conn)

    async def idle(self, port: str) -> None:
        conn = await self._open(port, "idle")
        if conn is not None:
            await self._until_closed(port, "idle", conn)

    async def slowloris(self, port: str, payload: bytes) -> None:
        conn = await self._open(port, "slowloris")
        if conn is None:
            return
        transport, proto = conn
        for i in range(len(payload)):
            if proto.ended.done():
                break
            with contextlib.suppress(Exception):
                transport.write(payload[i : i + 1])
            await asyncio.sleep(1.0)
        await self._until_closed(port, "slowloris", conn)

    def _pick(self, port: str, kinds: dict[str, tuple[float, int | None]]) -> str:
        open_kinds = [
            (k, w) for k, (w, cap) in kinds.items() if cap is None or self.tally.sent[port, k] < cap
        ]
        return self.rng.choices([k for k, _ in open_kinds], [w for _, w in open_kinds])[0]

    async def blast(
        self,
        port: str,
        kinds: dict[str, tuple[float, int | None]],
        make: Callable[[str], Payload],
        quota: int,
    ) -> None:
        heavy = asyncio.Semaphore(2)  # at most two multi-MiB bodies in flight

        async def worker() -> None:
            while not self.stop.is_set() and self.tally.by_port(port) < quota:
                kind = self._pick(port, kinds)
                if kind.startswith("body_"):
                    async with heavy:
                        await self.one(port, kind, make(kind))
                else:
                    await self.one(port, kind, make(kind))

        await asyncio.gather(*(worker() for _ in range(CONCURRENCY[port])))

    async def watch_rss(self, pid: int) -> None:
        while not self.stop.is_set():
            self.tally.peak_rss_kb = max(self.tally.peak_rss_kb, rss_kb(pid))
            await asyncio.sleep(0.25)

    async def run(self, coord_pid: int) -> Tally:
        p = self.payloads
        background: list[Awaitable[None]] = []
        # thousands of idle connections, opened in waves of 100 every 50 ms (a burst)
        for port, count in (
            ("control", IDLE_CONTROL),
            ("dashboard", IDLE_DASHBOARD),
            ("data", IDLE_DATA),
        ):
            background.append(self._waves(port, count))
        for port, count in SLOWLORIS.items():
            if port == "control":
                body = p.nonce() + p.hello
            elif port == "data":
                body = encode_data_hello(p.foreign, p.run_id, 0, 2)
            else:
                body = b"GET /paths HTTP/1.1\r\nHost: x\r\n" + b"X: y\r\n" * 20
            background.extend(self.slowloris(port, body) for _ in range(count))
        slow = IDLE_CONTROL + IDLE_DASHBOARD + IDLE_DATA + sum(SLOWLORIS.values())
        fast = TARGET_INPUTS - slow + 1000  # a margin over the target
        quotas = {port: int(fast * share) + 1 for port, share in SHARE.items()}
        rss = asyncio.ensure_future(self.watch_rss(coord_pid))
        try:
            async with asyncio.timeout(ATTACK_LIMIT_S):
                await asyncio.gather(
                    *background,
                    self.blast(
                        "control",
                        CONTROL_KINDS,
                        p.control,
                        quotas["control"] + IDLE_CONTROL + SLOWLORIS["control"],
                    ),
                    self.blast(
                        "data", DATA_KINDS, p.data, quotas["data"] + IDLE_DATA + SLOWLORIS["data"]
                    ),
                    self.blast(
                        "dashboard",
                        HTTP_KINDS,
                        p.http,
                        quotas["dashboard"] + IDLE_DASHBOARD + SLOWLORIS["dashboard"],
                    ),
                )
        except TimeoutError:
            pass  # the count assertion reports it
        finally:
            self.stop.set()
            await rss
        return self.tally

    async def _waves(self, port: str, count: int) -> None:
        tasks: list[asyncio.Task[None]] = []
        for start in range(0, count, 100):
            wave = [asyncio.ensure_future(self.idle(port)) for _ in range(min(100, count - start))]
            tasks.extend(wave)
            await asyncio.sleep(0.05)
        await asyncio.gather(*tasks)


# -------------------------------------------------------------------------------------------------
# Reading the coordinator's log
# -------------------------------------------------------------------------------------------------

_CONTROL_LINE = re.compile(
    r"WARNING flodl\.coord\.server: (?:closing|refused) \S+?(?: \(rank \S+\))?: (.*)"
)
_DATA_LINE = re.compile(
    r"WARNING flodl\.coord\.reduce: (?:closing the data connection of \S+: (.*)|"
    r"(refused data connection) from)"
)


def _reason_class(reason: str) -> str:
    for key in (
        "exceeds the",
        "bad auth tag",
        "EOF inside a frame",
        "empty frame body",
        "invalid",
        "undecodable frame body",
        "not a map",
        "no hello within",
        "evicted",
        "first frame is",
        "does not match this run",
        "already connected",
        "bad hello magic",
        "bad hello auth tag",
        "speaks data protocol version",
        "closed after",
        "already has a live data connection",
        "hello for a world of",
        "hello from another run",
        "read timeout",
        "refused data connection",
    ):
        if key in reason:
            return key
    return reason[:60]


def classify(counts: dict[str, int]) -> collections.Counter[str]:
    """The servers' refusal counters (reason → count) by reason class."""
    out: collections.Counter[str] = collections.Counter()
    for reason, n in counts.items():
        out[_reason_class(reason)] += n
    return out


def report_log(log: str) -> str:
    return f"{len(log.splitlines())} log lines"


def parse_log(text: str) -> tuple[collections.Counter[str], collections.Counter[str]]:
    control: collections.Counter[str] = collections.Counter()
    data: collections.Counter[str] = collections.Counter()
    for line in text.splitlines():
        if m := _CONTROL_LINE.match(line):
            control[_reason_class(m[1])] += 1
        elif m := _DATA_LINE.match(line):
            data[_reason_class(m[1] or m[2])] += 1
    return control, data


# -------------------------------------------------------------------------------------------------
# The test
# -------------------------------------------------------------------------------------------------


def _raise_fd_limit(needed: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft >= needed:
        return
    if hard != resource.RLIM_INFINITY and hard < needed:
        pytest.skip(f"RLIMIT_NOFILE hard limit {hard} < {needed} needed for the idle connections")
    resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))


def _assert_same_run(summary: dict[str, Any], reference: dict[str, Any]) -> None:
    assert summary["ok"], summary["reason"]
    assert summary["dead"] == [], summary["dead"]
    assert summary["joined"] == JOB["world_size"]
    assert summary["coverage"] == reference["coverage"]
    for report in summary["coverage"].values():
        assert report["ok"]
        assert report["committed"] == report["total"]
    assert len(summary["epochs"]) == JOB["epochs"]
    samples = [sum(e["samples"]) for e in summary["epochs"]]
    assert samples == [sum(e["samples"]) for e in reference["epochs"]]
    assert samples == [JOB["dataset_len"]] * JOB["epochs"]


@pytest.mark.timeout(720)
async def test_hostile_inputs_on_every_port_change_nothing(tmp_path: Path) -> None:
    _raise_fd_limit(IDLE_CONTROL + IDLE_DASHBOARD + IDLE_DATA + 2048)
    loop = asyncio.get_running_loop()

    # --- reference: the same job, no attack, no pacing
    ref = LiveRun(tmp_path, "reference", paced=False)
    try:
        await ref.start()
        ref_code, ref_codes, reference = await ref.finish()
    finally:
        await ref.cleanup()
    assert (ref_code, ref_codes) == (0, [0, 0]), ref.log.read_text()[-3000:]

    # --- the attacked run
    run = LiveRun(tmp_path, "attacked", paced=True)
    try:
        await run.start()
        await run.wait_training()
        assert run.coord is not None
        started = loop.time()
        attack = Attack(run.ports, Payloads(run.secret, run.run_id, random.Random(7)), seed=11)
        tally = await attack.run(run.coord.pid)
        attack_s = loop.time() - started
        still_training = run.coord.returncode is None and all(
            p.returncode is None for p in run.ranks
        )
        run.hold.unlink()
        code, codes, summary = await run.finish()
    finally:
        with contextlib.suppress(FileNotFoundError):
            run.hold.unlink()
        await run.cleanup()

    log = run.log.read_text(errors="replace")
    control_log = classify(summary["control_refusals"])
    data_log = classify(summary["data_refusals"])
    logged_control, logged_data = parse_log(log)
    # the log itself stays bounded: a budget of warnings a minute plus one summary line each
    assert sum(logged_control.values()) + sum(logged_data.values()) <= 2 * 20 * 3, report_log(log)
    authed = sum(n for (p, k), n in tally.sent.items() if k.startswith("authed_"))
    authed += tally.sent["control", "replayed_other_connection"]
    report = {
        "attack_s": round(attack_s, 1),
        "inputs": tally.total,
        "inputs_with_the_run_secret": authed
        + tally.sent["data", "replayed_hello"]
        + tally.sent["data", "world_mismatch_hello"]
        + tally.sent["data", "other_run_hello"],
        "bytes_sent": tally.bytes_sent,
        "by_port": {p: tally.by_port(p) for p in ("control", "data", "dashboard")},
        "by_kind": {f"{p}/{k}": n for (p, k), n in sorted(tally.sent.items())},
        "ended": {f"{p}/{h}": n for (p, h), n in sorted(tally.ended.items())},
        "http_status": {
            f"{k}/{s.decode(errors='replace')}": n
            for (k, s), n in sorted(tally.http_status.items())
        },
        "connect_errors": dict(tally.connect_errors),
        "client_timeouts": {f"{p}/{k}": n for (p, k), n in tally.client_timeouts.items()},
        "answered": {f"{p}/{k}": n for (p, k), n in tally.answered.items()},
        "control_log_reasons": dict(control_log),
        "data_log_reasons": dict(data_log),
        "coord_peak_rss_mb_sampled": round(tally.peak_rss_kb / 1024, 1),
        "coord_vm_hwm_mb": round(summary["vm_hwm_kb"] / 1024, 1),
        "coord_vm_hwm_mb_reference": round(reference["vm_hwm_kb"] / 1024, 1),
        "sync_rounds": summary["sync_rounds"],
        "listen_drops": summary["listen_drops"],
    }
    print("FUZZ REPORT " + json.dumps(report, indent=1))

    # the attack happened, while the run trained
    assert tally.total >= TARGET_INPUTS, report
    assert still_training, "the run ended before the attack did: raise JOB epochs or PACE_S"
    assert tally.by_port("control") >= 50_000
    assert tally.by_port("data") >= 5_000
    assert tally.by_port("dashboard") >= 10_000
    assert tally.sent["control", "idle"] >= 2000

    # the run ends as the reference did
    assert (code, codes) == (0, [0, 0]), log[-3000:]
    _assert_same_run(summary, reference)
    a, b = run.params(0), run.params(1)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert "declared dead" not in log

    # every connection reached its server: no accept queue overflowed. (With asyncio's default
    # backlog of 100, the burst of idle connections overflowed the control port's under a slow
    # attack; Linux then left some of them established on the client's side only, where no
    # deadline of the server can close them: they were the idle connections still open at 90 s.)
    assert summary["listen_drops"] == {"control": 0, "data": 0, "dashboard": 0}, report
    # every hostile connection was closed by the server (none left hanging), with a reason
    assert not tally.client_timeouts, report
    assert not tally.connect_errors, report
    # one counted reason per hostile control/data connection, no more, no less
    assert sum(control_log.values()) == tally.by_port("control"), report
    assert sum(data_log.values()) == tally.by_port("data"), report
    answers: collections.Counter[bytes] = collections.Counter()
    for (_, status), n in tally.http_status.items():
        answers[status] += n
    # every request got its refusal, and read it: the server half-closes after an answer and
    # reads what the client still sends, so no reset (which a client that writes before it
    # reads, as a slowloris does, would see instead of the answer) is ever sent
    assert set(answers) <= HTTP_REFUSALS, report
    # nothing unauthenticated reached the machine: hellos were refused, the rest never decoded
    assert control_log["bad auth tag"] >= (
        tally.sent["control", "wrong_tag"]
        + tally.sent["control", "replayed_other_run"]
        + tally.sent["control", "replayed_other_connection"]
        + tally.sent["control", "foreign_secret_invalid_fields"]
    )
    # a first frame over 64 KiB is refused by its length alone, before a byte of it is kept
    assert control_log["exceeds the"] >= (
        tally.sent["control", "body_1mib_bad_tag"] + tally.sent["control", "body_16mib_bad_tag"]
    )
    # authenticated but refused hellos stayed refused; no authenticated frame came first
    refused = control_log["does not match this run"] + control_log["already connected"]
    assert refused == tally.sent["control", "authed_refused_hello"], report
    assert control_log["first frame is"] >= tally.sent["control", "authed_not_hello"], report
    assert data_log["already has a live data connection"] <= tally.sent["data", "replayed_hello"]
    assert data_log["hello from another run"] == tally.sent["data", "other_run_hello"], report
    # the servers answered nothing but those refused hellos (a reject frame): no data-port
    # hello was acked, no unauthenticated control frame got a reply
    assert set(tally.answered) <= {("control", "authed_refused_hello")}, report
    assert "Traceback" not in log
    assert " ERROR " not in log and "CRITICAL" not in log

    # bounded memory, and the secret never printed
    assert summary["vm_hwm_kb"] < RSS_BOUND_MB * 1024, report
    assert run.secret.hex() not in log
    assert run.secret.hex().upper() not in log
