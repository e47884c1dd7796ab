"""Shared test configuration: event-loop selection per marker."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping

import pytest
import uvloop


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> Mapping[str, Callable[[], asyncio.AbstractEventLoop]]:
    """``@pytest.mark.uvloop`` tests run on uvloop (real time); the rest on the stdlib loop,
    which looptime can patch for virtual-time shell tests."""
    del config
    if item.get_closest_marker("uvloop"):
        return {"uvloop": uvloop.new_event_loop}
    return {"asyncio": asyncio.new_event_loop}
