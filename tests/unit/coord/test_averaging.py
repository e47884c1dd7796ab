"""Averaging's verdict seam: the LR meta-controller's nudge goes before the guard's verdict.

Production constants: anchor 10, the growth cap ×2 per cycle, the LR cliff factor 0.5. Driven
through the coordinator the run builds (real CoordConfig, ElChe, Dispatch, MetaController).
"""

from __future__ import annotations

from collections.abc import Sequence

from flodl.config import CoordConfig, ElCheConfig, validated
from flodl.coord.effects import Alert, Effect
from flodl.coord.elche_state import Phase
from flodl.coord.machine import Coordinator


def coordinator(mode: str) -> Coordinator:
    config = validated(
        CoordConfig,
        world_size=2,
        dataset_len=640,
        batch_size=32,
        elche=ElCheConfig.preset(mode, anchor=10),
    )
    return Coordinator(config)


def feed(coord: Coordinator, ms_per_batch: Sequence[float], sync_ms: float = 0.0) -> None:
    el = coord.elche
    counts = el.batch_counts
    el.report_timing([c * m for c, m in zip(counts, ms_per_batch, strict=True)], counts, sync_ms)


def sync_for_overhead(overhead: float, window_ms: float) -> float:
    return overhead * window_ms / (1.0 - overhead)


def staged_proposal(mode: str) -> Coordinator:
    """A coordinator in Warmup at anchor 10 with growth to 20 staged and LR 0.1 observed."""
    coord = coordinator(mode)
    assert coord.averaging.meta_controller is not None  # on by default
    feed(coord, [1.0, 1.0])
    assert coord.elche.phase is Phase.WARMUP
    coord.averaging.last_lr = 0.1
    coord.averaging.judge([10, 10], [])
    feed(coord, [1.0, 1.0], sync_ms=sync_for_overhead(0.12, 10.0))
    assert (coord.elche.anchor, coord.elche.proposal) == (10, 20)
    return coord


def test_an_lr_cliff_discards_the_staged_growth_instead_of_halving_it() -> None:
    coord = staged_proposal("nccl_cadence")
    coord.averaging.last_lr = 0.01  # a 90 % drop: the cliff, eff(0.5) on a flat anchor
    out: list[Effect] = []
    coord.averaging.judge([10, 10], out)
    # The nudge goes first and drops the proposal; the guard's Stable has nothing to commit.
    # (Stable first would commit 20 and the nudge would halve it back to 10.)
    assert (coord.elche.anchor, coord.elche.proposal) == (5, None)
    assert [(a.cls, a.detail) for a in out if isinstance(a, Alert)] == [
        ("drift", "LR meta-controller nudged the anchor down ×0.5 (LR cliff 0.1 → 0.01)")
    ]


def test_without_a_cliff_the_guards_stable_commits_the_proposal() -> None:
    coord = staged_proposal("nccl_cadence")
    coord.averaging.judge([10, 10], [])  # LR unchanged: no nudge
    assert (coord.elche.anchor, coord.elche.proposal) == (20, None)
