"""The run secret and the authentication built on it.

* the secret is never on a command line (``/proc/*/cmdline`` of the launcher, its coordinator
  and its ranks, sampled during a live ``local_ranks(2)`` run) nor in the output of a run that
  logs at DEBUG in every process, nor in the files the run writes;
* ``flodl coord`` creates a missing ``--secret-file`` with mode 0600, refuses one that group or
  others may read, never prints the secret, binds loopback by default and warns when it does
  not;
* a real hello recorded from run A is refused by run B, at its tag, whatever the two runs share
  (another secret; the same secret and another run id; the same secret and run id): every
  control connection agrees its own key from a server challenge and a rank nonce; a
  coordinator's answers recorded on one connection are refused by a rank on another; a frame
  replayed inside a connection (same sequence number) closes that connection;
* tags are compared in constant time (``hmac.compare_digest``, checked in the source) and a
  tag that differs in its last byte is refused (codec, data handshake, tensor frames, live).

Where the secret does live: the launcher hands it to its local ranks in their environment
(``FLODL_SECRET``), which processes of the same user can read (``/proc/<pid>/environ``); the
first test reads it from there.
"""

from __future__ import annotations

import ast
import asyncio
import base64
import contextlib
import inspect
import logging
import os
import re
import signal
import stat
import struct
import subprocess
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

import flodl
from flodl.config import CoordConfig, ElCheConfig, validated
from flodl.errors import FrameError
from flodl.rank.bridge import RankBridge
from flodl.service.coordinator import CoordinatorService
from flodl.wire import codec, data_hello, tensor_read
from flodl.wire.codec import HEADER_BYTES, TAG_BYTES, decode_frame, encode_frame
from flodl.wire.control_hello import CHALLENGE_BYTES, NONCE_BYTES, connection_key, parse_challenge
from flodl.wire.data_hello import encode_data_hello, parse_data_hello
from flodl.wire.frames import Accept, Heartbeat, Hello
from flodl.wire.stream import client_handshake
from flodl.wire.tensor_read import decode_tensor_frame
from flodl.wire.tensors import TensorKind, encode_tensor_frame

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "secret_main.py"
REPO = HERE.parents[1]
SIGNATURE = "ab" * 32


# -------------------------------------------------------------------------------------------------
# helpers
# -------------------------------------------------------------------------------------------------


def encodings(secret: bytes) -> list[str]:
    """Every text form of the secret a log line or a command line could carry."""
    return [
        secret.hex(),
        secret.hex().upper(),
        base64.b64encode(secret).decode(),
        base64.urlsafe_b64encode(secret).decode(),
        repr(secret)[2:-1],
    ]


def leaks(text: str, secret: bytes) -> list[str]:
    return [form for form in encodings(secret) if form in text]


