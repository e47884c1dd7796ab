"""Hostile files through the public entries: bundles, death records and record directories.

Every corrupted, truncated or foreign input must end in a clear error: a
:class:`flodl.FlodlError` subclass whose one-line message names the file (API), or exit status
2 with one ``error:`` line naming it and no traceback (CLI). Entries: ``Trainer.builder(...)
.resume_from(stem).run().join()`` on the single-device tier (in process), the same with
``local_ranks(2)`` (``files_main.py`` in a subprocess, the launcher tier), ``flodl coord
--resume-from``, ``flodl records tail|paths`` and ``flodl dashboard DIR --save``.

Death records are forensic only (never read for a resume), so garbage or foreign ones next to
a bundle must not disturb a resume. Record readers skip lines that are not records (a torn
last line is normal), so a directory with garbage lines is read, not refused.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from flodl import (
    CheckpointError,
    FlodlError,
    TensorBatchDataset,
    Trainer,
    TrainerBuilder,
    checkpoint,
)

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "files_main.py"
REPO = HERE.parents[1]
SAMPLES, EPOCHS = 256, 2  # 8 steps an epoch: every bundle below is at global step 16
DEEP_JSON = "[" * 100_000 + "]" * 100_000


# -------------------------------------------------------------------------------------------------
# bundles to corrupt
# -------------------------------------------------------------------------------------------------


def _data() -> TensorBatchDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, 16, generator=g)
    y = (x @ torch.randn(16, 4, generator=g)).argmax(dim=1)
    return TensorBatchDataset(x, y)


def _model(hidden: int) -> Callable[[torch.device], torch.nn.Module]:
    def build(device: torch.device) -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(
            torch.nn.Linear(16, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 4)
        ).to(device)

    return build


def _optim(params: object) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1)  # type: ignore[arg-type]


def _step(m: torch.nn.Module, batch: list[torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(m(batch[0]), batch[1])


def single_tier(hidden: int = 32, epochs: int = 3) -> TrainerBuilder:
    return (
        Trainer.builder(_model(hidden), _optim, _step)
        .dataset(_data())
        .batch_size(32)
        .num_epochs(epochs)
    )


def run_files_main(*args: str, scale: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLODL_")}
    if scale is not None:
        env["FLODL_NET_TIMEOUT_SCALE"] = scale
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--tag", f"flodl-test-{uuid.uuid4().hex}", *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=150,
        cwd=REPO,
        env=env,
    )


@pytest.fixture(scope="module")
def bundles(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Stems of saved bundles: ``one`` and ``other`` (single device, two models), ``two``
    (two local ranks). All at global step 16."""
    root = tmp_path_factory.mktemp("bundles")
    stems = {name: str(root / name / "b") for name in ("one", "other", "two")}
    for name, hidden in (("one", 32), ("other", 48)):
        Path(stems[name]).parent.mkdir()
        (
            single_tier(hidden, EPOCHS)
            .save_path(stems[name])
            .checkpoint_every(1)
            .run()
            .join(timeout=120)
        )
    Path(stems["two"]).parent.mkdir()
    out = run_files_main("--save", stems["two"], "--epochs", str(EPOCHS))
    assert out.returncode == 0, out.stderr[-3000:]
    for stem in stems.values():
        assert checkpoint.read_meta(stem).global_step == 16
    return stems


def model_file(stem: str) -> Path:
    """The model file of the save the bundle's meta commits."""
    return checkpoint.model_path(stem, checkpoint.resolve_tag(stem))


def copy_bundle(stem: str, dest: Path) -> str:
    """Copy a bundle's files to ``dest`` (stem ``dest/b``); return the new stem."""
    dest.mkdir()
    src = Path(stem)
    for path in src.parent.iterdir():
        if path.name.startswith(src.name + "."):
            shutil.copy(path, dest / path.name)
    return str(dest / src.name)


