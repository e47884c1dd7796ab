"""Deterministic simulated clusters driving the real pure coordinator (capacity planning)."""

from __future__ import annotations

from flodl.errors import InvariantViolation
from flodl.sim.cluster import Failure, SimCluster, SimTrace

__all__ = ["Failure", "InvariantViolation", "SimCluster", "SimTrace"]
