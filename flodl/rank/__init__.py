"""The rank process: bridge thread, training runtime, averaging clients."""

from __future__ import annotations