class Evil:
    """Unpickling this runs a command: a weights-only load must refuse it."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Callable[..., object], tuple[str]]:
        return (os.system, (f"touch {self.marker}",))


def _edit_meta(
    edit: Callable[[dict[str, object]], object],
) -> Callable[[Path, str, dict[str, str]], None]:
    def corrupt(meta: Path, stem: str, bundles: dict[str, str]) -> None:
        obj = json.loads(meta.read_text())
        edit(obj)
        meta.write_text(json.dumps(obj))

    return corrupt


def _set(key: str, value: object) -> Callable[[dict[str, object]], None]:
    return lambda obj: obj.__setitem__(key, value)


def _to_directory(meta: Path, stem: str, bundles: dict[str, str]) -> None:
    meta.unlink()
    meta.mkdir()


# name -> (corruption(meta_path, stem, bundles), text expected in the error)
MetaCase = Callable[[Path, str, dict[str, str]], object]
META_CASES: dict[str, tuple[MetaCase, str]] = {
    "truncated": (lambda p, s, b: p.write_bytes(p.read_bytes()[:40]), "not JSON"),
    "empty": (lambda p, s, b: p.write_bytes(b""), "not JSON"),
    "random_bytes": (lambda p, s, b: p.write_bytes(os.urandom(300)), "meta.json"),
    "json_list": (lambda p, s, b: p.write_text("[1, 2, 3]"), "must be a JSON object"),
    "nan_epoch": (_edit_meta(_set("epoch", float("nan"))), "epoch"),
    "negative_step": (_edit_meta(_set("global_step", -16)), "global_step"),
    "string_step": (_edit_meta(_set("global_step", "16")), "global_step"),
    "missing_epoch": (_edit_meta(lambda o: o.pop("epoch")), "epoch"),
    "bad_coverage": (_edit_meta(_set("coverage", {"seed": "x", "per_epoch": 5})), "coverage"),
    "newer_schema": (_edit_meta(_set("schema_version", 99)), "newer flodl"),
    "huge_epoch": (_edit_meta(_set("epoch", 10**30)), "epoch"),
    "other_save": (_edit_meta(_set("global_step", 8)), "different saves"),
    "is_a_directory": (_to_directory, "meta.json"),
    "missing": (lambda p, s, b: p.unlink(), "no checkpoint meta"),
}
FDL_CASES: dict[str, tuple[Callable[[Path, dict[str, str]], object], str]] = {
    "truncated": (lambda p, b: p.write_bytes(p.read_bytes()[:200]), "not a readable"),
    "random_bytes": (lambda p, b: p.write_bytes(os.urandom(4096)), "not a readable"),
    "json_text": (lambda p, b: p.write_text('{"params": []}'), "not a readable"),
    "missing": (lambda p, b: p.unlink(), "no such checkpoint file"),
    "wrong_format_tag": (
        lambda p, b: torch.save({"format": "something.else", "version": 1}, p),
        "not a flodl.fdl file",
    ),
    "another_model": (
        lambda p, b: shutil.copy(model_file(b["other"]), p),
        "bundle from another model",
    ),
}


def assert_clear(exc: BaseException, names: Path) -> None:
    assert isinstance(exc, FlodlError), f"{type(exc).__name__}: {exc}"
    message = str(exc)
    assert "\n" not in message, message
    assert str(names) in message, message


def resume_single(stem: str) -> BaseException | None:
    try:
        single_tier().resume_from(stem).run().join(timeout=120)
    except BaseException as exc:  # noqa: BLE001 - the test inspects it
        return exc
    return None


# -------------------------------------------------------------------------------------------------
# single-device tier (in process)
# -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", sorted(META_CASES))
def test_single_tier_refuses_a_bad_meta(case: str, bundles: dict[str, str], tmp_path: Path) -> None:
    stem = copy_bundle(bundles["one"], tmp_path / case)
    corrupt, expected = META_CASES[case]
    meta = checkpoint.meta_path(stem)
    corrupt(meta, stem, bundles)
    exc = resume_single(stem)
    assert exc is not None, "resumed from a corrupt meta"
    assert_clear(exc, meta)
    assert isinstance(exc, CheckpointError)
    assert expected in str(exc), exc


def test_single_tier_refuses_a_deeply_nested_meta(bundles: dict[str, str], tmp_path: Path) -> None:
    stem = copy_bundle(bundles["one"], tmp_path / "deep")
    checkpoint.meta_path(stem).write_text(DEEP_JSON)
    exc = resume_single(stem)
    assert exc is not None
    if isinstance(exc, RecursionError):
        raise exc
    assert_clear(exc, checkpoint.meta_path(stem))


@pytest.mark.parametrize("case", sorted(FDL_CASES))
def test_single_tier_refuses_a_bad_model_file(
    case: str, bundles: dict[str, str], tmp_path: Path
) -> None:
    stem = copy_bundle(bundles["one"], tmp_path / case)
    corrupt, expected = FDL_CASES[case]
    fdl = model_file(stem)
    corrupt(fdl, bundles)
    exc = resume_single(stem)
    assert exc is not None, "resumed from a corrupt model file"
    assert_clear(exc, fdl)
    assert expected in str(exc), exc


def test_single_tier_never_unpickles_code_from_a_model_file(
    bundles: dict[str, str], tmp_path: Path
) -> None:
    stem = copy_bundle(bundles["one"], tmp_path / "evil")
    marker = tmp_path / "payload-ran"
    torch.save({"format": "flodl.fdl", "params": [Evil(marker)]}, model_file(stem))
    exc = resume_single(stem)
    assert exc is not None
    assert_clear(exc, model_file(stem))
    assert not marker.exists(), "loading the bundle ran code from it"


def _garbage_death_records(stem: str) -> None:
    base = Path(stem)
    records = {
        0: os.urandom(200),  # garbage
        1: b'{"schema_version": 1, "rank": 1, "world_size": 9, "error": "another run", '
        b'"unix_time_secs": 1}',  # another run (world size 9)
        2: b'{"schema_version": 1, "rank": 7}',  # truncated fields, wrong rank
        3: b"[]",
        4: b'{"schema_version": 99, "rank": 4}',
    }
    for rank, data in records.items():
        (base.parent / f"{base.name}.rank{rank}.death.json").write_bytes(data)


def test_foreign_and_garbage_death_records_do_not_disturb_a_resume(
    bundles: dict[str, str], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    stem = copy_bundle(bundles["one"], tmp_path / "deaths")
    _garbage_death_records(stem)
    assert resume_single(stem) is None
    # the reader skips what it cannot read, with a warning naming the file
    with caplog.at_level("WARNING", logger="flodl.checkpoint"):
        assert checkpoint.death_records(stem) != []  # the one well-formed record
        assert checkpoint.death_records(stem, world_size=2) == []
    assert f"{Path(stem).name}.rank0.death.json" in caplog.text
    for rank in (0, 2, 3, 4):
        with pytest.raises(CheckpointError, match=rf"\.rank{rank}\.death\.json"):
            checkpoint.read_death_record(stem, rank)


def test_a_deeply_nested_death_record_is_skipped(tmp_path: Path) -> None:
    stem = str(tmp_path / "b")
    (tmp_path / "b.rank0.death.json").write_text(DEEP_JSON)
    assert checkpoint.death_records(stem) == []


# -------------------------------------------------------------------------------------------------
# launcher tier (local_ranks(2), a user script in a subprocess)
# -------------------------------------------------------------------------------------------------


def assert_one_line_error(
    out: subprocess.CompletedProcess[str], names: Path, expected: str
) -> None:
    assert out.returncode == 2, out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    lines = [line for line in out.stderr.splitlines() if line.startswith("files_main: ")]
    assert len(lines) == 1, out.stderr[-3000:]
    assert str(names) in lines[0] and expected in lines[0], lines[0]


@pytest.mark.integration
@pytest.mark.timeout(150)
@pytest.mark.parametrize("case", ["truncated", "random_bytes", "nan_epoch", "other_save"])
def test_launcher_tier_refuses_a_bad_meta(
    case: str, bundles: dict[str, str], tmp_path: Path
) -> None:
    stem = copy_bundle(bundles["two"], tmp_path / case)
    corrupt, expected = META_CASES[case]
    meta = checkpoint.meta_path(stem)
    corrupt(meta, stem, bundles)
    out = run_files_main("--resume", stem)
    names = model_file(stem) if case == "other_save" else meta
    assert_one_line_error(out, names, expected)


@pytest.mark.integration
@pytest.mark.timeout(150)
def test_launcher_tier_resumes_a_single_device_bundle(
    bundles: dict[str, str], tmp_path: Path
) -> None:
    # a resume takes any world size (docs/design.md §6): 1 saved, 2 resumed
    stem = copy_bundle(bundles["one"], tmp_path / "one")
    out = run_files_main("--resume", stem)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.splitlines()[-1] == "DONE"


@pytest.mark.integration
@pytest.mark.timeout(150)
def test_launcher_tier_refuses_a_deeply_nested_meta(
    bundles: dict[str, str], tmp_path: Path
) -> None:
    stem = copy_bundle(bundles["two"], tmp_path / "deep")
    checkpoint.meta_path(stem).write_text(DEEP_JSON)
    out = run_files_main("--resume", stem)
    assert_one_line_error(out, checkpoint.meta_path(stem), "not JSON")


@pytest.mark.integration
@pytest.mark.timeout(150)
def test_launcher_tier_refuses_a_bundle_of_another_model(
    bundles: dict[str, str], tmp_path: Path
) -> None:
    # The coordinator cannot check the model (it never builds it); each rank refuses the
    # bundle, prints why (naming the file) and exits 1 before joining. The launcher only
    # notices at the formation timeout (300 s x FLODL_NET_TIMEOUT_SCALE: 15 s here).
    stem = copy_bundle(bundles["two"], tmp_path / "other")
    shutil.copy(model_file(bundles["other"]), model_file(stem))
    out = run_files_main("--resume", stem, scale="0.05")
    assert out.returncode == 2, out.stderr[-3000:]
    launcher = [line for line in out.stderr.splitlines() if line.startswith("files_main: ")]
    assert len(launcher) == 1, out.stderr[-3000:]
    assert "never joined" in launcher[0] and "exit codes [1, 1]" in launcher[0], launcher[0]
    refusal = f"CheckpointError: {model_file(stem)}: bundle from another model"
    ranks = [line for line in out.stderr.splitlines() if line.startswith("flodl.errors.")]
    assert [refusal in line for line in ranks] == [True, True], out.stderr[-3000:]  # each rank
    assert refusal in launcher[0]  # and the launcher names the first death record


@pytest.mark.integration
@pytest.mark.timeout(150)
def test_launcher_tier_resumes_past_foreign_and_garbage_death_records(
    bundles: dict[str, str], tmp_path: Path
) -> None:
    stem = copy_bundle(bundles["two"], tmp_path / "deaths")
    _garbage_death_records(stem)
    out = run_files_main("--resume", stem)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "DONE" in out.stdout


# -------------------------------------------------------------------------------------------------
# the CLI: flodl coord --resume-from, flodl records, flodl dashboard --save
# -------------------------------------------------------------------------------------------------


def flodl_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "flodl", *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=cwd,
    )


def assert_cli_error(out: subprocess.CompletedProcess[str], prefix: str, names: str) -> None:
    assert out.returncode == 2, (out.returncode, out.stderr[-3000:])
    assert "Traceback" not in out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith(prefix) and names in lines[0], lines[0]


def _coord_resume(stem: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    secret = tmp_path / "secret"
    secret.write_text(os.urandom(32).hex())
    secret.chmod(0o600)
    return flodl_cli(
        *("coord", "--world-size", "2", "--dataset-len", str(SAMPLES), "--epochs", "3"),
        *("--mode", "cpu_cadence", "--secret-file", str(secret), "--resume-from", stem),
        cwd=tmp_path,
    )


@pytest.mark.parametrize("case", ["truncated", "json_list", "negative_step", "missing"])
def test_flodl_coord_refuses_a_bad_meta(case: str, bundles: dict[str, str], tmp_path: Path) -> None:
    stem = copy_bundle(bundles["two"], tmp_path / case)
    corrupt, _ = META_CASES[case]
    corrupt(checkpoint.meta_path(stem), stem, bundles)
    out = _coord_resume(stem, tmp_path)
    assert_cli_error(out, "flodl coord: error:", str(checkpoint.meta_path(stem)))


def test_flodl_coord_refuses_a_model_file_of_another_save(
    bundles: dict[str, str], tmp_path: Path
) -> None:
    stem = copy_bundle(bundles["two"], tmp_path / "trunc")
    fdl = model_file(stem)
    fdl.write_bytes(fdl.read_bytes()[:100])
    out = _coord_resume(stem, tmp_path)
    assert_cli_error(out, "flodl coord: error:", str(fdl))


def test_flodl_coord_refuses_a_deeply_nested_meta(bundles: dict[str, str], tmp_path: Path) -> None:
    stem = copy_bundle(bundles["two"], tmp_path / "deep")
    checkpoint.meta_path(stem).write_text(DEEP_JSON)
    out = _coord_resume(stem, tmp_path)
    assert_cli_error(out, "flodl coord: error:", str(checkpoint.meta_path(stem)))


GOOD_RECORD = {"v": 1, "ts": 1, "sev": "info", "path": "root", "kind": "node", "data": {"a": 1}}
GARBAGE_LINES: dict[str, bytes] = {
    "random_bytes": b"\x00\xff\xfe" + b"\x9c" * 300,
    "torn_json": b'{"v": 1, "ts": 1, "sev": "in',
    "json_list": b"[1, 2, 3]",
    "missing_keys": b'{"v": 1, "data": {}}',
    "deep_array": ("[" * 50_000 + "]" * 50_000).encode(),
    "deep_object": b'{"v":1,"ts":1,"sev":"info","path":"root","kind":"x","data":'
    + b'{"a":' * 5_000
    + b"1"
    + b"}" * 5_001,
    "huge_int": b'{"v":1,"ts":'
    + b"9" * 10_000
    + b',"sev":"info","path":"root","kind":"x","data":{}}',
    "not_utf8": b'{"v":1,"ts":1,"sev":"\xff","path":"root","kind":"x","data":{}}',
}


def _record_dir(root: Path, garbage: bytes | list[bytes]) -> Path:
    lines = garbage if isinstance(garbage, list) else [garbage]
    d = root / "records"
    d.mkdir()
    good = json.dumps(GOOD_RECORD).encode()
    (d / "root.log").write_bytes(b"\n".join([*lines, good, *lines, b""]))
    (d / "root").mkdir()
    (d / "root" / "rank0.log").write_bytes(b"\n".join(lines) + b"\n")
    (d / "root" / "rank0.log.1").write_bytes(os.urandom(4096))
    return d


@pytest.mark.parametrize("case", sorted(GARBAGE_LINES))
def test_records_tail_skips_garbage_lines(case: str, tmp_path: Path) -> None:
    d = _record_dir(tmp_path, GARBAGE_LINES[case])
    tail = flodl_cli("records", "tail", str(d), "-n", "50", cwd=tmp_path)
    assert tail.returncode == 0, tail.stderr[-3000:]
    assert "Traceback" not in tail.stderr
    assert [json.loads(line) for line in tail.stdout.splitlines()] == [GOOD_RECORD]


def test_records_paths_and_dashboard_save_skip_garbage_lines(tmp_path: Path) -> None:
    d = _record_dir(tmp_path, list(GARBAGE_LINES.values()))
    paths = flodl_cli("records", "paths", str(d), cwd=tmp_path)
    assert (paths.returncode, paths.stdout.split()) == (0, ["root", "root/rank0"]), paths.stderr
    html = tmp_path / "dash.html"
    saved = flodl_cli("dashboard", str(d), "--save", str(html), cwd=tmp_path)
    assert saved.returncode == 0, saved.stderr[-3000:]
    assert "Traceback" not in saved.stderr
    assert html.stat().st_size > 1000


def test_record_values_of_the_wrong_type_cannot_break_out_of_a_saved_dashboard(
    tmp_path: Path,
) -> None:
    d = tmp_path / "records"
    d.mkdir()
    hostile = [
        {**GOOD_RECORD, "data": {"x": "</script><script>alert(1)</script>"}},
        {**GOOD_RECORD, "kind": "<img src=x onerror=alert(1)>", "data": [1]},
        {"v": "x", "ts": "abc", "sev": "bogus", "path": 123, "kind": None, "data": "str"},
        {**GOOD_RECORD, "kind": "meta", "data": {"run": "not a dict", "reductions": 5}},
        {**GOOD_RECORD, "kind": "epoch", "data": {"epoch": "x", "avg_loss": [], "scalars": 3}},
    ]
    (d / "root.log").write_text("\n".join(json.dumps(r) for r in hostile) + "\nNaN\n")
    html = tmp_path / "dash.html"
    out = flodl_cli("dashboard", str(d), "--save", str(html), cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    text = html.read_text()
    assert "<script><script>" not in text and "alert(1)</script>" not in text
    assert "<img src=x" not in text


@pytest.mark.parametrize(
    ("setup", "args", "names"),
    [
        ("empty_dir", ("records", "tail", "{d}"), "{d}"),
        ("empty_dir", ("records", "paths", "{d}"), "{d}"),
        ("empty_dir", ("dashboard", "{d}", "--save", "{d}/x.html"), "{d}"),
        ("missing", ("records", "tail", "{d}"), "{d}"),
        ("missing", ("dashboard", "{d}", "--save", "{d}.html"), "{d}"),
        ("a_file", ("records", "tail", "{d}"), "{d}"),
        ("records", ("records", "tail", "{d}", "--path", "root/../../etc"), "root/../../etc"),
        ("records", ("records", "tail", "{d}", "--path", "root/rank9"), "root/rank9"),
        ("records", ("records", "tail", "{d}", "-n", "0"), "n=0"),
    ],
)
def test_record_cli_refuses_what_is_not_a_record_directory(
    setup: str, args: tuple[str, ...], names: str, tmp_path: Path
) -> None:
    d = tmp_path / "target"
    if setup == "empty_dir":
        d.mkdir()
    elif setup == "a_file":
        d.write_text("root.log\n")
    elif setup == "records":
        d = _record_dir(tmp_path, b"garbage")
    out = flodl_cli(*(a.format(d=d) for a in args), cwd=tmp_path)
    prefix = "flodl records: error:" if args[0] == "records" else "flodl dashboard: error:"
    assert_cli_error(out, prefix, names.format(d=d))


def test_dashboard_save_into_a_missing_directory_is_a_clear_error(tmp_path: Path) -> None:
    d = _record_dir(tmp_path, b"garbage")
    target = tmp_path / "no" / "such" / "dir" / "dash.html"
    out = flodl_cli("dashboard", str(d), "--save", str(target), cwd=tmp_path)
    # GAP (cosmetic): the message names the temporary file the writer tried
    # (".dash.html.<random>.tmp" in that directory), not the target
    assert_cli_error(out, "flodl dashboard: error:", str(target.parent))


def test_a_symlinked_record_file_is_not_followed(tmp_path: Path) -> None:
    d = _record_dir(tmp_path, b"garbage")
    outside = tmp_path / "outside.log"
    outside.write_text(json.dumps({**GOOD_RECORD, "data": {"secret": "outside"}}) + "\n")
    (d / "root" / "rank1.log").symlink_to(outside)
    paths = flodl_cli("records", "paths", str(d), cwd=tmp_path)
    assert paths.stdout.split() == ["root", "root/rank0"]
    html = tmp_path / "dash.html"
    saved = flodl_cli("dashboard", str(d), "--save", str(html), cwd=tmp_path)
    assert saved.returncode == 0, saved.stderr
    assert "outside" not in html.read_text()
