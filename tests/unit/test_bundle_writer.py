"""The coordinator's side of a bundle: metas commit in the order of their saves."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from flodl import checkpoint
from flodl.coord.effects import BundleRequested, WriteMeta
from flodl.service.bundles import BundleWriter


def meta(step: int, tag: str) -> dict[str, Any]:
    return {
        "schema_version": 3,
        "epoch": 1,
        "global_step": step,
        "sync_round": 1,
        "world_size_at_save": 1,
        "save_reason": "graceful_shutdown",
        "bundle_tag": tag,
    }


def save(stem: Path, tag: str, step: int) -> None:
    p = [torch.zeros(2)]
    checkpoint.save_model(
        stem, p, [], signature="s", global_step=step, sync_round=1, epoch=1, tag=tag
    )


def test_a_save_that_completes_after_a_newer_one_does_not_move_the_resume_point_back(
    tmp_path: Path,
) -> None:
    stem = tmp_path / "run"
    writer = BundleWriter(str(stem))
    old, new = "b100-0-aaaaaa", "b200-1-bbbbbb"
    for version, tag in ((0, old), (1, new)):
        writer.bundle_requested(BundleRequested(version, tag))
        save(stem, tag, 100 * (version + 1))
    writer.write_meta(WriteMeta(meta(200, new), "checkpoint", 1))
    assert (tmp_path / f"run.{old}.fdl").exists()  # still being written when new committed
    writer.write_meta(WriteMeta(meta(100, old), "checkpoint", 0))  # its writer was slower
    assert checkpoint.read_meta(stem).bundle_tag == new
    assert checkpoint.load_model(stem).global_step == 200
    assert writer.written == ["checkpoint"]
