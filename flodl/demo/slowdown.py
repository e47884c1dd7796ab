"""A slowed rank: :class:`Slowdown` makes the code it wraps ``factor`` times slower, standing in
for a weaker GPU; :func:`slowed` applies it to one rank's ``train_step``, :func:`parse_slow`
reads ``--slow``.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from torch import Tensor, nn

from flodl.errors import ConfigError

__all__ = ["Slowdown", "slowed", "parse_slow", "RANK_ENV"]

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
      :func:`~flodl.demo.task.measure_step_per_forward` measures it). The sleep then happens
      before the backward instead of after the optimizer step, which changes nothing for the
      rank's speed.

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
