"""Collective averaging over ``torch.distributed``, its only importer (docs/design.md §0, §2b).

A rank opens one client to the coordinator's ``TCPStore`` (:class:`flodl.service.store.StoreHost`)
and forms its process group on a ``PrefixStore``: session 0 is the full world under
``f"{run_id}/s0"``; after a death the coordinator sends each survivor ``NewSession`` with a fresh
``store_prefix`` and the ascending surviving global ranks, the survivor's position among them
its rank in the new group, and the rank calls :meth:`Collective.form` again (docs/design.md
§2). Backend: NCCL on CUDA devices, Gloo on CPU devices.

Every method runs on the rank's main thread only. Averaging (docs/design.md §2b):

* parameters: ``θ̄ = Σ w_k θ_k / Σ w_k`` in one ``all_reduce(SUM)`` of a flat buffer holding
  ``w_k θ_k`` with ``w_k`` appended as the last element (``Σw == 0``: everyone keeps its own);
* float buffers: the same trick with a 0/1 "moved since the last sync" indicator (an equal
  average over the ranks that stepped); integer and bool buffers are never averaged.

Failures. Any failure inside a collective or a group formation — a dead peer (Gloo: *Connection
closed by peer*, within milliseconds of the death), a silent one (``timeout_s``), an unreachable
store — raises :class:`flodl.errors.CollectiveFailed`. The tensors passed in are then untouched
(results are copied back only after the reduce succeeded), the session is marked broken (every
later collective raises at once, without touching the network), and the caller waits for
``NewSession``, calls :meth:`Collective.form` with its prefix and redoes the reduce from its
pre-sync copy. A failed Gloo group is torn down at once, so a survivor blocked on this rank
(not on the dead one) fails within milliseconds too, instead of at its timeout.

NCCL: the group is created with ``TORCH_NCCL_BLOCKING_WAIT=1`` unless the environment already sets
it, so a timed-out collective raises on this thread instead of the watchdog tearing the process
down (with blocking wait on, torch turns async error handling off); a broken NCCL group is
aborted, not finalised, before the next one forms.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

# torch.distributed re-exports these from torch._C without marking them public for type checkers
from torch.distributed import PrefixStore, TCPStore  # type: ignore[attr-defined]

from flodl.errors import CollectiveFailed, FlodlError, LocalProtocolError

_GATHER_POLL_S = 0.05
"""How often a member waiting for the others at a session's barrier looks again."""

_HALF = (torch.float16, torch.bfloat16)
"""Dtypes whose difference :func:`divergence` takes in float32."""

_NORM_CHUNK = 4096
"""Elements per partial norm in :func:`_square_sum`."""

__all__ = ["Collective", "divergence"]

logger = logging.getLogger(__name__)


