"""The step accounting every benchmark's systems share, re-exported from the product's own
lock-step runner (:mod:`flodl.demo.lockstep`, whose ``run_lockstep`` is the DDP and local-SGD
baseline), and the rank the two-rank benchmarks slow.

:class:`TimedStep` applies the one slowdown method and counts the busy time the same way in
every system (see :mod:`flodl.demo.lockstep`). Idle fraction = ``1 − busy / span``, where
``span`` is the training span of the run (first forward on any rank to the last forward on
any rank), also identical for every system.
"""

from __future__ import annotations

from _common import ensure_repo_on_path

ensure_repo_on_path()

from flodl.demo.lockstep import (  # noqa: E402 - after the path fix
    TimedStep,
    batches,
    equal_split,
    free_port,
    read_step_record,
)

__all__ = [
    "SLOW_RANK",
    "TimedStep",
    "batches",
    "read_step_record",
    "equal_split",
    "free_port",
]

SLOW_RANK = 1
"""The rank (or replica) slowed in every system."""
