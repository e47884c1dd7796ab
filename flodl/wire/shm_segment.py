"""Shared-memory segments of the data channel's local lane (format: :mod:`flodl.wire.shm`).

A segment is an anonymous ``memfd`` of its creator, mapped into this process and seen as a
flat ``uint8`` tensor; a peer on the same host maps it through ``/proc/<pid>/fd/<fd>``, which
the kernel opens only for a process of the same user (or root). Nothing is named in
``/dev/shm``, so nothing outlives the processes that map it.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import stat
import warnings
from typing import Self

import torch

from flodl.wire.shm import PROBE_BYTES

__all__ = ["Segment", "available"]


def available() -> str | None:
    """Why this process cannot offer a segment (``None`` when it can)."""
    if not hasattr(os, "memfd_create"):
        return "os.memfd_create is not available on this platform"
    if not os.path.isdir(f"/proc/{os.getpid()}/fd"):
        return "/proc is not mounted"
    return None


class Segment:
    """One mapped segment: :attr:`data` is the whole of it as a ``uint8`` tensor.

    Use :meth:`create` (this process owns it; peers open it) or :meth:`open_peer`; close with
    :meth:`close` (the mapping stays until no tensor views :attr:`data`).
    """

    def __init__(self, fd: int, size: int, probe: bytes, *, writable: bool) -> None:
        self.fd = fd
        self.size = size
        self.probe = probe
        self.pid = os.getpid()
        access = mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ
        self._map: mmap.mmap | None = mmap.mmap(fd, size, access=access)
        with warnings.catch_warnings():  # a read-only map: torch warns that it is not writable
            warnings.simplefilter("ignore", UserWarning)
            self.data = torch.frombuffer(self._map, dtype=torch.uint8)

    @classmethod
    def create(cls, size: int, name: str) -> Segment:
        """A new zeroed segment of ``size`` bytes with a random probe at its start.

        Raises:
            OSError: the memory could not be had.
        """
        fd = os.memfd_create(name, os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            probe = os.urandom(PROBE_BYTES)
            seg = cls(fd, size, probe, writable=True)
        except BaseException:
            os.close(fd)
            raise
        seg.data[:PROBE_BYTES].copy_(torch.frombuffer(bytearray(probe), dtype=torch.uint8))
        return seg

    @classmethod
    def open_peer(cls, pid: int, fd: int, size: int, probe: bytes) -> Segment:
        """Map, read-only, the segment another process of this user named ``(pid, fd)``.

        Raises:
            OSError: it cannot be opened (another host, another user, a process gone), or it
                is not what was named: not a regular file of this user, of another size, or
                with another probe.
        """
        path = f"/proc/{pid}/fd/{fd}"
        peer = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            st = os.fstat(peer)
            if not stat.S_ISREG(st.st_mode):
                raise OSError(f"{path} is not a memory segment")
            if st.st_uid != os.geteuid():
                raise OSError(f"{path} belongs to uid {st.st_uid}, not this process's")
            if st.st_size != size:
                raise OSError(f"{path} is {st.st_size} bytes, {size} were named")
            seg = cls(peer, size, probe, writable=False)
        except BaseException:
            os.close(peer)
            raise
        if bytes(seg.data[:PROBE_BYTES].tolist()) != probe:
            seg.close()
            raise OSError(f"{path} is not the segment named (its probe differs)")
        return seg

    def close(self) -> None:
        """Close the descriptor and drop this object's mapping. Idempotent.

        The pages are unmapped when the last tensor viewing them is freed, not here: a tensor
        made by ``torch.frombuffer`` keeps the ``mmap`` object alive but holds no buffer export,
        so ``mmap.close()`` would unmap under it, and a thread still reading such a view (the
        reduce server's fold of a rank that just died) would read unmapped memory and crash
        the process. With no view left, dropping the last reference unmaps at once.
        """
        m, self._map = self._map, None
        if m is None:
            return
        del self.data
        del m  # (the views, if any, hold the mapping; else this unmaps)
        with contextlib.suppress(OSError):
            os.close(self.fd)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