class Collective:
    """This rank's membership in the current collective session.

    Construction opens nothing; the store client connects on the first :meth:`form` with more
    than one rank (a one-rank session needs no store and no process group).

    Args:
        store_host: the coordinator's address (where its ``StoreHost`` listens).
        store_port: ``Accept.store_port``.
        device: the rank's device; CUDA selects NCCL, anything else Gloo. Tensors passed to the
            collectives must live there.
        timeout_s: the collective and rendezvous timeout. Keep it below the coordinator-liveness
            timeout so a rank never hangs in a collective longer than the coordinator waits.

    Raises:
        ValueError: ``timeout_s`` not a positive finite number, or ``store_port`` out of range.
    """

    def __init__(
        self,
        store_host: str,
        store_port: int,
        *,
        device: torch.device,
        timeout_s: float,
    ) -> None:
        if not (math.isfinite(timeout_s) and timeout_s > 0):
            raise ValueError(f"timeout_s must be a positive finite number, got {timeout_s}")
        if not 0 < store_port <= 65_535:
            raise ValueError(f"store_port must be in 1..65535, got {store_port}")
        self._host = store_host
        self._port = store_port
        self._device = torch.device(device)
        self._timeout = timedelta(seconds=timeout_s)
        self._store: TCPStore | None = None
        self._owns_group = False  # True while the default process group is ours
        self._formed = False
        self._broken = False
        self._prefix = ""
        self._rank = 0
        self._world_size = 0
        self._flat: dict[str, Tensor] = {}  # reused flat reduce buffers, by purpose
        self._members: tuple[int, ...] = ()  # the session's global ranks, ascending

    # ------------------------------------------------------------------ session
    @property
    def backend(self) -> str:
        """``"nccl"`` for a CUDA device, ``"gloo"`` otherwise."""
        return "nccl" if self._device.type == "cuda" else "gloo"

    @property
    def formed(self) -> bool:
        """True after a successful :meth:`form` (even if a collective has failed since)."""
        return self._formed

    @property
    def broken(self) -> bool:
        """True after a collective failed in the current session (form a new one)."""
        return self._broken

    @property
    def prefix(self) -> str:
        """The store prefix of the current session (``""`` before the first :meth:`form`)."""
        return self._prefix

    @property
    def rank(self) -> int:
        """This rank's position in the current session.

        Raises:
            LocalProtocolError: no session formed.
        """
        self._require_formed()
        return self._rank

    @property
    def world_size(self) -> int:
        """The number of ranks in the current session.

        Raises:
            LocalProtocolError: no session formed.
        """
        self._require_formed()
        return self._world_size

    def form(
        self,
        prefix: str,
        rank: int,
        world_size: int,
        superseded: Callable[[], bool] | None = None,
        members: Sequence[int] | None = None,
    ) -> None:
        """(Re)create the process group for one session, destroying the previous one first.

        Every member calls this with the same ``prefix`` and ``world_size`` and a distinct
        ``rank``; it returns once all of them joined. A prefix must never be reused for a second
        session (its keys are still in the store). ``world_size == 1`` forms nothing: every
        collective is then a local no-op. While the members gather, ``superseded()`` is asked
        every 50 ms: once it says a newer session was announced (a member died meanwhile, so
        this one can never gather), forming gives up at once instead of at the deadline.

        ``members`` are the session's global ranks, ascending (``NewSession.ranks``; default
        ``0..world_size-1``). When they are the previous session's less some (an eviction)
        and the backend can shrink a group (NCCL with ``torch.distributed.shrink_group``),
        the group is shrunk instead of created anew; every member then says whether its
        shrink worked, and unless all of them did, all create the group anew (so no member
        keeps a group the others left).

        Raises:
            ValueError: empty prefix, ``world_size < 1``, or ``rank`` outside ``0..world_size-1``.
            CollectiveFailed: the store was unreachable, not every member joined within twice
                ``timeout_s``, or a newer session superseded this one. No session is formed
                then; wait for the next ``NewSession``.
            FlodlError: a default process group that flodl did not create already exists.
        """
        if not prefix:
            raise ValueError("prefix must be non-empty")
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in 0..{world_size - 1}, got {rank}")
        new_members = tuple(members) if members is not None else tuple(range(world_size))
        if len(new_members) != world_size:
            raise ValueError(f"{len(new_members)} members given for a session of {world_size}")
        old_members = self._members
        if world_size > 1 and self._shrinkable(old_members, new_members):
            if self._shrink(prefix, rank, world_size, old_members, new_members, superseded):
                return
            prefix = f"{prefix}/reform"  # every member falls back together
        self._teardown_group()
        self._formed = False
        self._broken = False
        self._members = new_members
        self._prefix, self._rank, self._world_size = prefix, rank, world_size
        if world_size > 1:
            if not self._owns_group and dist.is_initialized():
                raise FlodlError(
                    "torch.distributed already has a default process group that flodl did not"
                    " create; flodl's collective backend needs the process to itself"
                )
            store = PrefixStore(prefix, self._client())
            self._await_members(store, prefix, rank, world_size, superseded)
            device_id: torch.device | None = None
            if self.backend == "nccl":
                os.environ.setdefault("TORCH_NCCL_BLOCKING_WAIT", "1")
                index = self._device.index
                if index is None:
                    index = torch.cuda.current_device()
                device_id = torch.device("cuda", index)
            self._owns_group = True
            _reset_group_counter()
            try:
                dist.init_process_group(
                    self.backend,
                    store=store,
                    rank=rank,
                    world_size=world_size,
                    timeout=self._timeout,
                    device_id=device_id,
                )
            except RuntimeError as exc:  # DistStoreError / DistNetworkError / backend errors
                self._broken = True
                self._teardown_group()
                raise CollectiveFailed(
                    f"forming session {prefix!r} as rank {rank}/{world_size} failed: {exc}"
                ) from exc
        self._formed = True
        logger.info(
            "collective session %r formed: rank %d of %d (%s)",
            prefix,
            rank,
            world_size,
            self.backend if world_size > 1 else "local",
        )

    def _shrinkable(self, old: tuple[int, ...], new: tuple[int, ...]) -> bool:
        """The new session is the current group less some members, and the backend can
        shrink it."""
        if not (self._owns_group and self._formed and dist.is_initialized()):
            return False
        if not set(new) < set(old):
            return False
        return shrink_supported(self._device)  # (NCCL can; Gloo cannot)

    def _shrink(
        self,
        prefix: str,
        rank: int,
        world_size: int,
        old: tuple[int, ...],
        new: tuple[int, ...],
        superseded: Callable[[], bool] | None,
    ) -> bool:
        """Shrink the group to ``new`` (docs/design.md §2, "Rejoin": eviction by
        ``shrink_group`` on CUDA). True when every member's shrink worked; False (the group
        torn down) when any failed: the caller then forms the session anew.

        Raises:
            CollectiveFailed: the members did not gather, or their answers did not arrive.
        """
        store = PrefixStore(prefix, self._client())
        try:
            self._await_members(store, prefix, rank, world_size, superseded)
        except CollectiveFailed:
            self._broken = True  # the next form starts from this group again, aborting it
            raise
        ok = False
        try:
            excluded = [i for i, g in enumerate(old) if g not in new]
            c10d: Any = dist.distributed_c10d
            flags = c10d.SHRINK_ABORT if self._broken else c10d.SHRINK_DEFAULT
            dist.shrink_group(excluded, shrink_flags=flags)
            ok = dist.get_rank() == rank and dist.get_world_size() == world_size
        except (RuntimeError, TypeError, ValueError) as exc:
            logger.warning("shrinking to session %r failed (%s); forming it anew", prefix, exc)
        keys = [f"flodl_shrunk/{r}" for r in range(world_size)]
        try:
            store.set(keys[rank], "1" if ok else "0")
            store.wait(keys, self._timeout)
            all_ok = all(store.get(k) == b"1" for k in keys)
        except RuntimeError as exc:
            self._broken = True
            self._teardown_group()
            raise CollectiveFailed(
                f"shrinking to session {prefix!r}: the members' answers did not arrive ({exc})"
            ) from exc
        if not all_ok:
            self._broken = True  # (an abort, not a graceful finalise)
            self._teardown_group()
            return False
        self._formed, self._broken = True, False
        self._members = new
        self._prefix, self._rank, self._world_size = prefix, rank, world_size
        logger.info(
            "collective session %r formed by shrinking: rank %d of %d", prefix, rank, world_size
        )
        return True

    def destroy(self) -> None:
        """Leave the session and close the store client. Idempotent; :meth:`form` may follow."""
        self._teardown_group()
        self._formed = False
        self._broken = False
        self._store = None
        self._flat.clear()

    # ------------------------------------------------------------------ collectives
    def broadcast(self, tensors: Sequence[Tensor], src: int = 0) -> None:
        """Overwrite ``tensors`` in place with rank ``src``'s (session rank), on every rank.

        One broadcast per dtype present (the tensors of a dtype travel flattened together), so
        parameters and integer buffers can go in one call.

        Raises:
            ValueError: ``src`` not a rank of the session.
            CollectiveFailed: a peer died or timed out; ``tensors`` are untouched.
            LocalProtocolError: no session formed.
        """
        self._require_formed()
        if not 0 <= src < self._world_size:
            raise ValueError(f"src must be in 0..{self._world_size - 1}, got {src}")
        if self._world_size == 1 or not tensors:
            return
        by_dtype: dict[torch.dtype, list[Tensor]] = {}
        for t in tensors:
            by_dtype.setdefault(t.dtype, []).append(t)
        flats: list[tuple[Tensor, list[Tensor]]] = []
        for group in by_dtype.values():
            flat = torch.cat([t.detach().reshape(-1) for t in group]).to(self._device)
            flats.append((flat, group))
        for flat, _ in flats:
            self._run("broadcast", functools.partial(dist.broadcast, flat, src=src))
        if self._rank == src:
            return
        with torch.no_grad():
            for flat, group in flats:
                _unpack(flat, group)

    def weighted_average(self, params: Sequence[Tensor], weight: float) -> float:
        """Replace ``params`` in place by ``Σ w_k θ_k / Σ w_k`` over the session.

        ``weight`` is this rank's ``w_k`` (``n_k^γ``; ``0`` for a rank that did not step). One
        ``all_reduce(SUM)`` of a reused flat buffer (float32, float64 if any parameter is)
        carries ``w_k θ_k`` and ``w_k`` as its last element. Every rank ends with the same
        values; a rank with ``w_k = 0`` adopts the others' average.

        Returns:
            ``Σ w_k``. ``0.0`` when every weight was 0: parameters are then left unchanged.

        Raises:
            ValueError: ``weight`` negative or not finite.
            TypeError: a parameter is not floating point.
            CollectiveFailed: a peer died or timed out; ``params`` are untouched.
            LocalProtocolError: no session formed.
        """
        w = float(weight)
        if not (math.isfinite(w) and w >= 0.0):
            raise ValueError(f"weight must be finite and >= 0, got {weight}")
        self._require_formed()
        for p in params:
            if not p.is_floating_point():
                raise TypeError(f"weighted_average needs floating parameters, got {p.dtype}")
        if self._world_size == 1:
            return w  # θ̄ = θ; with w = 0 the parameters stay too
        with torch.no_grad():
            flat = self._pack("params", params, w)
            self._run("weighted_average", lambda: dist.all_reduce(flat, op=dist.ReduceOp.SUM))
            total = float(flat[-1].item())
            if total <= 0.0:
                return 0.0
            _unpack(flat[:-1], params, total)
        return total

    def average_buffers(self, buffers: Sequence[Tensor], mover: bool) -> int:
        """Average the floating buffers in place over the ranks that stepped since the last sync.

        ``mover`` is this rank's 0/1 indicator. Integer and bool buffers (``num_batches_tracked``)
        are left alone. One ``all_reduce(SUM)`` (also when no buffer is floating: every rank
        learns the mover count). Non-movers adopt the movers' average.

        Returns:
            The number of movers in the session; ``0`` leaves every buffer unchanged.

        Raises:
            CollectiveFailed: a peer died or timed out; ``buffers`` are untouched.
            LocalProtocolError: no session formed.
        """
        self._require_formed()
        m = 1.0 if mover else 0.0
        if self._world_size == 1:
            return int(m)
        floats = [b for b in buffers if b.is_floating_point()]
        with torch.no_grad():
            flat = self._pack("buffers", floats, m)
            self._run("average_buffers", lambda: dist.all_reduce(flat, op=dist.ReduceOp.SUM))
            movers = round(float(flat[-1].item()))
            if movers <= 0:
                return 0
            _unpack(flat[:-1], floats, movers)
        return movers

    def share_from_lowest(self, tensors: Sequence[Tensor], holder: bool) -> bool:
        """Overwrite ``tensors`` on every member with those of the lowest session rank whose
        ``holder`` is True, bit-exact (a weight-1 / weight-0 average); False, nothing
        changed, when no member holds them.

        Raises:
            CollectiveFailed: as every collective (``tensors`` are then untouched).
        """
        self._require_formed()
        if self._world_size == 1:
            return holder
        top = torch.tensor(
            [float(self._world_size - self._rank) if holder else 0.0], device=self._device
        )
        self._run("finding the lowest holder", lambda: dist.all_reduce(top, op=dist.ReduceOp.MAX))
        highest = int(top.item())
        if highest == 0:
            return False
        root = self._world_size - highest
        self.weighted_average(tensors, 1.0 if self._rank == root else 0.0)
        return True

    def all_reduce_sum(self, t: Tensor) -> None:
        """Sum ``t`` in place over the session (a no-op with one rank).

        Raises:
            CollectiveFailed: a peer died or timed out; ``t`` may be partially reduced.
            LocalProtocolError: no session formed.
        """
        self._require_formed()
        if self._world_size == 1:
            return
        self._run("all_reduce_sum", lambda: dist.all_reduce(t, op=dist.ReduceOp.SUM))

    # ------------------------------------------------------------------ internals
    def _require_formed(self) -> None:
        if not self._formed:
            raise LocalProtocolError("no collective session: call form() first")

    def _await_members(
        self,
        store: Any,
        prefix: str,
        rank: int,
        world_size: int,
        superseded: Callable[[], bool] | None,
    ) -> None:
        """A store barrier before the backend's own rendezvous: every member arrives within
        twice the collective timeout. After a death, survivors learn of the failed collective
        at different moments (a reset at once, a timeout up to ``timeout_s`` later), so the
        backend's mesh, which allows only ``timeout_s``, would otherwise fail for the early ones.
        The barrier polls (``store.check``) so that a newer session can interrupt it: a member
        that dies while the others gather would otherwise cost every survivor the whole wait,
        and then the run (found by the chaos suite: a second kill during a re-form).

        Raises:
            CollectiveFailed: not every member arrived in time, a newer session superseded
                this one, or the store is unreachable.
        """
        keys = [f"flodl_member/{r}" for r in range(world_size)]
        limit_s = 2 * self._timeout.total_seconds()
        deadline = time.monotonic() + limit_s
        try:
            store.set(keys[rank], "1")
            while not store.check(keys):
                if superseded is not None and superseded():
                    raise CollectiveFailed(
                        f"forming session {prefix!r} as rank {rank}/{world_size}: a newer "
                        "session was announced before every member arrived"
                    )
                if time.monotonic() >= deadline:
                    raise CollectiveFailed(
                        f"forming session {prefix!r} as rank {rank}/{world_size}: not every "
                        f"member arrived within {limit_s:g} s"
                    )
                time.sleep(_GATHER_POLL_S)
        except RuntimeError as exc:  # DistStoreError: the store is gone
            raise CollectiveFailed(
                f"forming session {prefix!r} as rank {rank}/{world_size}: the store is "
                f"unreachable ({exc})"
            ) from exc

    def _client(self) -> TCPStore:
        if self._store is None:
            try:
                self._store = TCPStore(
                    self._host,
                    self._port,
                    None,
                    False,  # client
                    timeout=self._timeout,
                    wait_for_workers=False,
                )
            except RuntimeError as exc:
                raise CollectiveFailed(
                    f"cannot reach the coordinator's store at {self._host}:{self._port}: {exc}"
                ) from exc
        return self._store

    def _run(self, what: str, op: Callable[[], object]) -> None:
        if self._broken:
            raise CollectiveFailed(
                f"{what}: session {self._prefix!r} broke in an earlier collective;"
                " form the next session first"
            )
        try:
            op()
            return
        except RuntimeError as exc:  # Gloo: "Connection closed by peer", timeouts; NCCL errors
            error = str(exc)
        # (out of the except block: the exception's traceback holds the failed work, and the
        # work holds the group's connections open)
        self._broken = True
        if self.backend == "gloo" and not shrink_supported(self._device):
            # Close this rank's connections now. A survivor still blocked in the same
            # collective on a receive from this rank (Gloo's ring: it waits on its neighbour,
            # not on the dead rank) then fails at once, "closed by peer", instead of at its
            # collective timeout, 2/3 of the heartbeat timeout later. NCCL, and a group that
            # can shrink, keep their broken group: the next form may shrink it.
            self._teardown_group()
        raise CollectiveFailed(
            f"{what} failed in session {self._prefix!r} (rank {self._rank}"
            f" of {self._world_size}): {error}"
        )

    def _pack(self, purpose: str, tensors: Sequence[Tensor], last: float) -> Tensor:
        """The reused flat buffer ``[last·t0, last·t1, …, last]`` on the session device."""
        dtype = torch.float32
        if any(t.dtype == torch.float64 for t in tensors):
            dtype = torch.float64
        numel = sum(t.numel() for t in tensors) + 1
        flat = self._flat.get(purpose)
        if flat is None or flat.numel() != numel or flat.dtype != dtype:
            flat = torch.empty(numel, dtype=dtype, device=self._device)
            self._flat[purpose] = flat
        if last == 0.0:
            flat.zero_()  # contributes nothing (not even a NaN from 0·inf)
            return flat
        offset = 0
        for t in tensors:
            n = t.numel()
            view = flat[offset : offset + n].view(t.shape)
            if last == 1.0:
                view.copy_(t)
            elif _fusable(t, flat):
                torch.mul(t, last, out=view)  # the scaled copy in one pass over the data
            else:
                view.copy_(t).mul_(last)  # widened (or moved) first, scaled in ``flat``'s dtype
            offset += n
        flat[-1] = last
        return flat

    def _teardown_group(self) -> None:
        if not self._owns_group:
            return
        self._owns_group = False
        if not dist.is_initialized():
            return
        try:
            if self._broken and self.backend == "nccl":
                # A failed NCCL communicator may hang in a graceful finalise: abort it.
                abort: Callable[[], None] = dist.distributed_c10d._abort_process_group
                abort()
            else:
                dist.destroy_process_group()
        except RuntimeError:
            logger.debug("tearing down session %r failed", self._prefix, exc_info=True)


