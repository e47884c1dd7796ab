"""flodl: data-parallel PyTorch training across ranks of unequal speed that may die mid-run."""

from __future__ import annotations

import logging
import warnings
from typing import TYPE_CHECKING

# torch's CPU wheel warns at import time when numpy is absent; flodl never needs numpy.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)

from flodl.errors import (  # noqa: E402
    CheckpointError,
    ConfigError,
    CoordinatorLost,
    CycleAborted,
    FlodlError,
    FrameError,
    LocalProtocolError,
    ProtocolError,
    RemoteProtocolError,
    TrainingStopped,
)

__version__ = "0.1.0"

if TYPE_CHECKING:  # what ``__getattr__`` below loads lazily, as type checkers should see it
    from flodl.config import (
        CoordConfig,
        ElCheConfig,
        EpochCallbackPolicy,
        MaxFailure,
        Reduction,
    )
    from flodl.data import BatchDataset, MapDataset, TensorBatchDataset
    from flodl.launch.builder import ClusterBuilder
    from flodl.outer import NesterovMomentum, OuterAvg, OuterConfig, SlowMomentum
    from flodl.rank.snapshot import TrainedState
    from flodl.trainer import (
        Trainer,
        TrainerBuilder,
        TrainerConfig,
        TrainerHandle,
        record_scalar,
    )
    from flodl.wire.frames import EpochMetrics
    from flodl.worker import Worker


__all__ = [
    "__version__",
    "Trainer",
    "TrainerBuilder",
    "TrainerConfig",
    "TrainerHandle",
    "TrainedState",
    "ClusterBuilder",
    "ElCheConfig",
    "CoordConfig",
    "MaxFailure",
    "EpochCallbackPolicy",
    "Reduction",
    "OuterConfig",
    "OuterAvg",
    "SlowMomentum",
    "NesterovMomentum",
    "Worker",
    "EpochMetrics",
    "BatchDataset",
    "MapDataset",
    "TensorBatchDataset",
    "record_scalar",
    "CheckpointError",
    "ConfigError",
    "CoordinatorLost",
    "CycleAborted",
    "FlodlError",
    "FrameError",
    "LocalProtocolError",
    "ProtocolError",
    "RemoteProtocolError",
    "TrainingStopped",
]

logging.getLogger("flodl").addHandler(logging.NullHandler())

# The public API is loaded on first use (PEP 562): ``import flodl.rank.bridge`` or
# ``flodl.wire`` must not pay for torch, which the Trainer and datasets import.
_LAZY = {
    "Trainer": "flodl.trainer",
    "TrainerBuilder": "flodl.trainer",
    "TrainerConfig": "flodl.trainer",
    "TrainerHandle": "flodl.trainer",
    "record_scalar": "flodl.trainer",
    "TrainedState": "flodl.rank.snapshot",
    "ClusterBuilder": "flodl.launch.builder",
    "ElCheConfig": "flodl.config",
    "CoordConfig": "flodl.config",
    "MaxFailure": "flodl.config",
    "EpochCallbackPolicy": "flodl.config",
    "Reduction": "flodl.config",
    "OuterConfig": "flodl.outer",
    "OuterAvg": "flodl.outer",
    "SlowMomentum": "flodl.outer",
    "NesterovMomentum": "flodl.outer",
    "Worker": "flodl.worker",
    "EpochMetrics": "flodl.wire.frames",
    "BatchDataset": "flodl.data",
    "MapDataset": "flodl.data",
    "TensorBatchDataset": "flodl.data",
}


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'flodl' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
