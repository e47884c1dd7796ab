"""flodl: data-parallel PyTorch training across ranks of unequal speed that may die mid-run."""

from __future__ import annotations

import logging

from flodl.errors import (
    ConfigError,
    CoordinatorLost,
    CycleAborted,
    FlodlError,
    FrameError,
    LocalProtocolError,
    ProtocolError,
    RemoteProtocolError,
)

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "ConfigError",
    "CoordinatorLost",
    "CycleAborted",
    "FlodlError",
    "FrameError",
    "LocalProtocolError",
    "ProtocolError",
    "RemoteProtocolError",
]

logging.getLogger("flodl").addHandler(logging.NullHandler())
