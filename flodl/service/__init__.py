"""The coordinator process's shells around the pure :mod:`flodl.coord` machine: the asyncio
control server, the CPU reduce server (threads), the ``torch.distributed`` store and their
composition (docs/design.md §0, §2b)."""

from __future__ import annotations
