"""The pure coordinator: a sans-IO state machine (no I/O, no clock, no threads; docs/design.md
§0, §2). Its asyncio and thread shells live in :mod:`flodl.service`."""

from __future__ import annotations