def proc_table() -> dict[int, tuple[str, dict[str, str]]]:
    """pid → (command line, environment) of every process readable now."""
    table: dict[int, tuple[str, dict[str, str]]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            environ: dict[str, str] = {}
            with contextlib.suppress(OSError):
                for item in (entry / "environ").read_bytes().split(b"\0"):
                    key, sep, value = item.decode(errors="replace").partition("=")
                    if sep:
                        environ[key] = value
            table[int(entry.name)] = (cmdline, environ)
    return table


@dataclass
class Watch:
    """Samples the process table while a run lasts."""

    tag: str
    cmdlines: dict[int, str] = field(default_factory=dict)
    tagged: dict[int, tuple[str, dict[str, str]]] = field(default_factory=dict)

    def sample(self) -> None:
        for pid, (cmdline, environ) in proc_table().items():
            self.cmdlines[pid] = cmdline
            if self.tag in cmdline:
                self.tagged[pid] = (cmdline, environ)

    def until_exit(self, proc: subprocess.Popen[bytes], limit_s: float) -> int:
        deadline = time.monotonic() + limit_s
        while proc.poll() is None:
            self.sample()
            if time.monotonic() > deadline:
                proc.kill()
                raise AssertionError(f"{self.tag}: still running after {limit_s} s")
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(0.05)
        return proc.returncode


def scrubbed_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLODL_")}
    env.update(extra)
    return env


def files_under(root: Path) -> Iterator[Path]:
    for path in root.rglob("*"):
        if path.is_file():
            yield path


# -------------------------------------------------------------------------------------------------
# the secret stays off command lines and out of output and files
# -------------------------------------------------------------------------------------------------


@pytest.mark.integration
@pytest.mark.timeout(180)
def test_launcher_run_keeps_the_secret_off_command_lines_output_and_files(tmp_path: Path) -> None:
    tag = f"flodl-sec-{uuid.uuid4().hex}"
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    stdout, stderr = tmp_path / "stdout", tmp_path / "stderr"
    with stdout.open("wb") as so, stderr.open("wb") as se:
        proc = subprocess.Popen(
            [
                *(sys.executable, str(SCRIPT), "--tag", tag, "--ranks", "2", "--samples", "4096"),
                *("--step-sleep", "0.01", "--out-dir", str(out_dir)),
            ],
            stdout=so,
            stderr=se,
            cwd=REPO,
            env=scrubbed_env(),
        )
        watch = Watch(tag)
        code = watch.until_exit(proc, 150)
    out, err = stdout.read_text(errors="replace"), stderr.read_text(errors="replace")
    assert code == 0, err[-3000:]
    assert "DONE" in out
    assert " DEBUG flodl." in err  # DEBUG logging was on (launcher, coordinator and ranks)

    ranks = {pid: env for pid, (_, env) in watch.tagged.items() if "FLODL_RANK" in env}
    assert proc.pid in watch.tagged, "the launcher was never seen"
    assert sorted(env["FLODL_RANK"] for env in ranks.values()) == ["0", "1"]
    # the launcher hands the secret to its local ranks in their environment (docs/design.md §2c)
    handed = {env.get("FLODL_SECRET") for env in ranks.values()}
    assert len(handed) == 1 and None not in handed, "the ranks no longer get FLODL_SECRET"
    secret = bytes.fromhex(handed.pop() or "")
    assert len(secret) >= 16

    for pid, cmdline in watch.cmdlines.items():
        assert not leaks(cmdline, secret), f"the secret is on the command line of pid {pid}"
    launcher_env = watch.tagged[proc.pid][1]
    assert not leaks(" ".join(launcher_env.values()), secret), "the launcher's own environment"
    assert not leaks(out, secret) and not leaks(err, secret), "the secret is in the output"
    written = list(files_under(out_dir))
    names = {p.name for p in written}
    assert {"bundle.meta.json", "dashboard.html"} <= names
    assert any(re.fullmatch(r"bundle\.b[0-9a-f-]+\.fdl", n) for n in names)  # the tagged model
    assert any(p.suffix == ".log" for p in written)  # the record log
    for path in written:
        data = path.read_bytes()
        assert secret not in data, path
        assert not leaks(data.decode("latin-1"), secret), path
    print(
        f"secret checked against {len(watch.cmdlines)} command lines, {len(out) + len(err)} "
        f"bytes of DEBUG output and {len(written)} files; found only in the environment of "
        f"ranks {sorted(ranks)}"
    )


def _start_coord(
    tmp: Path, secret_file: Path, *args: str, name: str = "coord"
) -> tuple[subprocess.Popen[bytes], str, Path]:
    """Start ``flodl -vv coord``; return it, its ``host:port`` and its stderr file."""
    err = tmp / f"{name}.stderr"
    with err.open("wb") as se:
        proc = subprocess.Popen(
            [
                *(sys.executable, "-m", "flodl", "-vv", "coord", "--world-size", "2"),
                *("--dataset-len", "2048", "--epochs", "2", "--mode", "cpu_cadence"),
                *("--secret-file", str(secret_file), *args),
            ],
            stdout=subprocess.PIPE,
            stderr=se,
            cwd=REPO,
            env=scrubbed_env(),
            # SIGINT's default action in the child: a suite started in the background (CI
            # with `&`) passes SIGINT on ignored, and Python then installs no handler
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # noqa: PLW1509
        )
    assert proc.stdout is not None
    banner = b""
    while b"FLODL_COORD=" not in banner:
        line = proc.stdout.readline()
        if not line:
            proc.wait(30)
            proc.stdout.close()
            pytest.fail(f"flodl coord exited ({proc.returncode}): {err.read_text()[-2000:]}")
        banner += line
    found = re.search(rb"FLODL_COORD=(\S+)", banner)
    assert found is not None
    (tmp / f"{name}.banner").write_bytes(banner)
    return proc, found[1].decode(), err


@pytest.mark.integration
@pytest.mark.timeout(180)
def test_flodl_coord_creates_a_0600_secret_file_and_never_prints_it(tmp_path: Path) -> None:
    tag = f"flodl-sec-{uuid.uuid4().hex[:12]}"
    secret_file = tmp_path / "run.secret"
    coord, address, coord_err = _start_coord(tmp_path, secret_file, "--run-id", tag)
    ranks: list[subprocess.Popen[bytes]] = []
    watch = Watch(tag)
    try:
        assert stat.S_IMODE(secret_file.stat().st_mode) == 0o600
        secret = bytes.fromhex(secret_file.read_text().strip())
        assert len(secret) >= 16
        for rank in range(2):
            env = scrubbed_env(
                FLODL_RANK=str(rank),
                FLODL_WORLD_SIZE="2",
                FLODL_COORD=address,
                FLODL_SECRET_FILE=str(secret_file),
                FLODL_RUN_ID=tag,
            )
            out = (tmp_path / f"rank{rank}.out").open("wb")
            ranks.append(
                subprocess.Popen(
                    [sys.executable, str(SCRIPT), "--tag", tag, "--ranks", "1"],
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    cwd=REPO,
                    env=env,
                )
            )
            out.close()
        codes = [watch.until_exit(p, 150) for p in ranks]
        assert codes == [0, 0], [(tmp_path / f"rank{r}.out").read_text()[-2000:] for r in (0, 1)]
        assert coord.wait(60) == 0, coord_err.read_text()[-3000:]
        assert coord.stdout is not None
        coord_out = (tmp_path / "coord.banner").read_text() + coord.stdout.read().decode()
    finally:
        for p in (coord, *ranks):
            if p.poll() is None:
                p.kill()
                p.wait()
        if coord.stdout is not None:
            coord.stdout.close()
    texts = {
        "coordinator stdout": coord_out,
        "coordinator stderr (-vv)": coord_err.read_text(errors="replace"),
        **{f"rank {r} output": (tmp_path / f"rank{r}.out").read_text() for r in (0, 1)},
    }
    assert " DEBUG flodl." in texts["coordinator stderr (-vv)"]
    for what, text in texts.items():
        assert not leaks(text, secret), what
    assert str(secret_file) in coord_out  # the banner names the file, not the secret
    for pid, cmdline in watch.cmdlines.items():
        assert not leaks(cmdline, secret), pid
    for pid, (_, env) in watch.tagged.items():
        assert not leaks(" ".join(env.values()), secret), f"pid {pid} has the secret in its env"


def _run_coord_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "flodl", "coord", "--world-size", "2", "--dataset-len", "64", *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
        env=scrubbed_env(),
    )


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o660, 0o666])
def test_flodl_coord_refuses_a_secret_file_others_can_read(tmp_path: Path, mode: int) -> None:
    secret = os.urandom(32)
    path = tmp_path / "run.secret"
    path.write_text(secret.hex() + "\n")
    path.chmod(mode)
    out = _run_coord_cli("--secret-file", str(path))
    assert out.returncode == 2
    assert "Traceback" not in out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith("flodl coord: error:")
    assert str(path) in lines[0] and "chmod 600" in lines[0] and oct(mode) in lines[0]
    assert not leaks(out.stdout + out.stderr, secret)


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (b"not hex at all\n", "not a hex secret"),
        (b"00112233\n", "at least 16 bytes"),
        (b"\xff\xfe\x00garbage", "not a hex secret"),
        (b"", "at least 16 bytes"),
    ],
)
def test_flodl_coord_refuses_an_unusable_secret_file(
    tmp_path: Path, content: bytes, expected: str
) -> None:
    path = tmp_path / "run.secret"
    path.write_bytes(content)
    path.chmod(0o600)
    out = _run_coord_cli("--secret-file", str(path))
    assert out.returncode == 2
    assert "Traceback" not in out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0] and str(path) in lines[0], out.stderr
    if len(content) > 4:
        assert content.decode(errors="ignore").strip() not in lines[0]  # contents not echoed


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_flodl_coord_binds_loopback_by_default_and_warns_on_other_addresses(
    tmp_path: Path,
) -> None:
    secret_file = tmp_path / "run.secret"
    for name, args in (("default", ()), ("public", ("--host", "0.0.0.0"))):
        proc, address, err = _start_coord(tmp_path, secret_file, *args, name=name)
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:  # never leave it running; say what it was doing
            proc.kill()
            proc.wait(30)
            pytest.fail(f"flodl coord ignored SIGINT for 30 s: {err.read_text()[-3000:]}")
        finally:
            if proc.stdout is not None:
                proc.stdout.close()
        text = err.read_text()
        if name == "default":
            assert address.startswith("127.0.0.1:"), address
            assert "warning: listening on" not in text
        else:
            assert address.startswith("0.0.0.0:"), address
            assert "flodl coord: warning: listening on 0.0.0.0" in text
            assert "not encrypted" in text


