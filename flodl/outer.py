"""Outer optimizers: what happens to the averaged parameters between the reduce and the scatter
(docs/design.md §6, SlowMo / DiLoCo).

The pseudo-gradient of a window is ``g = prev_global − consensus``; the first window has
``prev_global = consensus`` (``g = 0``), so the first outer step is the identity.

* :class:`OuterAvg` (default): the identity; nothing is kept.
* :class:`SlowMomentum` ``(lr, mu)``: ``v = mu·v + g; new = prev − lr·v``; the inner optimizer
  runs on continuously.
* :class:`NesterovMomentum` ``(lr, mu)`` (DiLoCo): ``v = mu·v + g; new = prev − lr·(mu·v + g)``;
  ranks reset their inner optimizer state after every window (:attr:`resets_inner`).

Placement: CPU modes apply the step once, at the coordinator, on the folded consensus before
it is sent back; collective modes apply it on every rank after the all-reduce (each rank holds
the same inputs, so each computes the same result). The state (``prev`` and ``velocity``) is
checkpointed to ``<stem>.outer.fdl``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from flodl.config import OuterConfig

__all__ = ["OuterConfig", "OuterAvg", "SlowMomentum", "NesterovMomentum", "OuterStep"]


def OuterAvg() -> OuterConfig:
    """Plain averaging (the default)."""
    return OuterConfig(kind="avg")


def SlowMomentum(lr: float = 1.0, mu: float = 0.9) -> OuterConfig:
    """SlowMo: ``v = mu·v + g; new = prev − lr·v``."""
    return OuterConfig(kind="slow_momentum", lr=lr, mu=mu)


def NesterovMomentum(lr: float = 0.7, mu: float = 0.9) -> OuterConfig:
    """DiLoCo's outer Nesterov step; ranks reset their inner optimizer every window."""
    return OuterConfig(kind="nesterov", lr=lr, mu=mu)


class OuterStep:
    """The outer optimizer's state and step over a fixed list of tensors.

    :meth:`apply` rewrites the consensus in place into the outer optimizer's new global
    parameters and remembers them as the next window's ``prev``.
    """

    def __init__(self, config: OuterConfig) -> None:
        self.config = config
        self.prev: list[torch.Tensor] | None = None
        self.velocity: list[torch.Tensor] | None = None

    @torch.no_grad()
    def apply(self, consensus: Sequence[torch.Tensor]) -> None:
        cfg = self.config
        if cfg.is_identity:
            return
        if self.prev is None:
            self.prev = [t.detach().clone() for t in consensus]
            self.velocity = [torch.zeros_like(t) for t in consensus]
            return
        assert self.velocity is not None
        if len(self.prev) != len(consensus):
            raise ValueError(
                f"outer state holds {len(self.prev)} tensors, the consensus {len(consensus)}"
            )
        for prev, v, c in zip(self.prev, self.velocity, consensus, strict=True):
            g = prev - c
            v.mul_(cfg.mu).add_(g)
            # Nesterov steps along mu·v + g (built in g's storage), SlowMo along v
            step = g.add_(v, alpha=cfg.mu) if cfg.kind == "nesterov" else v
            c.copy_(prev).sub_(step, alpha=cfg.lr)
            prev.copy_(c)

    def state(self) -> dict[str, list[torch.Tensor]]:
        """Checkpointable state (CPU copies); empty before the first window."""
        if self.prev is None or self.velocity is None:
            return {}
        return {
            "prev": [t.detach().to("cpu", copy=True) for t in self.prev],
            "velocity": [t.detach().to("cpu", copy=True) for t in self.velocity],
        }

    def restore(self, state: dict[str, list[torch.Tensor]], like: Sequence[torch.Tensor]) -> None:
        """Load :meth:`state` onto the devices and dtypes of ``like``.

        Raises:
            ValueError: the saved tensors do not match ``like`` (count or shape).
        """
        prev, vel = state.get("prev"), state.get("velocity")
        if not prev or not vel:
            self.prev = self.velocity = None
            return
        if len(prev) != len(like) or len(vel) != len(like):
            raise ValueError(f"outer state has {len(prev)} tensors, the model {len(like)}")
        for p, v, t in zip(prev, vel, like, strict=True):
            if p.shape != t.shape or v.shape != t.shape:
                raise ValueError(f"outer state shape {tuple(p.shape)} vs model {tuple(t.shape)}")
        self.prev = [p.to(t.device, t.dtype, copy=True) for p, t in zip(prev, like, strict=True)]
        self.velocity = [v.to(t.device, t.dtype, copy=True) for v, t in zip(vel, like, strict=True)]
