"""The coordinator process's services, composed: control server + CPU reduce server or the
``torch.distributed`` store. Used in the launcher process and by ``flodl coord`` (where the
first rank's hello defines the job, and the data services start then)."""

from __future__ import annotations

import logging
import random
from collections.abc import Callable

import torch

from flodl.config import CoordConfig
from flodl.coord.effects import RunOver
from flodl.coord.machine import Coordinator
from flodl.coord.resume import ResumeState
from flodl.outer import OuterConfig
from flodl.service.reduce import ReduceServer
from flodl.service.server import CoordinatorServer, Defined, EffectSink
from flodl.service.standalone import DefinedJob, JobTerms, define_job
from flodl.service.store import StoreHost
from flodl.wire.frames import Hello

__all__ = ["CoordinatorService"]

logger = logging.getLogger(__name__)


class CoordinatorService:
    """One run's coordinator: start it inside a running event loop, await :meth:`wait`.

    Args:
        config: the run's configuration, or the :class:`~flodl.service.standalone.JobTerms`
            of a coordinator whose job the first rank's hello defines (``flodl coord``).
        secret: the run secret (≥ 16 bytes).
        host: address for every listening socket.
        port: control port (0 = any).
        data_port: the data service's port (0 = any): the CPU reduce server's in CPU modes,
            the torch.distributed store's in collective modes.
        sink: where meta/records/alerts/metrics go.
        resume: state read from a checkpoint meta.
        outer: the outer optimizer, applied here in CPU modes (ranks apply it in collective
            modes); ``outer_state`` restores its momentum.
        on_defined: called with the job once the first hello defined it (with ``JobTerms``).
        freeze_heap: freeze the process's heap while the run trains
            (:class:`~flodl.service.heap.HeapFreeze`): for a process that is the
            coordinator's alone (``flodl coord``), never a launcher in the user's interpreter.
    """

    def __init__(
        self,
        config: CoordConfig | JobTerms,
        secret: bytes,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        data_port: int = 0,
        sink: EffectSink | None = None,
        resume: ResumeState | None = None,
        outer: OuterConfig | None = None,
        outer_state: dict[str, list[torch.Tensor]] | None = None,
        on_defined: Callable[[DefinedJob], None] | None = None,
        freeze_heap: bool = False,
    ) -> None:
        self.secret = secret
        self.host = host
        self.port = port
        self.data_port = data_port
        self.sink = sink
        self.server: CoordinatorServer | None = None
        self._reduce: ReduceServer | None = None
        self._store: StoreHost | None = None
        self._on_defined = on_defined
        self.job: DefinedJob | None = None
        """The job the first hello defined (with ``JobTerms``)."""
        if isinstance(config, JobTerms):
            self._terms: JobTerms | None = config
            self.config: CoordConfig | None = None
        else:
            self._terms = None
            self.config = config
        self._resume = resume
        self._outer = outer
        self._outer_state = outer_state
        self._freeze_heap = freeze_heap

    @property
    def machine(self) -> Coordinator:
        """The pure coordinator (once the job is defined)."""
        assert self.server is not None, "start() first"
        return self.server.machine

    async def start(self) -> int:
        """Start every service (the data services wait for the job when the ranks bring it);
        returns the control port."""
        if self.config is None:
            self.server = CoordinatorServer(
                None,
                self.secret,
                host=self.host,
                port=self.port,
                sink=self.sink,
                define=self._define,
                freeze_heap=self._freeze_heap,
            )
        else:
            built = self._build(self.config, self._resume, self._outer, self._outer_state)
            self.server = CoordinatorServer(
                built.machine,
                self.secret,
                host=self.host,
                port=self.port,
                sink=self.sink,
                reduce=built.reduce,
                data_port=built.data_port,
                store_port=built.store_port,
                freeze_heap=self._freeze_heap,
            )
        port = await self.server.start()
        self.port = port
        return port

    def _build(
        self,
        config: CoordConfig,
        resume: ResumeState | None,
        outer: OuterConfig | None,
        outer_state: dict[str, list[torch.Tensor]] | None,
    ) -> Defined:
        """The machine and the data service of ``config`` (the CPU reduce server, or the
        torch.distributed store of the collective modes)."""
        machine = Coordinator(config, random.Random(config.seed), resume=resume)
        if config.elche.traits.cpu_averaging:
            self._reduce = ReduceServer(
                self.secret,
                run_id=config.run_id,
                host=self.host,
                port=self.data_port,
                world_size=config.world_size,
                on_done=self._on_reduce_done,
                outer=outer,
                outer_state=outer_state,
                broadcast_round=0,
            )
            return Defined(machine, reduce=self._reduce, data_port=self._reduce.start())
        self._store = StoreHost(self.host, self.data_port)
        return Defined(machine, store_port=self._store.port)

    def _define(self, hello: Hello) -> Defined | str:
        """The server's hook for the first hello: the job it brings, or why not."""
        assert self._terms is not None
        job = define_job(self._terms, hello)
        if isinstance(job, str):
            return job
        built = self._build(job.config, job.resume, job.outer, job.outer_state)
        self.config, self.job = job.config, job
        logger.info("%s", job.summary())
        if self._on_defined is not None:
            self._on_defined(job)
        return built

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
        if self.server is None or not self.server.defined:
            return 0
        return self.server.machine.membership.incarnations[rank]

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
