"""The launcher (tiers 2 and 3): the coordinator service on a thread, one child per rank, the
supervisor that reports every child's exit, and the final state (docs/design.md §2c).

The launcher re-executes the user's own command line once per rank (``sys.orig_argv``, so
``python -m pkg`` works) with the ``FLODL_*`` environment of :mod:`flodl.launch.env` and the run
secret in the environment (local) or on stdin (ssh), never on a command line. A watcher thread
per child reports its exit to the coordinator (the fast death path); an ``atexit`` hook,
SIGTERM and ``join()``'s KeyboardInterrupt path stop the children (SIGTERM, SIGKILL after
5 s), so no rank outlives its launcher. Every rank writes its final state to the run directory;
the launcher returns the lowest rank's.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import io
import logging
import os
import queue
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from flodl import checkpoint
from flodl.chaos import CHAOS_ENV, RECORD_DIR_ENV
from flodl.config import CoordConfig
from flodl.coord.effects import (
    Alert,
    BundleRequested,
    EpochDone,
    EvalDone,
    Record,
    RunOver,
    WriteMeta,
)
from flodl.errors import ConfigError, FlodlError
from flodl.handle import TrainerHandle, training_stopped
from flodl.launch import crash_trace
from flodl.launch.cluster import CLUSTER_ENV_VAR, Cluster, RankSlot
from flodl.launch.env import (
    ENV_COORD,
    ENV_DEVICE,
    ENV_FINAL_DIR,
    ENV_LAUNCHED,
    ENV_PREFIX_OUTPUT,
    ENV_RANK,
    ENV_RESTART,
    ENV_RUN_ID,
    ENV_SECRET,
    ENV_STEM,
    ENV_THREADS,
    ENV_WORLD,
    death_stem,
    final_state_path,
    local_host_names,
    respawn_limit,
    timeout_scale,
)
from flodl.launch.gpus import detect_gpus
from flodl.monitor.session import MonitorSession
from flodl.placement import placement_problem
from flodl.rank.snapshot import TrainedState
from flodl.rank.step import TrainJob, timed_callback
from flodl.service.bundles import BundleWriter, resume_from_bundle
from flodl.service.coordinator import CoordinatorService
from flodl.trainer_config import TrainerConfig, coord_config, monitor_session
from flodl.wire.frames import EpochMetrics

__all__ = ["launch"]

logger = logging.getLogger(__name__)

SERVICE_START_S = 60.0
"""How long the launcher waits for its coordinator thread to listen before giving up."""
STOP_GRACE_S = 5.0
"""How long a terminated child has to exit before it is killed."""


def launch(job: TrainJob, c: TrainerConfig, cluster: Cluster) -> TrainerHandle:
    """Start the run of ``job`` on ``cluster``; returns at once with its handle.

    ``devices: all`` is resolved first (each such host's GPUs, by ``nvidia-smi`` here or over
    ssh), then the placement is checked against the mode (:func:`placed`), all before any
    rank process starts.

    Raises:
        ConfigError: the configuration is invalid for this cluster (a collective mode on mixed
            devices or a shared GPU, a host with ``devices: all`` and no GPU, …).
        CheckpointError: ``resume_from`` names a missing, corrupt or foreign bundle.
        FlodlError: the coordinator failed to start.
    """
    return _Launcher(job, c, placed(c, cluster, local_host_names())).start()


def placed(c: TrainerConfig, cluster: Cluster, local_names: frozenset[str]) -> Cluster:
    """``cluster`` with every ``devices: all`` resolved, checked for ``c``'s mode and world.

    Raises:
        ConfigError: as :func:`launch` says.
    """
    if not cluster.is_resolved:
        counts: dict[str, int] = {}
        for index, worker in enumerate(cluster.workers):
            if worker.is_resolved:
                continue
            if worker.is_local(local_names):
                counts[worker.host] = len(detect_gpus())
            else:
                from flodl.launch.ssh import ssh_gpus

                counts[worker.host] = len(ssh_gpus(worker, cluster.worker_env(index)))
            logger.info(
                "workers[%d] %s: devices all = %d GPU(s)", index, worker.host, counts[worker.host]
            )
        cluster = cluster.resolve_all(counts)
    try:
        c.check_world(cluster.world_size)
    except ValueError as exc:
        raise ConfigError(f"invalid TrainerConfig for {cluster.world_size} ranks: {exc}") from None
    problem = placement_problem(c.elche.traits, cluster.placements(local_names))
    if problem is not None:
        raise ConfigError(problem)
    return cluster


@dataclass
class _HandleSink:
    """The coordinator's non-network effects, delivered in the launcher process."""

    handle: TrainerHandle
    metrics_fn: Callable[[EpochMetrics], None] | None
    bundles: BundleWriter
    eval_result_fn: Callable[[int, float], None] | None = None
    monitor: MonitorSession | None = None
    _epoch_extra: dict[str, Any] | None = None

    def write_meta(self, effect: WriteMeta) -> None:
        self.bundles.write_meta(effect)

    def bundle_requested(self, effect: BundleRequested) -> None:
        self.bundles.bundle_requested(effect)

    def record(self, effect: Record) -> None:
        if effect.kind == "epoch":  # merged into the epoch's records by epoch_done
            self._epoch_extra = dict(effect.data)
            return
        if self.monitor is not None:
            self.monitor.record(effect.path, effect.kind, effect.data)

    def alert(self, effect: Alert) -> None:
        if self.monitor is not None:
            self.monitor.alert(effect.cls, effect.path, effect.detail, effect.severity)
        else:
            print(f"flodl [{effect.cls}] {effect.path}: {effect.detail}", flush=True)  # noqa: T201

    def epoch_done(self, effect: EpochDone) -> None:
        extra, self._epoch_extra = self._epoch_extra or {}, None
        extra.pop("epoch", None)
        extra.pop("avg_loss", None)
        if self.monitor is not None:
            self.monitor.epoch(effect.metrics, extra)
        fn = self.metrics_fn
        if fn is not None:
            timed_callback(f"metrics_fn (epoch {effect.metrics.epoch})", lambda: fn(effect.metrics))
        self.handle._push(effect.metrics)

    def eval_done(self, effect: EvalDone) -> None:
        fn = self.eval_result_fn
        if fn is not None:
            timed_callback("eval_result_fn", lambda: fn(effect.epoch, effect.metric))


