"""The virtual clock of the pure-coordinator tests (time can't go backwards)."""

from __future__ import annotations


class FakeClock:
    """Monotonic virtual time: moves forward only, never sleeps."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def advance(self, dt: float) -> None:
        if dt < 0:
            raise ValueError(f"a monotonic clock cannot go back by {-dt} s")
        self.now += dt

    def advance_to(self, t: float) -> None:
        self.advance(t - self.now)
        self.now = t  # land exactly on t (no float drift at deadline boundaries)
