"""``flodl demo``: a real model on a real dataset that needs no download.

The task (:func:`demo_task`, :mod:`flodl.demo.task`) is a character-level language model over
the Python standard library's own source text: given ``context`` characters, predict the next
one. It is small enough that an epoch takes seconds on one CPU thread, and learns enough in a
few epochs (next-character accuracy well above the most-frequent-character baseline) that a
distributed run's accuracy can be compared with a solo run's.

:class:`Slowdown` (and :func:`slowed` for a ``train_step``; :mod:`flodl.demo.slowdown`) makes one
rank ``factor`` times slower than the hardware it runs on, standing in for a weaker GPU; the
benchmarks use the same helper for every system they compare.

:func:`run_demo` (:mod:`flodl.demo.run`) is the ``flodl demo`` command: a solo baseline in
process, then the same task with N local ranks in one of the five modes, then a summary table.
"""

from __future__ import annotations

from flodl.demo.run import DemoOptions, DemoResult, format_summary, run_demo
from flodl.demo.slowdown import RANK_ENV, Slowdown, parse_slow, slowed
from flodl.demo.task import (
    STEP_PER_FORWARD,
    VOCAB_SIZE,
    CharMLP,
    DemoTask,
    corpus_files,
    demo_task,
    encode,
    measure_step_per_forward,
    read_corpus,
)

__all__ = [
    "DemoTask",
    "demo_task",
    "corpus_files",
    "read_corpus",
    "encode",
    "VOCAB_SIZE",
    "Slowdown",
    "slowed",
    "parse_slow",
    "CharMLP",
    "STEP_PER_FORWARD",
    "measure_step_per_forward",
    "DemoOptions",
    "DemoResult",
    "run_demo",
    "format_summary",
    "RANK_ENV",
]
