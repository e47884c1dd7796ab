"""``flodl demo``: a real model on a real dataset that needs no download.

The task (:func:`demo_task`) is a character-level language model over the Python standard
library's own source text: given ``context`` characters, predict the next one. It is small
enough that an epoch takes seconds on one CPU thread, and learns enough in a few epochs
(next-character accuracy well above the most-frequent-character baseline) that a distributed
run's accuracy can be compared with a solo run's.

:class:`Slowdown` (and :func:`slowed` for a ``train_step``) makes one rank ``factor`` times
slower than the hardware it runs on, standing in for a weaker GPU; the benchmarks use the same
helper for every system they compare.

:func:`run_demo` is the ``flodl demo`` command: a solo baseline in process, then the same task
with N local ranks in one of the five modes, then a summary table.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from flodl.data import TensorBatchDataset
from flodl.errors import ConfigError

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

# --------------------------------------------------------------------------------------------
# The task
# --------------------------------------------------------------------------------------------

_OTHER = 0
_NEWLINE = 1
_FIRST_PRINTABLE = 32  # ' '
_LAST_PRINTABLE = 126  # '~'
VOCAB_SIZE = 2 + (_LAST_PRINTABLE - _FIRST_PRINTABLE + 1)
"""97 classes: 0 = any other byte (tabs, non-ASCII, control), 1 = newline, 2..96 = the
printable ASCII characters ``' '`` to ``'~'`` in order."""

_CODE = torch.zeros(256, dtype=torch.long)
_CODE[ord("\n")] = _NEWLINE
_CODE[_FIRST_PRINTABLE : _LAST_PRINTABLE + 1] = torch.arange(2, VOCAB_SIZE)


def corpus_files() -> list[Path]:
    """The corpus's files: the standard library's public top-level modules.

    Every ``*.py`` directly in ``os.path.dirname(os.__file__)`` whose name does not start with
    ``_`` (private and build-specific modules such as ``_sysconfigdata_*`` are left out), sorted
    by name (``abc.py``, ``aifc.py``, ``antigravity.py``, ``argparse.py``, ``ast.py``, …).
    """
    lib = Path(os.path.dirname(os.__file__))
    return sorted(p for p in lib.glob("*.py") if not p.name.startswith("_"))


def read_corpus(n_bytes: int) -> bytes:
    """The first ``n_bytes`` of :func:`corpus_files`, concatenated as raw bytes.

    Raises:
        ConfigError: the standard library has fewer bytes than that.
    """
    chunks: list[bytes] = []
    have = 0
    for path in corpus_files():
        if have >= n_bytes:
            break
        data = path.read_bytes()
        chunks.append(data)
        have += len(data)
    if have < n_bytes:
        raise ConfigError(f"the standard library has {have} bytes of source, {n_bytes} asked")
    return b"".join(chunks)[:n_bytes]


def encode(text: bytes) -> Tensor:
    """Bytes → class ids (``int64``) in the fixed :data:`VOCAB_SIZE` map."""
    raw = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
    return _CODE[raw]


class CharMLP(nn.Module):
    """Embedding of each context character, flattened, then a two-layer MLP → next char."""

    def __init__(self, vocab: int, context: int, embed: int = 16, hidden: int = 256) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, embed)
        self.mlp = nn.Sequential(
            nn.Linear(context * embed, hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Linear(hidden, vocab),
        )

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.mlp(self.embed(x).flatten(1))
        return out


@dataclass(frozen=True)
class DemoTask:
    """Everything a training system needs to train the demo model.

    Attributes:
        train: the training windows: ``(x, y)``, ``x`` ``int64`` of shape ``(samples,
            context)``, ``y`` ``int64`` of shape ``(samples,)``.
        held_out: windows from a disjoint region of the corpus, same layout, for ``eval_fn``.
        model_factory: ``model_factory(device) -> nn.Module`` (fresh, seeded weights).
        optim_factory: ``optim_factory(params) -> Optimizer``.
        train_step: ``train_step(model, batch) -> loss`` (forward + cross entropy).
        eval_fn: ``eval_fn(model, held_out) -> accuracy`` (next-character accuracy, 0..1).
        vocab_size: number of classes (:data:`VOCAB_SIZE`).
        context: characters of context per sample.
        description: one line saying what the task is and where its bytes come from.
        step_per_forward: a full training step (forward, backward, optimizer step) costs about
            this many forwards on this model (:data:`STEP_PER_FORWARD`, measured on the
            development machine; :func:`measure_step_per_forward` measures it here); pass it
            to :func:`slowed` / :class:`Slowdown`.
        trivial_accuracy: held-out accuracy of always predicting the most frequent training
            character (the floor a model must beat).
    """

    train: TensorBatchDataset
    held_out: tuple[Tensor, Tensor]
    model_factory: Callable[[Any], nn.Module]
    optim_factory: Callable[[Any], torch.optim.Optimizer]
    train_step: Callable[[nn.Module, Sequence[Tensor]], Tensor]
    eval_fn: Callable[[nn.Module, tuple[Tensor, Tensor]], float]
    vocab_size: int
    context: int
    description: str
    step_per_forward: float = 3.0
    trivial_accuracy: float = 0.0


def _model_factory(context: int, seed: int) -> Callable[[Any], nn.Module]:
    def make(device: Any = "cpu") -> nn.Module:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = CharMLP(VOCAB_SIZE, context)
        return model.to(device)

    return make


def _optim_factory(params: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=3e-3)


def _train_step(model: nn.Module, batch: Sequence[Tensor]) -> Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


def _eval_fn(model: nn.Module, held_out: tuple[Tensor, Tensor]) -> float:
    x, y = held_out
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    correct = 0
    with torch.no_grad():
        for start in range(0, len(y), 4096):
            logits = model(x[start : start + 4096].to(device))
            correct += int((logits.argmax(1).cpu() == y[start : start + 4096]).sum())
    model.train(was_training)
    return correct / max(1, len(y))


_BLOCK = 8192
"""The corpus is cut into blocks of this many bytes; every 5th block is held out."""


def _windows(ids: Tensor, count: int, context: int, held_out: bool) -> tuple[Tensor, Tensor]:
    """``count`` (context → next) windows at evenly spaced offsets among the windows that lie
    wholly inside training blocks (``held_out=False``) or held-out blocks (every 5th)."""
    starts = torch.arange(len(ids) - context)
    block = torch.div(starts, _BLOCK, rounding_mode="floor")
    same = block == torch.div(starts + context, _BLOCK, rounding_mode="floor")
    chosen = (block % 5 == 4) if held_out else (block % 5 != 4)
    pool = starts[same & chosen]
    if len(pool) < count:
        region = "held-out" if held_out else "training"
        raise ConfigError(f"the corpus holds {len(pool)} {region} windows, {count} asked")
    pick = pool[torch.div(torch.arange(count) * len(pool), count, rounding_mode="floor")]
    x = ids[pick[:, None] + torch.arange(context)[None, :]]
    y = ids[pick + context]
    return x, y


STEP_PER_FORWARD = 3.8
"""A training step of the demo model costs about 3.8 forwards: :func:`measure_step_per_forward`
gave 3.73–3.83 (batch 128, one thread, Python 3.11, torch 2.13 CPU; a forward with autograd
against forward + backward + Adam step)."""


def demo_task(
    *,
    samples: int = 128_000,
    context: int = 16,
    held_out: int = 8_192,
    corpus_bytes: int = 1 << 20,
    seed: int = 0,
) -> DemoTask:
    """The demo task: next-character prediction over the standard library's source.

    The corpus is the first ``corpus_bytes`` bytes (default 1 MiB) of the concatenated
    :func:`corpus_files` (public top-level stdlib modules, sorted by name), read as bytes and
    mapped to :data:`VOCAB_SIZE` classes by :func:`encode`. Its first 80 % is the training
    region: ``samples`` windows of ``context`` characters → the next one, at evenly spaced
    offsets (consecutive windows overlap when ``samples`` exceeds the region's length divided by
    ``context``). The last 20 % is the held-out region: ``held_out`` windows, evenly spaced.

    The corpus differs between Python versions (and patch releases), so accuracies are
    comparable only on one interpreter. Everything is deterministic for a given interpreter and
    ``seed`` (the model's initial weights).

    Raises:
        ConfigError: a size is out of range or the corpus is too small for it.
    """
    for name, value in (("samples", samples), ("context", context), ("held_out", held_out)):
        if value < 1:
            raise ConfigError(f"demo_task: {name} must be >= 1, got {value}")
    ids = encode(read_corpus(corpus_bytes))
    x, y = _windows(ids, samples, context, held_out=False)
    hx, hy = _windows(ids, held_out, context, held_out=True)
    counts = torch.bincount(y, minlength=VOCAB_SIZE)
    trivial = float(hy.eq(int(counts.argmax())).float().mean())
    return DemoTask(
        train=TensorBatchDataset(x, y),
        held_out=(hx, hy),
        model_factory=_model_factory(context, seed),
        optim_factory=_optim_factory,
        train_step=_train_step,
        eval_fn=_eval_fn,
        vocab_size=VOCAB_SIZE,
        context=context,
        description=(
            f"next-character prediction over the first {len(ids):,} bytes of the Python "
            f"{sys.version_info.major}.{sys.version_info.minor} standard library's source "
            f"({samples:,} windows of {context} characters; {held_out:,} held out)"
        ),
        trivial_accuracy=trivial,
        step_per_forward=STEP_PER_FORWARD,
    )


def measure_step_per_forward(task: DemoTask, batch_size: int = 128, steps: int = 30) -> float:
    """How many forwards one full training step (forward, backward, optimizer step) costs on
    this machine: best-of timing of both over ``steps`` batches of a fresh model."""
    model = task.model_factory("cpu")
    optim = task.optim_factory(model.parameters())
    batch = task.train.get_batch(list(range(batch_size)))
    fwd = full = math.inf
    for _ in range(steps):
        t0 = time.perf_counter()
        task.train_step(model, batch)  # with autograd, as inside a real step
        t1 = time.perf_counter()
        optim.zero_grad(set_to_none=True)
        task.train_step(model, batch).backward()  # type: ignore[no-untyped-call]
        optim.step()
        t2 = time.perf_counter()
        fwd, full = min(fwd, t1 - t0), min(full, t2 - t1)
    return full / fwd if fwd > 0 else 1.0


# --------------------------------------------------------------------------------------------
# A slowed rank
# --------------------------------------------------------------------------------------------

RANK_ENV = "FLODL_RANK"


class Slowdown:
    """Makes the code it wraps ``factor`` times slower by sleeping ``(factor − 1) ×`` the
    measured compute after it. Sleeping frees the CPU, so a slowed rank behaves like a slower
    device, not like a busier machine.

    Two ways to measure a step:

    * :meth:`step`: ``with slowdown.step(): forward; backward; optimizer.step()`` times the
      whole block and sleeps ``(factor − 1) ×`` that after it. Exact; for loops you own.
    * :meth:`forward` (what :func:`slowed` uses inside a flodl ``train_step``, which only runs
      the forward and returns the loss): times the forward and sleeps ``(factor − 1) ×
      step_per_forward ×`` that, i.e. it estimates the backward and optimizer step from the
      forward (``step_per_forward`` ≈ 3 for an MLP: the backward costs about two forwards;
      :func:`measure_step_per_forward` measures it). The sleep then happens before the
      backward instead of after the optimizer step, which changes nothing for the rank's speed.

    Framework work outside the measured block (data fetch, messages) is not slowed, as a weaker
    GPU would not slow it either. A sleep that ends late (on a busy machine the woken process
    waits for a core) is paid back by the next ones, so over a run the time slept is
    ``(factor − 1) ×`` the measured compute. Call from one thread (the training loop's).

    Args:
        factor: how many times slower (≥ 1; 1 disables it).
        step_per_forward: full-step cost in forwards, for :meth:`forward`.
        active: ``False`` makes every method a pass-through (a rank that is not slowed).
    """

    def __init__(
        self, factor: float, *, step_per_forward: float = 3.0, active: bool = True
    ) -> None:
        if not (factor >= 1.0 and math.isfinite(factor)):
            raise ConfigError(f"a slowdown factor must be a finite number >= 1, got {factor}")
        if not (step_per_forward >= 1.0 and math.isfinite(step_per_forward)):
            raise ConfigError(f"step_per_forward must be >= 1, got {step_per_forward}")
        self.factor = float(factor)
        self.step_per_forward = float(step_per_forward)
        self.active = active and factor > 1.0
        self.compute_s = 0.0
        """Measured (estimated, for :meth:`forward`) compute so far, seconds."""
        self.slept_s = 0.0
        """Total time slept so far, seconds."""
        self._owed_s = 0.0

    @classmethod
    def for_rank(
        cls,
        slow: Mapping[int, float],
        rank: int | None = None,
        *,
        rank_env: str = RANK_ENV,
        step_per_forward: float = 3.0,
    ) -> Slowdown:
        """The slowdown of ``rank`` (default: this process's ``rank_env`` variable; a process
        without it is not slowed) under ``slow`` (rank → factor)."""
        if rank is None:
            raw = os.environ.get(rank_env, "")
            rank = int(raw) if raw.strip().lstrip("-").isdigit() else None
        factor = slow.get(rank, 1.0) if rank is not None else 1.0
        return cls(factor, step_per_forward=step_per_forward)

    def pause(self, compute_s: float) -> float:
        """Sleep ``(factor − 1) × compute_s`` (if active); returns the seconds slept.

        A sleep that ends late (the process waits for a busy core after waking) is paid back
        by the next sleeps, so the total slept stays ``(factor − 1) ×`` the total compute.
        """
        if not self.active or compute_s <= 0:
            return 0.0
        self.compute_s += compute_s
        self._owed_s += (self.factor - 1.0) * compute_s
        if self._owed_s <= 0:
            return 0.0
        t0 = time.perf_counter()
        time.sleep(self._owed_s)  # noqa: TID251 - the point of a stand-in for a slower device
        slept = time.perf_counter() - t0
        self._owed_s -= slept
        self.slept_s += slept
        return slept

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Time the block (a whole training step) and sleep ``(factor − 1) ×`` that after."""
        if not self.active:
            yield
            return
        t0 = time.perf_counter()
        yield
        self.pause(time.perf_counter() - t0)

    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        """Time the block (a forward) and sleep ``(factor − 1) × step_per_forward ×`` that."""
        if not self.active:
            yield
            return
        t0 = time.perf_counter()
        yield
        self.pause((time.perf_counter() - t0) * self.step_per_forward)

    def wrap(
        self, train_step: Callable[[nn.Module, Any], Tensor]
    ) -> Callable[[nn.Module, Any], Tensor]:
        """``train_step`` slowed through :meth:`forward`."""

        def slowed_step(model: nn.Module, batch: Any) -> Tensor:
            with self.forward():
                return train_step(model, batch)

        return slowed_step


class _RankSlowedStep:
    """A ``train_step`` that finds its rank's factor on its first call (in the rank process)."""

    def __init__(
        self,
        train_step: Callable[[nn.Module, Any], Tensor],
        slow: Mapping[int, float],
        rank_env: str,
        step_per_forward: float,
    ) -> None:
        self.train_step = train_step
        self.slow = dict(slow)
        self.rank_env = rank_env
        self.step_per_forward = step_per_forward
        self.slowdown: Slowdown | None = None

    def __call__(self, model: nn.Module, batch: Any) -> Tensor:
        if self.slowdown is None:
            self.slowdown = Slowdown.for_rank(
                self.slow, rank_env=self.rank_env, step_per_forward=self.step_per_forward
            )
        with self.slowdown.forward():
            return self.train_step(model, batch)


def slowed(
    train_step: Callable[[nn.Module, Any], Tensor],
    factor: float | Mapping[int, float],
    *,
    slow_rank: int = 1,
    rank_env: str = RANK_ENV,
    step_per_forward: float = 3.0,
) -> Callable[[nn.Module, Any], Tensor]:
    """``train_step``, slowed ``factor``× on rank ``slow_rank`` only (:meth:`Slowdown.forward`).

    The rank is read from the ``rank_env`` environment variable at the first call, i.e. in the
    rank process; a process without it (a solo run) is not slowed. ``factor`` may instead map
    ranks to factors (``{1: 3.0, 2: 2.0}``), and ``slow_rank`` is then ignored.
    """
    slow = dict(factor) if isinstance(factor, Mapping) else {slow_rank: float(factor)}
    for rank, f in slow.items():
        Slowdown(f)  # validate now, in the caller, not in a rank
        if rank < 0:
            raise ConfigError(f"slowed: rank {rank} is negative")
    return _RankSlowedStep(train_step, slow, rank_env, step_per_forward)


def parse_slow(specs: Sequence[str], ranks: int) -> dict[int, float]:
    """``["1:3", "2:1.5,3:2"]`` → ``{1: 3.0, 2: 1.5, 3: 2.0}`` for a run of ``ranks`` ranks.

    Raises:
        ConfigError: a malformed item, a rank out of range, a repeated rank or a factor < 1.
    """
    out: dict[int, float] = {}
    for spec in specs:
        for item in spec.split(","):
            item = item.strip()
            if not item:
                continue
            rank_s, sep, factor_s = item.partition(":")
            try:
                if not sep:
                    raise ValueError
                rank, factor = int(rank_s), float(factor_s)
            except ValueError:
                raise ConfigError(f"--slow {item!r}: expected RANK:FACTOR, e.g. 1:3") from None
            if not 0 <= rank < ranks:
                raise ConfigError(
                    f"--slow {item!r}: rank {rank} is out of range for --ranks {ranks} "
                    f"(ranks are 0..{ranks - 1})"
                )
            if rank in out:
                raise ConfigError(f"--slow {item!r}: rank {rank} is given twice")
            if not (factor >= 1.0 and math.isfinite(factor)):
                raise ConfigError(f"--slow {item!r}: the factor must be a finite number >= 1")
            out[rank] = factor
    return out


# --------------------------------------------------------------------------------------------
# The command
# --------------------------------------------------------------------------------------------

DEFAULT_EPOCHS = 3
BATCH_SIZE = 128
MAX_RANKS = 16


@dataclass(frozen=True)
class DemoOptions:
    """``flodl demo``'s options (validated by :meth:`check`).

    Attributes:
        mode: one of the five ElChe modes (``nccl_*`` run on Gloo on a CPU-only machine).
        ranks: local CPU ranks of the distributed run (2..16).
        slow: rank → slowdown factor (:func:`parse_slow`).
        epochs: epochs of both runs.
        out: output directory (records, dashboard, checkpoint).
        seed: model initialization and shuffle seed of both runs.
        samples: training windows (:func:`demo_task`).
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
    lines.append(f"  checkpoint  {r.files['checkpoint']}.fdl (+ .meta.json)")
    return "\n".join(lines)
