"""The five modes as data: one row of traits per mode (docs/design.md §0, §2).

Pure module. A mode is a pacing policy (Sync, Cadence, Async) on an averaging backend (a
``torch.distributed`` collective among the ranks, or the coordinator's CPU reduce server).
Everything that behaves differently between modes reads a trait of :data:`MODE_TRAITS`; no
other module compares mode, policy or backend names (``tests/unit/test_arch.py`` checks it). A
new mode is a new row here plus, at most, its policy code.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal

__all__ = ["Mode", "Policy", "Backend", "MODES", "ModeTraits", "MODE_TRAITS", "traits_of"]

Mode = Literal["nccl_sync", "nccl_cadence", "cpu_sync", "cpu_cadence", "cpu_async"]
Policy = Literal["sync", "cadence", "async"]
Backend = Literal["collective", "cpu"]


@dataclass(frozen=True, slots=True)
class ModeTraits:
    """What one mode does, trait by trait.

    Attributes:
        mode: the mode's name.
        policy: its pacing policy (shown in records and tables; ElChe's own vocabulary).
        backend: its averaging backend (shown in records and tables).
        cpu_averaging: ranks upload their parameters to the coordinator's reduce server
            (``request_params``, the data port, the server's round report); otherwise ranks
            all-reduce among themselves (``sync_now``, a collective session re-formed after
            every death, at least two survivors needed to go on).
        barrier_paced: a rank is never handed a step across a reduce or an epoch barrier, so
            it holds at most one chunk and one epoch is open at a time.
        overshoot: a rank may train past its window by ``max_overshoot`` batches (auto-tuned
            unless set; growth may also relax the anchor up).
        one_step_gate: the reduce fires once every live rank made one step (a fixed one-step
            window), instead of when each hit its batch count.
        chunk_is_window: with progressive dispatch one chunk is one window, so the count gate
            waits for the chunk (a final-window slot may be one batch above the count).
        progressive: default dispatch is progressive chunks (else whole-epoch partitions).
        speed_proportional: calibrated partitions follow measured speeds (else equal splits).
        adaptive_window: ElChe may grow the window and the convergence guard judges it (the
            delivered-speed feed applies); a one-step window is never judged.
        throttle_at_trigger: a reduce trigger also throttles every rank until its update.
        folds_next_chunk: the ``update`` that ends a cycle carries the rank's next chunk.
        waits_for_update: a rank waits for the coordinator's ``update`` after its reduce.
        elastic_blend: ranks blend the consensus elastically (EASGD), keep the consensus for
            evals, saves and the final state, and adopt it for an eval.
        preset: the preset's ElChe settings (``ElCheConfig.preset``).
    """

    mode: Mode
    policy: Policy
    backend: Backend
    cpu_averaging: bool
    barrier_paced: bool
    overshoot: bool
    one_step_gate: bool
    chunk_is_window: bool
    progressive: bool
    speed_proportional: bool
    adaptive_window: bool
    throttle_at_trigger: bool
    folds_next_chunk: bool
    waits_for_update: bool
    elastic_blend: bool
    preset: Mapping[str, Any] = field(default_factory=dict)


def _row(mode: Mode, policy: Policy, backend: Backend, **preset: Any) -> ModeTraits:
    cpu = backend == "cpu"  # the one place backend and policy names are compared
    sync, cadence, elastic = policy == "sync", policy == "cadence", policy == "async"
    return ModeTraits(
        mode=mode,
        policy=policy,
        backend=backend,
        cpu_averaging=cpu,
        barrier_paced=not elastic,
        overshoot=elastic,
        one_step_gate=sync,
        chunk_is_window=cadence,
        progressive=not sync,
        speed_proportional=not sync,
        adaptive_window=not sync,
        throttle_at_trigger=cpu and sync,
        folds_next_chunk=cpu and cadence,
        waits_for_update=cpu and not elastic,
        elastic_blend=elastic,
        preset=MappingProxyType(preset),
    )


MODE_TRAITS: Mapping[Mode, ModeTraits] = MappingProxyType(
    {
        "nccl_sync": _row("nccl_sync", "sync", "collective", anchor=1),
        "nccl_cadence": _row("nccl_cadence", "cadence", "collective"),
        "cpu_sync": _row("cpu_sync", "sync", "cpu", anchor=1),
        "cpu_cadence": _row("cpu_cadence", "cadence", "cpu"),
        "cpu_async": _row("cpu_async", "async", "cpu", easgd_alpha=0.5, overhead_target=0.05),
    }
)

MODES: tuple[Mode, ...] = tuple(MODE_TRAITS)


def traits_of(mode: str) -> ModeTraits:
    """The traits of ``mode``.

    Raises:
        KeyError: not one of :data:`MODES`.
    """
    return MODE_TRAITS[mode]  # type: ignore[index]