# -------------------------------------------------------------------------------------------------
# replay: across runs (a recorded real hello) and inside a connection (sequence numbers)
# -------------------------------------------------------------------------------------------------


async def start_coordinator(secret: bytes, run_id: str) -> CoordinatorService:
    cfg = validated(
        CoordConfig,
        world_size=2,
        dataset_len=256,
        batch_size=32,
        num_epochs=1,
        elche=ElCheConfig.preset("cpu_cadence"),
        run_id=run_id,
    )
    service = CoordinatorService(cfg, secret)
    await service.start()
    return service


class RecordingProxy:
    """A TCP proxy that records its (last) client's nonce and every frame it sends (and can send
    one twice), and every byte the server sends back (its challenge first)."""

    def __init__(self, target_port: int, *, duplicate: int | None = None) -> None:
        self.target_port = target_port
        self.duplicate = duplicate
        self.nonce = b""
        self.frames: list[bytes] = []
        self.from_server = bytearray()
        self.server: asyncio.Server | None = None
        self.tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._on_client, "127.0.0.1", 0)
        return int(self.server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    async def _on_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        for coro in (self._frames(reader, up_writer), self._bytes(up_reader, writer)):
            task = asyncio.ensure_future(coro)
            self.tasks.add(task)

    async def _frames(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            self.nonce = await reader.readexactly(NONCE_BYTES)
            writer.write(self.nonce)
            while True:
                header = await reader.readexactly(HEADER_BYTES)
                (length,) = struct.unpack("!I", header)
                frame = header + await reader.readexactly(length + TAG_BYTES)
                self.frames.append(frame)
                writer.write(frame)
                if len(self.frames) - 1 == self.duplicate:
                    writer.write(frame)  # the replay: same bytes, same sequence number
                await writer.drain()
        writer.close()

    async def _bytes(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError):
            while data := await reader.read(65536):
                self.from_server += data
                writer.write(data)
                await writer.drain()
        writer.close()


def real_bridge(port: int, secret: bytes, run_id: str) -> RankBridge:
    hello = Hello(run_id=run_id, rank=0, world_size=2, model_signature=SIGNATURE)
    return RankBridge(
        "127.0.0.1",
        port,
        secret,
        hello,
        heartbeat_s=0.2,
        connect_timeout_s=10.0,
        hard_exit_grace_s=None,  # never os._exit the test process
    )


def proxy_key(proxy: RecordingProxy, secret: bytes) -> bytes:
    """The key of the connection the proxy relayed (from its challenge and nonce)."""
    server_nonce = parse_challenge(proxy.from_server[:CHALLENGE_BYTES])
    return connection_key(secret, server_nonce, proxy.nonce)


@dataclass(frozen=True)
class Recorded:
    """Both sides of a real rank's join, as a wire tap sees them."""

    from_rank: bytes
    """The rank's nonce and its hello."""
    from_coordinator: bytes
    """The coordinator's challenge and its accept."""


async def record_real_join(secret: bytes, run_id: str) -> Recorded:
    """What a real :class:`RankBridge` and coordinator of run ``run_id`` send to each other,
    up to the accept."""
    service = await start_coordinator(secret, run_id)
    assert service.server is not None
    proxy = RecordingProxy(service.port)
    try:
        bridge = real_bridge(await proxy.start(), secret, run_id)
        accept = await asyncio.to_thread(bridge.start)
        assert isinstance(accept, Accept)
        await asyncio.to_thread(bridge.close)
    finally:
        await proxy.close()
        await service.close()
    key = proxy_key(proxy, secret)  # the recording is genuine: it decodes under its own key
    hello = decode_frame(proxy.frames[0], key)
    assert isinstance(hello, Hello) and hello.run_id == run_id
    answer = bytes(proxy.from_server[CHALLENGE_BYTES:])
    assert isinstance(decode_frame(answer[: _first_len(answer)], key), Accept)
    return Recorded(
        proxy.nonce + proxy.frames[0],
        bytes(proxy.from_server[: CHALLENGE_BYTES + _first_len(answer)]),
    )


async def record_real_hello(secret: bytes, run_id: str) -> bytes:
    """The bytes a real :class:`RankBridge` sends to run ``run_id`` up to its hello (its nonce
    and the hello frame)."""
    return (await record_real_join(secret, run_id)).from_rank


async def _exchange(
    port: int,
    write: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]],
    limit_s: float,
) -> bytes:
    """Connect, ``write``, then return what came back before EOF or ``limit_s``."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    got = b""
    try:
        async with asyncio.timeout(limit_s):
            await write(reader, writer)
            await writer.drain()
            while chunk := await reader.read(65536):
                got += chunk
    except (ConnectionError, TimeoutError):
        pass  # a reset, or a connection the server keeps (an accepted hello)
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()
    return got


async def send_raw(port: int, data: bytes, limit_s: float = 15.0) -> bytes:
    """Read the coordinator's challenge on a fresh connection, then send ``data`` as it is (a
    recorded nonce and frames); return what came back after the challenge, before EOF or
    ``limit_s``."""

    async def write(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        parse_challenge(await reader.readexactly(CHALLENGE_BYTES))
        writer.write(data)

    return await _exchange(port, write, limit_s)


async def send_keyed(
    port: int, secret: bytes, make: Callable[[bytes], bytes], limit_s: float = 15.0
) -> tuple[bytes, bytes]:
    """Do a rank's handshake on a fresh connection, then send ``make(connection key)``; return
    the key and what came back, before EOF or ``limit_s``."""
    keys: list[bytes] = []

    async def write(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        keys.append(await client_handshake(reader, writer, secret))
        writer.write(make(keys[0]))

    reply = await _exchange(port, write, limit_s)
    assert keys, "no challenge from the coordinator"
    return keys[0], reply


@pytest.mark.uvloop
@pytest.mark.timeout(60)
async def test_a_real_hello_recorded_from_one_run_is_refused_by_another(
    caplog: pytest.LogCaptureFixture,
) -> None:
    secret_a = os.urandom(32)
    recorded = await record_real_hello(secret_a, "run-a")

    # run B: another run's secret (every launcher run draws its own): the tag fails
    service = await start_coordinator(os.urandom(32), "run-b")
    try:
        with caplog.at_level(logging.WARNING, logger="flodl.service.server"):
            reply = await send_raw(service.port, recorded)
        assert reply == b""  # not even a reject: nothing is decoded before the tag checks
        assert service.machine.membership.liveness.joined_count() == 0
        assert "bad first frame: bad auth tag" in caplog.text
    finally:
        await service.close()

    # run C: the same secret (a reused secret file) but another run id: the recorded hello was
    # keyed for its own connection (protocol 3), so it fails its tag before its run id is read
    # (protocol 2 decoded it and sent a reject naming the other run id)
    caplog.clear()
    service = await start_coordinator(secret_a, "run-c")
    try:
        with caplog.at_level(logging.WARNING, logger="flodl.service.server"):
            reply = await send_raw(service.port, recorded)
        assert reply == b""
        assert service.machine.membership.liveness.joined_count() == 0
        assert "bad first frame: bad auth tag" in caplog.text
    finally:
        await service.close()


@pytest.mark.uvloop
@pytest.mark.timeout(60)
async def test_a_recorded_hello_is_refused_by_a_later_run_with_the_same_secret_and_run_id(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Two `flodl coord` runs on one --secret-file given the same --run-id: the later one sends
    its own challenge, so the recorded nonce and hello give another key and the hello fails its
    tag (the connection is closed without an accept, nothing is decoded)."""
    secret = os.urandom(32)
    recorded = await record_real_hello(secret, "run")
    service = await start_coordinator(secret, "run")
    try:
        with caplog.at_level(logging.WARNING, logger="flodl.service.server"):
            reply = await send_raw(service.port, recorded, limit_s=5.0)
        assert reply == b""  # closed, without an accept
        assert service.machine.membership.liveness.joined_count() == 0
        assert "bad first frame: bad auth tag" in caplog.text
    finally:
        await service.close()


