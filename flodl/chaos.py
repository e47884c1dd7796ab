"""Chaos mode: seeded fault injection into a running job (a product feature, and the chaos suite).

A :class:`ChaosPlan` is a list of :class:`Fault` s, each aimed at one rank and triggered at a
point of that rank's own progress — its n-th training step, its first step in a given epoch,
or a time since its training started — so a plan is deterministic for a seed (what happens,
to whom, when), while the recovery it provokes is measured, not assumed. The plan reaches
every rank process through the ``FLODL_CHAOS`` environment variable (the launcher's children
inherit it), and the rank runtime calls the injector's hooks at its step boundaries, before
each averaging upload, inside callbacks and inside bundle saves.

Faults (``kind``):

* ``kill``: SIGKILL (the process vanishes; the launcher's child-exit report is the fast path);
* ``stop``: SIGSTOP for ``duration_s``, then SIGCONT from a detached helper — a hang: the
  heartbeat path declares the rank dead if it outlasts the heartbeat timeout, else it is slow;
* ``close_control`` / ``close_data``: the rank's control or data connection is cut as a
  network failure would cut it;
* ``delay_reduce``: the next averaging upload waits ``duration_s`` (slow, not dead);
* ``kill_in_reduce``: SIGKILL inside the next averaging cycle (the rank entered it — after its
  ``snapshot_ready`` where it sends one —, before the upload or the collective);
* ``delay_ack``: the next averaging round's ``sync_ack`` waits ``duration_s`` after the rank has
  the average (slow, not dead: its heartbeats go on), so that cycle stays pending;
* ``kill_after_ack``: SIGKILL right after the rank's ``sync_ack`` of its next averaging round is
  on the wire: the coordinator has its part of the cycle, which may still wait for others;
* ``kill_in_callback`` / ``kill_in_checkpoint``: SIGKILL inside the next callback
  (``epoch_fn``, eval, ``checkpoint_fn``) or bundle save (after the optimizer state, before
  the model file) on that rank;
* ``kill_after_save``: SIGKILL after the rank wrote its part of the next bundle (its optimizer
  state, and the model file when it is the writer) and before it reports it;
* ``kill_coordinator_in_save``: when the rank is the writer of the next bundle, it SIGKILLs its
  parent (the launcher, which runs the coordinator) after the model file is on disk and before
  the meta can commit it; the ranks then lose their coordinator;
* ``kill_in_reform``: SIGKILL when the rank next starts forming a collective session after a
  death (collective modes), before it reaches the session's barrier: the other survivors are
  left gathering for a member that will never come;
* ``skew_final``: the rank's final parameters are delivered with ``1e-3`` added to the first
  parameter, as a silent divergence (a flipped bit, a nondeterministic kernel) would leave
  them: the launcher must refuse survivors that disagree.

A fault fires in the rank's ``incarnation`` it names (0, the first process, by default): a
respawned rank reads the same plan, and does not fire its first incarnation's faults again.

Each fault is recorded when it fires (``kind: "event"``, class ``chaos``, at node
``root/chaos`` of the record log, wall-clock ``ts``) so :func:`recovery_table` can join it with
the coordinator's records: ``t_detect`` (fault → the rank declared dead) and ``t_resume``
(fault → the survivors' next completed reduce, the coordinator's ``recovered`` record).
"""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, get_args

from flodl.errors import ConfigError

if TYPE_CHECKING:
    import torch

__all__ = [
    "CHAOS_ENV",
    "RECORD_DIR_ENV",
    "FaultKind",
    "Fault",
    "ChaosPlan",
    "RankChaos",
    "recovery_table",
]

logger = logging.getLogger(__name__)

CHAOS_ENV = "FLODL_CHAOS"
RECORD_DIR_ENV = "FLODL_RECORD_LOG"
"""A record_log directory for runs that did not configure one (``flodl chaos`` sets it)."""

FaultKind = Literal[
    "kill",
    "stop",
    "close_control",
    "close_data",
    "delay_reduce",
    "kill_in_reduce",
    "delay_ack",
    "kill_after_ack",
    "kill_in_callback",
    "kill_in_checkpoint",
    "kill_after_save",
    "kill_coordinator_in_save",
    "kill_in_reform",
    "skew_final",
]
FAULT_KINDS: tuple[str, ...] = get_args(FaultKind)
SIGNAL_KINDS = {"KILL": "kill", "STOP": "stop", "CONT": "stop"}


