"""Rank processes driven over pipes by a test: their shutdown, shared by the test modules."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess


def close_workers(
    procs: Sequence[BaseProcess], conns: Sequence[Connection], grace_s: float
) -> None:
    """Ask every live worker to stop (``None`` on its pipe), give them ``grace_s`` together to
    exit, kill what is left, and close the pipes."""
    for proc, conn in zip(procs, conns, strict=True):
        if proc.is_alive():
            with contextlib.suppress(OSError):
                conn.send(None)
    deadline = time.monotonic() + grace_s
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join(5.0)
    for conn in conns:
        conn.close()
