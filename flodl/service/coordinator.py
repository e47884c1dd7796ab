"""The coordinator process's services, composed: control server + CPU reduce server or the
``torch.distributed`` store. Used in the launcher process and by ``flodl coord``."""

from __future__ import annotations

import logging
import random

import torch

from flodl.config import CoordConfig
from flodl.coord.effects import RunOver
from flodl.coord.machine import Coordinator
from flodl.coord.resume import ResumeState
from flodl.outer import OuterConfig
from flodl.service.reduce import ReduceServer
from flodl.service.server import CoordinatorServer, EffectSink
from flodl.service.store import StoreHost

__all__ = ["CoordinatorService"]

logger = logging.getLogger(__name__)


class CoordinatorService:
    """One run's coordinator: start it inside a running event loop, await :meth:`wait`.

    Args:
        config: the run's configuration.
        secret: the run secret (≥ 16 bytes).
        host: address for every listening socket.
        port: control port (0 = any).
        sink: where meta/records/alerts/metrics go.
        resume: state read from a checkpoint meta.
        outer: the outer optimizer, applied here in CPU modes (ranks apply it in collective
            modes); ``outer_state`` restores its momentum.
    """

    def __init__(
        self,
        config: CoordConfig,
        secret: bytes,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        sink: EffectSink | None = None,
        resume: ResumeState | None = None,
        outer: OuterConfig | None = None,
        outer_state: dict[str, list[torch.Tensor]] | None = None,
    ) -> None:
        self.config = config
        self.secret = secret
        self.host = host
        self.port = port
        self.sink = sink
        self.machine = Coordinator(config, random.Random(config.seed), resume=resume)
        self.server: CoordinatorServer | None = None
        self._reduce: ReduceServer | None = None
        self._store: StoreHost | None = None
        self._outer = outer
        self._outer_state = outer_state

    async def start(self) -> int:
        """Start every service; returns the control port."""
        data_port: int | None = None
        store_port: int | None = None
        if self.config.elche.traits.cpu_averaging:
            self._reduce = ReduceServer(
                self.secret,
                run_id=self.config.run_id,
                host=self.host,
                world_size=self.config.world_size,
                on_done=self._on_reduce_done,
                outer=self._outer,
                outer_state=self._outer_state,
                broadcast_round=0,
            )
            data_port = self._reduce.start()
        else:
            self._store = StoreHost(self.host)
            store_port = self._store.port
        self.server = CoordinatorServer(
            self.machine,
            self.secret,
            host=self.host,
            port=self.port,
            sink=self.sink,
            reduce=self._reduce,
            data_port=data_port,
            store_port=store_port,
        )
        port = await self.server.start()
        self.port = port
        return port

    def _on_reduce_done(self, cycle: int, contributors: tuple[int, ...], weight: float) -> None:
        if self.server is not None:
            self.server.reduce_done_threadsafe(cycle, contributors, weight)

    def outer_state(self) -> dict[str, list[torch.Tensor]]:
        """The coordinator-side outer optimizer state (CPU modes), for a bundle."""
        return self._reduce.outer_state() if self._reduce is not None else {}

    def child_exited_threadsafe(self, rank: int, exit_code: int) -> None:
        if self.server is not None:
            self.server.child_exited_threadsafe(rank, exit_code)

    def incarnation(self, rank: int) -> int:
        """The last incarnation of ``rank`` the coordinator admitted (0: the first); read it
        once the run is over, or from the loop."""
        return self.server.machine.membership.incarnations[rank] if self.server is not None else 0

    def may_rejoin_threadsafe(self, rank: int, timeout_s: float = 10.0) -> bool:
        """Whether a new incarnation of dead ``rank`` would be admitted now (a launcher's
        respawn asks before it starts one)."""
        return self.server is not None and self.server.may_rejoin_threadsafe(rank, timeout_s)

    async def wait(self) -> RunOver:
        assert self.server is not None, "start() first"
        return await self.server.wait()

    async def close(self) -> None:
        if self.server is not None:
            await self.server.close()
        if self._reduce is not None:
            self._reduce.close()
        if self._store is not None:
            self._store.close()
