"""ssh fan-out: the ssh argv, the quoted remote command, the secret kept out of argv, the
rank-side secret reader, and argument validation.

The command tests are pure (``shlex.split`` reads the remote string back). The round-trip tests
run the remote string under each POSIX shell found here (``sh -c REMOTE``, what sshd does with
the login shell), and :func:`spawn_ssh` runs against a fake ``ssh`` on ``PATH`` that records
its argv and stdin; both take milliseconds.
"""

from __future__ import annotations

import io
import itertools
import json
import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

from flodl.errors import ConfigError
from flodl.launch.cluster import SshSettings, Worker
from flodl.launch.env import ENV_SECRET_STDIN, read_secret_from_stdin
from flodl.launch.ssh import EXIT_BAD_WORKER_PATH, spawn_ssh, ssh_command

SECRET = bytes(range(0xA0, 0xC0))  # 32 bytes, hex a0a1…bf
DEFAULTS = [
    "-o",
    "BatchMode=yes",
    "-o",
    "ConnectTimeout=10",
    "-o",
    "ServerAliveInterval=5",
    "-o",
    "ServerAliveCountMax=3",
]
NASTY = [
    "a b",
    "it's",
    '"double"',
    "$HOME",
    "${PATH}",
    "`id`",
    "$(id)",
    "a;b",
    "x && y",
    "p | q",
    ">out",
    "*",
    "?",
    "{a,b}",
    "~",
    "~/x",
    "-x",
    "back\\slash",
    "tab\there",
    "multi\nline",
    "#hash",
    "!bang",
    "ünïcode",
    "",
]
"""Arguments a shell would mangle if any piece were not quoted."""


def worker(
    *, host: str = "node-a", path: str | None = None, ssh: SshSettings | None = None
) -> Worker:
    return Worker(host=host, devices=("cpu",), path=path, ssh=ssh)


def split(command: Sequence[str]) -> tuple[list[str], str, str]:
    """``(ssh options, target, remote)``; the remote string is the last argument."""
    assert command[:2] == ["ssh", "-T"]
    sep = command.index("--")
    assert len(command) == sep + 3, "exactly a target and one remote string follow --"
    return list(command[2:sep]), command[sep + 1], command[sep + 2]


def parse_remote(remote: str) -> tuple[str | None, dict[str, str], list[str]]:
    """``(cd path, exported env, exec argv)`` as the remote shell will see them."""
    tokens = shlex.split(remote)
    path: str | None = None
    if tokens[0] == "CDPATH=":
        assert tokens[1:3] == ["cd", "--"]
        path = tokens[3]
        assert tokens[4:7] == ["||", "{", "printf"]
        end = tokens.index("}")
        assert tokens[end - 4 : end + 2] == [";", "exit", str(EXIT_BAD_WORKER_PATH), ";", "}", ";"]
        tokens = tokens[end + 2 :]
    env: dict[str, str] = {}
    if tokens[0] == "export":
        end = tokens.index(";")
        for item in tokens[1:end]:
            key, _, value = item.partition("=")
            env[key] = value
        tokens = tokens[end + 1 :]
    assert tokens[0] == "exec"
    return path, env, tokens[1:]


# command construction -------------------------------------------------------------------------


def test_minimal_command() -> None:
    command = ssh_command(worker(), ["python", "train.py"], {})
    options, target, remote = split(command)
    assert options == DEFAULTS
    assert target == "node-a"
    assert remote == "export FLODL_SECRET_STDIN=1 ; exec python train.py"


def test_example_command_is_exact() -> None:
    w = worker(
        path="/opt/flodl",
        ssh=SshSettings(target="me@node-a.example", port=2222, identity_file="/k/id"),
    )
    command = ssh_command(w, ["python", "-m", "app"], {"FLODL_RANK": "3", "OMP": "4"})
    assert command == [
        "ssh",
        "-T",
        *DEFAULTS,
        "-p",
        "2222",
        "-i",
        "/k/id",
        "--",
        "me@node-a.example",
        (
            "CDPATH= cd -- /opt/flodl || { printf '%s\\n' 'flodl: worker node-a: cannot enter "
            "its path /opt/flodl (missing, not a directory, or not permitted); set path to the "
            "checkout on that host' >&2 ; exit 78 ; } ; export FLODL_RANK=3 FLODL_SECRET_STDIN=1 "
            "OMP=4 ; exec python -m app"
        ),
    ]


