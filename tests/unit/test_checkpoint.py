"""The checkpoint bundle: bit-exact round trips, the original's meta, and every corruption."""

from __future__ import annotations

import json
import logging
import os
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypedDict

import pytest
import torch

from flodl import checkpoint as ck
from flodl.checkpoint import (
    DEATH_SCHEMA_VERSION,
    META_SCHEMA_VERSION,
    CheckpointMeta,
    ModelBundle,
    atomic_write_bytes,
    death_records,
    load_model,
    load_optim,
    load_outer,
    normalize_stem,
    read_death_record,
    read_meta,
    resume_state,
    save_model,
    save_optim,
    save_outer,
    write_death_record,
    write_meta,
)
from flodl.config import CoordConfig, ElCheConfig, validated
from flodl.coord.effects import Record, Send
from flodl.coord.machine import Coordinator, ResumeState
from flodl.errors import CheckpointError, ConfigError, FlodlError
from flodl.rank import snapshot
from flodl.rank.snapshot import model_signature
from flodl.wire.frames import Hello, StartEpoch

SIG = "a" * 64
BS = 32

# The meta a run of the original (Rust) flodl leaves: serde_json's pretty printer, schema 3,
# ElChe state with the guard's trend history, no coverage block.
ORIGINAL_META = """\
{
  "schema_version": 3,
  "epoch": 5,
  "global_step": 1200,
  "sync_round": 40,
  "world_size_at_save": 2,
  "save_reason": "graceful_shutdown",
  "elche_state": {
    "anchor": 12,
    "anchor_rank": 0,
    "smoothed_ms_per_batch": [
      10.5,
      21.0
    ],
    "phase": "stable",
    "calibration_count": 7,
    "trend_history": [
      0.1,
      0.09
    ]
  }
}
"""


# =============================================================================================
# Helpers
# =============================================================================================


def net(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.ReLU(), torch.nn.Linear(4, 2)
    )


def train(model: torch.nn.Module, opt: torch.optim.Optimizer | None = None, steps: int = 3) -> None:
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(8, 3, generator=gen)
        loss = model(x).pow(2).mean()
        if opt is not None:
            opt.zero_grad()
        loss.backward()
        if opt is not None:
            opt.step()


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def assert_same(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(bits(a), bits(b))


def assert_same_tree(a: Any, b: Any) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor)
        assert_same(a, b)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b)
        for k in a:
            assert_same_tree(a[k], b[k])
    elif isinstance(a, list | tuple):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same_tree(x, y)
    else:
        assert type(a) is type(b) and a == b


def stray_tmp(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if ".tmp." in p.name)


def config(**kw: Any) -> CoordConfig:
    values: dict[str, Any] = {
        "world_size": 2,
        "dataset_len": 640,
        "batch_size": BS,
        "elche": ElCheConfig.preset("cpu_cadence"),
        **kw,
    }
    return validated(CoordConfig, **values)


def started(cfg: CoordConfig, resume: ResumeState | None = None) -> Coordinator:
    coord = Coordinator(cfg, random.Random(0), resume=resume)
    for r in range(cfg.world_size):
        coord.handle(
            Hello(run_id="run", rank=r, world_size=cfg.world_size, model_signature=SIG), 0.0
        )
    return coord


def meta_dict(**over: Any) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "schema_version": 3,
        "epoch": 1,
        "global_step": 30,
        "sync_round": 5,
        "world_size_at_save": 2,
        "save_reason": "graceful_shutdown",
        "elche_state": {
            "anchor": 4,
            "anchor_rank": 1,
            "smoothed_ms_per_batch": [10.0, 20.0],
            "phase": "stable",
            "calibration_count": 7,
            "trend_history": [0.01, 0.02],
        },
        "coverage": {
            "seed": 42,
            "epoch_splits": 1,
            "batch_size": BS,
            "per_epoch": [{"epoch": 1, "total_samples": 640, "uncovered_ranges": [[320, 320]]}],
        },
    }
    meta.update(over)
    return meta


def put_meta(stem: Path, meta: Any) -> Path:
    path = Path(f"{stem}.meta.json")
    path.write_text(json.dumps(meta))
    return path


# =============================================================================================
# Names and atomic writes
# =============================================================================================


@pytest.mark.parametrize(
    ("given", "stem"),
    [
        ("run", "run"),
        ("ckpt/run", "ckpt/run"),
        ("ckpt/run.fdl", "ckpt/run"),
        ("ckpt/run.outer.fdl", "ckpt/run"),
        ("ckpt/run.meta.json", "ckpt/run"),
        ("ckpt/run.rank3.optim", "ckpt/run"),
        ("ckpt/run.rank12.death.json", "ckpt/run"),
        ("run.fdl.fdl", "run.fdl"),  # ONE suffix
        ("run.optim", "run.optim"),  # .optim only after .rank<N>
        ("run.death.json", "run.death.json"),
        ("run.json", "run.json"),
        ("run.v2", "run.v2"),
        ("ckpt.fdl/run", "ckpt.fdl/run"),  # only the file name counts
    ],
)
def test_normalize_stem(given: str, stem: str) -> None:
    assert normalize_stem(given) == stem
    assert normalize_stem(Path(given)) == str(Path(stem))


@pytest.mark.parametrize("bad", ["", "ckpt/", ".fdl", "ckpt/.meta.json"])
def test_normalize_stem_rejects_names_without_a_stem(bad: str) -> None:
    with pytest.raises(ConfigError):
        normalize_stem(bad)


def test_bundle_paths_accept_a_stem_or_any_bundle_file() -> None:
    assert ck.model_path("r.meta.json") == Path("r.fdl")
    assert ck.optim_path("r.fdl", 2) == Path("r.rank2.optim")
    assert ck.meta_path("r.rank0.optim") == Path("r.meta.json")
    assert ck.outer_path("r") == Path("r.outer.fdl")
    assert ck.death_path("r.outer.fdl", 1) == Path("r.rank1.death.json")
    with pytest.raises(ConfigError):
        ck.optim_path("r", -1)


