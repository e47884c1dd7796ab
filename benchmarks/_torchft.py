"""torchft (PyPI ``torchft``, the ``bench`` extra) on CPU/Gloo for the benchmarks.

Setup, as torchft's own CPU integration tests run it (``local_sgd_integ_test.py``): one
``LighthouseServer`` (the Rust quorum service the wheel ships, ``torchft.coordination``) in
the benchmark process on ``127.0.0.1:0``; each replica group is one process that hosts its own
``TCPStore`` (torchft's ``Manager`` connects to it as a client) and runs a ``Manager`` over a
reconfigurable ``torchft.process_group.ProcessGroupGloo``, wrapped in ``LocalSGD(sync_every)``.
Timeouts are torchft's defaults (Manager 60 s, lighthouse heartbeat 5 s, join 60 s, tick
100 ms) unless a caller says otherwise.

:func:`unavailable` says why torchft cannot run here (None when it can), so a benchmark can
print the reason in its table instead of a number.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Self

import torch
from _ddp import SLOW_RANK, TimedStep, batches, equal_split, free_port

__all__ = [
    "unavailable",
    "torchft_version",
    "Lighthouse",
    "run_localsgd",
    "spawn_replicas",
    "spawn_replica",
]

os.environ.setdefault("RUST_LOG", "error")  # the lighthouse logs every quorum at INFO


def torchft_version() -> str | None:
    try:
        from importlib.metadata import version

        return version("torchft")
    except Exception:  # noqa: BLE001 - absent or broken metadata both mean "no version"
        return None


def unavailable() -> str | None:
    """None if torchft imports and its lighthouse starts here; else the reason, one line."""
    try:
        from torchft.coordination import LighthouseServer
        from torchft.local_sgd import LocalSGD  # noqa: F401
        from torchft.manager import Manager  # noqa: F401
        from torchft.process_group import ProcessGroupGloo  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure is reported, not raised
        return (
            f"torchft not importable ({type(exc).__name__}: {exc}); "
            "install the benchmark extra: pip install -e '.[bench]'"
        )
    try:
        server = LighthouseServer(bind="127.0.0.1:0", min_replicas=1)
        server.shutdown()
    except Exception as exc:  # noqa: BLE001 - reported in the benchmark's table
        return f"torchft lighthouse failed to start: {type(exc).__name__}: {exc}"
    return None


class Lighthouse:
    """A torchft lighthouse (context manager); ``address`` is for the replicas.

    ``cli=False``: ``torchft.coordination.LighthouseServer`` in this process, whose Python
    binding defaults ``join_timeout_ms`` to 100 (what torchft's own tests use).
    ``cli=True``: the ``torchft_lighthouse`` binary the wheel installs, with its command-line
    defaults (``join_timeout_ms`` 60 000): the deployed configuration.
    Both: heartbeat timeout 5 000 ms, quorum tick 100 ms.
    """

    def __init__(self, min_replicas: int, *, cli: bool = False) -> None:
        self.cli = cli
        self.server: Any = None
        self.proc: subprocess.Popen[bytes] | None = None
        if not cli:
            from torchft.coordination import LighthouseServer

            self.server = LighthouseServer(bind="127.0.0.1:0", min_replicas=min_replicas)
            self.address: str = self.server.address()
            return
        exe = shutil.which("torchft_lighthouse") or str(
            Path(sys.executable).with_name("torchft_lighthouse")
        )
        port = free_port()
        self.proc = subprocess.Popen(
            [exe, "--bind", f"127.0.0.1:{port}", "--min_replicas", str(min_replicas)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env={**os.environ, "RUST_LOG": "error"},
        )
        self.address = f"http://127.0.0.1:{port}"
        deadline = time.perf_counter() + 30.0
        while True:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            if self.proc.poll() is not None or time.perf_counter() > deadline:
                self.close()
                raise RuntimeError(f"torchft_lighthouse did not start on port {port}")
            time.sleep(0.05)

    def close(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server = None
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _log(fd: int, **event: Any) -> None:
    os.write(fd, (json.dumps({"ts": time.time() * 1000.0, **event}) + "\n").encode())


def _replica(replica: int, cfg: dict[str, Any], lighthouse: str, out_dir: str) -> None:
    """One replica group of one process: LocalSGD over the demo task."""
    os.environ.setdefault("RUST_LOG", "error")
    from torch.distributed import TCPStore  # type: ignore[attr-defined]
    from torchft.local_sgd import LocalSGD
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupGloo

    from flodl.demo import Slowdown, demo_task

    torch.set_num_threads(1)
    out = Path(out_dir)
    # torchft logs every failed collective with a traceback: keep it, out of the table
    noise = os.open(out / f"replica{replica}.stderr", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(noise, 1)
    os.dup2(noise, 2)
    events = os.open(out / f"replica{replica}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    task = demo_task(samples=cfg["samples"], seed=cfg["seed"], **cfg.get("task", {}))
    spf = float(cfg["step_per_forward"])
    if "slow" in cfg:
        slow = {int(r): float(f) for r, f in cfg["slow"].items()}
    else:
        slow = {SLOW_RANK: float(cfg.get("factor", 1.0))}
    slowdown = Slowdown.for_rank(slow, rank=replica, step_per_forward=spf)
    timed = TimedStep(
        task.train_step,
        slowdown,
        spf,
        out / f"replica{replica}.steps",
        measure=cfg.get("measure", "forward"),
    )
    model = task.model_factory("cpu")
    optim = task.optim_factory(model.parameters())
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    diloco = cfg.get("algorithm", "localsgd") == "diloco"

    def state_dict() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": optim.state_dict()}

    def load_state_dict(sd: dict[str, Any]) -> None:
        model.load_state_dict(sd["model"])
        optim.load_state_dict(sd["optim"])

    manager = Manager(
        pg=ProcessGroupGloo(),
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=int(cfg["min_replica_size"]),
        store_addr="127.0.0.1",
        store_port=store.port,
        rank=0,
        world_size=1,
        lighthouse_addr=lighthouse,
        replica_id=f"replica_{replica}",
        hostname="127.0.0.1",
        # every replica builds the same seeded initial weights (demo model_factory)
        init_sync=False,
        # DiLoCo refuses the asynchronous quorum LocalSGD runs with by default
        use_async_quorum=not diloco,
    )

    class QuorumSpy:
        """Delegates to torchft's ManagerClient and keeps the last quorum's member ids."""

        def __init__(self, client: Any) -> None:
            self.client = client
            self.replica_ids: list[str] = []

        def _quorum(self, *args: Any, **kwargs: Any) -> Any:
            result = self.client._quorum(*args, **kwargs)
            self.replica_ids = [r.split(":")[0] for r in result.replica_ids]
            return result

        def __getattr__(self, name: str) -> Any:
            return getattr(self.client, name)

    spy = QuorumSpy(manager._client)
    manager._client = spy

    class LoggedLocalSGD(LocalSGD):  # type: ignore[misc]
        """torchft's LocalSGD.sync, with the quorum and the commit time-stamped."""

        def sync(self) -> None:
            before = manager.current_step()
            manager.start_quorum()
            manager.wait_quorum()  # allreduce waits for it anyway; here we see when
            _log(
                events,
                event="quorum",
                quorum_id=manager._quorum_id,
                participants=manager.num_participants(),
                members=spy.replica_ids,
                healing=bool(manager._healing),  # this replica recovers a peer's state now
                step=before,
            )
            self._perform_sync()
            self._local_step = 0
            step = manager.current_step()
            _log(events, event="commit", committed=step > before, step=step)

    world = int(cfg["world"])
    forever = bool(cfg.get("forever", False))

    def train(algo: Any) -> None:
        _log(events, event="start")
        epoch = 0
        while forever or epoch < cfg["epochs"]:
            mine = equal_split(len(task.train), world, replica, epoch, cfg["seed"])
            for idx in batches(mine, cfg["batch_size"]):
                batch = task.train.get_batch(idx)
                optim.zero_grad(set_to_none=True)
                timed(model, batch).backward()  # type: ignore[no-untyped-call]
                optim.step()  # the algorithm's post-step hook syncs every sync_every steps
            epoch += 1
        if not diloco and algo._local_step > 0:  # the same step count everywhere: one more
            algo.sync()

    try:
        if diloco:
            from torchft.local_sgd import DiLoCo

            # DiLoCo's outer step as its paper and torchft's tests set it: Nesterov SGD
            outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
            with DiLoCo(
                manager, [model], optim, outer, sync_every=int(cfg["sync_every"]), pin_memory=False
            ) as algo:
                train(algo)
        else:
            with LoggedLocalSGD(manager, model, optim, sync_every=int(cfg["sync_every"])) as lsgd:
                train(lsgd)
        result: dict[str, Any] = {"replica": replica, **timed.summary()}
        result["syncs"] = manager.current_step()
        if replica == 0:
            result["metric"] = task.eval_fn(model, task.held_out)
            result["loss"] = task.loss_fn(model, task.held_out)
        tmp = out / f"replica{replica}.json.tmp"
        tmp.write_text(json.dumps(result))
        tmp.replace(out / f"replica{replica}.json")
    finally:
        manager.shutdown(wait=False)


def spawn_replicas(cfg: dict[str, Any], lighthouse: str, out_dir: Path) -> Any:
    """Start ``cfg['world']`` replica processes (spawn); returns the torch ProcessContext."""
    import torch.multiprocessing as mp

    out_dir.mkdir(parents=True, exist_ok=True)
    return mp.start_processes(  # type: ignore[attr-defined,no-untyped-call]
        _replica,
        args=(cfg, lighthouse, str(out_dir)),
        nprocs=int(cfg["world"]),
        join=False,
        start_method="spawn",
    )


def spawn_replica(replica: int, cfg: dict[str, Any], lighthouse: str, out_dir: Path) -> Any:
    """Start one more process for replica group ``replica`` (a restart after its death: same
    replica id and config; it appends to the same logs); returns the started
    ``multiprocessing`` process (spawn)."""
    import multiprocessing

    out_dir.mkdir(parents=True, exist_ok=True)
    proc = multiprocessing.get_context("spawn").Process(
        target=_replica, args=(replica, cfg, lighthouse, str(out_dir)), daemon=False
    )
    proc.start()
    return proc


def run_localsgd(cfg: dict[str, Any], out_dir: Path, timeout_s: float = 600.0) -> dict[str, Any]:
    """LocalSGD (or, with ``cfg['algorithm'] = 'diloco'``, DiLoCo) with a fixed
    ``cfg['sync_every']`` for ``cfg['epochs']`` epochs; per-replica summaries plus ``metric`` and
    ``loss`` (replica 0, after the last sync) and ``total_s``. Optional ``cfg`` keys: ``slow``
    (replica → factor; default ``{SLOW_RANK: cfg['factor']}``), ``task`` (more ``demo_task``
    sizes), ``measure`` (:class:`TimedStep`'s)."""
    world = int(cfg["world"])
    cfg = {"min_replica_size": world, **cfg}
    t0 = time.perf_counter()
    with Lighthouse(min_replicas=world) as lh:
        ctx = spawn_replicas(cfg, lh.address, out_dir)
        deadline = time.perf_counter() + timeout_s
        try:
            while not ctx.join(timeout=max(0.1, deadline - time.perf_counter())):
                if time.perf_counter() >= deadline:
                    raise TimeoutError(f"torchft did not finish within {timeout_s:.0f} s")
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
    total_s = time.perf_counter() - t0
    ranks = [json.loads((out_dir / f"replica{r}.json").read_text()) for r in range(world)]
    return {
        "ranks": ranks,
        "metric": ranks[0]["metric"],
        "loss": ranks[0].get("loss"),
        "total_s": total_s,
    }