@pytest.mark.uvloop
@pytest.mark.timeout(60)
async def test_a_recorded_coordinator_transcript_is_refused_by_a_rank() -> None:
    """A fake coordinator replays the challenge and the accept a real one sent on an earlier
    connection of the same run (same secret, same run id): the rank's nonce is fresh, so the
    key differs and the accept fails its tag; the rank never starts."""
    secret = os.urandom(32)
    recorded = await record_real_join(secret, "run-r")
    heard: list[bytes] = []

    async def replay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(recorded.from_coordinator)
        with contextlib.suppress(ConnectionError):
            heard.append(await reader.read(65536))
            while await reader.read(65536):
                pass
        writer.close()

    fake = await asyncio.start_server(replay, "127.0.0.1", 0)
    try:
        bridge = real_bridge(int(fake.sockets[0].getsockname()[1]), secret, "run-r")
        with pytest.raises(FrameError, match="bad auth tag"):
            await asyncio.to_thread(bridge.start)
        assert bridge.accepted is None
        await asyncio.to_thread(bridge.close)
        assert heard and heard[0][:NONCE_BYTES] != recorded.from_rank[:NONCE_BYTES]
    finally:
        fake.close()
        await fake.wait_closed()


@pytest.mark.uvloop
@pytest.mark.timeout(60)
async def test_a_frame_replayed_by_a_proxy_inside_a_connection_closes_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    secret = os.urandom(32)
    service = await start_coordinator(secret, "run-e")
    proxy = RecordingProxy(service.port, duplicate=1)  # the first heartbeat, twice
    bridge = real_bridge(await proxy.start(), secret, "run-e")
    try:
        with caplog.at_level(logging.WARNING, logger="flodl.service.server"):
            await asyncio.to_thread(bridge.start)
            lost = await asyncio.to_thread(bridge.lost.wait, 15.0)
        assert lost, "the coordinator kept the connection that replayed a frame"
        assert re.search(r"closing \S+ \(rank 0\): bad frame: bad auth tag", caplog.text)
        assert isinstance(decode_frame(proxy.frames[1], proxy_key(proxy, secret), seq=1), Heartbeat)
    finally:
        await asyncio.to_thread(bridge.close)
        await proxy.close()
        await service.close()


