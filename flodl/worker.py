"""The cooperative tier: a :class:`Worker` whose training loop the user owns.

``Trainer.builder(...).into_worker()`` returns a Worker; the user writes::

    worker = Trainer.builder(build_model, make_optim, train_step).dataset(ds)...into_worker()
    for batch in worker.batches():
        loss = my_loss(worker.model, batch)   # forward + loss, the user's code
        worker.step(loss)                    # backward, clipping, optimizer step, reporting
    state = worker.finish()

while the coordinator keeps the cadence, dispatch, averaging, roles and checkpoints: between
two batches :meth:`Worker.batches` obeys it exactly as the framework's own loop does.

The role of the process decides what a Worker is, as for ``Trainer.run()``:

* **a rank** (``FLODL_RANK``, or torchrun's / SLURM's variables with ``FLODL_COORD``): the
  Worker comes back once the rank has joined the coordinator, and its loop (not
  ``into_worker()``) trains this rank's share; :meth:`Worker.finish`
  sends the final state and — in a child spawned by flodl's launcher — exits the process (code
  after ``finish()`` runs once, in the launcher);
* **the launcher** (a cluster or ``local_ranks`` configured): it starts the coordinator and the
  rank processes (each re-running the script) and its own :meth:`~Worker.batches` yields nothing
  but waits for the run; :meth:`~Worker.finish` returns the final consensus;
* **one device**: the loop trains in process, with callbacks and checkpoints.

A rank Worker that is dropped, or whose process ends, without :meth:`~Worker.finish` writes a
death record (``<stem>.rank<N>.death.json``) and exits the process with status 1, so its peers
learn of it at once instead of waiting for a heartbeat timeout.
"""

from __future__ import annotations

import logging
import os
import sys
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Self

import torch

from flodl.errors import FlodlError, RunStopped
from flodl.handle import TrainerHandle, training_stopped
from flodl.rank.runtime import RankLoop, RankSpec
from flodl.rank.snapshot import TrainedState, write_death_record
from flodl.rank.step import TrainJob, apply_loss
from flodl.wire.frames import Intent

if TYPE_CHECKING:
    from flodl.local import LocalRun

__all__ = ["Worker"]

logger = logging.getLogger(__name__)

DROPPED_EXIT_CODE = 1


def _dropped(loop: RankLoop, spec: RankSpec) -> None:
    """A rank Worker went away without finish(): record why, stop peers waiting, exit 1."""
    if spec.stem is not None:
        exc = getattr(sys, "last_value", None)  # an uncaught error ended the user's loop
        why = "worker dropped without finish()"
        if exc is not None:
            why = f"{why}: {type(exc).__name__}: {exc}"
        write_death_record(spec.stem, spec.rank, spec.world_size, why)
    try:
        loop.close()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(DROPPED_EXIT_CODE)