def shrink_supported(device: torch.device) -> bool:
    """Whether the default group's backend on ``device`` can shrink (NCCL ≥ 2.27 in a torch
    with ``torch.distributed.shrink_group``; never Gloo)."""
    if not hasattr(dist, "shrink_group") or not dist.is_initialized():
        return False
    try:
        backend = dist.group.WORLD._get_backend(device)  # type: ignore[union-attr]
    except RuntimeError:
        return False
    return bool(getattr(backend, "supports_shrinking", False))


def _reset_group_counter() -> None:
    """Name the next default group ``"0"`` on every member.

    ``init_process_group`` names the default group (and so its store keys) after a process-wide
    counter that it bumps on every attempt and that only ``destroy_process_group`` resets. A
    member whose last formation failed would otherwise look for other keys than its peers and
    the next session would time out. Resetting it is what ``destroy_process_group`` does "to
    allow consistent value to be generated when we re-create process groups after some trainers
    recover from failure".
    """
    world: Any = getattr(dist.distributed_c10d, "_world", None)
    if world is not None and not dist.is_initialized():
        world.group_count = 0


def _fusable(t: Tensor, flat: Tensor) -> bool:
    """Whether ``t`` and ``flat`` share dtype and device, so that one elementwise op can read
    one and write the other: the same bits as a copy followed by the op on ``flat``, one pass
    over the data instead of two (on the rank's training thread, every round)."""
    return t.dtype == flat.dtype and t.device == flat.device