def test_checkpoint_error_is_a_flodl_error() -> None:
    assert issubclass(CheckpointError, FlodlError)
    from flodl import errors

    assert "CheckpointError" in errors.__all__


def test_atomic_write_creates_parents_and_replaces(tmp_path: Path) -> None:
    path = tmp_path / "a" / "b" / "f.bin"
    atomic_write_bytes(path, b"one")
    atomic_write_bytes(path, b"two")
    assert path.read_bytes() == b"two"
    assert stray_tmp(path.parent) == []


def test_failed_replace_leaves_the_previous_file_and_no_tmp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    m = net()
    stem = tmp_path / "run"
    save_model(stem, list(m.parameters()), list(m.buffers()), signature=SIG, **STEPS)
    write_meta(stem, meta_dict())
    atomic_write_bytes(tmp_path / "raw.bin", b"old")
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}

    def refuse(src: Any, dst: Any) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", refuse)
    with pytest.raises(CheckpointError, match=r"run\.fdl: cannot write"):
        save_model(stem, [torch.zeros(1)], [], signature="b" * 64, **STEPS)
    with pytest.raises(CheckpointError, match=r"run\.meta\.json: cannot write"):
        write_meta(stem, meta_dict(epoch=2))
    with pytest.raises(OSError, match="No space"):
        atomic_write_bytes(tmp_path / "raw.bin", b"new")
    assert write_death_record(stem, 0, 2, "boom") is None  # best effort
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
    assert stray_tmp(tmp_path) == []


def test_failure_while_serializing_removes_the_tmp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken_save(obj: Any, f: Any) -> None:
        f.write(b"partial")
        raise RuntimeError("serializer crashed")

    monkeypatch.setattr(torch, "save", broken_save)
    with pytest.raises(RuntimeError, match="serializer crashed"):
        save_outer(tmp_path / "run", {"momentum": [torch.ones(2)]}, global_step=1)
    assert list(tmp_path.iterdir()) == []


# =============================================================================================
# S.fdl
# =============================================================================================


class Steps(TypedDict):
    global_step: int
    sync_round: int
    epoch: int


STEPS: Steps = {"global_step": 120, "sync_round": 7, "epoch": 3}


def test_model_round_trip_is_bit_exact(tmp_path: Path) -> None:
    m = net()
    train(m, torch.optim.SGD(m.parameters(), lr=0.1))
    buffers = list(m.buffers())
    assert any(b.dtype == torch.int64 for b in buffers)  # BatchNorm's num_batches_tracked
    path = save_model(
        tmp_path / "run", list(m.parameters()), buffers, signature=model_signature(m), **STEPS
    )
    assert path == tmp_path / "run.fdl"
    bundle = load_model(tmp_path / "run.meta.json")  # any bundle file names the bundle
    assert (bundle.global_step, bundle.sync_round, bundle.epoch) == (120, 7, 3)
    assert bundle.signature == model_signature(m) and bundle.path == path
    for saved, live in zip(
        bundle.params + bundle.buffers, [*m.parameters(), *buffers], strict=True
    ):
        assert_same(saved, live)
        assert saved.device.type == "cpu" and not saved.requires_grad
    fresh = net(seed=99)
    bundle.load_into(fresh, model_signature(fresh))
    assert_same_tree(dict(fresh.state_dict()), dict(m.state_dict()))
    assert stray_tmp(tmp_path) == []


def test_saved_tensors_are_compact_contiguous_copies(tmp_path: Path) -> None:
    flat = torch.arange(1000, dtype=torch.float32)
    view = flat[10:16].view(2, 3).t()  # a non-contiguous view of a big buffer
    save_model(tmp_path / "run", [view], [], signature=SIG, **STEPS)
    (p,) = load_model(tmp_path / "run").params
    assert p.is_contiguous() and torch.equal(p, view)
    assert p.untyped_storage().nbytes() == 6 * 4
    flat.zero_()  # the bundle is a copy
    assert p.sum().item() == sum(range(10, 16))


def test_nan_payloads_survive(tmp_path: Path) -> None:
    t = torch.tensor([float("nan"), float("-inf"), -0.0, 1e-45], dtype=torch.float32)
    save_model(tmp_path / "run", [t], [torch.tensor(5)], signature=SIG, **STEPS)
    bundle = load_model(tmp_path / "run")
    assert_same(bundle.params[0], t)
    assert_same(bundle.buffers[0], torch.tensor(5))


def test_load_into_refuses_another_model(tmp_path: Path) -> None:
    m = net()
    save_model(
        tmp_path / "run",
        list(m.parameters()),
        list(m.buffers()),
        signature=model_signature(m),
        **STEPS,
    )
    bundle = load_model(tmp_path / "run")
    other = torch.nn.Sequential(torch.nn.Linear(3, 5))
    with pytest.raises(CheckpointError, match=r"run\.fdl: bundle from another model") as err:
        bundle.load_into(other, model_signature(other))
    assert str(tmp_path / "run.fdl") in str(err.value)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (
            lambda m: torch.nn.Sequential(torch.nn.Linear(3, 5)),
            r"bundle has 6 params / 3 buffers, the model 2 / 0",
        ),
        (
            lambda m: torch.nn.Sequential(
                torch.nn.Linear(3, 4),
                torch.nn.BatchNorm1d(4),
                torch.nn.ReLU(),
                torch.nn.Linear(4, 3),
            ),
            r"param 4 is \(2, 4\) torch.float32 in the bundle, \(3, 4\)",
        ),
        (lambda m: m.double(), r"param 0 is \(4, 3\) torch.float32 in the bundle, .*float64"),
    ],
    ids=["count", "shape", "dtype"],
)
def test_load_into_refuses_a_mismatch_and_leaves_the_model_untouched(
    tmp_path: Path, change: Callable[[torch.nn.Module], torch.nn.Module], match: str
) -> None:
    m = net()
    save_model(tmp_path / "run", list(m.parameters()), list(m.buffers()), signature=SIG, **STEPS)
    bundle = load_model(tmp_path / "run")
    target = change(net(seed=5))
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(CheckpointError, match=match) as err:
        bundle.load_into(target, SIG)  # even when the caller's signature agrees
    assert str(tmp_path / "run.fdl") in str(err.value)
    assert_same_tree(dict(target.state_dict()), before)