@pytest.mark.uvloop
@pytest.mark.timeout(60)
@pytest.mark.parametrize("replay", ["same_frame_twice", "hello_again", "future_seq"])
async def test_a_replayed_sequence_number_closes_the_connection(
    replay: str, caplog: pytest.LogCaptureFixture
) -> None:
    secret = os.urandom(32)
    service = await start_coordinator(secret, "run-f")

    def frames(key: bytes) -> bytes:
        hello = encode_frame(
            Hello(run_id="run-f", rank=0, world_size=2, model_signature=SIGNATURE), key, seq=0
        )
        beat = encode_frame(Heartbeat(rank=0, step=1), key, seq=1)
        second = {
            "same_frame_twice": beat,  # seq 1 again where 2 is expected
            "hello_again": hello,  # seq 0 again
            "future_seq": encode_frame(Heartbeat(rank=0, step=2), key, seq=5),
        }[replay]
        return hello + beat + second

    try:
        with caplog.at_level(logging.WARNING, logger="flodl.service.server"):
            key, reply = await send_keyed(service.port, secret, frames)
        accept = decode_frame(reply[: _first_len(reply)], key)
        assert isinstance(accept, Accept)
        assert re.search(r"closing \S+ \(rank 0\): bad frame: bad auth tag", caplog.text)
    finally:
        await service.close()


