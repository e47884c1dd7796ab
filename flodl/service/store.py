"""The rendezvous store the coordinator hosts for collective-backend ranks (docs/design.md §2b).

The coordinator process runs one master ``torch.distributed.TCPStore`` and tells every rank its
port in ``Accept.store_port``; each rank opens a client to it and forms its process group on a
``PrefixStore`` (session 0: ``f"{run_id}/s0"``; after a death, the ``store_prefix`` that
``NewSession`` names). The store carries only rendezvous keys, never tensors.

This shell and the CPU reduce server are the coordinator side's only torch importers. Importing
``torch.distributed`` and starting a ``TCPStore`` never initialises CUDA.
"""

from __future__ import annotations

from datetime import timedelta
from types import TracebackType
from typing import Self

# torch.distributed re-exports it from torch._C without marking it public for type checkers
from torch.distributed import TCPStore  # type: ignore[attr-defined]

__all__ = ["StoreHost"]

# The master's own timeout for blocking store calls; the coordinator never makes one (ranks set
# theirs on their clients), so this only bounds the master constructor.
_MASTER_TIMEOUT_S = 30.0


class StoreHost:
    """A master ``TCPStore`` listening on ``host:port`` (``port=0``: an ephemeral port).

    The libuv server runs on its own thread inside torch; nothing here blocks the event loop
    after construction (a few milliseconds). It does not wait for workers: ranks connect
    whenever they form a group.

    Args:
        host: the address to listen on and to hand out to ranks.
        port: the TCP port, ``0`` for any free one (read it back from :attr:`port`).

    Raises:
        ValueError: ``port`` outside ``0..65535``.
        RuntimeError: the port cannot be bound (torch's ``DistNetworkError``).
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        if not 0 <= port <= 65_535:
            raise ValueError(f"port must be in 0..65535, got {port}")
        self._host = host
        self._store: TCPStore | None = TCPStore(
            host,
            port,
            None,  # world_size unknown: sessions shrink after deaths
            True,  # is_master
            timeout=timedelta(seconds=_MASTER_TIMEOUT_S),
            wait_for_workers=False,
            multi_tenant=True,
            use_libuv=True,
        )
        self._port = self._store.port

    @property
    def host(self) -> str:
        """The address the store listens on."""
        return self._host

    @property
    def port(self) -> int:
        """The bound TCP port (the real one when constructed with ``port=0``)."""
        return self._port

    @property
    def closed(self) -> bool:
        """True once :meth:`close` ran."""
        return self._store is None

    def close(self) -> None:
        """Stop the server (drops the last reference to the master store). Idempotent.

        Clients still connected see their next store call fail; a rank mid-collective is not
        affected (collectives do not go through the store).
        """
        self._store = None

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._store is None else "open"
        return f"StoreHost({self._host}:{self._port}, {state})"