def _torch_file(path: Path, obj: Any) -> None:
    torch.save(obj, path)


def _good_model_record() -> dict[str, Any]:
    return {
        "format": "flodl.fdl",
        "version": 1,
        "signature": SIG,
        "global_step": 1,
        "sync_round": 1,
        "epoch": 0,
        "params": [torch.ones(2)],
        "buffers": [],
    }


@pytest.mark.parametrize(
    ("write", "match"),
    [
        (None, "no such checkpoint file"),
        (lambda p: p.write_bytes(b""), "not a readable flodl.fdl file"),
        (lambda p: p.write_bytes(os.urandom(4096)), "not a readable flodl.fdl file"),
        (lambda p: p.write_text("{}"), "not a readable flodl.fdl file"),
        (lambda p: _torch_file(p, torch.ones(3)), "holds a Tensor"),
        (lambda p: _torch_file(p, {**_good_model_record(), "format": "x"}), "format tag 'x'"),
        (lambda p: _torch_file(p, {**_good_model_record(), "version": 2}), "newer flodl"),
        (lambda p: _torch_file(p, {**_good_model_record(), "version": "1"}), "format version"),
        (lambda p: _torch_file(p, {**_good_model_record(), "signature": 7}), "signature must"),
        (lambda p: _torch_file(p, {**_good_model_record(), "epoch": -1}), "epoch must"),
        (lambda p: _torch_file(p, {**_good_model_record(), "global_step": True}), "global_step"),
        (lambda p: _torch_file(p, {**_good_model_record(), "params": [1.0]}), r"params\[0\]"),
        (lambda p: _torch_file(p, {**_good_model_record(), "buffers": None}), "buffers must"),
    ],
    ids=[
        "missing",
        "empty",
        "random",
        "json",
        "bare-tensor",
        "format-tag",
        "newer",
        "version-type",
        "signature-type",
        "negative-epoch",
        "bool-step",
        "non-tensor",
        "no-buffers",
    ],
)
def test_corrupt_model_files_are_checkpoint_errors(
    tmp_path: Path, write: Callable[[Path], object] | None, match: str
) -> None:
    path = tmp_path / "run.fdl"
    if write is not None:
        write(path)
    with pytest.raises(CheckpointError, match=match) as err:
        load_model(tmp_path / "run")
    assert str(path) in str(err.value)


@pytest.mark.parametrize("cut", [0.1, 0.5, 0.9, 0.999])
def test_truncated_model_file_is_a_checkpoint_error(tmp_path: Path, cut: float) -> None:
    m = net()
    path = save_model(
        tmp_path / "run", list(m.parameters()), list(m.buffers()), signature=SIG, **STEPS
    )
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * cut)])
    with pytest.raises(CheckpointError) as err:
        load_model(tmp_path / "run")
    assert str(path) in str(err.value)


def test_a_pickled_object_is_not_executed(tmp_path: Path) -> None:
    torch.save({**_good_model_record(), "extra": Path("x")}, tmp_path / "run.fdl")
    with pytest.raises(CheckpointError, match="not a readable"):
        load_model(tmp_path / "run")


# =============================================================================================
# S.rank<N>.optim
# =============================================================================================

OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "sgd-momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-2, betas=(0.8, 0.99)),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.05, amsgrad=True),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_optimizer_state_round_trips_bit_exactly(tmp_path: Path, name: str) -> None:
    make = OPTIMIZERS[name]
    m = net()
    opt = make(m.parameters())
    train(m, opt, steps=4)
    path = save_optim(tmp_path / "run", 1, opt.state_dict(), global_step=4, sync_round=2)
    assert path == tmp_path / "run.rank1.optim"
    bundle = load_optim(tmp_path / "run.fdl", 1)
    assert bundle is not None
    assert (bundle.rank, bundle.global_step, bundle.sync_round) == (1, 4, 2)

    twin = net(seed=3)
    twin.load_state_dict(m.state_dict())
    twin_opt = make(twin.parameters())
    twin_opt.load_state_dict(bundle.state)
    assert_same_tree(twin_opt.state_dict(), opt.state_dict())
    # the restored optimizer continues exactly where the saved one was
    train(m, opt, steps=2)
    train(twin, twin_opt, steps=2)
    assert_same_tree(dict(twin.state_dict()), dict(m.state_dict()))


def test_load_optim_of_a_missing_rank_is_none(tmp_path: Path) -> None:
    assert load_optim(tmp_path / "run", 0) is None


def test_optim_saved_by_another_rank_is_refused(tmp_path: Path) -> None:
    path = save_optim(tmp_path / "run", 0, {"state": {}, "param_groups": []}, **OPT_STEPS)
    path.rename(tmp_path / "run.rank1.optim")
    with pytest.raises(CheckpointError, match="saved by rank 0, read for rank 1"):
        load_optim(tmp_path / "run", 1)


class OptSteps(TypedDict):
    global_step: int
    sync_round: int


OPT_STEPS: OptSteps = {"global_step": 1, "sync_round": 1}


