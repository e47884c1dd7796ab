"""One data connection of the reduce server: its record (socket, serving thread, receive
buffers), its frame reader and the exceptions that end it.
"""

from __future__ import annotations

import socket
import threading
from dataclasses import dataclass, field

import torch

from flodl.service.reduce_buffers import Flat
from flodl.service.reduce_shm import UploadSegment

__all__ = ["Refused", "PeerClosed", "Conn", "Reader"]


class Refused(Exception):
    """A connection is closed for a protocol reason other than a bad frame (logged)."""


class PeerClosed(Exception):
    """The peer closed the connection between frames (a clean end)."""


@dataclass(eq=False, slots=True)
class Conn:
    sock: socket.socket
    peer: str
    thread: threading.Thread | None = None
    rank: int | None = None
    upload_key: bytes = b""
    """The key of this connection's uploads, agreed by its handshake."""
    closed: bool = False  # shut down on purpose (reason already logged)
    released: bool = False  # socket closed: never touch it again
    params: Flat | None = None
    buffers: Flat | None = None
    scratch: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.uint8))
    shm: UploadSegment | None = None
    """The rank's upload segment once its shared-memory offer was accepted."""


class Reader:
    """``recv_into`` for one frame: no deadline until its first byte, ``timeout`` after."""

    __slots__ = ("_idle", "_sock", "_timeout")

    def __init__(self, sock: socket.socket, timeout: float) -> None:
        self._sock = sock
        self._timeout = timeout
        self._idle = False

    def wait_for_frame(self) -> None:
        self._idle = True
        self._sock.settimeout(None)

    def peek(self, n: int) -> bytes:
        """The next ``n`` bytes, left unread (waits, without a deadline, for the next message;
        fewer at EOF).

        Raises:
            PeerClosed: the peer closed the connection before any byte.
        """
        try:
            data = self._sock.recv(n, socket.MSG_PEEK | socket.MSG_WAITALL)
        except ConnectionResetError:
            raise PeerClosed from None
        if not data:
            raise PeerClosed
        return data

    def __call__(self, view: memoryview) -> int:
        if not self._idle:
            return self._sock.recv_into(view)
        try:
            n = self._sock.recv_into(view)
        except ConnectionResetError:
            raise PeerClosed from None
        if n == 0:
            raise PeerClosed
        self._idle = False
        self._sock.settimeout(self._timeout)
        return n
