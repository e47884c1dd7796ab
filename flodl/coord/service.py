"""The coordinator process's services, composed: control server + CPU reduce server or the
``torch.distributed`` store. Used in the launcher process and by ``flodl coord``."""

from __future__ import annotations

import logging
import random

import torch

from flodl import checkpoint
from flodl.config import CoordConfig
from flodl.coord.effects import BundleRequested, RunOver, WriteMeta
from flodl.coord.machine import Coordinator, ResumeState
from flodl.coord.reduce import ReduceServer
from flodl.coord.server import CoordinatorServer, EffectSink
from flodl.coord.store import StoreHost
from flodl.errors import CheckpointError
from flodl.outer import OuterConfig

__all__ = ["CoordinatorService", "BundleWriter", "resume_from_bundle"]

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
        if self.config.elche.backend == "cpu":
            self._reduce = ReduceServer(
                self.secret,
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


class BundleWriter:
    """The coordinator's part of a checkpoint bundle: the CPU outer optimizer's state as of the
    request, then the meta that commits the bundle (the ranks already wrote the model file).

    A failed write is logged and costs only this checkpoint, never the run.
    """

    def __init__(self, stem: str | None, service: CoordinatorService | None = None) -> None:
        self.stem = stem
        self.service = service
        self._outer: dict[int, dict[str, list[torch.Tensor]]] = {}
        self.written: list[str] = []

    def bundle_requested(self, effect: BundleRequested) -> None:
        if self.stem is not None and self.service is not None:
            state = self.service.outer_state()
            if state:
                self._outer[effect.version] = state

    def write_meta(self, effect: WriteMeta) -> None:
        outer = self._outer.pop(effect.version, None) if effect.version is not None else None
        if self.stem is None:
            return
        try:
            if outer:
                checkpoint.save_outer(self.stem, outer, global_step=effect.meta["global_step"])
            checkpoint.write_meta(self.stem, effect.meta)
        except Exception:
            logger.exception(
                "writing the checkpoint meta for %s failed (training continues)", self.stem
            )
            return
        self.written.append(str(effect.reason))
        logger.info("checkpoint %s saved (%s)", self.stem, effect.reason)


def resume_from_bundle(
    stem: str, coord_cfg: CoordConfig
) -> tuple[ResumeState, dict[str, list[torch.Tensor]] | None]:
    """The coordinator's side of ``resume_from``: the meta (checked against this run and the
    model file), and the CPU outer state when there is one.

    Raises:
        CheckpointError: missing/corrupt files, another world size or seed, or a model file
            from another save than the meta.
    """
    meta = checkpoint.read_meta(stem, world_size=coord_cfg.world_size)
    state = checkpoint.resume_state(
        meta,
        seed=coord_cfg.seed,
        batch_size=coord_cfg.batch_size,
        epoch_splits=coord_cfg.epoch_splits,
        total_epochs=coord_cfg.total_epochs,
    )
    bundle = checkpoint.load_model(stem)
    if bundle.global_step != meta.global_step:
        raise CheckpointError(
            f"{stem}.fdl is from global step {bundle.global_step} but {stem}.meta.json from "
            f"{meta.global_step}: the two come from different saves"
        )
    outer = None
    if coord_cfg.elche.backend == "cpu":
        try:
            saved = checkpoint.load_outer(stem)
        except CheckpointError as exc:
            logger.warning("outer optimizer state not restored (%s): zero momentum", exc)
            saved = None
        if saved is not None and saved.global_step == meta.global_step:
            outer = saved.state
    return state, outer