@pytest.mark.parametrize(
    ("write", "match"),
    [
        (lambda p: p.write_bytes(os.urandom(512)), "not a readable flodl.optim"),
        (lambda p: _torch_file(p, _good_model_record()), "format tag 'flodl.fdl'"),
        (
            lambda p: _torch_file(
                p, {"format": "flodl.optim", "version": 1, "rank": 0, "global_step": 0}
            ),
            "sync_round must",
        ),
        (
            lambda p: _torch_file(
                p,
                {
                    "format": "flodl.optim",
                    "version": 1,
                    "rank": 0,
                    "global_step": 0,
                    "sync_round": 0,
                    "state": [1],
                },
            ),
            "state must be a dict",
        ),
    ],
    ids=["random", "a-model-file", "missing-field", "state-type"],
)
def test_corrupt_optim_files_are_checkpoint_errors(
    tmp_path: Path, write: Callable[[Path], object], match: str
) -> None:
    path = tmp_path / "run.rank0.optim"
    write(path)
    with pytest.raises(CheckpointError, match=match) as err:
        load_optim(tmp_path / "run", 0)
    assert str(path) in str(err.value)


def test_save_optim_refuses_what_weights_only_cannot_load(tmp_path: Path) -> None:
    class Custom:
        pass

    state = {"state": {0: {"thing": Custom()}}, "param_groups": []}
    with pytest.raises(CheckpointError, match=r"refusing to write: .*Custom"):
        save_optim(tmp_path / "run", 0, state, **OPT_STEPS)
    assert list(tmp_path.iterdir()) == []


# =============================================================================================
# S.outer.fdl
# =============================================================================================


