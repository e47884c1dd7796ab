"""A bool given for an integer setting is refused, naming the setting, in every config model
(pydantic's lax mode would take ``anchor: true`` as anchor 1); integers and the bool settings
are unchanged."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

from flodl.config import (
    _INT_FIELDS,
    CoordConfig,
    ElCheConfig,
    JobSpec,
    MaxFailure,
    OuterConfig,
    refuse_bool_int,
    validated,
)
from flodl.errors import ConfigError
from flodl.launch.cluster import Controller, SshSettings, Worker
from flodl.launch.cluster_file import parse_cluster_yaml
from flodl.trainer_config import TrainerConfig

MODELS: list[type[BaseModel]] = [
    ElCheConfig,
    MaxFailure,
    OuterConfig,
    JobSpec,
    CoordConfig,
    TrainerConfig,
    Controller,
    SshSettings,
    Worker,
]


def int_fields(model: type[BaseModel]) -> frozenset[str]:
    class Info:
        field_name = ""

    refuse_bool_int(model, True, Info())  # type: ignore[arg-type]  # (fills the cache)
    return _INT_FIELDS.get(model, frozenset())


def test_the_integer_settings_are_found() -> None:
    assert int_fields(ElCheConfig) >= {"anchor", "max_anchor", "min_anchor"}
    assert int_fields(TrainerConfig) >= {"batch_size", "num_epochs", "respawn", "dashboard"}
    assert int_fields(CoordConfig) >= {"world_size", "min_world_size", "dataset_len"}
    assert int_fields(SshSettings) == {"port"}
    assert int_fields(Controller) == {"port"}
    for model in MODELS:  # no bool setting is taken for an integer one
        for name in int_fields(model):
            assert model.model_fields[name].annotation is not bool


@pytest.mark.parametrize(
    ("model", "base"),
    [
        (ElCheConfig, {}),
        (TrainerConfig, {"dataset": list(range(64))}),
        (SshSettings, {}),
        (Controller, {"host": "127.0.0.1"}),
    ],
)
def test_a_bool_for_any_integer_setting_is_refused_by_name(
    model: type[BaseModel], base: dict[str, Any]
) -> None:
    for name in sorted(int_fields(model)):
        with pytest.raises(ValidationError) as info:
            model(**base, **{name: True})
        (error,) = info.value.errors()
        assert error["loc"] == (name,)
        assert error["msg"] == "must be an integer, got the bool True"


def test_integers_and_bool_settings_still_validate() -> None:
    assert ElCheConfig(anchor=7, min_anchor=None).anchor == 7
    assert ElCheConfig(anchor=1).anchor == 1
    c = TrainerConfig(dataset=list(range(64)), respawn=0, dashboard=None)
    assert c.respawn == 0 and c.dashboard is None


def test_the_public_entries_name_the_setting() -> None:
    with pytest.raises(ConfigError, match=r"anchor: must be an integer, got the bool True"):
        validated(ElCheConfig, anchor=True)
    yml = "cluster:\n  workers:\n    - host: a\n      devices: [cpu]\n      ssh: {port: true}\n"
    with pytest.raises(ConfigError, match=r"ssh\.port: must be an integer, got the bool True"):
        parse_cluster_yaml(yml)