@dataclass(frozen=True)
class Fault:
    """One fault: ``kind`` on ``rank`` when it reaches ``step`` (its own training steps),
    trains its first step of ``epoch`` (or of a later one), or has trained ``after_s`` seconds,
    whichever is set; ``duration_s`` for stop/delay; it fires in the rank's ``incarnation``
    (0: its first process; a respawned one is the next).

    ``epoch`` does not depend on how the batches were split among the ranks: a hook fault
    (``kill_in_checkpoint``, ``kill_after_save``, ``kill_coordinator_in_save``) armed at
    ``epoch=e`` fires in the bundle saved after epoch ``e``, never in epoch ``e − 1``'s,
    since the epoch-boundary callbacks reach a rank before any work of the next epoch
    (docs/design.md §8)."""

    kind: str
    rank: int
    step: int | None = None
    after_s: float | None = None
    duration_s: float = 0.0
    epoch: int | None = None
    incarnation: int = 0

    def __post_init__(self) -> None:
        if self.kind not in FAULT_KINDS:
            raise ConfigError(f"unknown fault kind {self.kind!r}: one of {', '.join(FAULT_KINDS)}")
        if self.rank < 0:
            raise ConfigError(f"fault rank must be >= 0, got {self.rank}")
        triggers = (self.step, self.after_s, self.epoch)
        if sum(t is not None for t in triggers) != 1:
            raise ConfigError("a fault needs exactly one trigger: step, epoch or after_s")
        if self.step is not None and self.step < 0:
            raise ConfigError(f"fault step must be >= 0, got {self.step}")
        if self.epoch is not None and self.epoch < 0:
            raise ConfigError(f"fault epoch must be >= 0, got {self.epoch}")
        if self.after_s is not None and not self.after_s >= 0:
            raise ConfigError(f"fault after_s must be >= 0, got {self.after_s}")
        if self.incarnation < 0:
            raise ConfigError(f"fault incarnation must be >= 0, got {self.incarnation}")
        if not 0 <= self.duration_s <= 3600:
            raise ConfigError(f"fault duration_s must be in [0, 3600], got {self.duration_s}")


@dataclass(frozen=True)
class ChaosPlan:
    """A seeded list of faults (see the module docstring)."""

    faults: tuple[Fault, ...] = ()
    seed: int = 0

    @classmethod
    def generate(
        cls,
        *,
        world_size: int,
        kills: int,
        mtbf_s: float,
        seed: int = 0,
        signals: Sequence[str] = ("KILL",),
        stop_s: float = 2.0,
        spare: Sequence[int] = (),
    ) -> ChaosPlan:
        """``kills`` faults on distinct ranks, spaced by exponential gaps of mean ``mtbf_s``
        seconds of training; each fault's kind is drawn from ``signals`` (``KILL``, ``STOP``,
        ``CONT`` — STOP and CONT make a stop-then-continue hang of ``stop_s``). Ranks in
        ``spare`` are never hit. Deterministic for a seed.

        Raises:
            ConfigError: more faults than ranks that may be hit, a bad signal or interval.
        """
        if not mtbf_s > 0:
            raise ConfigError(f"--mtbf must be > 0 seconds, got {mtbf_s}")
        kinds = []
        for sig in signals:
            name = sig.strip().upper().removeprefix("SIG")
            if name not in SIGNAL_KINDS:
                raise ConfigError(f"unknown signal {sig!r}: use KILL, STOP or CONT")
            kinds.append(SIGNAL_KINDS[name])
        targets = [r for r in range(world_size) if r not in set(spare)]
        if kills > len(targets):
            raise ConfigError(
                f"{kills} faults need as many distinct ranks; {len(targets)} may be hit"
            )
        rng = random.Random(seed)
        ranks = rng.sample(targets, kills)
        at, faults = 0.0, []
        for rank in ranks:
            at += rng.expovariate(1.0 / mtbf_s)
            kind = rng.choice(sorted(set(kinds)))
            duration = stop_s if kind == "stop" else 0.0
            faults.append(Fault(kind, rank, after_s=round(at, 3), duration_s=duration))
        return cls(tuple(faults), seed)

    # ------------------------------------------------------------------ transport
    def to_env(self) -> str:
        return json.dumps({"seed": self.seed, "faults": [asdict(f) for f in self.faults]})

    @classmethod
    def from_env(cls, text: str) -> ChaosPlan:
        """Inverse of :meth:`to_env`.

        Raises:
            ConfigError: the text is not a valid plan.
        """
        try:
            data = json.loads(text)
            faults = tuple(Fault(**f) for f in data["faults"])
            return cls(faults, int(data.get("seed", 0)))
        except ConfigError:
            raise
        except (ValueError, TypeError, KeyError, RecursionError) as exc:
            raise ConfigError(f"{CHAOS_ENV} is not a valid chaos plan: {exc}") from None

    def for_rank(self, rank: int, incarnation: int = 0) -> list[Fault]:
        """``rank``'s faults in its ``incarnation``."""
        return [f for f in self.faults if f.rank == rank and f.incarnation == incarnation]


