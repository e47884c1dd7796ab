"""The ``flodl demo`` command: a solo baseline in process, what ``flodl sim`` predicts for the
rig, the same task under lock-step DDP (:mod:`flodl.demo.lockstep`) and then under flodl with N
local ranks in one of the five modes, then a summary table.
"""

from __future__ import annotations

import dataclasses
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

__all__ = [
    "DemoOptions",
    "DemoResult",
    "Prediction",
    "predict",
    "run_demo",
    "format_summary",
    "result_json",
]

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
class Prediction:
    """What ``flodl sim`` predicts for the rig before the distributed runs (seconds)."""

    ms_per_batch: list[float]
    """Per rank: the solo run's measured ms per batch times the rank's slowdown."""
    reduce_ms: float
    lockstep_s: float
    lockstep_syncs: int
    train_s: float
    syncs: int


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
    lockstep_accuracy: float = math.nan
    lockstep_wall_s: float = math.nan
    lockstep_train_s: float = math.nan
    lockstep_syncs: int = 0
    predicted: Prediction | None = None
    replayed_s: float | None = None
    """``flodl sim --from-records``' replay of the run's training span (measured speeds)."""

    @property
    def diff_pp(self) -> float:
        """Distributed minus solo accuracy, percentage points."""
        return 100.0 * (self.accuracy - self.solo_accuracy)

    @property
    def speedup(self) -> float:
        """flodl's training span against lock-step DDP's (> 1: flodl is faster)."""
        return self.lockstep_train_s / self.train_s if self.train_s > 0 else math.nan


def result_json(options: DemoOptions, r: DemoResult) -> dict[str, Any]:
    """The summary table's figures (``flodl demo --json``): the options, every field of the
    result (times in seconds, accuracies 0..1; a figure that was not measured is null), the
    derived ``diff_pp`` and ``speedup``, and the table as printed."""

    from flodl.monitor.hub_entries import finite

    opts = dataclasses.asdict(options)
    opts["slow"] = {str(k): v for k, v in sorted(options.slow.items())}
    result = dataclasses.asdict(r) | {"diff_pp": r.diff_pp, "speedup": r.speedup}
    out: dict[str, Any] = finite(
        {"options": opts, "result": result, "summary": format_summary(options, r)}
    )
    return out


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
    say(f"\n[1/3] solo baseline: one rank's hardware alone ({threads} CPU thread(s)), in process")
    solo = _solo(options, task, threads, say)
    predicted = predict(options, len(task.train), solo[2])
    say(
        f"\nflodl sim predicts for this rig (ms/batch "
        f"{', '.join(f'{ms:.1f}' for ms in predicted.ms_per_batch)} from the solo run, "
        f"averaging {predicted.reduce_ms:g} ms): lock-step DDP {predicted.lockstep_s:.1f} s of "
        f"training, {options.mode} {predicted.train_s:.1f} s "
        f"({_ratio(predicted.lockstep_s, predicted.train_s)} faster)"
    )
    rig = f"{options.ranks} local CPU ranks{' (' + slow_text + ')' if slow_text else ''}"
    say(f"\n[2/3] lock-step DDP (torch DistributedDataParallel, Gloo): {rig}, equal shards")
    lock = _lockstep(options, task, threads, root)
    say(
        f"  ddp  ▏held-out accuracy {100 * lock['metric']:.1f} % ▏training "
        f"{lock['train_s']:.1f} s ▏{lock['total_s']:.1f} s"
    )
    say(f"\n[3/3] flodl {options.mode}: {rig}")
    t0 = time.perf_counter()
    metrics: list[Any] = []
    state = _distributed(options, task, metrics, files=files)
    wall = time.perf_counter() - t0
    assert state is not None
    model = task.model_factory("cpu")
    state.load_into(model)
    recorded = from_records(files["records"])
    result = DemoResult(
        solo_accuracy=solo[0],
        accuracy=task.eval_fn(model, task.held_out),
        solo_wall_s=solo[1],
        wall_s=wall,
        solo_train_s=solo[2],
        train_s=recorded["train_s"],
        batch_share=recorded["shares"],
        syncs=recorded["syncs"],
        anchor=recorded["anchor"],
        trivial_accuracy=task.trivial_accuracy,
        files={k: _display_path(v) for k, v in files.items()},
        lockstep_accuracy=float(lock["metric"]),
        lockstep_wall_s=float(lock["total_s"]),
        lockstep_train_s=float(lock["train_s"]),
        lockstep_syncs=int(lock["syncs"]),
        predicted=predicted,
        replayed_s=recorded["replayed_s"],
    )
    say()
    say(format_summary(options, result))
    return result


def predict(options: DemoOptions, dataset_len: int, solo_train_s: float) -> Prediction:
    """``flodl sim``'s prediction for the rig: the solo run's ms per batch on every rank, times
    its slowdown; lock-step DDP from :func:`~flodl.sim.plan.lockstep_s`, the mode from the
    simulator (the production coordinator), the averaging cost at ``flodl sim``'s default."""
    from flodl.sim.plan import RigPlan, lockstep_s, lockstep_steps, plan_modes

    solo_batches = options.epochs * math.ceil(dataset_len / BATCH_SIZE)
    base_ms = 1000.0 * solo_train_s / max(1, solo_batches)
    speeds = tuple(options.slow.get(r, 1.0) for r in range(options.ranks))
    rig = RigPlan(
        speeds=speeds,
        base_ms=base_ms,
        dataset_len=dataset_len,
        batch_size=BATCH_SIZE,
        epochs=options.epochs,
        seed=options.seed,
    )
    trace = plan_modes(rig, [options.mode])[options.mode]
    return Prediction(
        ms_per_batch=rig.ms_per_batch,
        reduce_ms=rig.reduce_ms,
        lockstep_s=lockstep_s(rig),
        lockstep_syncs=lockstep_steps(rig),
        train_s=trace.wall_s,
        syncs=trace.cycles,
    )