def _first_len(data: bytes) -> int:
    (body_len,) = struct.unpack("!I", data[:HEADER_BYTES])
    assert isinstance(body_len, int)
    return HEADER_BYTES + body_len + TAG_BYTES


# -------------------------------------------------------------------------------------------------
# constant-time tag comparison
# -------------------------------------------------------------------------------------------------


def test_tags_are_compared_with_hmac_compare_digest() -> None:
    assert "hmac.compare_digest(" in inspect.getsource(codec.verify_tag)
    assert "hmac.compare_digest(" in inspect.getsource(data_hello._parse)
    assert "hmac.compare_digest(" in inspect.getsource(tensor_read._read_payloads)
    # and nowhere in the code that handles peer bytes is a tag, digest or MAC compared with
    # == / != (checkpoint.py and launch/cluster_file.py have unrelated format and YAML "tags")
    secretish = re.compile(r"(tag|digest|mac|hmac)$", re.IGNORECASE)
    offenders = []
    root = Path(flodl.__file__).parent
    paths = [p for sub in ("wire", "coord", "rank", "service") for p in (root / sub).rglob("*.py")]
    paths.append(root / "launch" / "ssh.py")
    assert len(paths) > 20
    for path in sorted(paths):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if not isinstance(node, ast.Compare):
                continue
            if not any(isinstance(op, ast.Eq | ast.NotEq) for op in node.ops):
                continue
            for side in (node.left, *node.comparators):
                name = _name_of(side)
                if name is not None and secretish.search(name):
                    offenders.append(f"{path.relative_to(root)}:{node.lineno} ({name})")
    assert offenders == []


