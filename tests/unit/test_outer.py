"""The outer optimizers (docs/design.md §6): OuterStep against a hand-written float64 reference.

The reference below is written from the original's formulas, not from :mod:`flodl.outer`:
``g = prev − consensus; v = mu·v + g``; SlowMo ``new = prev − lr·v``; Nesterov
``new = prev − lr·(mu·v + g)``; the first window only sets ``prev``.
"""

from __future__ import annotations

import math

import pytest
import torch
from pydantic import ValidationError

from flodl.outer import NesterovMomentum, OuterAvg, OuterConfig, OuterStep, SlowMomentum

SHAPES = ((3, 4), (5,), (), (2, 1, 3))
WINDOWS = 6


def consensus(window: int, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    """Window ``window``'s averaged parameters (deterministic, different every window)."""
    gen = torch.Generator().manual_seed(4242 + window)
    return [(torch.randn(s, generator=gen) + 0.25 * window).to(dtype) for s in SHAPES]


class Reference:
    """The original's outer step on float64 copies (independent of flodl.outer)."""

    def __init__(self, kind: str, lr: float, mu: float) -> None:
        self.kind, self.lr, self.mu = kind, lr, mu
        self.prev: list[torch.Tensor] | None = None
        self.v: list[torch.Tensor] = []

    def step(self, cons: list[torch.Tensor]) -> list[torch.Tensor]:
        c = [t.double() for t in cons]
        if self.prev is None:
            self.prev = c
            self.v = [torch.zeros_like(t) for t in c]
            return [t.clone() for t in c]
        out: list[torch.Tensor] = []
        for i, (prev, ci) in enumerate(zip(self.prev, c, strict=True)):
            g = prev - ci
            self.v[i] = self.mu * self.v[i] + g
            direction = self.v[i] if self.kind == "slow" else self.mu * self.v[i] + g
            out.append(prev - self.lr * direction)
        self.prev = [t.clone() for t in out]
        return out


def run(step: OuterStep, windows: range) -> list[list[torch.Tensor]]:
    """Apply ``step`` to the consensus of each window; the results (the tensors rewritten)."""
    outs = []
    for w in windows:
        cons = consensus(w)
        step.apply(cons)
        outs.append(cons)
    return outs


# ---------------------------------------------------------------------- the math
@pytest.mark.parametrize(
    ("config", "kind"),
    [
        (SlowMomentum(lr=0.8, mu=0.5), "slow"),
        (SlowMomentum(lr=1.0, mu=0.9), "slow"),
        (SlowMomentum(lr=1.7, mu=0.0), "slow"),
        (NesterovMomentum(lr=0.7, mu=0.9), "nesterov"),
        (NesterovMomentum(lr=0.3, mu=0.25), "nesterov"),
    ],
    ids=["slowmo-0.8-0.5", "slowmo-1-0.9", "slowmo-1.7-0", "nesterov-0.7-0.9", "nesterov-0.3-0.25"],
)
def test_outer_step_matches_the_reference_over_several_windows(
    config: OuterConfig, kind: str
) -> None:
    step = OuterStep(config)
    ref = Reference(kind, config.lr, config.mu)
    plain_gap = 0.0
    for w in range(WINDOWS):
        cons = consensus(w)
        plain = [t.clone() for t in cons]
        expected = ref.step(cons)
        step.apply(cons)
        for got, want in zip(cons, expected, strict=True):
            assert got.dtype == torch.float32
            torch.testing.assert_close(got, want.float(), rtol=1e-5, atol=1e-5)
        if w == 0:  # first window: identity, sets prev
            assert all(torch.equal(a, b) for a, b in zip(cons, plain, strict=True))
        else:
            gaps = [float((a - b).abs().max()) for a, b in zip(cons, plain, strict=True)]
            plain_gap = max(plain_gap, *gaps)
        assert step.prev is not None and step.velocity is not None
        for prev, t in zip(step.prev, cons, strict=True):
            assert torch.equal(prev, t)  # the new global params are the next window's prev
            assert prev.data_ptr() != t.data_ptr()  # ... as a copy
    assert plain_gap > 0.1  # the outer step is not plain averaging


def test_first_window_is_the_identity_and_starts_zero_momentum() -> None:
    step = OuterStep(NesterovMomentum(lr=0.7, mu=0.9))
    assert step.state() == {}
    cons = consensus(0)
    before = [t.clone() for t in cons]
    step.apply(cons)
    assert all(torch.equal(a, b) for a, b in zip(cons, before, strict=True))
    state = step.state()
    assert all(torch.equal(a, b) for a, b in zip(state["prev"], before, strict=True))
    assert all(not v.any() for v in state["velocity"])
    # a consensus equal to prev is a fixed point: g = 0, v stays 0
    again = [t.clone() for t in before]
    step.apply(again)
    assert all(torch.equal(a, b) for a, b in zip(again, before, strict=True))


def test_slow_momentum_with_lr_1_mu_0_is_plain_averaging() -> None:
    step = OuterStep(SlowMomentum(lr=1.0, mu=0.0))
    for w in range(WINDOWS):
        cons = consensus(w)
        plain = [t.clone() for t in cons]
        step.apply(cons)
        for got, want in zip(cons, plain, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_outer_avg_never_changes_anything_and_keeps_no_state() -> None:
    config = OuterAvg()
    assert config == OuterConfig()  # the default
    assert config.is_identity and not config.resets_inner
    step = OuterStep(config)
    for w in range(3):
        cons = consensus(w)
        before = [t.clone() for t in cons]
        step.apply(cons)
        assert all(torch.equal(a, b) for a, b in zip(cons, before, strict=True))
        assert step.prev is None and step.velocity is None
        assert step.state() == {}


def test_float64_parameters_stay_float64_and_match_the_reference() -> None:
    step = OuterStep(NesterovMomentum(lr=0.7, mu=0.9))
    ref = Reference("nesterov", 0.7, 0.9)
    for w in range(4):
        cons = consensus(w, torch.float64)
        expected = ref.step(cons)
        step.apply(cons)
        for got, want in zip(cons, expected, strict=True):
            assert got.dtype == torch.float64
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_apply_with_another_tensor_count_raises() -> None:
    step = OuterStep(SlowMomentum(lr=0.8, mu=0.5))
    step.apply(consensus(0))
    with pytest.raises(ValueError, match="tensors"):
        step.apply(consensus(1)[:-1])


# ---------------------------------------------------------------------- state
@pytest.mark.parametrize(
    "config", [SlowMomentum(lr=0.8, mu=0.5), NesterovMomentum(lr=0.7, mu=0.9)], ids=["slow", "nag"]
)
def test_state_restore_round_trip_reproduces_the_next_steps_bit_exactly(
    config: OuterConfig,
) -> None:
    first = OuterStep(config)
    run(first, range(3))
    saved = first.state()
    assert set(saved) == {"prev", "velocity"}
    assert any(v.any() for v in saved["velocity"])  # momentum is not trivially zero
    # the snapshot is a copy: neither later steps nor edits to it touch the other side
    expect_prev = [t.clone() for t in saved["prev"]]
    expected = run(first, range(3, WINDOWS))
    assert all(torch.equal(a, b) for a, b in zip(saved["prev"], expect_prev, strict=True))

    resumed = OuterStep(config)
    resumed.restore(saved, consensus(0))
    for t in saved["prev"] + saved["velocity"]:
        t.fill_(float("nan"))  # restore copied, so this cannot leak in
    got = run(resumed, range(3, WINDOWS))
    for a_list, b_list in zip(got, expected, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(a_list, b_list, strict=True))


def test_restore_follows_the_dtype_of_like_and_empty_state_resets() -> None:
    step = OuterStep(SlowMomentum(lr=0.8, mu=0.5))
    source = OuterStep(SlowMomentum(lr=0.8, mu=0.5))
    run(source, range(2))
    step.restore(source.state(), consensus(0, torch.float64))
    assert step.prev is not None and step.velocity is not None
    assert all(t.dtype == torch.float64 for t in step.prev + step.velocity)
    step.restore({}, consensus(0))
    assert step.prev is None and step.velocity is None
    cons = consensus(5)
    before = [t.clone() for t in cons]
    step.apply(cons)  # a fresh first window again
    assert all(torch.equal(a, b) for a, b in zip(cons, before, strict=True))


def test_restore_with_wrong_count_or_shape_raises() -> None:
    source = OuterStep(NesterovMomentum(lr=0.7, mu=0.9))
    run(source, range(2))
    state = source.state()
    like = consensus(0)
    step = OuterStep(NesterovMomentum(lr=0.7, mu=0.9))
    with pytest.raises(ValueError, match="tensors"):
        step.restore(state, like[:-1])
    with pytest.raises(ValueError, match="tensors"):
        step.restore({"prev": state["prev"], "velocity": state["velocity"][:-1]}, like)
    with pytest.raises(ValueError, match="shape"):
        step.restore(state, [*like[:-1], torch.zeros(3, 2)])
    bad_velocity = [*state["velocity"][:-1], torch.zeros(7)]
    with pytest.raises(ValueError, match="shape"):
        step.restore({"prev": state["prev"], "velocity": bad_velocity}, like)
    assert step.prev is None and step.velocity is None  # a failed restore loads nothing


# ---------------------------------------------------------------------- config
def test_factories_and_defaults() -> None:
    assert SlowMomentum() == OuterConfig(kind="slow_momentum", lr=1.0, mu=0.9)
    assert NesterovMomentum() == OuterConfig(kind="nesterov", lr=0.7, mu=0.9)
    assert OuterAvg().kind == "avg"
    assert not SlowMomentum().is_identity and not NesterovMomentum().is_identity


def test_resets_inner_only_for_nesterov() -> None:
    assert NesterovMomentum().resets_inner
    assert not SlowMomentum().resets_inner
    assert not OuterAvg().resets_inner


@pytest.mark.parametrize(
    ("lr", "mu"),
    [
        (0.0, 0.5),
        (-0.1, 0.5),
        (10.5, 0.5),
        (math.nan, 0.5),
        (math.inf, 0.5),
        (1.0, 1.0),
        (1.0, 1.5),
        (1.0, -0.1),
        (1.0, math.nan),
        (1.0, math.inf),
    ],
)
def test_config_rejects_bad_lr_and_mu(lr: float, mu: float) -> None:
    with pytest.raises(ValidationError):
        SlowMomentum(lr=lr, mu=mu)
    with pytest.raises(ValidationError):
        NesterovMomentum(lr=lr, mu=mu)


def test_config_is_frozen_and_strict() -> None:
    config = SlowMomentum(lr=0.8, mu=0.5)
    with pytest.raises(ValidationError):
        config.lr = 0.5  # type: ignore[misc]
    with pytest.raises(ValidationError):
        OuterConfig.model_validate({"kind": "adam"})
    with pytest.raises(ValidationError):
        OuterConfig.model_validate({"kind": "nesterov", "beta": 0.9})
    assert OuterConfig.model_validate(config.model_dump()) == config
    assert SlowMomentum(lr=10.0, mu=0.0).lr == 10.0  # bounds are inclusive where documented
