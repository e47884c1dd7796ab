"""A rank process's side of the launch contract (tier 4, and the children of tiers 2 and 3).

The process learns who it is from the environment (:mod:`flodl.launch.env`), trains until the
coordinator ends the run, and then either exits (a child of flodl's own launcher: its final
state goes to the launcher's run directory, so code after ``join()`` runs once, in the
launcher) or returns a handle (a rank started by torchrun, SLURM or by hand: ``is_primary``
says which rank does the one-off work).
"""

from __future__ import annotations

import os
import stat
import sys
import traceback
from pathlib import Path

import torch

from flodl.handle import TrainerHandle, training_stopped
from flodl.launch import crash_trace
from flodl.launch.env import (
    ENV_DEVICE,
    ENV_FINAL_DIR,
    ENV_RUN_ID,
    ENV_THREADS,
    coord_address,
    death_stem,
    final_state_path,
    is_launched,
    rank_env,
    read_secret,
    timeout_scale,
)
from flodl.rank.gpu import tier4_device
from flodl.rank.runtime import RankSpec, run_rank
from flodl.rank.snapshot import TrainedState
from flodl.rank.step import TrainJob
from flodl.timeouts import Timeouts

__all__ = ["rank_spec", "run_as_rank", "exit_launched_rank"]


def rank_spec(
    heartbeat_timeout: float, save_path: str | None = None, device: str = "auto"
) -> RankSpec:
    """This rank's addresses, secret, device and initial deadlines from the environment.

    The device is ``FLODL_DEVICE`` (a flodl launcher's placement), else ``device`` (the
    ``TrainerConfig``'s) as :func:`~flodl.rank.gpu.tier4_device` resolves it.

    ``heartbeat_timeout`` (scaled by ``FLODL_NET_TIMEOUT_SCALE``) bounds only the connection and
    the handshake; from the coordinator's ``accept`` on, the rank obeys the deadlines it sends.
    Death records go to :func:`~flodl.launch.env.death_stem` (``save_path``, when the job has
    one, is where the bundles are too).

    Raises:
        ConfigError: a variable is missing or malformed (the message names it).
    """
    found = rank_env()
    if found is None:
        raise AssertionError("rank_spec() called in a process that is not a rank")
    rank, world = found
    host, port = coord_address()
    run_id = os.environ.get(ENV_RUN_ID, "run")
    threads = os.environ.get(ENV_THREADS)
    return RankSpec(
        coord_host=host,
        coord_port=port,
        secret=read_secret(),
        run_id=run_id,
        rank=rank,
        world_size=world,
        device=os.environ.get(ENV_DEVICE) or tier4_device(device),
        timeouts=Timeouts.derive(heartbeat_timeout, timeout_scale()),
        stem=death_stem(run_id, save_path),
        threads=int(threads) if threads else None,
    )


def run_as_rank(job: TrainJob, heartbeat_timeout: float, device: str = "auto") -> TrainerHandle:
    """Train as this process's rank, in the calling thread; a launched child never returns
    (it exits).

    Returns:
        A finished handle (tier 4: a rank started by torchrun, SLURM or by hand): ``join()``
        returns the final state, or raises ``TrainingStopped`` after a ShutdownWithSave.

    Raises:
        CoordinatorLost: the coordinator went silent or the connection broke.
        FlodlError: whatever else ended the rank (a failing ``train_step`` raises as is).
    """
    spec = rank_spec(heartbeat_timeout, job.save_path, device)
    launched = is_launched()
    tracing = crash_trace.enable()  # a native crash prints the rank's stacks (docs/design.md §8)
    try:
        state = run_rank(spec, job)
    except BaseException:
        if launched:
            # the launcher's user reads this child's stderr: say which rank died and why
            print(f"flodl: rank {spec.rank} failed:", file=sys.stderr)  # noqa: T201
            traceback.print_exc()
            exit_launched_rank(None, spec.rank)
        raise
    finally:
        if not launched:  # (a launched child is flodl's process until it exits)
            crash_trace.disable(tracing)
    if launched:
        exit_launched_rank(state, spec.rank)
    handle = TrainerHandle(spec.world_size, is_primary=spec.rank == 0)
    if state.save_reason is not None:
        stopped = training_stopped(state.save_reason, state.save_detail, job.save_path, state)
        handle._finish(None, stopped)
    else:
        handle._finish(state, None)
    return handle


def exit_launched_rank(state: TrainedState | None, rank: int) -> None:
    """End a launcher-spawned rank process: its final state goes to the launcher (exit 0), or
    nothing does (exit 1). Code after ``join()``/``finish()`` runs once: in the launcher."""
    code = 1
    if state is not None:
        code = 0
        final_dir = os.environ.get(ENV_FINAL_DIR)
        if final_dir:
            try:
                _save_state(state, final_state_path(final_dir, rank))
            except OSError:
                traceback.print_exc()
                code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _save_state(state: TrainedState, path: Path) -> None:
    # a rank on another host than its launcher creates the directory (docs/design.md §2c), in
    # a shared /tmp: it must be a directory of this user's that no one else may enter
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    found = os.lstat(path.parent)
    if not stat.S_ISDIR(found.st_mode) or found.st_uid != os.getuid() or found.st_mode & 0o077:
        raise OSError(
            f"{path.parent} is not a private directory of this user (mode "
            f"{stat.S_IMODE(found.st_mode):o}, owner {found.st_uid}): the final state is not "
            "written there"
        )
    tmp = path.with_name(path.name + ".tmp")
    torch.save(
        {"params": state.params, "buffers": state.buffers, "save_reason": state.save_reason}, tmp
    )
    os.replace(tmp, path)