class Worker:
    """A training loop owned by the user, paced by the coordinator. Build it with
    ``Trainer.builder(...).into_worker()``; see the module docstring."""

    def __init__(
        self,
        *,
        loop: RankLoop | None = None,
        local: LocalRun | None = None,
        handle: TrainerHandle | None = None,
        launched: bool = False,
        final_path: str | None = None,
    ) -> None:
        self._loop = loop
        self._local = local
        self._handle = handle
        self._launched = launched
        self._final_path = final_path
        self._state: TrainedState | None = None
        self._scalars: dict[str, list[float]] = {}
        self._pending = False
        self._finished = False
        self._started = False
        self._evals_seen: tuple[int, float] | None = None
        self._finalizer: weakref.finalize[Any, Worker] | None = None
        if loop is not None:
            accept = loop.start()
            self._finalizer = weakref.finalize(self, _dropped, loop, loop.spec)
            self._finalizer.atexit = True
            loop.begin(accept)

    # ------------------------------------------------------------------ what it is
    @property
    def rank(self) -> int | None:
        """This process's global rank; ``None`` in the launcher, 0 on one device."""
        if self._loop is not None:
            return self._loop.spec.rank
        return 0 if self._local is not None else None

    @property
    def world_size(self) -> int:
        if self._loop is not None:
            return self._loop.spec.world_size
        if self._handle is not None:
            return self._handle.world_size
        return 1

    @property
    def is_launcher(self) -> bool:
        """True in the process that launched the ranks (its loop trains nothing)."""
        return self._handle is not None

    @property
    def model(self) -> torch.nn.Module:
        """The model this process trains.

        Raises:
            FlodlError: in the launcher, which holds no model (use :meth:`finish`'s state).
        """
        if self._loop is not None:
            return self._loop.model
        if self._local is not None:
            return self._local.model
        raise FlodlError("the launcher process holds no model: use the state finish() returns")

    @property
    def device(self) -> torch.device:
        if self._loop is not None:
            return self._loop.device
        if self._local is not None:
            return self._local.device
        return torch.device("cpu")

    # ------------------------------------------------------------------ the loop
    def batches(self) -> Iterator[list[torch.Tensor]]:
        """Every batch this process should train, on its device, gradients zeroed and the LR
        set; call :meth:`step` once per batch. Ends when the coordinator ends the run."""
        if self._started:
            raise FlodlError("batches() can be iterated once per run")
        self._started = True
        if self._handle is not None:
            self._handle.join()  # the launcher: wait for the ranks (errors surface here)
            return
        if self._local is not None:
            for batch in self._local.batches():
                self._pending = True
                yield batch
                self._pending = False
            return
        loop = self._require_loop()
        try:
            for batch in loop.batches():
                loop.model.train()
                loop.optim.zero_grad(set_to_none=True)
                self._pending = True
                yield batch
                if self._pending:
                    raise FlodlError("call worker.step(loss) once for every batch")
        except RunStopped as stop:
            self._state = loop._finish(stop.save_reason, stop.detail)

    def step(self, loss: torch.Tensor) -> float:
        """Backward, ``max_grad_norm`` clipping and the optimizer step for the current batch;
        reports it to the coordinator. Returns the loss value.

        Raises:
            FlodlError: no batch is pending, or the loss is not a finite scalar tensor.
        """
        if not self._pending:
            raise FlodlError("step() needs a batch from batches() first (one step per batch)")
        if self._local is not None:
            value = self._local.step(loss)
            self._pending = False
            return value
        loop = self._require_loop()
        job: TrainJob = loop.job
        value = apply_loss(job, loop.model, loop.optim, loss, loop.step + 1)
        scalars, self._scalars = self._scalars, {}
        loop.after_step(value, scalars)
        self._pending = False
        return value

    def record_scalar(self, name: str, value: float) -> None:
        """Add ``value`` to scalar ``name`` of the current step (rolled up into
        ``EpochMetrics.scalars``)."""
        v = float(value)
        if self._local is not None:
            slot = self._local._sums.scalars.setdefault(name, [0.0, 0.0])
        else:
            slot = self._scalars.setdefault(name, [0.0, 0.0])
        slot[0] += v
        slot[1] += 1

    # ------------------------------------------------------------------ requests
    def request_eval(self) -> None:
        """Ask for an eval at the next epoch boundary (on the eval role rank)."""
        self._intent("eval_now")

    def request_checkpoint(self) -> None:
        """Ask for a checkpoint (``checkpoint_fn`` and, with ``save_path``, a bundle) at the
        next epoch boundary."""
        self._intent("checkpoint_now")

    def _intent(self, intent: str) -> None:
        if self._local is not None:
            self._local.intents.add(intent)
        elif self._loop is not None:
            self._loop._send(Intent(rank=self._loop.spec.rank, intent=intent))

    def poll_eval(self) -> tuple[int, float] | None:
        """The newest eval result ``(epoch, metric)`` not returned before, else ``None``."""
        latest: tuple[int, float] | None = None
        if self._loop is not None:
            latest = self._loop.last_eval
        elif self._local is not None and self._local.evals:
            latest = self._local.evals[-1]
        if latest is None or latest == self._evals_seen:
            return None
        self._evals_seen = latest
        return latest

    # ------------------------------------------------------------------ the end
    def finish(self) -> TrainedState:
        """End this process's part of the run and return the final state.

        In a rank spawned by flodl's launcher this does not return: the state goes to the
        launcher and the process exits 0. A rank that finishes before the coordinator ended
        the run leaves it (its unfinished work goes to the others) and is counted as a death.

        Raises:
            TrainingStopped: the coordinator stopped the run before its end (a
                ShutdownWithSave), as :meth:`TrainerHandle.join` does.
        """
        if self._finished:
            raise FlodlError("finish() was already called")
        self._finished = True
        if self._handle is not None:
            return self._handle.join()
        if self._local is not None:
            if not self._local.done:
                logger.warning("finish() before the run's last batch: the run ends early")
            return self._local.result()
        loop = self._require_loop()
        if self._finalizer is not None:
            self._finalizer.detach()
        state = self._state
        try:
            if state is None:
                logger.warning(
                    "rank %d: finish() before the coordinator ended the run: leaving it",
                    loop.spec.rank,
                )
                state = TrainedState.of(loop.model)
        finally:
            loop.close()
        if self._launched:
            from flodl.launch.child import exit_launched_rank

            exit_launched_rank(state if self._state is not None else None, loop.spec.rank)
        if state.save_reason is not None:
            job = loop.job
            raise training_stopped(state.save_reason, state.save_detail, job.save_path, state)
        return state

    def _require_loop(self) -> RankLoop:
        if self._loop is None:
            raise FlodlError("this Worker has no rank loop")
        return self._loop

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *rest: object) -> None:
        if not self._finished and exc_type is None:
            self.finish()
