"""The coordinator: the pure state machine (sans-IO) and its asyncio shells."""

from __future__ import annotations
