"""The pure coordinator: a sans-IO state machine (no I/O, no clock, no threads; docs/design.md
§0, §2). Its asyncio and thread shells live in :mod:`flodl.service`."""

from __future__ import annotations


def compiled() -> bool:
    """Whether this installation's coordinator core is compiled: a wheel built with the
    compiled-core hook (``HATCH_BUILD_HOOK_ENABLE_CUSTOM=1 pip install .``; docs/design.md §2,
    "Compiled core") holds its hot path as C extensions, which Python loads before the sources."""
    from flodl.coord import machine

    return not str(machine.__file__).endswith(".py")