TARGETS = (None, "me@node-a.example")
PORTS = (22, 2222)
USERS = (None, "bob")
IDENTITIES = (None, "/keys/id_ed25519", "~/.ssh/id_flodl")
OPTIONS: tuple[tuple[str, ...], ...] = ((), ("-o", "Compression=yes", "-v", "-J", "jump"))


@pytest.mark.parametrize(
    ("target", "port", "user", "identity", "options"),
    list(itertools.product(TARGETS, PORTS, USERS, IDENTITIES, OPTIONS)),
)
def test_every_ssh_settings_combination(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    target: str | None,
    port: int,
    user: str | None,
    identity: str | None,
    options: tuple[str, ...],
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    settings = SshSettings(
        target=target, port=port, user=user, identity_file=identity, options=options
    )
    command = ssh_command(worker(ssh=settings), ["prog"], {})
    got_options, got_target, remote = split(command)
    expected = list(DEFAULTS)
    if port != 22:
        expected += ["-p", str(port)]
    if user is not None:
        expected += ["-l", user]
    if identity is not None:
        expected += ["-i", identity.replace("~", str(tmp_path), 1)]
    expected += list(options)
    assert got_options == expected
    assert got_target == (target or "node-a")
    assert parse_remote(remote) == (None, {ENV_SECRET_STDIN: "1"}, ["prog"])


def test_no_ssh_settings_is_the_defaults_only() -> None:
    options, target, _ = split(ssh_command(worker(host="10.0.0.7"), ["prog"], {}))
    assert options == DEFAULTS
    assert target == "10.0.0.7"


def test_identity_tilde_is_expanded_on_this_machine(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    w = worker(ssh=SshSettings(identity_file="~/.ssh/id"))
    options, _, _ = split(ssh_command(w, ["prog"], {}))
    assert options[-2:] == ["-i", str(tmp_path / "home" / ".ssh" / "id")]


@pytest.mark.parametrize(
    ("user_options", "dropped"),
    [
        (("-o", "ConnectTimeout=30"), "ConnectTimeout=10"),
        (("-oBatchMode=no",), "BatchMode=yes"),
        (("-o", "serveraliveinterval 7"), "ServerAliveInterval=5"),
        (("-o", "ServerAliveCountMax = 9"), "ServerAliveCountMax=3"),
    ],
)
def test_user_option_replaces_the_same_default(user_options: tuple[str, ...], dropped: str) -> None:
    options, _, _ = split(ssh_command(worker(ssh=SshSettings(options=user_options)), ["p"], {}))
    assert dropped not in options
    kept = [o for o in DEFAULTS if o != "-o" and o != dropped]
    assert [o for o in options if o in kept] == kept
    assert options[-len(user_options) :] == list(user_options)


# quoting --------------------------------------------------------------------------------------


@pytest.mark.parametrize("nasty", NASTY)
def test_argv_pieces_survive_quoting(nasty: str) -> None:
    argv = ["/opt/my python", "-c", nasty, f"pre{nasty}post"]
    _, _, remote = split(ssh_command(worker(), argv, {}))
    assert parse_remote(remote)[2] == argv


@pytest.mark.parametrize("nasty", [n for n in NASTY if n and "\n" not in n])
def test_env_values_and_paths_survive_quoting(nasty: str) -> None:
    path = f"/srv/dir {nasty}" if nasty.startswith("~") else f"/srv/{nasty}"
    env = {"VALUE": nasty, "OTHER": f"a{nasty}b"}
    _, _, remote = split(ssh_command(worker(path=path), ["prog"], env))
    got_path, got_env, argv = parse_remote(remote)
    assert got_path == path
    assert got_env == {"OTHER": f"a{nasty}b", "VALUE": nasty, ENV_SECRET_STDIN: "1"}
    assert argv == ["prog"]


def test_env_is_exported_in_sorted_order() -> None:
    _, _, remote = split(ssh_command(worker(), ["p"], {"ZED": "1", "ALPHA": "2", "MID": "3"}))
    assert list(parse_remote(remote)[1]) == ["ALPHA", "FLODL_SECRET_STDIN", "MID", "ZED"]


@pytest.mark.parametrize(
    ("path", "expected"),
    [("~", "$HOME"), ("~/", "$HOME/"), ("~/runs/my flodl", "$HOME/runs/my flodl")],
)
def test_home_relative_path_uses_remote_home(path: str, expected: str) -> None:
    _, _, remote = split(ssh_command(worker(path=path), ["p"], {}))
    assert parse_remote(remote)[0] == expected
    assert '"$HOME"' in remote


def test_tilde_elsewhere_in_path_is_literal() -> None:
    _, _, remote = split(ssh_command(worker(path="/srv/~x"), ["p"], {}))
    assert parse_remote(remote)[0] == "/srv/~x"
    assert "$HOME" not in remote


# the secret -----------------------------------------------------------------------------------


def test_secret_never_appears_in_argv() -> None:
    env = {"FLODL_SECRET": SECRET.hex(), "FLODL_RANK": "0", "FLODL_COORD": "10.0.0.1:1337"}
    command = ssh_command(worker(path="/opt/flodl"), ["python", "train.py"], env)
    joined = "\0".join(command)
    assert SECRET.hex() not in joined
    assert SECRET.hex().upper() not in joined
    assert "FLODL_SECRET=" not in joined
    _, exported, _ = parse_remote(split(command)[2])
    assert exported == {
        "FLODL_COORD": "10.0.0.1:1337",
        "FLODL_RANK": "0",
        ENV_SECRET_STDIN: "1",
    }


def test_secret_stdin_flag_is_forced_to_one() -> None:
    command = ssh_command(worker(), ["p"], {ENV_SECRET_STDIN: "0"})
    assert parse_remote(split(command)[2])[1] == {ENV_SECRET_STDIN: "1"}


def test_without_stdin_secret_the_env_may_not_hold_it() -> None:
    with pytest.raises(ConfigError, match="FLODL_SECRET may not be exported"):
        ssh_command(worker(), ["p"], {"FLODL_SECRET": SECRET.hex()}, secret_via_stdin=False)
    command = ssh_command(worker(), ["p"], {"A": "1"}, secret_via_stdin=False)
    assert parse_remote(split(command)[2])[1] == {"A": "1"}


def test_env_mapping_is_not_modified() -> None:
    env = {"FLODL_SECRET": SECRET.hex()}
    ssh_command(worker(), ["p"], env)
    assert env == {"FLODL_SECRET": SECRET.hex()}


# validation -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("env", "match"),
    [
        ({"A\x00B": "1"}, "NUL or newline"),
        ({"A\nB": "1"}, "NUL or newline"),
        ({"A": "x\x00y"}, "NUL or newline"),
        ({"A": "x\ny"}, "NUL or newline"),
        ({"A": "x\ry"}, "NUL or newline"),
        ({"": "1"}, "not a shell variable name"),
        ({"1A": "1"}, "not a shell variable name"),
        ({"A-B": "1"}, "not a shell variable name"),
        ({"A=B": "1"}, "not a shell variable name"),
        ({"A B": "1"}, "not a shell variable name"),
        ({"A": 1}, "must be strings"),
    ],
)
def test_bad_env_is_rejected(env: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        ssh_command(worker(), ["p"], env)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        ([], "remote argv is empty"),
        ((), "remote argv is empty"),
        ("python train.py", "sequence of strings"),
        ([""], "must name a program"),
        (["-c", "x"], "must name a program"),
        (["python", "a\x00b"], r"argv\[1\] contains a NUL"),
        (["python", 3], r"argv\[1\] must be a string"),
    ],
)
def test_bad_remote_argv_is_rejected(argv: Sequence[object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        ssh_command(worker(), argv, {})  # type: ignore[arg-type]


def test_config_error_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="empty"):
        ssh_command(worker(), [], {})


# read_secret_from_stdin -----------------------------------------------------------------------


def feed(monkeypatch: pytest.MonkeyPatch, text: str) -> io.StringIO:
    stream = io.StringIO(text)
    monkeypatch.setattr(sys, "stdin", stream)
    return stream


@pytest.mark.parametrize(
    "text",
    [
        SECRET.hex() + "\n",
        SECRET.hex(),
        SECRET.hex().upper() + "\n",
        "  " + SECRET.hex() + " \r\n",
    ],
)
def test_read_secret_good(monkeypatch: pytest.MonkeyPatch, text: str) -> None:
    feed(monkeypatch, text)
    assert read_secret_from_stdin() == SECRET


def test_read_secret_minimum_length(monkeypatch: pytest.MonkeyPatch) -> None:
    feed(monkeypatch, "ab" * 16 + "\n")
    assert read_secret_from_stdin() == b"\xab" * 16


def test_read_secret_reads_one_line_only(monkeypatch: pytest.MonkeyPatch) -> None:
    stream = feed(monkeypatch, SECRET.hex() + "\nnext line\n")
    assert read_secret_from_stdin() == SECRET
    assert stream.read() == "next line\n"


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("ab" * 15 + "\n", "is 15 bytes; at least 16"),
        ("\n", "is 0 bytes; at least 16"),
        ("", "stdin ended before the run secret"),
        ("zz" * 32 + "\n", "must be one line of hex digits"),
        (SECRET.hex()[:-1] + "\n", "must be one line of hex digits"),
        ("ab" * 16 + " cd\n", "must be one line of hex digits"),
        ("ab" * 2000 + "\n", "longer than 1024 hex digits"),
    ],
)
def test_read_secret_bad(monkeypatch: pytest.MonkeyPatch, text: str, match: str) -> None:
    feed(monkeypatch, text)
    with pytest.raises(ConfigError, match=match):
        read_secret_from_stdin()


