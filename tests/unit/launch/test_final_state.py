"""Where a launched rank leaves its final state (docs/design.md §2c): a private directory of
its own user, created if missing, never one that someone else made first."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import torch

from flodl.launch.child import _save_state
from flodl.launch.env import final_state_path
from flodl.rank.snapshot import TrainedState


def state() -> TrainedState:
    return TrainedState([torch.ones(2)], [], None)


def test_the_directory_is_created_private_and_the_state_written(tmp_path: Path) -> None:
    path = final_state_path(tmp_path / "flodl-final-run-1", 3)
    _save_state(state(), path)
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert torch.load(path, weights_only=True)["params"][0].tolist() == [1.0, 1.0]


def test_a_directory_others_may_enter_is_refused(tmp_path: Path) -> None:
    shared = tmp_path / "flodl-final-run-2"
    shared.mkdir(mode=0o755)
    shared.chmod(0o755)  # (the umask may have narrowed it)
    with pytest.raises(OSError, match="is not a private directory of this user"):
        _save_state(state(), final_state_path(shared, 0))
    assert os.listdir(shared) == []


def test_a_symbolic_link_in_its_place_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    (tmp_path / "flodl-final-run-3").symlink_to(target)
    with pytest.raises(OSError, match="is not a private directory"):
        _save_state(state(), final_state_path(tmp_path / "flodl-final-run-3", 0))
    assert os.listdir(target) == []
