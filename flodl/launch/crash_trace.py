"""Python stacks on a fatal signal in the processes of a run (docs/design.md §8, "Crash traces").

A native crash (a segfault in torch, Gloo or NCCL, an abort) kills a process without a Python
traceback: the launcher, which hosts the coordinator and the reduce server, would vanish with
nothing said, and every rank would only report the coordinator lost. :func:`enable` turns on
:mod:`faulthandler` for the run, so such a death prints every thread's stack to stderr first.
"""

from __future__ import annotations

import faulthandler
import threading

__all__ = ["disable", "enable"]

_lock = threading.Lock()
_held = 0
"""Runs of this process holding the handler :func:`enable` turned on (two launchers in one
interpreter: the handler stays on until both are done)."""


def enable() -> bool:
    """Dump every thread's Python stack to stderr on SIGSEGV, SIGFPE, SIGABRT, SIGBUS and
    SIGILL, unless :mod:`faulthandler` is already on (the user's, or ``python -X
    faulthandler``: left as it is).

    Returns:
        Whether this call turned it on (then :func:`disable` turns it off again). ``False``
        too where stderr has no file descriptor (a notebook's): nothing is dumped there.
    """
    global _held
    with _lock:
        if _held:
            _held += 1
            return True
        if faulthandler.is_enabled():
            return False
        try:
            faulthandler.enable(all_threads=True)
        except (AttributeError, OSError, RuntimeError, ValueError):
            return False
        _held = 1
        return True


def disable(enabled: bool) -> None:
    """Undo :func:`enable` (``enabled``: its result): the handler goes off when the last run
    that turned it on is done."""
    global _held
    if not enabled:
        return
    with _lock:
        _held -= 1
        if _held == 0:
            faulthandler.disable()