def from_records(records: str) -> dict[str, Any]:
    """What the summary's flodl column shows, read from the run's record log: the training
    span (the last ``epoch`` record's ``t_s``), its syncs and anchor, each rank's share of the
    run's samples (the last ``contribution`` record: cumulative), and the replay's span
    (:func:`flodl.sim.replay.replay`; ``None`` if the log cannot be replayed).

    Raises:
        FlodlError: the log has no epoch record (the run did not finish one).
    """
    from flodl.errors import FlodlError
    from flodl.monitor.records import read_tree
    from flodl.sim.replay import compare, recorded_run, replay

    tree = read_tree(records)
    root = tree.get("root", [])
    epochs = [r["data"] for r in root if r.get("kind") == "epoch"]
    if not epochs:
        raise FlodlError(f"the run's record log {records} has no epoch record")
    contribution = [r["data"] for r in root if r.get("kind") == "contribution"]
    samples = [float(x["samples"]) for x in contribution[-1]["ranks"]] if contribution else []
    total = sum(samples)
    try:
        replayed: float | None = compare(run := recorded_run(tree), replay(run))["predicted_s"]
    except ConfigError:
        replayed = None
    return {
        "train_s": float(epochs[-1]["t_s"]),
        "syncs": int(epochs[-1]["syncs"]),
        "anchor": int(epochs[-1]["anchor"]),
        "shares": [x / total for x in samples] if total else [],
        "replayed_s": replayed,
    }


def _lockstep(options: DemoOptions, task: DemoTask, threads: int, root: Path) -> dict[str, Any]:
    """The lock-step baseline: real DDP on the same ranks, slowdowns, threads, epochs, batch
    size and seed as the flodl run."""
    import shutil
    import tempfile

    from flodl.demo.lockstep import run_lockstep

    scratch = Path(tempfile.mkdtemp(prefix="lockstep-", dir=root))
    try:
        return run_lockstep(
            world=options.ranks,
            samples=options.samples,
            seed=options.seed,
            epochs=options.epochs,
            batch_size=BATCH_SIZE,
            slow=options.slow,
            step_per_forward=task.step_per_forward,
            threads=threads,
            out_dir=scratch,
        )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}×" if b > 0 and math.isfinite(a / b) else "-"


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
            .device("cpu")  # on the CPU, like the baselines it is compared with
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
        .device("cpu")  # on the CPU, like the baselines it is compared with
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
    """The summary table, the speed-up over lock-step, and where the files are."""
    name = f"flodl {options.mode}"
    shares = " · ".join(f"r{i} {100 * s:.0f}%" for i, s in enumerate(r.batch_share)) or "-"
    equal = " · ".join(f"r{i} {100 / options.ranks:.0f}%" for i in range(options.ranks))
    p = r.predicted

    def acc(x: float) -> str:
        return f"{100 * x:.1f} % ({100 * (x - r.solo_accuracy):+.1f} pp vs solo)"

    rows = [
        ("", "solo", "lock-step DDP", name),
        ("accuracy", f"{100 * r.solo_accuracy:.1f} %", acc(r.lockstep_accuracy), acc(r.accuracy)),
        (
            "wall time",
            f"{r.solo_wall_s:.1f} s",
            f"{r.lockstep_wall_s:.1f} s",
            f"{r.wall_s:.1f} s ({_ratio(r.lockstep_wall_s, r.wall_s)} lock-step's speed)",
        ),
        (
            "training time",
            f"{r.solo_train_s:.1f} s",
            f"{r.lockstep_train_s:.1f} s",
            f"{r.train_s:.1f} s ({_ratio(r.lockstep_train_s, r.train_s)} lock-step's speed)",
        ),
        (
            "predicted",
            "-",
            "-" if p is None else f"{p.lockstep_s:.1f} s",
            "-" if p is None else f"{p.train_s:.1f} s ({p.syncs} syncs)",
        ),
        (
            "replayed",
            "-",
            "-",
            "-" if r.replayed_s is None else f"{r.replayed_s:.1f} s (from its records)",
        ),
        ("batch share", "r0 100%", equal, shares),
        ("syncs", "-", str(r.lockstep_syncs), str(r.syncs)),
        ("anchor", "-", "-", str(r.anchor)),
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    trivial = 100 * r.trivial_accuracy
    lines = [f"summary (held-out next-character accuracy; always-the-commonest {trivial:.1f} %)"]
    for a, b, c, d in rows:
        lines.append(
            f"  {a.ljust(widths[0])}  {b.rjust(widths[1])}  {c.ljust(widths[2])}  {d}".rstrip()
        )
    lines.append("")
    lines.append(
        f"  flodl trained {_ratio(r.lockstep_train_s, r.train_s)} as fast as lock-step DDP on "
        f"the same ranks: {r.syncs} averagings\n  instead of {r.lockstep_syncs} all-reduces, "
        f"and batches split by speed ({shares}) instead of equally"
    )
    lines.append("")
    lines.append(
        f"  records     {r.files['records']}/root.log  (flodl records tail {r.files['records']})"
    )
    lines.append(f"  dashboard   {r.files['dashboard']}")
    lines.append(
        f"  checkpoint  {r.files['checkpoint']}.meta.json (resume_from: {r.files['checkpoint']})"
    )
    lines.append(f"  replay      flodl sim --from-records {r.files['records']}")
    return "\n".join(lines)