def _name_of(node: ast.expr) -> str | None:
    match node:
        case ast.Name(id=name) | ast.Attribute(attr=name):
            return name
        case ast.Call(func=func):
            return _name_of(func)
        case ast.Subscript(value=value):
            return _name_of(value)
    return None


def _flip_last(data: bytes) -> bytes:
    return data[:-1] + bytes([data[-1] ^ 0x01])


def test_a_tag_differing_in_its_last_byte_is_refused_everywhere() -> None:
    secret = os.urandom(32)
    frame = encode_frame(Heartbeat(rank=0, step=1), secret, seq=3)
    assert isinstance(decode_frame(frame, secret, seq=3), Heartbeat)
    with pytest.raises(FrameError, match="bad auth tag"):
        decode_frame(_flip_last(frame), secret, seq=3)

    hello = encode_data_hello(secret, "run", 1, 2)
    assert parse_data_hello(secret, "run", hello)[:2] == (1, 2)
    with pytest.raises(FrameError, match="auth tag"):
        parse_data_hello(secret, "run", _flip_last(hello))

    ts = [torch.arange(6, dtype=torch.float32).view(2, 3), torch.ones(4)]
    wire = b"".join(
        bytes(b)
        for b in encode_tensor_frame(
            ts, kind=TensorKind.MODEL_PARAMS, weight=1.0, round=3, secret=secret
        )
    )
    out = [torch.empty(2, 3), torch.empty(4)]
    decode_tensor_frame(wire, out, secret=secret, max_frame_bytes=1 << 20)
    assert torch.equal(out[0], ts[0])
    with pytest.raises(FrameError, match="auth tag"):
        decode_tensor_frame(_flip_last(wire), out, secret=secret, max_frame_bytes=1 << 20)


@pytest.mark.uvloop
@pytest.mark.timeout(60)
async def test_a_live_hello_with_its_last_tag_byte_flipped_is_refused(
    caplog: pytest.LogCaptureFixture,
) -> None:
    secret = os.urandom(32)
    service = await start_coordinator(secret, "run-g")

    def hello(key: bytes) -> bytes:
        return encode_frame(
            Hello(run_id="run-g", rank=0, world_size=2, model_signature=SIGNATURE), key
        )

    try:
        with caplog.at_level(logging.WARNING, logger="flodl.service.server"):
            _, refused = await send_keyed(service.port, secret, lambda k: _flip_last(hello(k)))
            assert refused == b""
            # the genuine one joins
            key, reply = await send_keyed(service.port, secret, hello, limit_s=1.0)
        assert "bad first frame: bad auth tag" in caplog.text
        assert isinstance(decode_frame(reply[: _first_len(reply)], key), Accept)
    finally:
        await service.close()
