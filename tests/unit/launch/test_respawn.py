"""The respawn knob: TrainerConfig.respawn, FLODL_RESPAWN (``flodl launch --respawn N``) and
the configurations that cannot rejoin (docs/design.md §2, "Rejoin")."""

from __future__ import annotations

import pytest
import torch

from flodl import ElCheConfig, NesterovMomentum, TensorBatchDataset, TrainerConfig
from flodl.config import MODES
from flodl.errors import ConfigError
from flodl.launch.env import ENV_RESPAWN, respawn_limit

DATA = TensorBatchDataset(torch.zeros(64, 2), torch.zeros(64, dtype=torch.long))


def test_flodl_respawn_overrides_the_config_and_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_RESPAWN, raising=False)
    assert respawn_limit(2) == 2
    monkeypatch.setenv(ENV_RESPAWN, "5")
    assert respawn_limit(2) == 5
    monkeypatch.setenv(ENV_RESPAWN, "0")
    assert respawn_limit(2) == 0
    for bad in ("-1", "two", "1001", "1.5"):
        monkeypatch.setenv(ENV_RESPAWN, bad)
        with pytest.raises(ConfigError, match=f"{ENV_RESPAWN}={bad!r} must be an integer"):
            respawn_limit(0)


@pytest.mark.parametrize("mode", MODES)
def test_respawn_is_accepted_in_every_mode(mode: str) -> None:
    c = TrainerConfig(dataset=DATA, batch_size=8, elche=ElCheConfig.preset(mode), respawn=3)
    assert c.respawn == 3


@pytest.mark.parametrize("mode", ["cpu_cadence", "nccl_cadence"])
def test_respawn_with_an_outer_optimizer_is_accepted_in_every_placement(mode: str) -> None:
    """CPU modes keep the outer state at the reduce server; collective modes copy it to a
    rejoined rank from a live one (docs/design.md §2, "Rejoin")."""
    c = TrainerConfig(
        dataset=DATA,
        batch_size=8,
        elche=ElCheConfig.preset(mode),
        outer_optimizer=NesterovMomentum(),
        respawn=1,
    )
    assert c.respawn == 1
