"""Fixtures of the unit tier."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[str], ModuleType]]:
    """Import a script of benchmarks/ the way it runs (its folder first on sys.path); every
    module loaded from benchmarks/ is forgotten afterwards."""
    monkeypatch.syspath_prepend(str(REPO))
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    yield importlib.import_module
    folder = str(REPO / "benchmarks")
    for name, module in list(sys.modules.items()):
        if (getattr(module, "__file__", None) or "").startswith(folder):
            sys.modules.pop(name, None)
