"""Shared test configuration: event-loop selection per marker, and where the processes a test
starts put their temporary files."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator, Mapping

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


@pytest.fixture(scope="session", autouse=True)
def _children_keep_their_temporary_files_under_basetemp(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[None]:
    """Every process a test starts inherits a ``TMPDIR`` inside this session's pytest temporary
    directory, so what a child leaves in its temporary directory goes with pytest's retention
    instead of piling up in /tmp: torchrun's log directory (``torchelastic_*``, which it never
    removes) and the run directory of a launcher that a test crashes on purpose (a native
    crash runs no exit hook). This process's own ``tempfile`` is left as it was; a test that
    checks where a run directory goes sets ``TMPDIR`` for its child itself."""
    scratch = tmp_path_factory.mktemp("children-tmp", numbered=False)
    with pytest.MonkeyPatch.context() as patch:  # (the session's own: monkeypatch is per test)
        patch.setenv("TMPDIR", str(scratch))
        yield
