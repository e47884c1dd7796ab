"""A standalone coordinator process with its dashboard, for the live fuzz test.

Run as ``python fuzz_coord_main.py`` with the job in ``FLODL_TEST_COORD`` (JSON) and the path
of the run secret (hex, mode 0600) in ``FLODL_SECRET_FILE``; the secret itself is never in the
environment, on the command line or in the output. Logs go to stderr at INFO (every closed
hostile connection is one WARNING line there).

Writes, atomically:

* ``job["ports"]`` once serving: ``{"control", "data", "dashboard", "pid"}`` (the CPU reduce
  server's port is what ranks learn from ``accept.data_port``);
* ``job["summary"]`` when the run is over: the outcome, the per-epoch coverage audit, the ranks
  declared dead, the number of ranks that ever joined, the peak RSS (``VmHWM`` and
  ``ru_maxrss``, kB) and, per listening port, the connections the kernel dropped because its
  accept queue was full (``listen_drops``: such a connection never reaches the server).

Exit status 0 when the run ended ok, 1 otherwise.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import socket
import struct
import sys
from pathlib import Path
from typing import Any

import uvloop

from flodl.config import CoordConfig, ElCheConfig, validated
from flodl.coord.effects import Alert, EpochDone, Record
from flodl.monitor.session import MonitorSession
from flodl.service.coordinator import CoordinatorService
from flodl.service.server import LoggingSink


class DashboardSink(LoggingSink):
    """Logged, and fed to a monitoring session that serves the live dashboard."""

    def __init__(self, session: MonitorSession) -> None:
        self.session = session
        self.epochs: list[dict[str, Any]] = []

    def record(self, effect: Record) -> None:
        if effect.kind != "epoch":
            self.session.record(effect.path, effect.kind, effect.data)

    def alert(self, effect: Alert) -> None:
        super().alert(effect)
        self.session.alert(effect.cls, effect.path, effect.detail, effect.severity)

    def epoch_done(self, effect: EpochDone) -> None:
        super().epoch_done(effect)
        m = effect.metrics
        self.session.epoch(m)
        self.epochs.append(
            {"epoch": m.epoch, "samples": list(m.per_rank_samples), "loss": m.avg_loss}
        )


def write_json(path: str, obj: object) -> None:
    tmp = Path(path + ".tmp")
    tmp.write_text(json.dumps(obj))
    tmp.replace(path)


def listen_drops(listener: Any) -> int:
    """A listening socket's drop count (Linux ``SO_MEMINFO``, index 8): connections dropped
    because the accept queue was full; -1 where the option is missing."""
    try:
        raw = listener.getsockopt(socket.SOL_SOCKET, 55, 64)
    except OSError:
        return -1
    return int(struct.unpack(f"{len(raw) // 4}I", raw)[8])


def vm_hwm_kb() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return -1


async def main(job: dict[str, Any], secret: bytes) -> int:
    world = int(job["world_size"])
    cfg = validated(
        CoordConfig,
        world_size=world,
        dataset_len=int(job["dataset_len"]),
        batch_size=int(job["batch_size"]),
        num_epochs=int(job["epochs"]),
        elche=ElCheConfig.preset(job["mode"]),
        run_id=job["run_id"],
    )
    session = MonitorSession(
        world_size=world, total_epochs=cfg.num_epochs, batch_size=cfg.batch_size, dashboard_port=0
    )
    sink = DashboardSink(session)
    service = CoordinatorService(cfg, secret, sink=sink)
    over = None
    drops: dict[str, int] = {}
    try:
        control = await service.start()
        reduce_server = service._reduce  # the CPU reduce server: its port is accept.data_port
        assert reduce_server is not None, "fuzz_coord_main needs a CPU averaging mode"
        assert session.dashboard is not None
        write_json(
            job["ports"],
            {
                "control": control,
                "data": reduce_server.port,
                "dashboard": session.dashboard.port,
                "pid": os.getpid(),
            },
        )
        over = await service.wait()
        assert service.server is not None and service.server._server is not None
        drops = {
            "control": listen_drops(service.server._server.sockets[0]),
            "data": listen_drops(reduce_server._listen),
            "dashboard": listen_drops(session.dashboard.server._server.sockets[0]),
        }
    finally:
        await service.close()
        session.close()
        machine = service.machine
        write_json(
            job["summary"],
            {
                "ok": over is not None and over.ok,
                "reason": None if over is None else over.reason,
                "coverage": {
                    str(e): {"total": r.total, "committed": r.committed, "ok": r.ok}
                    for e, r in sorted(machine.dispatch.coverage_log.items())
                },
                "dead": machine.membership.liveness.dead(),
                "joined": machine.membership.liveness.joined_count(),
                "sync_rounds": machine.sync_rounds,
                "epochs": sink.epochs,
                "vm_hwm_kb": vm_hwm_kb(),
                # every refused or cut connection by reason (the log holds only a budget)
                "control_refusals": dict(service.server.refusals.counts)
                if service.server is not None
                else {},
                "data_refusals": dict(service._reduce.refusals.counts)
                if service._reduce is not None
                else {},
                "ru_maxrss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                "listen_drops": drops,
            },
        )
    return 0 if over.ok else 1


if __name__ == "__main__":
    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s"
    )
    run_secret = bytes.fromhex(Path(os.environ["FLODL_SECRET_FILE"]).read_text().strip())
    sys.exit(uvloop.run(main(json.loads(os.environ["FLODL_TEST_COORD"]), run_secret)))