def test_outer_state_round_trips_bit_exactly(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(0)
    state = {
        "momentum": [torch.randn(4, 3, generator=gen), torch.randn(4, generator=gen)],
        "prev_global": [torch.randn(2, generator=gen).double()],
    }
    path = save_outer(tmp_path / "run.meta.json", state, global_step=17)
    assert path == tmp_path / "run.outer.fdl"
    bundle = load_outer(tmp_path / "run")
    assert bundle is not None and bundle.global_step == 17 and bundle.path == path
    assert list(bundle.state) == list(state)
    for name, tensors in state.items():
        assert len(bundle.state[name]) == len(tensors)
        for a, b in zip(bundle.state[name], tensors, strict=True):
            assert_same(a, b)


def test_load_outer_missing_is_none_corrupt_is_an_error(tmp_path: Path) -> None:
    assert load_outer(tmp_path / "run") is None
    path = tmp_path / "run.outer.fdl"
    path.write_bytes(b"\x00" * 100)
    with pytest.raises(CheckpointError, match=r"not a readable flodl\.outer") as err:
        load_outer(tmp_path / "run")
    assert str(path) in str(err.value)
    _torch_file(path, {"format": "flodl.outer", "version": 1, "global_step": 0, "state": {"m": 1}})
    with pytest.raises(CheckpointError, match="m must be a list of tensors"):
        load_outer(tmp_path / "run")


def test_save_outer_refuses_non_tensor_lists(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="refusing to write"):
        save_outer(tmp_path / "run", {"m": [1.0]}, global_step=0)  # type: ignore[list-item]


# =============================================================================================
# S.meta.json
# =============================================================================================


def test_the_coordinators_meta_record_round_trips(tmp_path: Path) -> None:
    cfg = config(num_epochs=2)
    coord = started(cfg)
    meta = coord.meta_record("graceful_shutdown")
    assert meta["coverage"]["per_epoch"], "an open epoch is recorded"
    path = write_meta(tmp_path / "run", meta)
    assert path == tmp_path / "run.meta.json"
    text = path.read_text()
    assert text.startswith('{\n  "schema_version": 3,')  # pretty, the original's field order
    assert json.loads(text) == json.loads(json.dumps(meta))
    read = read_meta(tmp_path / "run", world_size=2)
    assert read.model_dump(exclude_none=False) == CheckpointMeta.model_validate(meta).model_dump()
    state = resume_state(
        read, seed=cfg.seed, batch_size=BS, epoch_splits=1, total_epochs=cfg.total_epochs
    )
    assert state.epoch == meta["epoch"] == 0
    assert state.uncovered == ((0, 640),)
    assert state.elche is not None and state.elche.to_dict() == meta["elche_state"]
    Coordinator(cfg, random.Random(0), resume=state)  # the coordinator accepts what we read


def test_a_resumed_coordinator_reads_back_its_uncovered_ranges(tmp_path: Path) -> None:
    cfg = config(num_epochs=2)
    meta = meta_dict()
    write_meta(tmp_path / "run", meta)
    state = resume_state(
        read_meta(tmp_path / "run", world_size=2),
        seed=42,
        batch_size=BS,
        epoch_splits=1,
        total_epochs=2,
    )
    assert state == ResumeState(
        epoch=1,
        global_step=30,
        sync_round=5,
        elche=state.elche,
        uncovered=((320, 320),),
        world_size_at_save=2,
    )
    assert state.elche is not None and state.elche.trend_history == [0.01, 0.02]
    coord = started(cfg, resume=state)
    again = coord.meta_record("single_survivor")
    assert again["coverage"]["per_epoch"] == meta["coverage"]["per_epoch"]
    write_meta(tmp_path / "run", again)
    assert read_meta(tmp_path / "run").save_reason == "single_survivor"


def test_a_two_rank_save_seeds_a_three_rank_coordinator_and_says_so(tmp_path: Path) -> None:
    write_meta(tmp_path / "run", meta_dict())
    state = resume_state(
        read_meta(tmp_path / "run"), seed=42, batch_size=BS, epoch_splits=1, total_epochs=2
    )
    assert state.world_size_at_save == 2
    cfg = config(num_epochs=2, world_size=3)
    coord = Coordinator(cfg, random.Random(0), resume=state)
    out = []
    for r in range(3):
        out += coord.handle(Hello(run_id="run", rank=r, world_size=3, model_signature=SIG), 0.0)
    [resumed] = [e for e in out if isinstance(e, Record) and e.kind == "resumed"]
    assert resumed.data == {
        "epoch": 1,
        "global_step": 30,
        "world_size_at_save": 2,
        "world_size": 3,
        "uncovered_samples": 320,
    }
    # ranks 0 and 1 keep their speeds (rank 1, the slower, anchors); rank 2 calibrates
    assert coord.elche.smoothed_ms == [10.0, 20.0, 0.0]
    assert coord.elche.anchor_rank == 1
    # the uncovered 10 batches go to the three ranks, the new one included
    plans = {
        e.rank: e.frame.plan for e in out if isinstance(e, Send) and isinstance(e.frame, StartEpoch)
    }
    assert sorted(plans) == [0, 1, 2]
    assert sorted((p.partition_offset, p.partition_size) for p in plans.values()) == [
        (320, 160), (480, 96), (576, 64)
    ]  # fmt: skip


def test_the_original_flodls_meta_is_readable(tmp_path: Path) -> None:
    path = tmp_path / "orig.meta.json"
    path.write_text(ORIGINAL_META)
    meta = read_meta(tmp_path / "orig", world_size=2)
    assert (meta.schema_version, meta.epoch, meta.global_step, meta.sync_round) == (3, 5, 1200, 40)
    assert meta.world_size_at_save == 2 and meta.save_reason == "graceful_shutdown"
    assert meta.coverage is None
    state = resume_state(meta, seed=1, batch_size=64, epoch_splits=1, total_epochs=10)
    assert state.uncovered is None and state.epoch == 5 and state.sync_round == 40
    assert state.elche is not None
    assert state.elche.anchor == 12 and state.elche.anchor_rank == 0
    assert state.elche.smoothed_ms_per_batch == [10.5, 21.0]
    assert state.elche.phase == "stable" and state.elche.calibration_count == 7
    assert state.elche.trend_history == [0.1, 0.09]
    Coordinator(config(num_epochs=10), random.Random(0), resume=state)


def test_schema_1_and_2_metas_read_fine(tmp_path: Path) -> None:
    v1 = {k: v for k, v in json.loads(ORIGINAL_META).items() if k != "elche_state"}
    v1["schema_version"] = 1
    put_meta(tmp_path / "v1", v1)
    meta = read_meta(tmp_path / "v1")
    assert meta.elche_state is None and meta.elche is None
    assert resume_state(meta, seed=0, batch_size=1, epoch_splits=1, total_epochs=5).elche is None

    v2 = json.loads(ORIGINAL_META)
    v2["schema_version"] = 2
    del v2["elche_state"]["trend_history"]
    put_meta(tmp_path / "v2", v2)
    state = resume_state(
        read_meta(tmp_path / "v2"), seed=0, batch_size=1, epoch_splits=1, total_epochs=5
    )
    assert state.elche is not None and state.elche.trend_history is None


def test_unknown_fields_are_ignored(tmp_path: Path) -> None:
    meta = meta_dict(future_field={"x": 1})
    meta["coverage"]["per_epoch"][0]["note"] = "later flodl"
    meta["elche_state"]["extra"] = 3
    put_meta(tmp_path / "run", meta)
    assert read_meta(tmp_path / "run").epoch == 1


@pytest.mark.parametrize(
    ("given", "read"),
    [
        ("reduce_stall", "reduce_stall"),
        ("AllRanksLost", "all_ranks_lost"),
        (2, "single_survivor"),
        ("shrug", "graceful_shutdown"),
        (99, "graceful_shutdown"),
        (None, "graceful_shutdown"),
    ],
)
def test_save_reason_unknown_reads_as_graceful_shutdown(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, given: object, read: str
) -> None:
    put_meta(tmp_path / "run", meta_dict(save_reason=given))
    with caplog.at_level(logging.WARNING, logger="flodl.checkpoint"):
        assert read_meta(tmp_path / "run").save_reason == read
    assert ("unknown save_reason" in caplog.text) == (read == "graceful_shutdown")


def test_missing_save_reason_reads_as_graceful_shutdown(tmp_path: Path) -> None:
    meta = meta_dict()
    del meta["save_reason"]
    put_meta(tmp_path / "run", meta)
    assert read_meta(tmp_path / "run").save_reason == "graceful_shutdown"


def test_missing_meta(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="no checkpoint meta at") as err:
        read_meta(tmp_path / "run")
    assert str(tmp_path / "run.meta.json") in str(err.value)


def _meta_with(**over: Any) -> dict[str, Any]:
    return meta_dict(**over)


def _coverage(**over: Any) -> dict[str, Any]:
    cov = meta_dict()["coverage"]
    cov.update(over)
    return meta_dict(coverage=cov)


def _ranges(ranges: list[Any], total: int = 640) -> dict[str, Any]:
    return _coverage(per_epoch=[{"epoch": 1, "total_samples": total, "uncovered_ranges": ranges}])


def _elche(**over: Any) -> dict[str, Any]:
    meta = meta_dict()
    meta["elche_state"].update(over)
    return meta


@pytest.mark.parametrize(
    ("content", "match"),
    [
        ("", "not JSON"),
        ("{not json", "not JSON"),
        ("\udcff", "cannot read|not JSON"),
        ("[1, 2]", "must be a JSON object, not list"),
        ('"meta"', "must be a JSON object, not str"),
        (_meta_with(schema_version=4), r"written by a newer flodl \(schema 4 > 3\); upgrade"),
        (_meta_with(schema_version=0), "schema_version"),
        (_meta_with(schema_version="3"), "schema_version"),
        (_meta_with(epoch=-1), "epoch: Input should be greater than or equal to 0"),
        (_meta_with(global_step=1.5), "global_step"),
        (_meta_with(sync_round=True), "sync_round"),
        (_meta_with(world_size_at_save=0), "world_size_at_save"),
        ({"schema_version": 3, "epoch": 0}, "global_step: Field required"),
        (_meta_with(elche_state=[1]), "elche_state"),
        (_elche(phase="chaos"), "elche_state: phase must be one of"),
        (_elche(anchor=0), "elche_state: anchor must be an int >= 1"),
        (_elche(smoothed_ms_per_batch=[1.0]), "has 1 ranks, world_size_at_save is 2"),
        (_elche(trend_history=["x"]), "trend_history"),
        (_elche(anchor_rank=2), "anchor_rank 2 is out of range for world_size_at_save 2"),
        (_coverage(batch_size=0), "coverage.batch_size"),
        (_coverage(epoch_splits=0), "coverage.epoch_splits"),
        (_coverage(seed="42"), "coverage.seed"),
        (_ranges([[16, 32]]), r"\(offset=16, size=32\) is not batch-aligned"),
        (_ranges([[32, 20]]), r"\(offset=32, size=20\) is not batch-aligned"),
        (_ranges([[-32, 32]]), "is negative"),
        (_ranges([[608, 64]]), "ends past total_samples=640"),
        (_ranges([[0, 64], [32, 64]]), "overlaps the previous range"),
        (_ranges([[0, 64, 1]]), "uncovered_ranges"),
        (_ranges([{"offset": 0, "size": 64}]), "uncovered_ranges"),
        (
            _coverage(
                per_epoch=[
                    {"epoch": 1, "total_samples": 64, "uncovered_ranges": []},
                    {"epoch": 1, "total_samples": 64, "uncovered_ranges": []},
                ]
            ),
            "epoch 1 appears twice",
        ),
    ],
)
def test_bad_metas_are_checkpoint_errors_naming_the_file_and_field(
    tmp_path: Path, content: Any, match: str
) -> None:
    path = tmp_path / "run.meta.json"
    if isinstance(content, str):
        path.write_bytes(content.encode("utf-8", "surrogateescape"))
    else:
        path.write_text(json.dumps(content))
    with pytest.raises(CheckpointError, match=match) as err:
        read_meta(tmp_path / "run")
    assert str(path) in str(err.value)


def test_read_meta_checks_an_expected_world_size(tmp_path: Path) -> None:
    meta = meta_dict(world_size_at_save=4)
    meta["elche_state"]["smoothed_ms_per_batch"] = [1.0, 2.0, 3.0, 4.0]
    put_meta(tmp_path / "run", meta)
    assert read_meta(tmp_path / "run", world_size=4).world_size_at_save == 4
    with pytest.raises(
        CheckpointError,
        match="saved with world size 4, 2 was expected",
    ) as err:
        read_meta(tmp_path / "run", world_size=2)
    assert str(tmp_path / "run.meta.json") in str(err.value)


def test_adjacent_and_empty_ranges_are_fine(tmp_path: Path) -> None:
    put_meta(tmp_path / "run", _ranges([[64, 64], [0, 64], [640, 0]]))
    meta = read_meta(tmp_path / "run")
    state = resume_state(meta, seed=42, batch_size=BS, epoch_splits=1, total_epochs=2)
    assert state.uncovered == ((0, 64), (64, 64), (640, 0))


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        (
            {"seed": 7},
            "the checkpoint was made with seed 42, this run uses 7: resume needs the same seed",
        ),
        ({"batch_size": 64}, "made with batch size 32, this run uses 64"),
        ({"epoch_splits": 2}, "made with epoch_splits 1, this run uses 2"),
        ({"total_epochs": 0}, "at epoch 1, this run has only 0 epochs"),
    ],
)
def test_resume_refuses_another_runs_coverage(
    tmp_path: Path, kw: dict[str, int], match: str
) -> None:
    args: dict[str, int] = {"seed": 42, "batch_size": BS, "epoch_splits": 1, "total_epochs": 2}
    args.update(kw)
    path = write_meta(tmp_path / "run", meta_dict())
    meta = read_meta(tmp_path / "run")
    assert meta.source == path
    with pytest.raises(CheckpointError, match=match) as err:
        resume_state(meta, **args)
    assert str(path) in str(err.value)
    # a meta built in memory has no file to name
    with pytest.raises(CheckpointError, match=f"^checkpoint meta: .*{match}"):
        resume_state(CheckpointMeta.model_validate(meta_dict()), **args)


