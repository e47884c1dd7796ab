"""Argument checks of the pure core: each raises :class:`~flodl.errors.LocalProtocolError`
naming the argument (a bad argument here is our own caller's bug, never a peer's).

Pure module.
"""

from __future__ import annotations

from flodl.errors import LocalProtocolError

__all__ = ["require_non_negative", "require_positive"]


def require_non_negative(name: str, value: int) -> None:
    """Raise unless ``value >= 0``."""
    if value < 0:
        raise LocalProtocolError(f"{name} must be >= 0, got {value}")


def require_positive(name: str, value: int) -> None:
    """Raise unless ``value >= 1``."""
    if value < 1:
        raise LocalProtocolError(f"{name} must be >= 1, got {value}")