def _unpack(flat: Tensor, tensors: Sequence[Tensor], divisor: float = 1.0) -> None:
    """Write consecutive slices of ``flat``, divided by ``divisor`` in ``flat``'s dtype, back
    into ``tensors`` (cast to their dtype). ``flat`` itself is left divided only where a
    tensor's dtype or device differs from it."""
    offset = 0
    for t in tensors:
        n = t.numel()
        src = flat[offset : offset + n].view(t.shape)
        if divisor == 1.0:
            t.copy_(src)
        elif _fusable(t, flat):
            torch.div(src, divisor, out=t)
        else:
            t.copy_(src.div_(divisor))
        offset += n


def divergence(
    pre: Sequence[Tensor], post: Sequence[Tensor], *, consume_pre: bool = False
) -> tuple[float, float, float]:
    """``(‖pre − post‖ / ‖post‖, ‖pre‖, ‖post‖)``: L2 over all tensors concatenated
    (docs/design.md §2b).

    ``pre`` is a rank's parameters before the reduce, ``post`` the consensus after it. The ratio
    is ``0.0`` when ``‖post‖`` is 0 or the ratio is not finite (a frame cannot carry NaN).
    Sums of squares in float64 (see :func:`_square_sum`) with one host synchronisation.
    ``consume_pre``: ``pre`` is scratch the caller no longer needs, so the difference is taken
    in place (after ``‖pre‖``) where a pair shares dtype and device and is not a half type,
    instead of in a new tensor per pair; the figures are the same bits either way.

    Raises:
        ValueError: the sequences differ in length or a pair differs in shape.
    """
    if len(pre) != len(post):
        raise ValueError(f"pre has {len(pre)} tensors, post has {len(post)}")
    if not pre:
        return (0.0, 0.0, 0.0)
    squares: list[Tensor] = []
    with torch.no_grad():
        for a, b in zip(pre, post, strict=True):
            if a.shape != b.shape:
                raise ValueError(f"shape mismatch: {tuple(a.shape)} vs {tuple(b.shape)}")
            a = a.detach()
            b = b.detach().to(device=a.device)
            in_place = consume_pre
            if a.dtype in _HALF or b.dtype in _HALF or a.dtype != b.dtype:
                a, b = a.float(), b.float()  # the difference of two rounded values, unrounded
                in_place = False  # as documented: only a pair that shares its dtype is scratch
            of_pre = _square_sum(a)  # before an in-place difference overwrites ``a``
            diff = a.sub_(b) if in_place else a - b
            squares += (_square_sum(diff), of_pre, _square_sum(b))
        per = torch.stack(squares).view(-1, 3).sum(dim=0).sqrt()
        diff2, pre2, post2 = (float(x) for x in per.tolist())
    ratio = diff2 / post2 if post2 > 0.0 else 0.0
    return (ratio if math.isfinite(ratio) else 0.0, pre2, post2)


def _square_sum(x: Tensor) -> Tensor:
    """``Σ x²`` as a float64 scalar tensor, without a float64 copy of ``x``.

    The norms of chunks of :data:`_NORM_CHUNK` elements are taken in ``x``'s dtype (each exact to
    its rounding) and their squares summed in float64. A float64 copy of every tensor cost
    30–150 ms a round in page faults on 2.2 M parameters, charged to the rank's step
    (docs/design.md §2b); this costs a pass over the data. A chunk whose squares overflow the
    dtype gives an infinite sum (the ratio is then reported as 0.0).
    """
    flat = x.reshape(-1)
    whole = flat.numel() - flat.numel() % _NORM_CHUNK
    parts = []
    if whole:
        parts.append(torch.linalg.vector_norm(flat[:whole].view(-1, _NORM_CHUNK), dim=1))
    if whole < flat.numel():
        parts.append(torch.linalg.vector_norm(flat[whole:]).reshape(1))
    if not parts:
        return torch.zeros((), dtype=torch.float64, device=x.device)
    return torch.cat(parts).to(torch.float64).square().sum()