def test_read_secret_error_does_not_echo_the_input(monkeypatch: pytest.MonkeyPatch) -> None:
    almost = "ab" * 31 + "zz"
    feed(monkeypatch, almost + "\n")
    with pytest.raises(ConfigError) as info:
        read_secret_from_stdin()
    assert almost not in str(info.value)


def test_read_secret_without_stdin(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "stdin", None)
    with pytest.raises(ConfigError, match="no stdin"):
        read_secret_from_stdin()


# round trip through real local shells -------------------------------------------------------

SHELLS = [s for s in ("sh", "dash", "bash", "zsh", "ksh", "mksh") if shutil.which(s)]
PROBE = (
    "import json, os, sys\n"
    "print(json.dumps({'argv': sys.argv[1:], 'cwd': os.getcwd(),"
    " 'env': {k: os.environ.get(k) for k in ('VALUE', 'FLODL_SECRET_STDIN', 'FLODL_SECRET')}}))\n"
)


def run_remote(shell: str, remote: str, home: Path) -> subprocess.CompletedProcess[str]:
    """What sshd does with REMOTE: ``<login shell> -c REMOTE``."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home)}
    return subprocess.run(
        [shell, "-c", remote], env=env, capture_output=True, text=True, timeout=30, check=False
    )


@pytest.mark.skipif(not SHELLS, reason="no POSIX shell found")
@pytest.mark.parametrize("shell", SHELLS)
def test_remote_string_round_trips_through_the_shell(shell: str, tmp_path: Path) -> None:
    workdir = tmp_path / "dir with 'quote' $x `y` ;z"
    workdir.mkdir()
    args = list(NASTY)
    value = 'it\'s $HOME `id` ; $(id) \\ "q" *'
    command = ssh_command(
        worker(path=str(workdir)),
        [sys.executable, "-c", PROBE, *args],
        {"VALUE": value, "FLODL_SECRET": SECRET.hex()},
    )
    done = run_remote(shell, split(command)[2], tmp_path)
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout)
    assert got["argv"] == args
    assert got["cwd"] == str(workdir)
    assert got["env"] == {"VALUE": value, "FLODL_SECRET_STDIN": "1", "FLODL_SECRET": None}


@pytest.mark.skipif(not SHELLS, reason="no POSIX shell found")
@pytest.mark.parametrize("shell", SHELLS)
def test_home_relative_path_round_trips(shell: str, tmp_path: Path) -> None:
    (tmp_path / "runs" / "my flodl").mkdir(parents=True)
    command = ssh_command(worker(path="~/runs/my flodl"), [sys.executable, "-c", PROBE], {})
    done = run_remote(shell, split(command)[2], tmp_path)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["cwd"] == str(tmp_path / "runs" / "my flodl")


@pytest.mark.skipif(not SHELLS, reason="no POSIX shell found")
@pytest.mark.parametrize("shell", SHELLS)
def test_missing_path_fails_clearly(shell: str, tmp_path: Path) -> None:
    missing = tmp_path / "no such dir"
    command = ssh_command(worker(host="node-b", path=str(missing)), ["true"], {})
    done = run_remote(shell, split(command)[2], tmp_path)
    assert done.returncode == EXIT_BAD_WORKER_PATH
    assert done.stdout == ""
    assert f"flodl: worker node-b: cannot enter its path {missing}" in done.stderr


# spawn_ssh against a fake ssh -----------------------------------------------------------------

FAKE_SSH = """#!/bin/sh
for arg in "$@"; do printf '%s\\0' "$arg"; done > "$FAKE_SSH_DIR/argv"
cat > "$FAKE_SSH_DIR/stdin"
echo fake-out
exit 7
"""


@pytest.fixture
def fake_ssh(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    script = bindir / "ssh"
    script.write_text(FAKE_SSH)
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}")
    monkeypatch.setenv("FAKE_SSH_DIR", str(tmp_path))
    return tmp_path


def test_spawn_ssh_sends_the_secret_on_stdin_only(fake_ssh: Path) -> None:
    env = {"FLODL_SECRET": SECRET.hex(), "FLODL_RANK": "1"}
    proc = spawn_ssh(worker(), ["python", "train.py"], env, SECRET, stdout=subprocess.PIPE)
    assert proc.stdin is None
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 7
    assert out == b"fake-out\n"
    assert (fake_ssh / "stdin").read_bytes() == SECRET.hex().encode() + b"\n"
    argv = (fake_ssh / "argv").read_bytes().split(b"\0")[:-1]
    assert [a.decode() for a in argv] == ssh_command(worker(), ["python", "train.py"], env)[1:]
    assert SECRET.hex().encode() not in b"\0".join(argv)


def test_spawn_ssh_survives_an_ssh_that_exits_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "ssh").write_text("#!/bin/sh\nexec 0<&-\nexit 255\n")
    (bindir / "ssh").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}")
    for _ in range(5):  # whichever of write and exit comes first, no error escapes
        proc = spawn_ssh(worker(), ["p"], {}, SECRET)
        assert proc.wait(timeout=30) == 255


@pytest.mark.parametrize(
    ("secret", "match"),
    [(b"x" * 15, "got 15 bytes"), (b"", "got 0 bytes"), (SECRET.hex(), "got str")],
)
def test_spawn_ssh_rejects_a_weak_secret(secret: object, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        spawn_ssh(worker(), ["p"], {}, secret)  # type: ignore[arg-type]


def test_spawn_ssh_validates_before_starting_anything(fake_ssh: Path) -> None:
    with pytest.raises(ConfigError, match="NUL or newline"):
        spawn_ssh(worker(), ["p"], {"A": "x\ny"}, SECRET)
    assert not (fake_ssh / "argv").exists()