def test_resume_at_the_end_and_without_an_entry_for_the_epoch() -> None:
    meta = CheckpointMeta.model_validate(meta_dict(epoch=2))
    state = resume_state(meta, seed=42, batch_size=BS, epoch_splits=1, total_epochs=2)
    assert state.epoch == 2 and state.uncovered is None  # a finished run: nothing left


def test_write_meta_refuses_what_readers_refuse(tmp_path: Path) -> None:
    for bad in (
        meta_dict(schema_version=META_SCHEMA_VERSION + 1),
        _ranges([[16, 32]]),
        _elche(smoothed_ms_per_batch=[1.0]),
        {"epoch": 1},
    ):
        with pytest.raises(CheckpointError, match=r"run\.meta\.json: refusing to write"):
            write_meta(tmp_path / "run", bad)
    assert list(tmp_path.iterdir()) == []


def test_write_meta_omits_absent_blocks(tmp_path: Path) -> None:
    meta = meta_dict(schema_version=1)
    del meta["elche_state"], meta["coverage"]
    path = write_meta(tmp_path / "run", meta)
    assert set(json.loads(path.read_text())) == {
        "schema_version",
        "epoch",
        "global_step",
        "sync_round",
        "world_size_at_save",
        "save_reason",
    }


def test_meta_model_is_frozen() -> None:
    meta = CheckpointMeta.model_validate(meta_dict())
    with pytest.raises(ValueError, match="frozen"):
        meta.epoch = 3  # type: ignore[misc]


# =============================================================================================
# S.rank<N>.death.json
# =============================================================================================


