"""Every network deadline of a run, derived from one knob (docs/reliability.md, "one knob").

Pure module. ``hb = heartbeat_timeout × FLODL_NET_TIMEOUT_SCALE`` is the only input (plus the
scale itself for the few floors that are not multiples of ``hb``); every other deadline is a
property of :class:`Timeouts`, so the order of the hierarchy holds by construction: a rank
gives up on a collective (``2/3·hb``) before its coordinator would declare it dead (``hb``),
and leaves its process ``hb/3`` after losing its coordinator; heartbeats go out at least three
times per ``hb`` in both directions, so one late heartbeat never reads as a death. The
coordinator builds one ``Timeouts`` (the Trainer's launcher and ``flodl coord`` alike), sends
``hb`` and the scale in ``accept``, and ranks derive theirs from what they receive, never from
their own settings.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from flodl.errors import ConfigError

__all__ = [
    "DEFAULT_HEARTBEAT_TIMEOUT_S",
    "HEARTBEATS_PER_TIMEOUT",
    "HEARTBEAT_INTERVAL_S",
    "MIN_TIMEOUT_SCALE",
    "Timeouts",
    "heartbeat_interval_s",
]

DEFAULT_HEARTBEAT_TIMEOUT_S = 30.0
"""The default liveness timeout, before scaling (the original's)."""
HEARTBEAT_INTERVAL_S = 1.0
"""Heartbeat cadence in both directions (unscaled, as the original), for every ``hb`` of 3 s or
more (every default); :func:`heartbeat_interval_s` shortens it below that."""
MIN_TIMEOUT_SCALE = 0.01
HEARTBEATS_PER_TIMEOUT = 3
"""The fewest heartbeats a liveness window holds (docs/design.md §2b, "Heartbeat cadence")."""


def heartbeat_interval_s(heartbeat_timeout_s: float) -> float:
    """The heartbeat cadence for a liveness timeout ``hb`` (scaled): 1 s, or ``hb / 3`` when
    that is shorter. The original keeps 1 s at every timeout, so a rank that only heartbeats
    (waiting in an averaging round for a peer that hung, say) was declared dead whenever its
    heartbeat came a little late with ``hb`` near 1 s, and always below it."""
    return min(HEARTBEAT_INTERVAL_S, heartbeat_timeout_s / HEARTBEATS_PER_TIMEOUT)


@dataclass(frozen=True, slots=True)
class Timeouts:
    """The deadlines of one run, in seconds.

    Attributes:
        heartbeat_s: ``hb``, the liveness timeout in both directions, already scaled.
        scale: ``FLODL_NET_TIMEOUT_SCALE`` (for the floors that are not multiples of ``hb``).

    Raises:
        ConfigError: a non-positive or non-finite timeout, or a scale below 0.01.
    """

    heartbeat_s: float = DEFAULT_HEARTBEAT_TIMEOUT_S
    scale: float = 1.0

    def __post_init__(self) -> None:
        if not (self.heartbeat_s > 0.0 and math.isfinite(self.heartbeat_s)):
            raise ConfigError(
                f"heartbeat timeout must be a positive finite number of seconds, got "
                f"{self.heartbeat_s!r}"
            )
        if not (self.scale >= MIN_TIMEOUT_SCALE and math.isfinite(self.scale)):
            raise ConfigError(
                f"FLODL_NET_TIMEOUT_SCALE must be a finite number >= {MIN_TIMEOUT_SCALE}, got "
                f"{self.scale!r}"
            )

    @classmethod
    def derive(
        cls, heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT_S, scale: float = 1.0
    ) -> Timeouts:
        """The deadlines for a configured (unscaled) ``heartbeat_timeout`` and a scale."""
        if not (scale >= MIN_TIMEOUT_SCALE and math.isfinite(scale)):
            raise ConfigError(
                f"FLODL_NET_TIMEOUT_SCALE must be a finite number >= {MIN_TIMEOUT_SCALE}, got "
                f"{scale!r}"
            )
        return cls(heartbeat_timeout * scale, scale)

    @property
    def heartbeat_interval_s(self) -> float:
        """Heartbeats in both directions: every second, or ``hb / 3`` when that is shorter
        (:func:`heartbeat_interval_s`)."""
        return heartbeat_interval_s(self.heartbeat_s)

    @property
    def join_s(self) -> float:
        """Cohort formation: every rank joined within ``10 · hb``."""
        return 10.0 * self.heartbeat_s

    @property
    def stall_floor_s(self) -> float:
        """The floor of the stall ceiling: 300 s, scaled."""
        return 300.0 * self.scale

    @property
    def stall_ceiling_s(self) -> float:
        """A pending averaging cycle, or no training progress: ``max(10 · hb, 300 s · scale)``."""
        return max(10.0 * self.heartbeat_s, self.stall_floor_s)

    @property
    def step_hang_floor_s(self) -> float:
        """The least time a rank's training step may run before the rank counts it hung and
        leaves the run: ``2 · hb``, twice what the coordinator gives a silent rank
        (docs/design.md §2b, "A hung training step")."""
        return 2.0 * self.heartbeat_s

    @property
    def step_hang_ceiling_s(self) -> float:
        """The most (and the limit before the rank finished a step): the stall ceiling less
        ``hb``, so a hung rank leaves before the progress watchdog would end the run."""
        return self.stall_ceiling_s - self.heartbeat_s

    @property
    def collective_s(self) -> float:
        """One ``torch.distributed`` operation: ``2/3 · hb``, below liveness, so no rank hangs
        in a collective after its peers declared it dead."""
        return self.heartbeat_s * 2.0 / 3.0

    @property
    def session_form_s(self) -> float:
        """Re-forming a collective session after a death (every survivor must arrive):
        twice the collective timeout."""
        return 2.0 * self.collective_s

    @property
    def hard_exit_grace_s(self) -> float:
        """After losing its coordinator, how long a rank's main thread has to write its death
        record and exit before its bridge ends the process: ``hb/3``, at least 2 s."""
        return max(2.0, self.heartbeat_s / 3.0)

    @property
    def connect_s(self) -> float:
        """A rank connecting to the coordinator: ``hb``."""
        return self.heartbeat_s

    @property
    def data_io_s(self) -> float:
        """One read or send inside a data-plane frame: ``4 · hb`` (at least 4 s)."""
        return 4.0 * max(self.heartbeat_s, 1.0)

    @property
    def handshake_s(self) -> float:
        """A new connection's whole handshake (control ``hello``, data hello), scaled 10 s."""
        return 10.0 * self.scale
