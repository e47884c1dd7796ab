"""Record log: path gate, write → tail → read_tree, the bounded ring, errors swallowed."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from flodl.errors import ConfigError
from flodl.monitor.records import (
    DEFAULT_MAX_BYTES,
    RECORD_VERSION,
    RecordLog,
    make_record,
    node_file,
    paths,
    read_tree,
    validate_path,
)

LOGGER = "flodl.monitor.records"


def rec(path: str, i: int, *, pad: int = 0, kind: str = "node") -> dict[str, Any]:
    return make_record(path, kind, {"i": i, "pad": "x" * pad}, ts_ms=1_700_000_000_000 + i)


def node_bytes(directory: Path, path: str) -> int:
    active = node_file(directory, path)
    return sum(p.stat().st_size for p in active.parent.glob(active.name + "*"))


# -- paths ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "path",
    [
        "root",
        "root/rank0",
        "root/node-a",
        "root/node-a/rank3",
        "root/host.example.org/rank12",
        "root/a_b/c-d/e.f",
        "root/" + "a" * 64,
        "root/..a",
        "root/a..",
    ],
)
def test_valid_paths(path: str) -> None:
    assert validate_path(path) == path


@pytest.mark.parametrize(
    ("path", "why"),
    [
        ("", "empty"),
        ("/root", "start with"),
        ("/etc/passwd", "start with"),
        ("rootx", "start with"),
        ("Root", "start with"),
        ("root/", "bad segment"),
        ("root//a", "bad segment"),
        ("root/../x", "'..' segment"),
        ("root/./x", "'.' segment"),
        ("root/..", "'..' segment"),
        ("root/a b", "bad segment"),
        ("root/%2e%2e", "bad segment"),
        ("root/%2e%2e/etc", "bad segment"),
        ("root/a\\b", "bad segment"),
        ("root/a\nb", "bad segment"),
        ("root/a\n", "bad segment"),
        ("root/a\x00", "bad segment"),
        ("root/é", "bad segment"),
        ("root/a/b/c/d", "5 segments deep"),
        ("root/" + "a" * 65, "bad segment"),
    ],
)
def test_invalid_paths_are_rejected_with_a_reason(path: str, why: str) -> None:
    with pytest.raises(ConfigError, match=why):
        validate_path(path)


def test_non_string_path_is_rejected() -> None:
    with pytest.raises(ConfigError, match="string"):
        validate_path(None)


def test_node_file_layout(tmp_path: Path) -> None:
    assert node_file(tmp_path, "root") == tmp_path / "root.log"
    assert node_file(tmp_path, "root/a") == tmp_path / "root" / "a.log"
    assert node_file(tmp_path, "root/a/rank1") == tmp_path / "root" / "a" / "rank1.log"
    with pytest.raises(ConfigError):
        node_file(tmp_path, "root/../../etc")


def test_make_record_shape_and_validation() -> None:
    r = make_record("root/rank0", "node", {"loss": 1.5}, sev="warning", ts_ms=12)
    assert r == {
        "v": RECORD_VERSION,
        "ts": 12,
        "sev": "warning",
        "path": "root/rank0",
        "kind": "node",
        "data": {"loss": 1.5},
    }
    assert isinstance(make_record("root", "meta", {})["ts"], int)
    with pytest.raises(ConfigError, match="severity"):
        make_record("root", "node", {}, sev="fatal")
    with pytest.raises(ConfigError, match="kind"):
        make_record("root", "Node kind", {})
    with pytest.raises(ConfigError, match="data"):
        make_record("root", "node", [1, 2])  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="ts_ms"):
        make_record("root", "node", {}, ts_ms=-1)
    with pytest.raises(ConfigError):
        make_record("root/../x", "node", {})


# -- construction --------------------------------------------------------------------------


def test_max_bytes_zero_means_default(tmp_path: Path) -> None:
    assert RecordLog(tmp_path, 0).max_bytes == DEFAULT_MAX_BYTES == 32 * 2**20
    assert RecordLog(tmp_path).segment_bytes == DEFAULT_MAX_BYTES // 4


@pytest.mark.parametrize(
    ("max_bytes", "segments"), [(-1, 4), (4095, 1), (100, 4), (4096, 5), (8192, 0)]
)
def test_bad_sizes_are_rejected(tmp_path: Path, max_bytes: int, segments: int) -> None:
    with pytest.raises(ConfigError):
        RecordLog(tmp_path, max_bytes, segments=segments)


def test_nothing_is_created_before_the_first_write(tmp_path: Path) -> None:
    RecordLog(tmp_path / "new").close()
    assert not (tmp_path / "new").exists()


# -- round trip ----------------------------------------------------------------------------


def test_write_tail_read_tree_round_trip(tmp_path: Path) -> None:
    meta = make_record("root", "meta", {"reductions": {"loss": "mean"}, "run": {"id": "x"}})
    written = [meta]
    with RecordLog(tmp_path) as log:
        log.write(meta)
        for i in range(5):
            for path in ("root", "root/h1", "root/h1/rank0", "root/h1/rank1", "root/rank2"):
                r = rec(path, i)
                log.write(r)
                written.append(r)
        alert = make_record(
            "root/h1/rank1",
            "event",
            {"class": "rank_lost", "detail": "silent 30 s", "count": 1},
            sev="critical",
        )
        log.write(alert)
        written.append(alert)

    assert (tmp_path / "root.log").is_file()
    assert (tmp_path / "root" / "h1" / "rank0.log").is_file()
    tree = read_tree(tmp_path)
    assert list(tree) == sorted(tree)
    assert set(tree) == {"root", "root/h1", "root/h1/rank0", "root/h1/rank1", "root/rank2"}
    assert paths(tmp_path) == sorted(tree)
    for path, records in tree.items():
        assert records == [r for r in written if r["path"] == path]
    assert RecordLog.tail(tmp_path, "root", 2) == tree["root"][-2:]
    assert RecordLog.tail(tmp_path, "root/h1/rank1", 1) == [alert]
    assert RecordLog.tail(tmp_path, "root/h1/rank1", 100) == tree["root/h1/rank1"]


def test_lines_are_compact_json(tmp_path: Path) -> None:
    r = rec("root", 1)
    with RecordLog(tmp_path) as log:
        log.write(r)
    assert (tmp_path / "root.log").read_text() == json.dumps(r, separators=(",", ":")) + "\n"


def test_a_write_is_readable_before_close(tmp_path: Path) -> None:
    log = RecordLog(tmp_path)
    try:
        for i in range(3):
            log.write(rec("root/rank0", i))
            assert RecordLog.tail(tmp_path, "root/rank0", 1)[0]["data"]["i"] == i
    finally:
        log.close()


def test_write_after_close_reopens(tmp_path: Path) -> None:
    log = RecordLog(tmp_path)
    log.write(rec("root", 0))
    log.close()
    log.write(rec("root", 1))
    log.close()
    assert [r["data"]["i"] for r in read_tree(tmp_path)["root"]] == [0, 1]


def test_appends_to_an_existing_log(tmp_path: Path) -> None:
    with RecordLog(tmp_path) as log:
        log.write(rec("root", 0))
    with RecordLog(tmp_path) as log:
        log.write(rec("root", 1))
    assert [r["data"]["i"] for r in RecordLog.tail(tmp_path, "root", 10)] == [0, 1]


def test_concurrent_writers_never_interleave_lines(tmp_path: Path) -> None:
    log = RecordLog(tmp_path, 1 << 20)

    def work(t: int) -> None:
        for i in range(200):
            log.write(rec("root", t * 1000 + i, pad=50))

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    log.close()
    got = sorted(r["data"]["i"] for r in read_tree(tmp_path)["root"])
    assert got == sorted(t * 1000 + i for t in range(4) for i in range(200))


# -- the ring ------------------------------------------------------------------------------


def test_ring_stays_bounded_and_keeps_the_newest(tmp_path: Path) -> None:
    max_bytes = 16 * 1024
    line = len(json.dumps(rec("root/rank0", 0, pad=100), separators=(",", ":"))) + 1
    total = 2000  # ~ 30 × max_bytes
    with RecordLog(tmp_path, max_bytes) as log:
        for i in range(total):
            log.write(rec("root/rank0", i, pad=100))
            assert node_bytes(tmp_path, "root/rank0") <= max_bytes
        log.write(rec("root/rank1", 0))
    assert total * line > 20 * max_bytes

    kept = [r["data"]["i"] for r in read_tree(tmp_path)["root/rank0"]]
    assert kept == list(range(kept[0], total))  # contiguous, the newest ones, in order
    assert kept[0] > 0
    # at least (segments - 1) full segments survive a rotation
    assert len(kept) * line >= 3 * (max_bytes // 4) - 3 * line
    assert len(list((tmp_path / "root").glob("rank0.log*"))) == 4
    assert read_tree(tmp_path)["root/rank1"] == [rec("root/rank1", 0)]


def test_rotation_order(tmp_path: Path) -> None:
    max_bytes, segments = 4096, 4
    seg = max_bytes // segments
    size = len(json.dumps(rec("root", 0, pad=200), separators=(",", ":"))) + 1
    per_segment = seg // size
    with RecordLog(tmp_path, max_bytes, segments=segments) as log:
        for i in range(per_segment * 6 + 1):
            log.write(rec("root", i, pad=200))

    def ids(name: str) -> list[int]:
        text = (tmp_path / name).read_text()
        return [json.loads(line)["data"]["i"] for line in text.splitlines()]

    newest = ids("root.log")
    assert newest == [per_segment * 6]
    for k in range(1, segments):
        older = ids(f"root.log.{k}")
        assert len(older) == per_segment
        assert older[-1] + 1 == (newest[0] if k == 1 else ids(f"root.log.{k - 1}")[0])
    assert not (tmp_path / f"root.log.{segments}").exists()


def test_single_segment_ring(tmp_path: Path) -> None:
    with RecordLog(tmp_path, 4096, segments=1) as log:
        for i in range(200):
            log.write(rec("root", i, pad=50))
    assert (tmp_path / "root.log").stat().st_size <= 4096
    assert not list(tmp_path.glob("root.log.*"))
    kept = [r["data"]["i"] for r in RecordLog.tail(tmp_path, "root", 1000)]
    assert kept == list(range(kept[0], 200))


def test_tail_reads_across_segments(tmp_path: Path) -> None:
    with RecordLog(tmp_path, 4096) as log:
        for i in range(100):
            log.write(rec("root/rank0", i, pad=100))
    all_kept = [r["data"]["i"] for r in read_tree(tmp_path)["root/rank0"]]
    active = (tmp_path / "root" / "rank0.log").read_text().count("\n")
    n = active + 3  # reaches into root/rank0.log.1
    assert [r["data"]["i"] for r in RecordLog.tail(tmp_path, "root/rank0", n)] == list(
        range(100 - n, 100)
    )
    got = [r["data"]["i"] for r in RecordLog.tail(tmp_path, "root/rank0", 10_000)]
    assert got == all_kept


def test_tail_reads_big_segments_backwards_in_blocks(tmp_path: Path) -> None:
    with RecordLog(tmp_path, 4 << 20, segments=1) as log:
        for i in range(3000):
            log.write(rec("root", i, pad=300))  # > 1 MiB in one file: many 64 KiB blocks
    assert (tmp_path / "root.log").stat().st_size > 1 << 20
    got = RecordLog.tail(tmp_path, "root", 5)
    assert [r["data"]["i"] for r in got] == [2995, 2996, 2997, 2998, 2999]
    got = RecordLog.tail(tmp_path, "root", 2500)  # lines straddle block boundaries
    assert [r["data"]["i"] for r in got] == list(range(500, 3000))


def test_oversized_record_is_dropped_with_one_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    with RecordLog(tmp_path, 4096) as log:
        log.write(rec("root", 0))
        log.write(rec("root", 1, pad=2000))
        log.write(rec("root", 2, pad=2000))
        log.write(rec("root", 3))
    assert [r["data"]["i"] for r in read_tree(tmp_path)["root"]] == [0, 3]
    assert len(caplog.records) == 1
    assert "larger than one segment" in caplog.records[0].getMessage()


def test_rotation_drops_a_stale_oversized_active_file(tmp_path: Path) -> None:
    (tmp_path / "root.log").write_text("x" * 5000 + "\n")
    with RecordLog(tmp_path, 4096, segments=2) as log:
        log.write(rec("root", 0))
        assert (tmp_path / "root.log").stat().st_size < 2048
    assert RecordLog.tail(tmp_path, "root", 5) == [rec("root", 0)]


# -- garbage and bad input -----------------------------------------------------------------


def test_garbage_lines_are_skipped(tmp_path: Path) -> None:
    good = [rec("root/rank0", i) for i in range(3)]
    lines = [
        json.dumps(good[0]),
        "not json at all",
        "",
        "[1, 2, 3]",
        '"a string"',
        json.dumps({"v": 1, "ts": 1, "path": "root/rank0"}),  # missing keys
        "\udcff\udcfe binary",  # invalid UTF-8 once encoded with surrogateescape
        json.dumps(good[1]),
        "{" * 100_000,  # deep nesting: RecursionError inside json
        json.dumps(good[2]),
        json.dumps(good[2])[:40],  # torn last line, no newline
    ]
    f = tmp_path / "root" / "rank0.log"
    f.parent.mkdir()
    f.write_bytes("\n".join(lines).encode("utf-8", "surrogateescape"))
    assert RecordLog.tail(tmp_path, "root/rank0", 10) == good
    assert RecordLog.tail(tmp_path, "root/rank0", 1) == good[-1:]
    assert read_tree(tmp_path)["root/rank0"] == good


def test_writer_repairs_a_torn_last_line(tmp_path: Path) -> None:
    (tmp_path / "root.log").write_text(json.dumps(rec("root", 0)) + "\n" + '{"v":1,"ts"')
    with RecordLog(tmp_path) as log:
        log.write(rec("root", 1))
    assert [r["data"]["i"] for r in read_tree(tmp_path)["root"]] == [0, 1]


def test_bad_records_are_dropped_with_one_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    good = rec("root", 0)
    bad: list[Any] = [
        None,
        [1],
        {"v": 1},
        {**good, "path": "root/../../etc/x"},
        {**good, "path": "/tmp/x"},
        {**good, "kind": "No Way"},
        {**good, "sev": "loud"},
        {**good, "data": 3},
        {**good, "data": {"x": object()}},
        {**good, "data": {"x": {1, 2}}},
    ]
    with RecordLog(tmp_path) as log:
        for b in bad:
            log.write(b)
        log.write(good)
    assert read_tree(tmp_path) == {"root": [good]}
    assert not (tmp_path.parent / "etc").exists()
    assert len(caplog.records) == 1
    assert caplog.records[0].levelno == logging.WARNING


# -- I/O errors ----------------------------------------------------------------------------


@contextlib.contextmanager
def _read_only_dir(base: Path) -> Iterator[Path]:
    """A directory nobody can write to: a read-only tmpfs mount when running as root (chmod does
    not stop root), else a 0o555 directory."""
    ro = base / "ro"
    ro.mkdir()
    if os.geteuid() != 0:
        ro.chmod(0o555)
        try:
            yield ro
        finally:
            ro.chmod(0o755)
        return
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(ro)],
        check=False,
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        pytest.skip(f"root without a way to make a read-only directory: {mounted.stderr.strip()}")
    try:
        yield ro
    finally:
        subprocess.run(["umount", str(ro)], check=True)


def test_read_only_directory_is_swallowed_with_one_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with _read_only_dir(tmp_path) as ro:
        with pytest.raises(OSError):  # really read-only
            (ro / "probe").write_text("x")
        caplog.set_level(logging.WARNING, logger=LOGGER)
        with RecordLog(ro) as log:
            for i in range(10):
                log.write(rec("root/h/rank0", i))
                log.write(rec("root", i))
        assert len(caplog.records) == 1
        assert "cannot write records" in caplog.records[0].getMessage()


def test_unwritable_parent_is_swallowed_then_recovers(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Works as root too: a regular FILE where the node's directory should be makes mkdir fail.
    caplog.set_level(logging.WARNING, logger=LOGGER)
    blocker = tmp_path / "root"
    blocker.write_text("not a directory")
    log = RecordLog(tmp_path)
    try:
        for i in range(10):
            log.write(rec("root/h/rank0", i))
            log.write(rec("root/rank1", i))
        assert len(caplog.records) == 1
        assert caplog.records[0].levelno == logging.WARNING
        assert "cannot write records" in caplog.records[0].getMessage()

        # The error was transient: later writes go through, and nothing more is logged.
        blocker.unlink()
        log.write(rec("root/h/rank0", 99))
        log.write(rec("root/rank1", 99))
        assert RecordLog.tail(tmp_path, "root/h/rank0", 5) == [rec("root/h/rank0", 99)]
        assert RecordLog.tail(tmp_path, "root/rank1", 5) == [rec("root/rank1", 99)]
        assert len(caplog.records) == 1
    finally:
        log.close()


def test_io_error_during_rotation_is_swallowed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    # A directory squatting on the oldest segment's name makes the rotation's unlink fail.
    (tmp_path / "root.log.1").mkdir()
    with RecordLog(tmp_path, 4096, segments=2) as log:
        for i in range(100):
            log.write(rec("root", i, pad=100))
    assert len(caplog.records) == 1
    assert (tmp_path / "root.log").stat().st_size <= 2048


# -- readers -------------------------------------------------------------------------------


def test_tail_of_unknown_node_is_empty(tmp_path: Path) -> None:
    assert RecordLog.tail(tmp_path, "root/nobody", 5) == []
    assert RecordLog.tail(tmp_path / "missing", "root", 5) == []


@pytest.mark.parametrize("n", [0, -1, True, 1.5])
def test_tail_needs_n_at_least_one(tmp_path: Path, n: Any) -> None:
    with pytest.raises(ConfigError, match="n="):
        RecordLog.tail(tmp_path, "root", n)


@pytest.mark.parametrize("path", ["root/../x", "/etc/passwd", "root/%2e%2e", ""])
def test_tail_rejects_bad_paths(tmp_path: Path, path: str) -> None:
    with pytest.raises(ConfigError):
        RecordLog.tail(tmp_path, path, 1)


def test_read_tree_rejects_what_is_not_a_record_directory(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not a record directory"):
        read_tree(tmp_path / "missing")
    with pytest.raises(ConfigError, match="not a record directory"):
        read_tree(tmp_path)
    with pytest.raises(ConfigError, match="not a record directory"):
        paths(tmp_path)
    (tmp_path / "f").write_text("")
    with pytest.raises(ConfigError, match="not a record directory"):
        read_tree(tmp_path / "f")


def test_read_tree_ignores_stray_files(tmp_path: Path) -> None:
    with RecordLog(tmp_path) as log:
        log.write(rec("root/h/rank0", 0))
    (tmp_path / "notes.txt").write_text("hi")
    (tmp_path / "root.logx").write_text("hi")
    (tmp_path / "root" / "h" / "rank0.log.0").write_text(json.dumps(rec("root/h/rank0", 9)))
    (tmp_path / "root" / "h" / "rank0.tmp").write_text("hi")
    (tmp_path / "root" / "bad name.log").write_text(json.dumps(rec("root", 9)))
    deep = tmp_path / "root" / "a" / "b" / "c"
    deep.mkdir(parents=True)
    (deep / "d.log").write_text(json.dumps(rec("root", 9)))  # root/a/b/c/d is too deep
    os.symlink(tmp_path / "notes.txt", tmp_path / "root" / "link.log")
    assert read_tree(tmp_path) == {"root/h/rank0": [rec("root/h/rank0", 0)]}
    assert paths(tmp_path) == ["root/h/rank0"]


def test_read_tree_with_only_root_dir(tmp_path: Path) -> None:
    (tmp_path / "root").mkdir()
    assert read_tree(tmp_path) == {}
    assert paths(tmp_path) == []
