"""The coordinator process's part of a checkpoint bundle: the CPU outer optimizer's state and
the meta that commits the bundle (docs/design.md §6), and the coordinator's side of a resume.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from flodl import checkpoint
from flodl.config import CoordConfig
from flodl.coord.effects import BundleRequested, WriteMeta
from flodl.coord.resume import ResumeState
from flodl.errors import CheckpointError

if TYPE_CHECKING:
    from flodl.service.coordinator import CoordinatorService

__all__ = ["BundleWriter", "resume_from_bundle"]

logger = logging.getLogger(__name__)


class BundleWriter:
    """The coordinator's part of a checkpoint bundle: the CPU outer optimizer's state as of the
    request, then the meta that commits the bundle (the ranks already wrote the model file
    under the save's tag), then the removal of superseded saves.

    Metas commit in the order of their saves: a save that completes after a newer one was
    committed is not written (it would move the resume point back). A failed write is logged
    and costs only this checkpoint, never the run.
    """

    def __init__(self, stem: str | None, service: CoordinatorService | None = None) -> None:
        self.stem = stem
        self.service = service
        self._outer: dict[int, dict[str, list[torch.Tensor]]] = {}
        self._in_flight: dict[int, str] = {}
        self._last: tuple[int, int] | None = None
        self.written: list[str] = []

    def bundle_requested(self, effect: BundleRequested) -> None:
        if effect.tag is not None:
            self._in_flight[effect.version] = effect.tag
        if self.stem is not None and self.service is not None:
            state = self.service.outer_state()
            if state:
                self._outer[effect.version] = state

    def write_meta(self, effect: WriteMeta) -> None:
        outer = self._outer.pop(effect.version, None) if effect.version is not None else None
        if effect.version is not None:
            self._in_flight.pop(effect.version, None)
        if self.stem is None:
            return
        meta = effect.meta
        order = (int(meta["global_step"]), effect.version or 0)
        if self._last is not None and order < self._last:
            logger.warning(
                "bundle %s completed after a newer one was committed: not written", effect.version
            )
            return
        tag = meta.get("bundle_tag")
        try:
            if outer:
                step = meta["global_step"]
                checkpoint.save_outer(self.stem, outer, global_step=step, tag=tag)
            checkpoint.commit_bundle(self.stem, meta, in_flight=self._in_flight.values())
        except Exception:
            logger.exception(
                "writing the checkpoint meta for %s failed (training continues)", self.stem
            )
            return
        self._last = order
        self.written.append(str(effect.reason))
        logger.info("checkpoint %s saved (%s)", self.stem, effect.reason)


def read_bundle(stem: str) -> checkpoint.CheckpointMeta:
    """The meta of the bundle at ``stem``, checked against its model file (what can be checked
    before the job is known: ``flodl coord --resume-from`` fails at its start on a bad bundle).

    Raises:
        CheckpointError: missing/corrupt files, or a model file from another save than the
            meta.
    """
    meta = checkpoint.read_meta(stem)
    bundle = checkpoint.load_model(stem, meta.bundle_tag)
    if bundle.global_step != meta.global_step:
        raise CheckpointError(
            f"{bundle.path} is from global step {bundle.global_step} but "
            f"{checkpoint.meta_path(stem)} from {meta.global_step}: the two come from "
            "different saves"
        )
    return meta


def resume_from_bundle(
    stem: str, coord_cfg: CoordConfig
) -> tuple[ResumeState, dict[str, list[torch.Tensor]] | None]:
    """The coordinator's side of ``resume_from``: the meta (checked against this run and the
    model file), and the CPU outer state when there is one.

    Raises:
        CheckpointError: missing/corrupt files, another seed, batch size or epoch split, or
            a model file from another save than the meta (the world size may differ:
            docs/design.md §6, "Resume at another world size").
    """
    meta = read_bundle(stem)
    state = checkpoint.resume_state(
        meta,
        seed=coord_cfg.seed,
        batch_size=coord_cfg.batch_size,
        epoch_splits=coord_cfg.epoch_splits,
        total_epochs=coord_cfg.total_epochs,
    )
    tag = meta.bundle_tag
    outer = None
    if coord_cfg.elche.traits.cpu_averaging:
        try:
            saved = checkpoint.load_outer(stem, tag)
        except CheckpointError as exc:
            logger.warning("outer optimizer state not restored (%s): zero momentum", exc)
            saved = None
        if saved is not None and saved.global_step == meta.global_step:
            outer = saved.state
    return state, outer