def _child_argv() -> list[str]:
    """Re-execute the user's own entry point (script or ``-m module``, same argv)."""
    orig = list(getattr(sys, "orig_argv", []))
    if len(orig) >= 2:
        return [sys.executable, *orig[1:]]
    return [sys.executable, *sys.argv]


def _record_hosts(cluster: Cluster) -> tuple[str, ...]:
    """Each rank's host name as a record-tree path segment (``[A-Za-z0-9._-]``, ≤ 64)."""
    names = []
    for slot in cluster.ranks():
        host = cluster.workers[slot.worker_index].host
        names.append(re.sub(r"[^A-Za-z0-9._-]", "_", host)[:64].strip(".") or "host")
    return tuple(names)


class _Launcher:
    """One launched run: the service thread, the children, their watchers and the finisher."""

    def __init__(self, job: TrainJob, c: TrainerConfig, cluster: Cluster) -> None:
        self.job, self.c, self.cluster = job, c, cluster
        self.respawn = respawn_limit(c.respawn)
        self.local_names = local_host_names()
        self.all_local = cluster.is_local(self.local_names)
        self.bind_host = "127.0.0.1" if self.all_local else cluster.controller.host
        self.bind_port = 0 if self.all_local else cluster.controller.port
        assert job.description is not None, "a Trainer job always has its description"
        self.coord_cfg: CoordConfig = coord_config(
            job.description,
            c,
            world_size=cluster.world_size,
            run_id=f"run-{secrets.token_hex(4)}",
            scale=timeout_scale(),
            hosts=_record_hosts(cluster),
        )
        resume, outer_state = (
            resume_from_bundle(job.resume_from, self.coord_cfg) if job.resume_from else (None, None)
        )
        self.secret = secrets.token_bytes(32)
        self.handle = TrainerHandle(cluster.world_size)
        self.bundles = BundleWriter(job.save_path)
        hosts = sorted(set(self.coord_cfg.hosts or ()))
        self.monitor = monitor_session(
            c,
            cluster.world_size,
            self.coord_cfg.hosts,
            run_info={"run_id": self.coord_cfg.run_id, "hosts": hosts},
        )
        if self.monitor is not None:
            self.handle.dashboard_url = self.monitor.url
        sink = _HandleSink(self.handle, c.metrics_fn, self.bundles, c.eval_result_fn, self.monitor)
        self.service = CoordinatorService(
            self.coord_cfg,
            self.secret,
            host=self.bind_host,
            port=self.bind_port,
            sink=sink,
            resume=resume,
            outer=c.outer_optimizer,
            outer_state=outer_state,
        )
        self.bundles.service = self.service
        self.run_dir = Path(tempfile.mkdtemp(prefix="flodl-"))
        self.remote_final_dir = f"/tmp/flodl-final-{self.coord_cfg.run_id}"
        """Where a rank on another host leaves its final state (the launcher fetches it over
        ssh when no rank of this host delivered one, then removes the directory)."""
        self.death_stem = death_stem(self.coord_cfg.run_id, job.save_path)
        self.started_unix = int(time.time())  # noqa: TID251 - the death records' clock
        self.procs: list[subprocess.Popen[bytes]] = []
        """Each rank's current process (a respawn replaces its entry)."""
        self._spawn_args: list[tuple[RankSlot, dict[str, str], dict[str, str], bool]] = []
        self._procs_lock = threading.Lock()
        self._stopping = False
        """Set by :meth:`kill_all`: no respawn may start after it (it would be orphaned)."""
        self._sigterm: tuple[Any, Any] | None = None
        """(our SIGTERM handler, the one it replaced) while installed."""
        self._restarts: dict[int, int] = {}
        """How many times each rank's process was respawned."""
        self.pumps: list[threading.Thread] = []
        self.watchers: list[threading.Thread] = []
        self.over_box: list[RunOver] = []
        self.loop_box: list[asyncio.AbstractEventLoop] = []
        self.serve_box: list[asyncio.Task[None]] = []
        """The service thread's main task (cancelled when :meth:`start` fails)."""
        self.stopped = threading.Event()

    # ------------------------------------------------------------------ start
    def start(self) -> TrainerHandle:
        # this process hosts the coordinator and the reduce server: a native crash in them
        # prints every thread's stack instead of vanishing (docs/design.md §8)
        self._crash_trace = crash_trace.enable()
        try:
            port = self._start_service()
            if not self.all_local:
                # printed as well as logged: it must be seen even where logging is not configured
                warning = (
                    f"coordinator listening on {self.bind_host}:{port} for ranks on other "
                    "hosts: traffic is authenticated (HMAC) but not encrypted; tunnel it across "
                    "untrusted networks"
                )
                logger.warning("%s", warning)
                print(f"flodl: warning: {warning}", file=sys.stderr, flush=True)  # noqa: T201
            atexit.register(self._at_exit)  # before the first child: none may outlive us
            self._stop_children_on_sigterm()
            self._spawn_ranks(port)
        except BaseException:
            self._abort_start()
            raise
        for rank in range(len(self.procs)):
            watcher = threading.Thread(
                target=self._watch, args=(rank,), name=f"flodl-watch-{rank}", daemon=True
            )
            watcher.start()
            self.watchers.append(watcher)
        finisher = threading.Thread(target=self._finish, name="flodl-finish", daemon=True)
        finisher.start()
        self.handle._joiner = lambda: self._join(finisher)
        return self.handle

    def _start_service(self) -> int:
        ready: queue.SimpleQueue[int | BaseException] = queue.SimpleQueue()
        service = self.service

        async def serve() -> None:
            self.loop_box.append(asyncio.get_running_loop())
            task = asyncio.current_task()
            assert task is not None
            self.serve_box.append(task)
            try:
                port = await service.start()
            except BaseException as exc:
                ready.put(exc)
                raise
            ready.put(port)
            try:
                self.over_box.append(await service.wait())
            finally:
                await service.close()

        def service_main() -> None:
            try:
                import uvloop

                uvloop.run(serve())
            except asyncio.CancelledError:
                logger.debug("coordinator service stopped: the launcher failed to start")
            except BaseException:
                logger.exception("coordinator service failed")
            finally:
                self.stopped.set()

        threading.Thread(target=service_main, name="flodl-coord", daemon=True).start()
        try:
            got = ready.get(timeout=SERVICE_START_S)
        except queue.Empty:
            raise FlodlError(
                f"the coordinator did not start listening within {SERVICE_START_S:g} s"
            ) from None
        if isinstance(got, BaseException):
            raise FlodlError(f"the coordinator failed to start: {got}") from got
        return got

    def _base_env(self, port: int) -> dict[str, str]:
        cfg = self.coord_cfg
        env = {
            ENV_COORD: f"{self.bind_host}:{port}",
            ENV_WORLD: str(cfg.world_size),
            ENV_RUN_ID: cfg.run_id,
            ENV_LAUNCHED: "1",
            ENV_FINAL_DIR: str(self.run_dir),
            ENV_STEM: self.death_stem,
        }
        if self.c.record_log is not None:  # rank-side records (chaos faults) go to the same tree
            env[RECORD_DIR_ENV] = self.c.record_log
        if self.c.chaos is not None:
            env[CHAOS_ENV] = self.c.chaos.to_env()
        return env

    def _spawn_ranks(self, port: int) -> None:
        cluster = self.cluster
        slots = cluster.ranks()
        per_worker = {
            i: sum(1 for s in slots if s.worker_index == i) for i in range(len(cluster.workers))
        }
        cores = os.cpu_count() or 1
        prefix = os.environ.get(ENV_PREFIX_OUTPUT) == "1"
        base = self._base_env(port)
        inherited = {k: v for k, v in os.environ.items() if k != CLUSTER_ENV_VAR}
        for slot in slots:
            threads = max(1, cores // per_worker[slot.worker_index]) if slot.device == "cpu" else 1
            env = {
                **cluster.worker_env(slot.worker_index),
                **base,
                ENV_RANK: str(slot.rank),
                ENV_DEVICE: slot.device,
                ENV_THREADS: str(threads),
            }
            if not self._is_local(slot):
                env[ENV_FINAL_DIR] = self.remote_final_dir
            self._spawn_args.append((slot, env, inherited, prefix))
            self.procs.append(self._start_rank(slot.rank))

    def _start_rank(self, rank: int, restart: int = 0) -> subprocess.Popen[bytes]:
        slot, env, inherited, prefix = self._spawn_args[rank]
        if restart:
            env = {**env, ENV_RESTART: str(restart)}
        proc = self._spawn(slot, env, inherited, piped=prefix)
        if prefix:
            for stream, out in ((proc.stdout, sys.stdout), (proc.stderr, sys.stderr)):
                pump = threading.Thread(
                    target=_pump, args=(stream, out, f"[rank {slot.rank}] "), daemon=True
                )
                pump.start()
                self.pumps.append(pump)
        return proc

    def _is_local(self, slot: RankSlot) -> bool:
        return self.cluster.workers[slot.worker_index].is_local(self.local_names)

    def _spawn(
        self, slot: RankSlot, env: dict[str, str], inherited: dict[str, str], *, piped: bool
    ) -> subprocess.Popen[bytes]:
        worker = self.cluster.workers[slot.worker_index]
        pipe = subprocess.PIPE if piped else None
        try:
            if self._is_local(slot):
                full = {**inherited, **env, ENV_SECRET: self.secret.hex()}
                return subprocess.Popen(_child_argv(), env=full, stdout=pipe, stderr=pipe)
            from flodl.launch.ssh import spawn_ssh

            return spawn_ssh(worker, _child_argv(), env, self.secret, stdout=pipe, stderr=pipe)
        except OSError as exc:  # no ssh on PATH, no such interpreter, out of processes...
            how = "here" if self._is_local(slot) else "over ssh"
            raise FlodlError(
                f"could not start rank {slot.rank} on {worker.host} ({how}): {exc}"
            ) from exc

    def _stop_children_on_sigterm(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        # SIGTERM would end the launcher without atexit hooks and orphan the ranks: stop them
        # first, then exit as a SIGTERM'd process would.
        previous = signal.getsignal(signal.SIGTERM)

        def on_sigterm(signum: int, frame: Any) -> None:
            self.kill_all()
            if callable(previous):
                previous(signum, frame)
            raise SystemExit(128 + signum)

        signal.signal(signal.SIGTERM, on_sigterm)
        self._sigterm = (on_sigterm, previous)

    def _restore_sigterm(self) -> None:
        """The run is over: give SIGTERM back to the handler it had before (from the main
        thread, and only if nobody replaced ours since), so that runs in one interpreter do
        not chain a handler each."""
        if self._sigterm is None or threading.current_thread() is not threading.main_thread():
            return
        ours, previous = self._sigterm
        if signal.getsignal(signal.SIGTERM) is ours:
            signal.signal(signal.SIGTERM, previous)
        self._sigterm = None

    def _watch(self, rank: int) -> None:
        """Report each exit of ``rank``'s process; respawn a failed one while
        ``TrainerConfig.respawn`` allows and the coordinator would admit it back."""
        restarts = 0
        while True:
            code = self.procs[rank].wait()
            self.service.child_exited_threadsafe(rank, code)
            if code == 0 or restarts >= self.respawn or self.stopped.is_set():
                return
            # asked on the loop after the exit above was handled: the rank is dead by now
            if not self.service.may_rejoin_threadsafe(rank):
                return
            restarts += 1
            with self._procs_lock:
                if self._stopping:
                    return
                self._restarts[rank] = restarts
                message = (
                    f"rank {rank} exited with code {code}: respawning it "
                    f"({restarts} of {self.respawn}); it rejoins the run"
                )
                logger.warning("%s", message)
                print(f"flodl: {message}", file=sys.stderr, flush=True)  # noqa: T201
                try:
                    self.procs[rank] = self._start_rank(rank, restarts)
                except FlodlError as exc:  # the run goes on without it, as with no respawn
                    logger.warning("rank %d stays dead: %s", rank, exc)
                    print(f"flodl: rank {rank} stays dead: {exc}", file=sys.stderr, flush=True)  # noqa: T201
                    return

    # ------------------------------------------------------------------ stop
    def _abort_start(self) -> None:
        """:meth:`start` failed: stop what it had started (the children, the service thread,
        the dashboard) and remove the run directory, so that the error is all that is left."""
        self.kill_all()
        atexit.unregister(self._at_exit)
        self._restore_sigterm()
        for pump in self.pumps:
            pump.join(timeout=STOP_GRACE_S)
        if self.loop_box and self.serve_box:
            with contextlib.suppress(RuntimeError):  # the loop already ended on its own
                self.loop_box[0].call_soon_threadsafe(self.serve_box[0].cancel)
            self.stopped.wait(timeout=STOP_GRACE_S)
        if self.monitor is not None:
            self.monitor.close()
        shutil.rmtree(self.run_dir, ignore_errors=True)
        crash_trace.disable(self._crash_trace)

    def _at_exit(self) -> None:
        """The interpreter exits before the run ended (a signal, an interrupt, an exception in
        the user's code): stop the children and remove the run directory (the finisher, a
        daemon thread, would not get to it)."""
        self.kill_all()
        shutil.rmtree(self.run_dir, ignore_errors=True)

    def kill_all(self) -> None:
        """Terminate every child still running; kill those that outlast the grace."""
        with self._procs_lock:
            self._stopping = True
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        deadline = time.perf_counter() + STOP_GRACE_S
        for p in self.procs:
            try:
                p.wait(timeout=max(0.0, deadline - time.perf_counter()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def _stop_unadmitted(self) -> None:
        """The run is over: a respawned process the coordinator never admitted (it was still
        starting) has no state to deliver, so it is stopped now instead of being waited for
        until it gives up reaching the coordinator."""
        with self._procs_lock:
            for rank, restarts in self._restarts.items():
                proc = self.procs[rank]
                if self.service.incarnation(rank) < restarts and proc.poll() is None:
                    message = (
                        f"rank {rank}: its respawned process was never admitted (the run "
                        "ended first); stopping it"
                    )
                    logger.warning("%s", message)
                    print(f"flodl: {message}", file=sys.stderr, flush=True)  # noqa: T201
                    proc.terminate()

    def _finish(self) -> None:
        error: BaseException | None = None
        state: TrainedState | None = None
        try:
            self.stopped.wait()
            self._stop_unadmitted()
            for t in self.watchers:
                t.join(timeout=self.coord_cfg.timeouts.heartbeat_s + 10.0)
            self.kill_all()
            for pump in self.pumps:
                pump.join(timeout=STOP_GRACE_S)
            over = self.over_box[0] if self.over_box else None
            codes = [p.returncode for p in self.procs]
            finals = self._load_finals(codes)
            state = finals[0][1] if finals else None
            if over is None:
                error = FlodlError("the coordinator stopped without ending the run")
            elif not over.ok and over.save_reason is None:
                error = FlodlError(
                    f"run failed: {over.reason} (rank exit codes {codes}){self._deaths()}"
                )
            elif over.save_reason is not None:
                if state is not None:
                    state.save_reason = over.save_reason
                error = training_stopped(over.save_reason, over.detail, self.job.save_path, state)
            elif state is None:
                error = FlodlError(
                    f"no rank delivered a final state (exit codes {codes}){self._deaths()}"
                )
            else:
                error = _disagreement(finals)
        except BaseException as exc:  # noqa: BLE001 - delivered to join()
            error = exc
        finally:
            # removed before the exit hook goes: the interpreter may be exiting under us (a
            # signal, an interrupt), and this daemon thread be stopped at any line
            shutil.rmtree(self.run_dir, ignore_errors=True)
            if self.monitor is not None:
                self.monitor.close()  # the service stopped: every record is in; archive, stop
            atexit.unregister(self._at_exit)
            crash_trace.disable(self._crash_trace)
        self.handle._finish(state, error)

    def _load_finals(self, codes: list[int | None]) -> list[tuple[int, TrainedState]]:
        """The final states the launcher holds: every rank of this host that delivered one;
        when none did (the launcher runs no rank, or every local rank died), the lowest rank
        elsewhere that finished, fetched over ssh. Every other host's final-state directory
        is removed."""
        slots = self.cluster.ranks()
        here = [self._is_local(slot) for slot in slots]
        local = [code if h else None for h, code in zip(here, codes, strict=True)]
        finals = _load_final(self.run_dir, local)
        remote = sorted({slot.worker_index for slot, h in zip(slots, here, strict=True) if not h})
        if not remote:
            return finals
        from flodl.launch.ssh import ssh_fetch, ssh_remove

        cleaned: set[int] = set()
        if not finals:
            for slot, h, code in zip(slots, here, codes, strict=True):
                if h or code != 0:
                    continue
                worker = self.cluster.workers[slot.worker_index]
                path = str(final_state_path(self.remote_final_dir, slot.rank))
                try:
                    data = ssh_fetch(worker, path, remove=self.remote_final_dir)
                except ConfigError as exc:
                    logger.warning("rank %d's final state: %s", slot.rank, exc)
                    continue
                finally:
                    cleaned.add(slot.worker_index)
                finals = [(slot.rank, _read_final(data))]
                logger.info(
                    "fetched rank %d's final state from %s over ssh", slot.rank, worker.host
                )
                break
        for index in remote:
            if index not in cleaned:
                ssh_remove(self.cluster.workers[index], self.remote_final_dir)
        return finals

    def _deaths(self) -> str:
        """What the ranks' death records say, for an error message."""
        records = [
            r
            for r in checkpoint.death_records(self.death_stem)
            if r.unix_time_secs >= self.started_unix - 1  # not an earlier run's
        ]
        if not records:
            return ""
        first = records[0]
        where = checkpoint.death_path(self.death_stem, first.rank)
        return (
            f"; rank {first.rank} died of {first.error!r} ({len(records)} death record(s), {where})"
        )

    def _join(self, finisher: threading.Thread) -> None:
        try:
            finisher.join()
            self._restore_sigterm()
        except KeyboardInterrupt:
            for p in self.procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGINT)
            self.kill_all()
            loop = self.loop_box[0] if self.loop_box else None
            if loop is not None and not loop.is_closed():
                loop.call_soon_threadsafe(_cancel_all, loop)
            raise


def _pump(stream: Any, out: Any, prefix: str) -> None:
    """Copy a child's output line by line, each line prefixed with its rank."""
    try:
        for raw in iter(stream.readline, b""):
            out.write(prefix + raw.decode(errors="replace"))
            out.flush()
    finally:
        stream.close()


def _cancel_all(loop: asyncio.AbstractEventLoop) -> None:
    for task in asyncio.all_tasks(loop):
        task.cancel()


def _read_final(source: bytes | Path) -> TrainedState:
    """A rank's final state as its :func:`~flodl.launch.child.exit_launched_rank` saved it: a
    file of this host, or the bytes fetched from another."""
    readable: Any = source if isinstance(source, Path) else io.BytesIO(source)
    saved: dict[str, Any] = torch.load(readable, weights_only=True)
    return TrainedState(list(saved["params"]), list(saved["buffers"]), saved["save_reason"])


def _load_final(run_dir: Path, codes: list[int | None]) -> list[tuple[int, TrainedState]]:
    """``(rank, final state)`` of every rank that delivered one into ``run_dir`` (``codes``:
    each rank's exit code, ``None`` for a rank not to read), ascending; the first has
    ``replicas_agree`` set when several did."""
    finals: list[tuple[int, TrainedState]] = []
    for rank, code in enumerate(codes):
        path = final_state_path(run_dir, rank)
        if code == 0 and path.exists():
            finals.append((rank, _read_final(path)))
    if len(finals) > 1:
        first = finals[0][1]
        first.replicas_agree = all(
            all(torch.equal(a, b) for a, b in zip(first.params, s.params, strict=True))
            for _, s in finals[1:]
        )
    return finals


def _disagreement(finals: list[tuple[int, TrainedState]]) -> FlodlError | None:
    """A completed run whose survivors hold different parameters is an error: every one of
    them took part in the final reduce, so they must hold its consensus."""
    if not finals or finals[0][1].replicas_agree is not False:
        return None
    base_rank, base = finals[0]
    for rank, other in finals[1:]:
        for index, (a, b) in enumerate(zip(base.params, other.params, strict=True)):
            if not torch.equal(a, b):
                diff = float((a.double() - b.double()).abs().max()) if a.shape == b.shape else None
                how = f"max |difference| {diff:.3g}" if diff is not None else "another shape"
                return FlodlError(
                    f"the survivors of the run disagree: parameter {index} "
                    f"{tuple(a.shape)} of rank {rank} differs from rank {base_rank}'s ({how}); "
                    "they all took part in the final reduce and must hold its consensus"
                )
    return None
