"""The demo task: a character-level language model over the Python standard library's own
source (the corpus, its encoding, :class:`CharMLP` and :func:`demo_task`).
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
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
    "CharMLP",
    "held_out_loss",
    "STEP_PER_FORWARD",
    "measure_step_per_forward",
]

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


def _sum_over_held_out(
    model: nn.Module, held_out: tuple[Tensor, Tensor], per_chunk: Callable[[Tensor, Tensor], float]
) -> float:
    """``per_chunk(logits, targets)`` summed over ``held_out`` in chunks of 4096 windows, in eval
    mode and without autograd, divided by the window count."""
    x, y = held_out
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    total = 0.0
    with torch.no_grad():
        for start in range(0, len(y), 4096):
            logits = model(x[start : start + 4096].to(device)).cpu()
            total += per_chunk(logits, y[start : start + 4096])
    model.train(was_training)
    return total / max(1, len(y))


def held_out_loss(model: nn.Module, held_out: tuple[Tensor, Tensor]) -> float:
    """Mean next-character cross entropy of ``model`` over ``held_out`` (nats per character)."""
    return _sum_over_held_out(
        model, held_out, lambda logits, y: float(F.cross_entropy(logits, y, reduction="sum"))
    )


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
        loss_fn: ``loss_fn(model, held_out) -> loss`` (mean cross entropy, nats per character;
            :func:`held_out_loss`).
        vocab_size: number of classes (:data:`VOCAB_SIZE`).
        context: characters of context per sample.
        description: one line saying what the task is and where its bytes come from.
        step_per_forward: a full training step (forward, backward, optimizer step) costs about
            this many forwards on this model (:data:`STEP_PER_FORWARD`, measured on the
            development machine; :func:`measure_step_per_forward` measures it here); pass it
            to :func:`~flodl.demo.slowdown.slowed` / :class:`~flodl.demo.slowdown.Slowdown`.
        trivial_accuracy: held-out accuracy of always predicting the most frequent training
            character (the floor a model must beat).
        parameters: the model's parameter count.
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
    loss_fn: Callable[[nn.Module, tuple[Tensor, Tensor]], float] = held_out_loss
    parameters: int = 0


def _model_factory(context: int, seed: int, embed: int, hidden: int) -> Callable[[Any], nn.Module]:
    def make(device: Any = "cpu") -> nn.Module:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = CharMLP(VOCAB_SIZE, context, embed=embed, hidden=hidden)
        return model.to(device)

    return make


def _optim_factory(params: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=3e-3)


def _train_step(model: nn.Module, batch: Sequence[Tensor]) -> Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


def _eval_fn(model: nn.Module, held_out: tuple[Tensor, Tensor]) -> float:
    return _sum_over_held_out(
        model, held_out, lambda logits, y: float((logits.argmax(1) == y).sum())
    )


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
    embed: int = 16,
    hidden: int = 256,
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

    The model is a :class:`CharMLP` of ``embed`` dimensions per context character and two hidden
    layers of ``hidden`` units: the defaults make a 0.1 M-parameter model whose step takes about
    a millisecond on one core; ``context=32, embed=32, hidden=1024`` makes a 2.2 M-parameter one
    of about 25 ms (the realistic workload of ``benchmarks/bench_hetero.py``).

    Raises:
        ConfigError: a size is out of range or the corpus is too small for it.
    """
    sizes = (
        ("samples", samples),
        ("context", context),
        ("held_out", held_out),
        ("embed", embed),
        ("hidden", hidden),
    )
    for name, value in sizes:
        if value < 1:
            raise ConfigError(f"demo_task: {name} must be >= 1, got {value}")
    ids = encode(read_corpus(corpus_bytes))
    x, y = _windows(ids, samples, context, held_out=False)
    hx, hy = _windows(ids, held_out, context, held_out=True)
    counts = torch.bincount(y, minlength=VOCAB_SIZE)
    trivial = float(hy.eq(int(counts.argmax())).float().mean())
    factory = _model_factory(context, seed, embed, hidden)
    n_params = sum(p.numel() for p in factory("cpu").parameters())
    return DemoTask(
        train=TensorBatchDataset(x, y),
        held_out=(hx, hy),
        model_factory=factory,
        optim_factory=_optim_factory,
        train_step=_train_step,
        eval_fn=_eval_fn,
        vocab_size=VOCAB_SIZE,
        context=context,
        description=(
            f"next-character prediction over the first {len(ids):,} bytes of the Python "
            f"{sys.version_info.major}.{sys.version_info.minor} standard library's source "
            f"({samples:,} windows of {context} characters; {held_out:,} held out); "
            f"a {n_params / 1e6:.2f} M-parameter CharMLP (embed {embed}, hidden {hidden})"
        ),
        trivial_accuracy=trivial,
        step_per_forward=STEP_PER_FORWARD,
        parameters=n_params,
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