@dataclass
class RankChaos:
    """The in-rank injector: the runtime calls its hooks; faults fire once each.

    Args:
        rank: this rank.
        faults: this rank's faults.
        record_dir: where fault records go (``None``: only logged).
        abort_control / abort_data: cut the control / data connection.
        flush_control: wait until the frames sent so far are on the control connection's wire
            (``kill_after_ack``).
    """

    rank: int
    faults: list[Fault]
    record_dir: str | None = None
    abort_control: Callable[[], None] | None = None
    abort_data: Callable[[], None] | None = None
    flush_control: Callable[[], object] | None = None
    started: float = field(default_factory=time.monotonic)
    _armed: dict[str, Fault] = field(default_factory=dict)

    @classmethod
    def from_environ(
        cls, rank: int, environ: Mapping[str, str] | None = None, *, incarnation: int = 0
    ) -> RankChaos | None:
        """The injector of ``rank``'s faults in its ``incarnation`` (``accept.incarnation``),
        from the plan in ``FLODL_CHAOS``; None without one."""
        env = os.environ if environ is None else environ
        text = env.get(CHAOS_ENV)
        if not text:
            return None
        faults = ChaosPlan.from_env(text).for_rank(rank, incarnation)
        if not faults:
            return None
        return cls(rank, faults, env.get(RECORD_DIR_ENV) or None)

    # ------------------------------------------------------------------ hooks
    def on_step(self, step: int, epoch: int | None = None) -> None:
        """After each training step (of ``epoch``; None: before training, the initial
        broadcast): fire the faults whose trigger was reached."""
        if not self.faults:
            return
        elapsed = time.monotonic() - self.started
        due = [
            f
            for f in self.faults
            if (f.step is not None and step >= f.step)
            or (f.epoch is not None and epoch is not None and epoch >= f.epoch)
            or (f.after_s is not None and elapsed >= f.after_s)
        ]
        for fault in due:
            self.faults.remove(fault)
            self._fire(fault, step)

    def begin(self) -> None:
        """Training starts (before the initial broadcast): the fault clock starts, and faults
        at step 0 fire here — inside the initial broadcast."""
        self.started = time.monotonic()
        self.on_step(0)

    def before_reduce(self) -> None:
        self._sleep_if_armed("delay_reduce")
        self._kill_if_armed("kill_in_reduce")

    def before_ack(self) -> None:
        """The rank has the round's average; its ``sync_ack`` is about to leave."""
        self._sleep_if_armed("delay_ack")

    def after_ack(self) -> None:
        """The round's ``sync_ack`` was sent: ``kill_after_ack`` once it is on the wire."""
        if "kill_after_ack" in self._armed and self.flush_control is not None:
            self.flush_control()
        self._kill_if_armed("kill_after_ack")

    def in_callback(self) -> None:
        self._kill_if_armed("kill_in_callback")

    def in_save(self) -> None:
        """Between the optimizer state and the model file of a bundle save."""
        self._kill_if_armed("kill_in_checkpoint")

    def after_save(self, *, wrote_model: bool) -> None:
        """After this rank's part of a bundle is on disk, before it reports it."""
        self._kill_if_armed("kill_after_save")
        if wrote_model:
            self._kill_if_armed("kill_coordinator_in_save", os.getppid())

    def in_reform(self) -> None:
        """Before this rank arrives at a new collective session's barrier."""
        self._kill_if_armed("kill_in_reform")

    def final_params(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        """The final parameters this rank delivers (``skew_final``: the first one skewed)."""
        if self._armed.pop("skew_final", None) is None or not params:
            return params
        self._record("skew_final", None)
        return [params[0] + 1e-3, *params[1:]]

    # ------------------------------------------------------------------ faults
    def _sleep_if_armed(self, kind: str) -> None:
        """Fire the armed delay ``kind``: this thread waits its ``duration_s`` (recorded when
        it was armed)."""
        fault = self._armed.pop(kind, None)
        if fault is not None:
            time.sleep(fault.duration_s)

    def _kill_if_armed(self, kind: str, pid: int | None = None) -> None:
        """Fire the armed hook fault ``kind``: record it, then SIGKILL ``pid`` (this process
        unless given; the launcher for ``kill_coordinator_in_save``)."""
        if self._armed.pop(kind, None) is not None:
            self._record(kind, None)
            os.kill(os.getpid() if pid is None else pid, signal.SIGKILL)

    def _fire(self, fault: Fault, step: int) -> None:
        kind = fault.kind
        if kind in _AT_A_HOOK:
            self._armed[kind] = fault  # fires at its hook
            if kind in ("delay_reduce", "delay_ack"):
                self._record(kind, step, duration_s=fault.duration_s)
            return
        self._record(kind, step, duration_s=fault.duration_s)
        if kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif kind == "stop":
            # a detached helper wakes us: nothing of ours runs while we are stopped
            subprocess.Popen(
                [sys.executable, "-c", _WAKER, str(os.getpid()), str(fault.duration_s)],
                start_new_session=True,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            os.kill(os.getpid(), signal.SIGSTOP)
        elif kind == "close_control" and self.abort_control is not None:
            self.abort_control()
        elif kind == "close_data" and self.abort_data is not None:
            self.abort_data()

    def _record(self, kind: str, step: int | None, **extra: Any) -> None:
        detail = f"chaos: {kind} on rank {self.rank}"
        if step is not None:
            detail += f" at step {step}"
        logger.warning(detail)
        if self.record_dir is None:
            return
        from flodl.monitor.records import RecordLog, make_record

        data = {"class": "chaos", "detail": detail, "count": 1, "fault": kind}
        data |= {"rank": self.rank, "step": step, **extra}
        with RecordLog(self.record_dir) as log:
            log.write(make_record("root/chaos", "event", data, sev="warning"))


_AT_A_HOOK = frozenset(
    {
        "delay_reduce",
        "kill_in_reduce",
        "delay_ack",
        "kill_after_ack",
        "kill_in_callback",
        "kill_in_checkpoint",
        "kill_after_save",
        "kill_coordinator_in_save",
        "kill_in_reform",
        "skew_final",
    }
)
"""Faults armed at their trigger and fired at the runtime hook they name."""

_WAKER = (
    "import os, signal, sys, time\n"
    "time.sleep(float(sys.argv[2]))\n"
    "try:\n    os.kill(int(sys.argv[1]), signal.SIGCONT)\nexcept ProcessLookupError:\n    pass\n"
)


def recovery_table(record_dir: str | Path) -> list[dict[str, Any]]:
    """Join fault records with the coordinator's: one row per fault with ``t_detect_s`` (fault
    → that rank declared dead) and ``t_resume_s`` (fault → the next reduce the survivors
    completed after the death), ``None`` where it did not happen (a rank that was only slow).

    Raises:
        ConfigError: ``record_dir`` is not a record directory.
    """
    from flodl.monitor.records import read_tree

    tree = read_tree(record_dir)
    faults = [r for r in tree.get("root/chaos", []) if r["kind"] == "event"]
    deaths: dict[int, dict[str, Any]] = {}
    for path, records in tree.items():
        tail = path.rsplit("/", 1)[-1]
        if not tail.startswith("rank") or not tail[4:].isdigit():
            continue
        for r in records:
            if r["kind"] == "event" and r["data"].get("class") == "rank_lost":
                deaths.setdefault(int(tail[4:]), r)
    recovered = [r for r in tree.get("root", []) if r["kind"] == "recovered"]
    rows = []
    for f in faults:
        rank = f["data"]["rank"]
        row: dict[str, Any] = {
            "fault": f["data"]["fault"],
            "rank": rank,
            "step": f["data"].get("step"),
            "t_detect_s": None,
            "t_resume_s": None,
        }
        death = deaths.get(rank)
        if death is not None and death["ts"] >= f["ts"] - 5:
            row["t_detect_s"] = (death["ts"] - f["ts"]) / 1000.0
            after = [r for r in recovered if rank in r["data"].get("after_deaths", [])]
            if after:
                row["t_resume_s"] = (after[0]["ts"] - f["ts"]) / 1000.0
        rows.append(row)
    return rows
