"""Callbacks and bundles: which rank runs ``epoch_fn``, eval and ``checkpoint_fn``, when, and
how a failed one fails over; the bundle saves the meta commits (docs/design.md §6).

Pure module. Rules:

* **roles** (:class:`~flodl.coord.roles.Roles`): the fastest live rank, elected at the first
  calibration and sticky, or a pinned rank; a role rank's death re-elects; a pinned rank that
  is dead or not joined yet lends its roles to the fastest survivor (a ``roles`` record and a
  ``callback_roles_moved`` alert) and takes them back once it holds the consensus;
* **epoch boundary**: the checkpoint (``checkpoint_every``, ``checkpoint_at_epoch``, or a
  ``checkpoint_now`` intent) and the eval (``eval_every``, or an ``eval_now`` intent) of the
  epoch that just ended are sent before the first ``start_epoch`` of the next, so the role rank
  runs them in FIFO order; the last epoch's eval is the final eval, which always runs, once,
  tagged with the last epoch's index like every eval (``total_epochs − 1``, 0-based as
  ``EpochMetrics.epoch``; its ``schedule_id`` is ``total_epochs``, so no epoch's eval is
  mistaken for it);
* **checkpoint_fn failover**: a failed or dead writer hands the version to the next live rank
  that has not tried it (lowest index first); exhausted → a ``checkpoint_failed`` alert;
* **bundles**: every live rank writes its part (``save_consensus_model``), the target rank the
  model file; the meta, computed at request time, is written only once the model file is on
  disk (``WriteMeta``), so a meta always names a bundle that exists;
* **callback slack**: the epoch-boundary callbacks run on the role ranks when the epoch's
  final reduce is done (they see the consensus), i.e. at the start of the next epoch's first
  window; so when a cycle closes an epoch, the role ranks' quotas of that next window shrink by
  their callbacks' cost (EWMA), and a callback runs in freed slack instead of stretching the
  barrier. (The original shrank the epoch's *last* window, where no callback runs here:
  docs/design.md §6.)
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from flodl.config import CoordConfig
from flodl.coord.effects import Alert, BundleRequested, Effect, EvalDone, Record, Send, WriteMeta
from flodl.coord.elche import ElChe
from flodl.coord.ledger import EpochWork
from flodl.coord.membership import Membership
from flodl.coord.resume import bundle_tag
from flodl.coord.roles import CheckpointRetry, Roles
from flodl.wire.frames import (
    BundleSaved,
    Checkpoint,
    CheckpointResult,
    CoordFrame,
    EvalBroadcast,
    EvalResult,
    ExecuteEval,
    SaveConsensusModel,
    SaveReason,
    SetEpochCallbackRole,
)

__all__ = ["Callbacks"]

MetaRecord = Callable[[SaveReason | str], dict[str, Any]]
"""The checkpoint meta as of now (computed when a bundle is requested)."""


@dataclass(slots=True)
class PendingBundle:
    """A requested bundle awaiting its model file.

    Attributes:
        retry: the writer's failover (its current target).
        meta: the meta to write once the ``.fdl`` is on disk.
        detail: why it was saved.
        writer: the writer the request named.
        unanswered: the live ranks that have not answered the request yet.
    """

    retry: CheckpointRetry
    meta: dict[str, Any]
    detail: str
    writer: int
    unanswered: set[int]

    def answers_as_writer(self, rank: int) -> bool:
        """Whether ``rank``'s answer (the next one) is the current writer's. A rank answers
        every frame it gets, in order, so its first answer is to the request, in which only
        :attr:`writer` was the target: a rank the save was handed to meanwhile answers it as a
        part, not as a failed writer."""
        to_request = rank in self.unanswered
        self.unanswered.discard(rank)
        return self.retry.target == rank and not (to_request and rank != self.writer)


class Callbacks:
    """Roles, callback schedules and their failover, and bundle saves.

    Args:
        config: the run's configuration.
        membership: the roster.
        paths: each rank's record path (alerts name it).
        meta_record: see :data:`MetaRecord`.
    """

    def __init__(
        self,
        config: CoordConfig,
        membership: Membership,
        paths: Sequence[str],
        meta_record: MetaRecord,
        rng: random.Random,
    ) -> None:
        self.config = config
        self.traits = config.elche.traits
        self.membership = membership
        self.paths = paths
        self._meta_record = meta_record
        self._rng = rng
        self.roles = Roles(config.epoch_callback_policy)
        self.intents: set[str] = set()
        self.checkpoints: dict[int, CheckpointRetry] = {}
        self.bundles: dict[int, PendingBundle] = {}
        """Requested bundles awaiting their model file, by version."""
        self._bundle_seq = 0
        self.final_eval: int | None = None
        """The final eval's ``schedule_id`` once it was sent."""

    # ------------------------------------------------------------------ roles
    def send_roles_if_dirty(self, out: list[Effect]) -> None:
        if not self.roles.dirty:
            return
        self.roles.dirty = False
        out.extend(
            self.membership.broadcast(SetEpochCallbackRole(rank=self.roles.epoch_callback_role))
        )

    def elect(self, alive: Sequence[int], smoothed_ms: Sequence[float], out: list[Effect]) -> None:
        """The first calibration: elect the fastest (``Fastest``) and tell the ranks at once,
        so the epoch in progress already ends on the elected rank."""
        why = self.roles.on_first_calibration(alive, smoothed_ms)
        if why:
            out.append(Record("root", "roles", {"roles": why}))
        self.send_roles_if_dirty(out)

    def on_death(self, rank: int, smoothed_ms: Sequence[float], out: list[Effect]) -> None:
        """Move every role and every pending callback of a dead rank to a survivor (one that
        holds the consensus: never a rank admitted mid-run that awaits it)."""
        alive = self.membership.training()
        self._roles_moved(self.roles.on_death(rank, alive, smoothed_ms), out)
        for _version, retry in sorted(self.checkpoints.items()):
            if retry.target == rank:
                self._retry_checkpoint(retry, f"rank {rank} died", out)
        self.failover_bundles(rank, out, ranks_stopped=False)

    def on_formed(
        self, vacant: Sequence[int], smoothed_ms: Sequence[float], out: list[Effect]
    ) -> None:
        """Training starts without ``vacant`` (a minimum world size): the roles they hold go to
        a rank that joined (a pinned rank takes them back when it joins and has the
        consensus)."""
        alive = self.membership.training()
        for rank in vacant:
            self._roles_moved(self.roles.on_absent(rank, alive, smoothed_ms), out)

    def on_consensus(self, ranks: Sequence[int], out: list[Effect]) -> None:
        """``ranks`` (rejoined or late) received the consensus: a pinned rank among them takes
        its roles back, and every rank is told at once."""
        for rank in ranks:
            why = self.roles.on_consensus(rank)
            if why:
                out.append(Record("root", "roles", {"roles": why}))
                out.append(Alert("callback_roles_moved", self.paths[rank], why, "info"))
        self.send_roles_if_dirty(out)

    def _roles_moved(self, why: str, out: list[Effect]) -> None:
        if not why:
            return
        out.append(Record("root", "roles", {"roles": why}))
        if isinstance(self.roles.policy, int):  # the user's choice is overridden: say so
            out.append(Alert("callback_roles_moved", "root", why))

    def observe_epoch_fn(self, rank: int, elapsed_ms: float, out: list[Effect]) -> None:
        self.roles.observe_cost("epoch_fn", rank, elapsed_ms)
        out.append(self._timed("epoch_fn", rank, elapsed_ms))

    def _timed(self, fn: str, rank: int, elapsed_ms: float) -> Record:
        """The ``callback`` record of one callback run on a role rank (its wall time)."""
        return Record(self.paths[rank], "callback", {"fn": fn, "elapsed_ms": elapsed_ms})

    # ------------------------------------------------------------------ schedules
    def checkpoint_due(self, epoch: int) -> bool:
        c = self.config
        every = c.checkpoint_every is not None and (epoch + 1) % c.checkpoint_every == 0
        return every or c.checkpoint_at_epoch == epoch or "checkpoint_now" in self.intents

    def eval_due(self, epoch: int) -> bool:
        every = self.config.effective_eval_every
        due = every is not None and (epoch + 1) % every == 0
        return (due or "eval_now" in self.intents) and self.config.has_eval

    def epoch_boundary(self, done: int, out: list[Effect]) -> None:
        """Checkpoint and eval for the epoch that just ended (``done``)."""
        self.maybe_checkpoint(done, out)
        self.maybe_eval(done, out)

    def maybe_checkpoint(self, epoch: int, out: list[Effect], *, bundle: bool = True) -> None:
        if not self.checkpoint_due(epoch):
            return
        self.intents.discard("checkpoint_now")
        target = self._checkpoint_target()
        if target is None:
            return
        if self.config.has_checkpoint_fn:
            retry = CheckpointRetry(version=epoch)
            retry.first(target)
            self.checkpoints[epoch] = retry
            out.append(Send(target, Checkpoint(version=epoch, target_rank=target)))
        if bundle:
            self.request_bundle("graceful_shutdown", f"checkpoint after epoch {epoch}", out)

    def maybe_eval(self, epoch: int, out: list[Effect], *, final: bool = False) -> bool:
        """Send the eval of ``epoch`` to the eval role if it is due (or ``final``: the final
        eval, which is the last epoch's); True when it was sent."""
        if not (final or self.eval_due(epoch)):
            return False
        self.intents.discard("eval_now")
        target = self.roles.eval_role
        if not self.membership.trains(target):
            return False
        out.append(
            Send(
                target,
                ExecuteEval(
                    schedule_id=self.config.total_epochs if final else epoch,
                    epoch=epoch,
                    target_rank=target,
                    adopt_consensus=self.traits.elastic_blend,
                ),
            )
        )
        return True

    def start_final_eval(self, out: list[Effect]) -> bool:
        """After the last epoch: the final eval, which is that epoch's eval (tagged
        ``total_epochs − 1``); True when sent."""
        if not (self.config.has_eval and self.maybe_eval(self._last_epoch, out, final=True)):
            return False
        self.final_eval = self.config.total_epochs
        return True

    def retry_final_eval(self, out: list[Effect]) -> bool:
        """The eval role died during the final eval: send it to the new one; False when there
        is none (the run then shuts down)."""
        return self.final_eval is not None and self.maybe_eval(self._last_epoch, out, final=True)

    @property
    def _last_epoch(self) -> int:
        return self.config.total_epochs - 1

    def _checkpoint_target(self) -> int | None:
        target = self.roles.checkpoint_role
        if self.membership.trains(target):
            return target
        holders = self.membership.training()  # the model written must be the consensus
        return holders[0] if holders else None

    # ------------------------------------------------------------------ results
    def on_eval_result(self, res: EvalResult, out: list[Effect]) -> bool:
        """An eval finished (or failed); True when it was the final eval."""
        self.roles.observe_cost("eval", res.rank, res.elapsed_ms)
        out.append(self._timed("eval", res.rank, res.elapsed_ms))
        if res.error is None and res.metric is not None:
            out.append(
                Record(
                    "root",
                    "eval",
                    {"epoch": res.epoch, "metric": res.metric, "rank": res.rank},
                )
            )
            out.append(EvalDone(res.epoch, res.metric))
            out.extend(self.membership.broadcast(EvalBroadcast(epoch=res.epoch, metric=res.metric)))
        else:
            out.append(Alert("eval_failed", self.paths[res.rank], f"eval {res.epoch}: {res.error}"))
        return self.final_eval is not None and res.schedule_id == self.final_eval

    def on_checkpoint_result(self, res: CheckpointResult, out: list[Effect]) -> None:
        self.roles.observe_cost("checkpoint", res.rank, res.elapsed_ms)
        out.append(self._timed("checkpoint", res.rank, res.elapsed_ms))
        retry = self.checkpoints.get(res.version)
        if retry is None or retry.target != res.rank:
            return
        if res.error is None:
            self.checkpoints.pop(res.version, None)
            if self.roles.checkpoint_role != res.rank:
                self.roles.checkpoint_role = res.rank
            return
        self._retry_checkpoint(retry, f"rank {res.rank}: {res.error}", out)

    def _retry_checkpoint(self, retry: CheckpointRetry, why: str, out: list[Effect]) -> None:
        nxt = retry.next_target(self.membership.training())
        if nxt is None:
            self.checkpoints.pop(retry.version, None)
            out.append(
                Alert(
                    "checkpoint_failed",
                    "root",
                    f"checkpoint {retry.version} failed on every live rank ({why})",
                )
            )
            return
        out.append(Send(nxt, Checkpoint(version=retry.version, target_rank=nxt)))

    # ------------------------------------------------------------------ bundles
    def request_bundle(self, reason: SaveReason, detail: str, out: list[Effect]) -> None:
        """Ask every live rank for its part of a new bundle (the checkpoint role rank writes
        the model); the meta, computed now, is written when the model file is on disk."""
        if not self.config.save_bundles:
            return
        writer = self._checkpoint_target()
        if writer is None:
            out.append(Alert("checkpoint_failed", "root", f"no live rank to save ({detail})"))
            return
        version = self._bundle_seq
        self._bundle_seq += 1
        retry = CheckpointRetry(version=version)
        retry.first(writer)
        meta = self._meta_record(reason)
        meta["bundle_tag"] = bundle_tag(meta["global_step"], version, self._rng.getrandbits(24))
        self.bundles[version] = PendingBundle(
            retry, meta, detail, writer, set(self.membership.alive())
        )
        out.append(BundleRequested(version, meta["bundle_tag"]))
        out.extend(self.membership.broadcast(self._bundle_frame(version, writer)))

    def _bundle_frame(self, version: int, writer: int) -> CoordFrame:
        meta = self.bundles[version].meta
        return SaveConsensusModel(
            target_rank=writer,
            version=version,
            global_step=meta["global_step"],
            sync_round=meta["sync_round"],
            epoch=meta["epoch"],
            tag=meta["bundle_tag"],
        )

    def on_bundle_saved(self, res: BundleSaved, out: list[Effect], *, ranks_stopped: bool) -> None:
        self.roles.observe_cost("checkpoint", res.rank, res.elapsed_ms)
        out.append(self._timed("checkpoint", res.rank, res.elapsed_ms))
        pending = self.bundles.get(res.version)
        if pending is None or not pending.answers_as_writer(res.rank):
            if res.error is not None:  # a rank's optimizer state: the bundle still commits
                out.append(
                    Alert(
                        "checkpoint_failed",
                        self.paths[res.rank],
                        f"rank {res.rank} could not save its part of bundle {res.version}: "
                        f"{res.error}",
                    )
                )
            return
        if res.model:  # the model file is on disk: the meta commits the bundle
            del self.bundles[res.version]
            out.append(WriteMeta(pending.meta, pending.detail, res.version))
            if res.error is not None:
                out.append(
                    Alert(
                        "checkpoint_failed",
                        self.paths[res.rank],
                        f"bundle {res.version}: rank {res.rank} wrote the model but not its "
                        f"optimizer state: {res.error}",
                    )
                )
            return
        why = f"rank {res.rank}: {res.error or 'no model file written'}"
        self._retry_bundle(res.version, why, out, ranks_stopped=ranks_stopped)

    def abandon_bundles(self, why: str, out: list[Effect]) -> None:
        """Give up every pending bundle (the previous one stays the resume point)."""
        for version in sorted(self.bundles):
            detail = self.bundles.pop(version).detail
            out.append(
                Alert(
                    "checkpoint_failed",
                    "root",
                    f"bundle {version} ({detail}) {why}; the previous checkpoint stays the one "
                    "to resume from",
                )
            )

    def failover_bundles(self, dead: int, out: list[Effect], *, ranks_stopped: bool) -> None:
        for version in sorted(self.bundles):
            pending = self.bundles[version]
            pending.unanswered.discard(dead)  # (a later incarnation of it never got the request)
            if pending.retry.target == dead:
                self._retry_bundle(version, f"rank {dead} died", out, ranks_stopped=ranks_stopped)

    def _retry_bundle(
        self, version: int, why: str, out: list[Effect], *, ranks_stopped: bool
    ) -> None:
        pending = self.bundles[version]
        retry, detail = pending.retry, pending.detail
        # once the ranks were told to stop, none is left to take the save over
        nxt = None if ranks_stopped else retry.next_target(self.membership.training())
        if nxt is None:
            del self.bundles[version]
            out.append(
                Alert(
                    "checkpoint_failed",
                    "root",
                    f"bundle {version} ({detail}) not saved ({why}); the previous checkpoint "
                    "stays the one to resume from",
                )
            )
            return
        out.append(Send(nxt, self._bundle_frame(version, nxt)))

    # ------------------------------------------------------------------ slack
    def stage_slack(self, elche: ElChe, work: EpochWork | None) -> None:
        """Pre-shrink the role ranks' quotas of the window that opens the next epoch, when the
        cycle finalizing now closes ``work``'s epoch: its callbacks run in that window."""
        if not elche.calibrated or work is None or not work.is_done():
            return
        slack = [0.0] * self.config.world_size
        epoch = work.epoch
        roles = self.roles
        if self.config.has_epoch_fn:
            r = roles.epoch_callback_role
            slack[r] += roles.cost("epoch_fn", r)
        if self.config.has_checkpoint_fn and self.checkpoint_due(epoch):
            r = roles.checkpoint_role
            slack[r] += roles.cost("checkpoint", r)
        if self.eval_due(epoch):
            r = roles.eval_role
            slack[r] += roles.cost("eval", r)
        floor = max(0.05 * elche.anchor_wall_ms(), 100.0)
        slack = [
            s if s >= floor and self.membership.is_alive(r) else 0.0 for r, s in enumerate(slack)
        ]
        if any(slack):
            elche.apply_callback_slack(slack)