def test_death_record_round_trip(tmp_path: Path) -> None:
    path = write_death_record(tmp_path / "run.fdl", 3, 4, "RuntimeError: " + "x" * 10_000)
    assert path == tmp_path / "run.rank3.death.json"
    assert stray_tmp(tmp_path) == []
    rec = read_death_record(path)
    assert (rec.schema_version, rec.rank, rec.world_size) == (DEATH_SCHEMA_VERSION, 3, 4)
    assert rec.error.startswith("RuntimeError: ") and len(rec.error) == 4096
    assert rec.unix_time_secs > 1_600_000_000
    assert read_death_record(tmp_path / "run", 3) == rec


def test_snapshot_re_exports_the_death_record_writer() -> None:
    assert snapshot.write_death_record is write_death_record
    assert snapshot.DEATH_SCHEMA_VERSION == DEATH_SCHEMA_VERSION == 1
    assert {"write_death_record", "DEATH_SCHEMA_VERSION"} <= set(snapshot.__all__)


def test_write_death_record_is_best_effort(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert write_death_record(blocker / "run", 0, 1, "e") is None  # parent is a file
    assert write_death_record("", 0, 1, "e") is None


_GOOD_DEATH: dict[str, Any] = {
    "schema_version": 1,
    "rank": 0,
    "world_size": 2,
    "error": "boom",
    "unix_time_secs": 1_700_000_000,
}


@pytest.mark.parametrize(
    ("content", "match"),
    [
        ("garbage", "not JSON"),
        ("[]", "must be a JSON object"),
        ({**_GOOD_DEATH, "schema_version": 2}, r"newer flodl \(schema 2 > 1\)"),
        ({**_GOOD_DEATH, "rank": -1}, "rank"),
        ({**_GOOD_DEATH, "error": None}, "error"),
        ({k: v for k, v in _GOOD_DEATH.items() if k != "unix_time_secs"}, "unix_time_secs"),
        ({**_GOOD_DEATH, "rank": 1}, "the record says rank 1"),
    ],
)
def test_bad_death_records_are_checkpoint_errors(tmp_path: Path, content: Any, match: str) -> None:
    path = tmp_path / "run.rank0.death.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    with pytest.raises(CheckpointError, match=match) as err:
        read_death_record(path)
    assert str(path) in str(err.value)


def test_missing_death_record(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="no death record at"):
        read_death_record(tmp_path / "run", 0)


def test_death_records_lists_skips_and_filters(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    for rank in (10, 2, 0):
        write_death_record(tmp_path / "run", rank, 16, f"rank {rank} died")
    write_death_record(tmp_path / "run", 1, 8, "an older run")
    write_death_record(tmp_path / "run2", 5, 16, "another stem")
    write_death_record(tmp_path / "ru", 6, 16, "a prefix stem")
    (tmp_path / "run.rank3.death.json").write_text("{torn")
    with caplog.at_level(logging.WARNING, logger="flodl.checkpoint"):
        records = death_records(tmp_path / "run.meta.json")
    assert [r.rank for r in records] == [0, 1, 2, 10]
    assert "run.rank3.death.json" in caplog.text
    assert [r.rank for r in death_records(tmp_path / "run", world_size=16)] == [0, 2, 10]
    assert death_records(tmp_path / "nothing") == []
    assert death_records(tmp_path / "missing-dir" / "run") == []


def test_model_bundle_is_immutable(tmp_path: Path) -> None:
    save_model(tmp_path / "run", [torch.ones(1)], [], signature=SIG, **STEPS)
    bundle = load_model(tmp_path / "run")
    assert isinstance(bundle, ModelBundle)
    with pytest.raises(AttributeError):
        bundle.epoch = 9  # type: ignore[misc]


# --- tagged saves: the meta is the switch --------------------------------------------------

TAG_A = "b100-0-aaaaaa"
TAG_B = "b200-1-bbbbbb"
TAG_C = "b300-2-cccccc"


def test_tagged_names_and_stems(tmp_path: Path) -> None:
    stem = tmp_path / "run"
    assert ck.model_path(stem, TAG_A).name == f"run.{TAG_A}.fdl"
    assert ck.optim_path(stem, 2, TAG_A).name == f"run.{TAG_A}.rank2.optim"
    assert ck.outer_path(stem, TAG_A).name == f"run.{TAG_A}.outer.fdl"
    for path in (ck.model_path(stem, TAG_A), ck.optim_path(stem, 0, TAG_A)):
        assert ck.normalize_stem(path) == str(stem)
    assert ck.normalize_stem(tmp_path / "run.v2") == str(tmp_path / "run.v2")  # not a tag
    with pytest.raises(ConfigError, match="bundle tag"):
        ck.model_path(stem, "../evil")


def _save(stem: Path, tag: str, step: int) -> None:
    model = net()
    ck.save_model(
        stem,
        list(model.parameters()),
        [],
        signature="s",
        global_step=step,
        sync_round=0,
        epoch=1,
        tag=tag,
    )
    ck.save_optim(
        stem, 0, {"state": {}, "param_groups": []}, global_step=step, sync_round=0, tag=tag
    )


def test_a_save_is_the_resume_point_only_once_its_meta_commits(tmp_path: Path) -> None:
    stem = tmp_path / "run"
    _save(stem, TAG_A, 100)
    ck.commit_bundle(stem, meta_dict(global_step=100, bundle_tag=TAG_A))
    _save(stem, TAG_B, 200)  # a second save, killed before its meta
    assert ck.read_meta(stem).bundle_tag == TAG_A
    assert ck.load_model(stem).global_step == 100  # the files the meta names
    assert ck.load_optim(stem, 0) is not None and ck.load_optim(stem, 0).global_step == 100  # type: ignore[union-attr]
    _save(stem, TAG_C, 300)
    ck.commit_bundle(stem, meta_dict(global_step=300, bundle_tag=TAG_C))
    assert ck.load_model(stem).global_step == 300
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == [f"run.{TAG_C}.fdl", f"run.{TAG_C}.rank0.optim", "run.meta.json"]


def test_a_commit_killed_between_its_meta_and_its_clean_up_resumes_from_the_new_save(
    tmp_path: Path,
) -> None:
    """The last write of a commit is the meta; the clean-up after it is best effort. Killed in
    between, the older save's files are still there, but the meta names the new one, which is
    what a resume reads; the next commit removes both older saves."""
    stem = tmp_path / "run"
    _save(stem, TAG_A, 100)
    ck.commit_bundle(stem, meta_dict(global_step=100, bundle_tag=TAG_A))
    _save(stem, TAG_B, 200)
    ck.write_meta(stem, meta_dict(global_step=200, bundle_tag=TAG_B))  # then killed
    assert (tmp_path / f"run.{TAG_A}.fdl").exists()
    assert ck.read_meta(stem).bundle_tag == TAG_B
    assert ck.load_model(stem).global_step == 200
    assert ck.load_optim(stem, 0) is not None and ck.load_optim(stem, 0).global_step == 200  # type: ignore[union-attr]
    _save(stem, TAG_C, 300)
    ck.commit_bundle(stem, meta_dict(global_step=300, bundle_tag=TAG_C))
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == [f"run.{TAG_C}.fdl", f"run.{TAG_C}.rank0.optim", "run.meta.json"]


def test_commit_spares_saves_in_flight_and_removes_the_original_layout(tmp_path: Path) -> None:
    stem = tmp_path / "run"
    for name in ("run.fdl", "run.rank0.optim", "run.outer.fdl", f"run.{TAG_A}.fdl.tmp.123"):
        (tmp_path / name).write_bytes(b"x")
    _save(stem, TAG_B, 200)
    _save(stem, TAG_C, 300)  # being written when TAG_B commits
    (tmp_path / "run.rank1.death.json").write_text("{}")  # not bundle data: untouched
    ck.commit_bundle(stem, meta_dict(global_step=200, bundle_tag=TAG_B), in_flight=[TAG_C])
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == sorted(
        [
            f"run.{TAG_B}.fdl",
            f"run.{TAG_B}.rank0.optim",
            f"run.{TAG_C}.fdl",
            f"run.{TAG_C}.rank0.optim",
            "run.meta.json",
            "run.rank1.death.json",
        ]
    )


def test_a_meta_without_a_tag_reads_the_original_layout(tmp_path: Path) -> None:
    stem = tmp_path / "run"
    model = net()
    ck.save_model(
        stem, list(model.parameters()), [], signature="s", global_step=7, sync_round=0, epoch=1
    )
    ck.write_meta(stem, meta_dict(global_step=7))
    assert ck.resolve_tag(stem) is None
    assert ck.load_model(stem).path == tmp_path / "run.fdl"


def test_a_meta_with_a_bad_tag_is_refused(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="bundle_tag"):
        ck.write_meta(tmp_path / "run", meta_dict(bundle_tag="../../etc"))


# --- uncovered samples: the coverage ranges as dataset indices ---------------------------------


def _coverage_meta(ranges: list[tuple[int, int]], *, total: int, entry_epoch: int = 1) -> Any:
    """A meta resuming at epoch 1, with a coverage entry for ``entry_epoch``."""
    entry = {"epoch": entry_epoch, "total_samples": total, "uncovered_ranges": ranges}
    coverage = {"seed": 7, "batch_size": 4, "epoch_splits": 2, "per_epoch": [entry]}
    return ck.CheckpointMeta.model_validate(meta_dict(epoch=1, coverage=coverage))


def test_uncovered_ranges_map_to_the_dataset_indices_of_the_shuffle() -> None:
    from flodl.sampling import epoch_slice, permutation

    # 41 samples, 2 splits: epoch 1 is the second half of data pass 0 (20 picks, 5 batches)
    meta = _coverage_meta([(12, 8), (0, 4)], total=20)
    data_pass, start, _ = epoch_slice(1, 41, 2)
    perm = permutation(41, data_pass, 7)
    want = [perm[start + i] for i in (*range(4), *range(12, 20))]
    assert ck.uncovered_samples(meta, 41) == want
    twice = _coverage_meta([(0, 8)], total=40)  # augment 2: picks are (sample, view) pairs
    got = ck.uncovered_samples(twice, 41, augment=2)
    assert got is not None and all(0 <= s < 41 for s in got) and len(got) == 8


def test_covered_samples_are_the_rest_of_the_epoch_in_shuffle_order() -> None:
    from flodl.sampling import epoch_slice, permutation

    meta = _coverage_meta([(12, 8), (0, 4)], total=20)
    data_pass, start, _ = epoch_slice(1, 41, 2)
    perm = permutation(41, data_pass, 7)
    assert ck.covered_samples(meta, 41) == [perm[start + i] for i in range(4, 12)]
    todo = ck.uncovered_samples(meta, 41)
    done = ck.covered_samples(meta, 41)
    assert todo is not None and done is not None
    # together: the epoch's whole batches (20 of its 20 or 21 picks), each sample once
    assert sorted(todo + done) == sorted(perm[start + i] for i in range(20))
    twice = _coverage_meta([(0, 8)], total=40)
    got = ck.covered_samples(twice, 41, augment=2)
    assert got is not None and len(got) == 32 and all(0 <= x < 41 for x in got)
    assert ck.covered_samples(_coverage_meta([], total=20, entry_epoch=0), 41) is None
    with pytest.raises(CheckpointError, match="another dataset"):
        ck.covered_samples(_coverage_meta([(0, 4)], total=20), 100)


def test_uncovered_samples_without_an_entry_and_for_another_dataset() -> None:
    # no entry for epoch 1: it restarts whole
    assert ck.uncovered_samples(_coverage_meta([], total=20, entry_epoch=0), 41) is None
    with pytest.raises(CheckpointError, match="had 20 samples at the save; a dataset of 100"):
        ck.uncovered_samples(_coverage_meta([(0, 4)], total=20), 100)
