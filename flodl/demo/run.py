"""The ``flodl demo`` command: a solo baseline in process, then the same task with N local ranks
in one of the five modes, then a summary table.
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from flodl.demo.slowdown import slowed
from flodl.demo.task import DemoTask, demo_task
from flodl.errors import ConfigError

__all__ = ["DemoOptions", "DemoResult", "run_demo", "format_summary"]

DEFAULT_EPOCHS = 3
BATCH_SIZE = 128
MAX_RANKS = 16


@dataclass(frozen=True)
class DemoOptions:
    """``flodl demo``'s options (validated by :meth:`check`).

    Attributes:
        mode: one of the five ElChe modes (``nccl_*`` run on Gloo on a CPU-only machine).
        ranks: local CPU ranks of the distributed run (2..16).
        slow: rank → slowdown factor (:func:`~flodl.demo.slowdown.parse_slow`).
        epochs: epochs of both runs.
        out: output directory (records, dashboard, checkpoint).
        seed: model initialization and shuffle seed of both runs.
        samples: training windows (:func:`~flodl.demo.task.demo_task`).
    """

    mode: str = "cpu_cadence"
    ranks: int = 2
    slow: Mapping[int, float] = field(default_factory=lambda: {1: 3.0})
    epochs: int = DEFAULT_EPOCHS
    out: str = "runs/demo"
    seed: int = 0
    samples: int = 128_000

    def check(self) -> None:
        """Raises:
        ConfigError: naming the bad option.
        """
        from flodl.config import MODES

        if self.mode not in MODES:
            raise ConfigError(f"--mode {self.mode!r}: expected one of {', '.join(MODES)}")
        if not 2 <= self.ranks <= MAX_RANKS:
            raise ConfigError(f"--ranks {self.ranks}: expected 2..{MAX_RANKS}")
        for rank, factor in self.slow.items():
            if not 0 <= rank < self.ranks:
                raise ConfigError(
                    f"--slow {rank}:{factor:g}: rank {rank} is out of range for --ranks "
                    f"{self.ranks} (ranks are 0..{self.ranks - 1})"
                )
            if not (factor >= 1.0 and math.isfinite(factor)):
                raise ConfigError(f"--slow {rank}:{factor}: the factor must be >= 1")
        if not 1 <= self.epochs <= 1000:
            raise ConfigError(f"--epochs {self.epochs}: expected 1..1000")
        if self.samples < BATCH_SIZE * self.ranks:
            raise ConfigError(f"--samples {self.samples}: need at least {BATCH_SIZE * self.ranks}")


@dataclass
class DemoResult:
    """What the summary table shows (times in seconds, accuracies 0..1)."""

    solo_accuracy: float
    accuracy: float
    solo_wall_s: float
    wall_s: float
    solo_train_s: float
    train_s: float
    batch_share: list[float]
    syncs: int
    anchor: int
    trivial_accuracy: float
    files: dict[str, str]

    @property
    def diff_pp(self) -> float:
        """Distributed minus solo accuracy, percentage points."""
        return 100.0 * (self.accuracy - self.solo_accuracy)


def _is_rank() -> bool:
    from flodl.launch.env import rank_env

    return rank_env() is not None


def run_demo(options: DemoOptions, out: Any = None) -> DemoResult | None:
    """Run ``flodl demo``: a solo baseline, the distributed run, the summary table.

    In a rank process (the launcher re-executes ``flodl demo …`` once per rank with
    ``FLODL_RANK`` set) only the distributed run's ``Trainer`` call is made, which trains as
    that rank and ends the process; the launcher process does everything else.

    Args:
        options: validated here.
        out: text stream for the report (default ``sys.stdout``).

    Returns:
        The figures of the summary table (``None`` only in a rank that was not started by
        flodl's launcher).

    Raises:
        ConfigError: a bad option.
        FlodlError: a run failed.
    """
    options.check()
    stream = out if out is not None else sys.stdout
    task = demo_task(samples=options.samples, seed=options.seed)
    if _is_rank():
        _distributed(options, task, [])
        return None

    root = Path(options.out).resolve()
    files = _prepare_out(root)
    cores = os.cpu_count() or 1
    slow_text = ", ".join(f"rank {r} slowed {f:g}×" for r, f in sorted(options.slow.items()))

    def say(text: str = "") -> None:
        stream.write(text + "\n")
        stream.flush()

    say(f"flodl demo: {task.description}")
    say(
        f"  model: {sum(p.numel() for p in task.model_factory('cpu').parameters()):,}-parameter "
        f"character MLP, Adam, batch {BATCH_SIZE}, {options.epochs} epoch(s), seed "
        f"{options.seed}; most-frequent-character accuracy {100 * task.trivial_accuracy:.1f} %"
    )
    threads = max(1, cores // options.ranks)
    say(f"\n[1/2] solo baseline: one rank's hardware alone ({threads} CPU thread(s)), in process")
    solo = _solo(options, task, threads, say)
    say(
        f"\n[2/2] {options.mode}: {options.ranks} local CPU ranks"
        f"{' (' + slow_text + ')' if slow_text else ''}"
    )
    t0 = time.perf_counter()
    metrics: list[Any] = []
    state = _distributed(options, task, metrics, files=files)
    wall = time.perf_counter() - t0
    assert state is not None
    model = task.model_factory("cpu")
    state.load_into(model)
    last = metrics[-1] if metrics else None
    result = DemoResult(
        solo_accuracy=solo[0],
        accuracy=task.eval_fn(model, task.held_out),
        solo_wall_s=solo[1],
        wall_s=wall,
        solo_train_s=solo[2],
        train_s=sum(m.epoch_ms for m in metrics) / 1000.0,
        batch_share=list(last.per_rank_batch_share) if last is not None else [],
        syncs=int(last.syncs) if last is not None else 0,
        anchor=int(last.anchor) if last is not None else 0,
        trivial_accuracy=task.trivial_accuracy,
        files={k: _display_path(v) for k, v in files.items()},
    )
    say()
    say(format_summary(options, result))
    return result


def _out_paths(root: Path) -> dict[str, str]:
    """Where the distributed run writes: the record tree, the dashboard, the bundle stem."""
    return {
        "records": str(root / "records"),
        "dashboard": str(root / "dashboard.html"),
        "checkpoint": str(root / "checkpoint"),
    }


def _prepare_out(root: Path) -> dict[str, str]:
    """Create ``root``; clear a previous demo's record tree there (never anything else)."""
    import shutil

    root.mkdir(parents=True, exist_ok=True)
    records = root / "records"
    if records.is_dir():
        if (records / "root.log").exists() or (records / "root").is_dir():
            shutil.rmtree(records)
        elif any(records.iterdir()):
            raise ConfigError(f"{records} exists and is not a flodl record directory")
    return _out_paths(root)


def _display_path(path: str) -> str:
    try:
        return os.path.relpath(path)
    except ValueError:
        return path


def _solo(
    options: DemoOptions, task: DemoTask, threads: int, say: Callable[[str], None]
) -> tuple[float, float, float]:
    """The baseline: world 1 in process, same epochs, seed and batch size. Returns
    ``(accuracy, wall s, training s)``."""
    from flodl.trainer import Trainer

    epoch_ms: list[float] = []

    def on_epoch(m: Any) -> None:
        epoch_ms.append(m.epoch_ms)
        say(
            f"  solo ▏epoch {m.epoch + 1}/{options.epochs} ▏loss {m.avg_loss:.4f} "
            f"▏{m.epoch_ms / 1000:.1f} s"
        )

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        t0 = time.perf_counter()
        state = (
            Trainer.builder(task.model_factory, task.optim_factory, task.train_step)
            .dataset(task.train)
            .batch_size(BATCH_SIZE)
            .num_epochs(options.epochs)
            .seed(options.seed)
            .progress(False)
            .metrics_fn(on_epoch)
            .run()
            .join()
        )
        wall = time.perf_counter() - t0
    finally:
        torch.set_num_threads(before)
    model = task.model_factory("cpu")
    state.load_into(model)
    accuracy = task.eval_fn(model, task.held_out)
    say(f"  solo ▏held-out accuracy {100 * accuracy:.1f} % ▏{wall:.1f} s")
    return accuracy, wall, sum(epoch_ms) / 1000.0


def _distributed(
    options: DemoOptions,
    task: DemoTask,
    metrics: list[Any],
    files: dict[str, str] | None = None,
) -> Any:
    """The distributed run's one ``Trainer`` call (the same in the launcher and the ranks)."""
    from flodl.config import ElCheConfig
    from flodl.trainer import Trainer

    # A rank rebuilds the same configuration from the same options; the launcher writes the
    # records and the dashboard, and tells the ranks the bundle stem.
    files = files or _out_paths(Path(options.out).resolve())
    step = slowed(task.train_step, options.slow, step_per_forward=task.step_per_forward)
    handle = (
        Trainer.builder(task.model_factory, task.optim_factory, step)
        .dataset(task.train)
        .batch_size(BATCH_SIZE)
        .num_epochs(options.epochs)
        .seed(options.seed)
        .elche(ElCheConfig.preset(options.mode))
        .local_ranks(options.ranks)
        .eval_dataset(task.held_out)
        .eval_fn(task.eval_fn)
        .metrics_fn(metrics.append)
        .progress(True)
        .reports_per_epoch(4)
        .record_log(files["records"])
        .save_dashboard(files["dashboard"])
        .save_path(files["checkpoint"])
        .run()
    )
    return handle.join()


def format_summary(options: DemoOptions, r: DemoResult) -> str:
    """The summary table and where the files are."""
    name = f"{options.mode}, {options.ranks} ranks"
    shares = " · ".join(f"r{i} {100 * s:.0f}%" for i, s in enumerate(r.batch_share)) or "-"
    speed = r.solo_train_s / r.train_s if r.train_s > 0 else math.nan
    rows = [
        ("", "solo", name),
        (
            "accuracy",
            f"{100 * r.solo_accuracy:.1f} %",
            f"{100 * r.accuracy:.1f} % ({r.diff_pp:+.1f} pp vs solo)",
        ),
        ("wall time", f"{r.solo_wall_s:.1f} s", f"{r.wall_s:.1f} s (incl. rank start-up)"),
        (
            "training time",
            f"{r.solo_train_s:.1f} s",
            f"{r.train_s:.1f} s ({speed:.2f}× solo's speed)",
        ),
        ("batch share", "r0 100%", shares),
        ("syncs", "-", str(r.syncs)),
        ("anchor", "-", str(r.anchor)),
    ]
    w0 = max(len(a) for a, _, _ in rows)
    w1 = max(len(b) for _, b, _ in rows)
    trivial = 100 * r.trivial_accuracy
    lines = [f"summary (held-out next-character accuracy; always-the-commonest {trivial:.1f} %)"]
    for a, b, c in rows:
        lines.append(f"  {a.ljust(w0)}  {b.rjust(w1)}  {c}".rstrip())
    lines.append("")
    lines.append(
        f"  records     {r.files['records']}/root.log  (flodl records tail {r.files['records']})"
    )
    lines.append(f"  dashboard   {r.files['dashboard']}")
    lines.append(
        f"  checkpoint  {r.files['checkpoint']}.meta.json (resume_from: {r.files['checkpoint']})"
    )
    return "\n".join(lines)
