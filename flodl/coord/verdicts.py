"""Anchor verdicts: the vocabulary shared by ElChe, the convergence guards and the meta-controller.

A verdict says what a convergence assessment asks ElChe to do with its reduce window, whoever
produced it. ElChe applies it through :meth:`flodl.coord.elche.ElChe.apply_verdict` and never learns
the source; arbitration between producers is the caller's, in one place.

The guards' ``ConvergenceAction`` is the same three types (a guard never asks for ``relax_up``; the
coordinator adds it when it maps the guard's ``Stable`` onto ElChe).

Pure: standard-library data modules only.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Stable", "SuppressGrowth", "NudgeDown", "AnchorVerdict", "ConvergenceAction"]


@dataclass(frozen=True, slots=True)
class Stable:
    """Convergence is clean: commit the staged grow proposal and count toward re-arming growth.

    Attributes:
        relax_up: also drift the anchor up by one batch (the Async opt-in; see
            :meth:`flodl.coord.elche.ElChe.relax_anchor_up`).
    """

    relax_up: bool = False


@dataclass(frozen=True, slots=True)
class SuppressGrowth:
    """Divergence trending up: veto the staged grow proposal and latch growth off."""


@dataclass(frozen=True, slots=True)
class NudgeDown:
    """Sustained divergence (or a predicted one, e.g. an LR cliff): shrink the anchor.

    Attributes:
        factor: multiplicative shrink (0.5 halves the anchor); ElChe clamps it to [0.1, 1.0] and
            ignores a non-finite value.
    """

    factor: float


AnchorVerdict = Stable | SuppressGrowth | NudgeDown
"""Anything :meth:`flodl.coord.elche.ElChe.apply_verdict` accepts."""

ConvergenceAction = Stable | SuppressGrowth | NudgeDown
"""What a convergence guard returns: the same three verdict types."""
