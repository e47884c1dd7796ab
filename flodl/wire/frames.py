"""The control-plane message catalog: every frame a rank and the coordinator exchange.

Pure module: pydantic models only, no I/O. Each frame is a frozen model with a ``kind``
literal (the snake_case name of the class); :data:`Frame` is their discriminated union and
:data:`FRAME_ADAPTER` the one :class:`pydantic.TypeAdapter` that validates it.

Every numeric field is range-checked (ranks ≥ 0 and below :data:`MAX_WORLD_SIZE`, counters ≥ 0,
durations and weights finite and non-negative, losses finite), every string and list is bounded,
and unknown fields are refused, so a decoded frame is safe to act on.

Directions (docs/design.md §1, in snake_case):

* rank → coordinator: :class:`Hello` (first frame on every connection), :class:`Heartbeat`,
  :class:`Batch`, :class:`SyncAck`, :class:`SnapshotReady`, :class:`Metrics`, :class:`LrUpdate`,
  :class:`Intent`, :class:`EvalResult`, :class:`CheckpointResult`, :class:`EpochFnElapsed`,
  :class:`ResourceSample`, :class:`PartitionRevoked`, :class:`Exiting`, and from a launcher's
  supervisor connection :class:`RankExited`.
* coordinator → rank: :class:`Accept` / :class:`Reject` (handshake reply),
  :class:`CoordHeartbeat`, :class:`StartEpoch`, :class:`ExtendPartition`,
  :class:`RevokePartition`, :class:`RequestParams`, :class:`Update`, :class:`SyncNow`,
  :class:`Throttle`, :class:`SetGlobalStep`, :class:`DeclareDead`, :class:`NewSession`,
  :class:`Checkpoint`, :class:`SaveConsensusModel`, :class:`ExecuteEval`, :class:`ArmConsensusEval`,
  :class:`SetEpochCallbackRole`, :class:`EpochAggregated`, :class:`EvalBroadcast`,
  :class:`StageAdvisory`, :class:`Shutdown`, :class:`ShutdownWithSave`.

Deviation from the original: the NCCL re-rendezvous pair ``RequestNewNcclId`` /
``NewNcclIdGenerated`` is not needed because the coordinator hosts the ``torch.distributed``
store itself; :class:`NewSession` carries a fresh store prefix instead of a 128-byte NCCL uid.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, TypeAdapter, model_validator

from flodl.config import MAX_SCALARS, JobSpec

__all__ = [
    "PROTOCOL_VERSION",
    "MAX_WORLD_SIZE",
    "MAX_SCALARS",
    "SaveReason",
    "Role",
    "EpochPlan",
    "EpochMetrics",
    # rank -> coordinator
    "Hello",
    "Heartbeat",
    "Batch",
    "SyncAck",
    "SnapshotReady",
    "Metrics",
    "LrUpdate",
    "Intent",
    "EvalResult",
    "CheckpointResult",
    "BundleSaved",
    "EpochFnElapsed",
    "SessionFailed",
    "ResourceSample",
    "Exiting",
    "RankExited",
    # coordinator -> rank
    "Accept",
    "Reject",
    "CoordHeartbeat",
    "StartEpoch",
    "ExtendPartition",
    "RevokePartition",
    "PartitionRevoked",
    "RequestParams",
    "Update",
    "SyncNow",
    "Throttle",
    "SetGlobalStep",
    "DeclareDead",
    "NewSession",
    "rank_spans",
    "Checkpoint",
    "SaveConsensusModel",
    "ExecuteEval",
    "ArmConsensusEval",
    "SetEpochCallbackRole",
    "EpochAggregated",
    "EvalBroadcast",
    "StageAdvisory",
    "Shutdown",
    "ShutdownWithSave",
    # unions
    "Frame",
    "RankFrame",
    "CoordFrame",
    "FRAME_ADAPTER",
    "FRAME_KINDS",
    "BUNDLE_TAG_PATTERN",
    "RANK_FRAME_KINDS",
    "COORD_FRAME_KINDS",
]

PROTOCOL_VERSION = 10
"""Version of the control protocol, in every ``hello`` and in the server's challenge; bumped on
any incompatible change of a frame, of the codec or of the handshake. 10: ``new_session`` has
no ``new_rank`` and names its members as runs of consecutive ranks (``spans``), so every member
of a session gets the same frame, encoded once, of a size that grows with the gaps in the
member list instead of the world size; 9: ``session_failed`` (a
member could not form its collective session, or its collective failed, and says so instead of
waiting for a ``new_session`` that only a death would bring); 8: ``update.global_step``
(the CPU modes' ``set_global_step``, folded in) and ``batch.metrics`` (a slice's report on its
last batch); 7: no ``snapshot_ready`` from the ranks of CPU Sync and Cadence; 6: ``hello.gpu``
(the physical GPU behind a CUDA rank's device) and ``resource_sample.device`` / ``gpu_name``;
5: ``hello.job`` (the ranks bring the job description); 4: ``revoke_partition`` /
``partition_revoked`` (a whole-epoch partition re-split for a rank that joins mid-epoch) and
``sync_now.heal`` (the outer optimizer's state copied to a rejoined rank); 3: a
per-connection key from nonces both ways (:mod:`flodl.wire.control_hello`); 2 keyed frames with
the secret itself; see docs/design.md §1."""

BUNDLE_TAG_PATTERN = r"b\d{1,20}-\d{1,10}-[0-9a-f]{6}"
"""A checkpoint save's tag, on its files and in the meta that commits them:
``b<global step>-<bundle version>-<6 hex>``."""

MAX_WORLD_SIZE = 65_536
MAX_U63 = (1 << 63) - 1
MAX_TEXT = 4096
"""Longest free-text field (error messages, reasons), in characters."""
MAX_SEGMENTS = 4096

# ---------------------------------------------------------------------------------------------
# Field types
# ---------------------------------------------------------------------------------------------

RankId = Annotated[int, Field(ge=0, lt=MAX_WORLD_SIZE)]
WorldSize = Annotated[int, Field(ge=1, le=MAX_WORLD_SIZE)]
Count = Annotated[int, Field(ge=0, le=MAX_U63)]
Millis = Annotated[float, Field(ge=0.0, allow_inf_nan=False)]
NonNeg = Annotated[float, Field(ge=0.0, allow_inf_nan=False)]
Finite = Annotated[float, Field(allow_inf_nan=False)]
Text = Annotated[str, StringConstraints(max_length=MAX_TEXT)]
Name = Annotated[str, StringConstraints(min_length=1, max_length=128)]
RunId = Annotated[str, StringConstraints(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")]
Signature = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]
"""A model signature: lowercase hex SHA-256 of the parameter names, shapes and dtypes."""

SaveReason = Literal[
    "graceful_shutdown",
    "max_failure_exceeded",
    "single_survivor",
    "all_ranks_lost",
    "reduce_stall",
]
"""Why a ``shutdown_with_save`` was broadcast (the original's SaveReason, JSON spelling)."""

Role = Literal["rank", "worker", "supervisor"]
"""What a connection is: a training rank, a cooperative-tier worker, or a launcher's
supervisor that reports child exits (``rank_exited``) and trains nothing."""


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", strict=False)


class _Frame(_Model):
    """Base of every frame. Do not instantiate directly."""


# ---------------------------------------------------------------------------------------------
# Shared payloads
# ---------------------------------------------------------------------------------------------


class EpochPlan(_Model):
    """A contiguous slice of an epoch's permutation, in samples: ``[offset, offset + size)``."""

    epoch: Count
    partition_offset: Count
    partition_size: Count


class EpochMetrics(_Model):
    """One epoch's aggregate across ranks (docs/design.md §2).

    Per-rank lists are indexed by rank and have ``world_size`` entries; a rank that reported
    nothing this epoch has ``None`` in the optional lists and 0 in the counters.
    """

    epoch: Count
    avg_loss: Finite
    epoch_ms: Millis
    scalars: dict[Name, Finite] = Field(default_factory=dict, max_length=MAX_SCALARS)
    per_rank: list[dict[Name, Finite]] = Field(default_factory=list, max_length=MAX_WORLD_SIZE)
    per_rank_loss: list[Finite | None] = Field(default_factory=list, max_length=MAX_WORLD_SIZE)
    per_rank_throughput: list[NonNeg] = Field(default_factory=list, max_length=MAX_WORLD_SIZE)
    per_rank_batch_share: list[NonNeg] = Field(default_factory=list, max_length=MAX_WORLD_SIZE)
    per_rank_samples: list[Count] = Field(default_factory=list, max_length=MAX_WORLD_SIZE)
    per_rank_share_complete_ms: list[Millis] = Field(
        default_factory=list, max_length=MAX_WORLD_SIZE
    )
    per_rank_compute_only_ms: list[Millis] = Field(default_factory=list, max_length=MAX_WORLD_SIZE)
    per_rank_data_starve_ms: list[Millis] = Field(default_factory=list, max_length=MAX_WORLD_SIZE)
    device_indices: list[int | None] = Field(default_factory=list, max_length=MAX_WORLD_SIZE)
    syncs: Count = 0
    anchor: Count = 0


# ---------------------------------------------------------------------------------------------
# rank -> coordinator
# ---------------------------------------------------------------------------------------------


class Hello(_Frame):
    """First frame on every connection. The coordinator refuses a wrong protocol, run id,
    world size, a duplicate rank or a model signature that differs from the first rank's."""

    kind: Literal["hello"] = "hello"
    protocol: Annotated[int, Field(ge=0, le=65_535)] = PROTOCOL_VERSION
    run_id: RunId
    rank: RankId
    world_size: WorldSize
    model_signature: Signature
    role: Role = "rank"
    host: Annotated[str, StringConstraints(max_length=255)] = ""
    device: Annotated[str, StringConstraints(max_length=64)] = "cpu"
    gpu: Annotated[str, StringConstraints(max_length=96)] | None = None
    """The physical GPU behind a CUDA ``device`` (its UUID, ``GPU-…``), which tells ranks
    apart whose ``CUDA_VISIBLE_DEVICES`` differ; ``None`` on a CPU rank (docs/design.md §2c,
    "Devices")."""
    job: JobSpec | None = None
    """What the rank trains (docs/design.md §2c, "The ranks bring the job"): the first
    rank's defines a standalone coordinator's job, every other rank must bring the same;
    ``None`` only from a hand-built rank, which no coordinator still waiting for its job
    admits."""


class Heartbeat(_Frame):
    """Sent by the rank's bridge thread every second; ``step`` is the main thread's last
    written optimizer-step counter (cumulative over the run)."""

    kind: Literal["heartbeat"] = "heartbeat"
    rank: RankId
    step: Count


class Metrics(_Frame):
    """A rank's report for a finished chunk (progressive) or epoch partition (sync).

    ``scalars`` maps a ``record_scalar`` name to ``(sum, count)`` over the chunk.
    """

    kind: Literal["metrics"] = "metrics"
    rank: RankId
    epoch: Count
    avg_loss: Finite
    batches_processed: Count
    samples_processed: Count
    epoch_ms: Millis
    share_complete_ms: Millis
    compute_only_ms: Millis
    data_starve_ms: Millis = 0.0
    scalars: dict[Name, tuple[Finite, Count]] = Field(default_factory=dict, max_length=MAX_SCALARS)


class Batch(_Frame):
    """One optimizer step done. ``batch_ms`` is compute only, ``data_ms`` the wait for data.
    ``metrics``: the report of the slice this batch finished, when it was the slice's last
    (one frame where there were two; a slice cut short by ``revoke_partition`` still reports
    in a ``metrics`` frame of its own)."""

    kind: Literal["batch"] = "batch"
    rank: RankId
    epoch: Count
    step: Count
    batch_ms: Millis
    data_ms: Millis = 0.0
    loss: Finite
    param_norm: NonNeg | None = None
    metrics: Metrics | None = None


class SyncAck(_Frame):
    """The rank took part in averaging cycle ``cycle``; ``step`` is its cumulative step count
    at its snapshot. Divergence (docs/design.md §2b): ``||W_pre - W_post|| / ||W_post||``."""

    kind: Literal["sync_ack"] = "sync_ack"
    rank: RankId
    cycle: Count
    step: Count
    session: Count = 0
    divergence: NonNeg | None = None
    pre_norm: NonNeg | None = None
    post_norm: NonNeg | None = None
    error: Text | None = None


class SnapshotReady(_Frame):
    """The rank entered cycle ``cycle`` (its upload or collective starts): the done counts the
    cycle commits if the rank dies before its ``sync_ack``. Sent in CPU Async and the
    collective modes only; ranks that wait for the update train nothing until then, so the
    coordinator reads the same counts from its ledger (docs/design.md §2, commit rule)."""

    kind: Literal["snapshot_ready"] = "snapshot_ready"
    rank: RankId
    cycle: Count
    step: Count = 0


class LrUpdate(_Frame):
    kind: Literal["lr_update"] = "lr_update"
    rank: RankId
    lr: NonNeg


class Intent(_Frame):
    """A cooperative-tier request, folded into the next epoch-boundary dispatch."""

    kind: Literal["intent"] = "intent"
    rank: RankId
    intent: Literal["eval_now", "checkpoint_now"]


class EvalResult(_Frame):
    kind: Literal["eval_result"] = "eval_result"
    rank: RankId
    schedule_id: Count
    epoch: Count
    metric: Finite | None = None
    elapsed_ms: Millis
    error: Text | None = None


class CheckpointResult(_Frame):
    kind: Literal["checkpoint_result"] = "checkpoint_result"
    rank: RankId
    version: Count
    elapsed_ms: Millis
    error: Text | None = None


class BundleSaved(_Frame):
    """A rank wrote its part of checkpoint bundle ``version`` (``model``: it wrote the
    ``.fdl``); ``error`` says why it could not."""

    kind: Literal["bundle_saved"] = "bundle_saved"
    rank: RankId
    version: Count
    model: bool = False
    elapsed_ms: Millis = 0.0
    error: Text | None = None


class EpochFnElapsed(_Frame):
    kind: Literal["epoch_fn_elapsed"] = "epoch_fn_elapsed"
    rank: RankId
    epoch: Count
    elapsed_ms: Millis


class SessionFailed(_Frame):
    """A member of collective session ``session`` could not form it (not every member arrived
    in time) or its collective failed in it; it holds its frames until the next
    ``new_session``, which the coordinator sends for this report when no death does first
    (docs/design.md §2b, "Collective sessions")."""

    kind: Literal["session_failed"] = "session_failed"
    rank: RankId
    session: Count


class ResourceSample(_Frame):
    kind: Literal["resource_sample"] = "resource_sample"
    rank: RankId
    cpu_percent: Annotated[float, Field(ge=0.0, le=100_000.0, allow_inf_nan=False)]
    ram_used: Count
    ram_total: Count
    gpu_util_percent: Annotated[float, Field(ge=0.0, le=100.0, allow_inf_nan=False)] | None = None
    vram_allocated: Count | None = None
    """Bytes torch has allocated on the rank's GPU."""
    vram_reserved: Count | None = None
    """Bytes torch's caching allocator holds on the rank's GPU (allocated and cached)."""
    vram_total: Count | None = None
    device: Annotated[str, StringConstraints(max_length=64)] | None = None
    """The rank's device (``cpu``, ``cuda:N``)."""
    gpu_name: Annotated[str, StringConstraints(max_length=96)] | None = None


class PartitionRevoked(_Frame):
    """The answer to :class:`RevokePartition` (it echoes the range): the last
    ``revoked_size`` samples of it were dropped untrained (0: the rank had started all of it,
    or no longer held it); the rest stays this rank's."""

    kind: Literal["partition_revoked"] = "partition_revoked"
    rank: RankId
    epoch: Count
    partition_offset: Count
    partition_size: Count
    revoked_size: Count


class Exiting(_Frame):
    """Sent only on clean completion: a latch, so a finished rank never counts as a death."""

    kind: Literal["exiting"] = "exiting"
    rank: RankId


class RankExited(_Frame):
    """From a launcher's supervisor connection: a child process ended (fast death path)."""

    kind: Literal["rank_exited"] = "rank_exited"
    rank: RankId
    exit_code: Annotated[int, Field(ge=-255, le=255)]


# ---------------------------------------------------------------------------------------------
# coordinator -> rank
# ---------------------------------------------------------------------------------------------


class Accept(_Frame):
    """Handshake accepted. The rank obeys the coordinator's deadlines from now on: every one of
    them derives from ``heartbeat_timeout_s`` (already scaled) and ``timeout_scale``
    (:class:`~flodl.timeouts.Timeouts`)."""

    kind: Literal["accept"] = "accept"
    protocol: Annotated[int, Field(ge=0, le=65_535)] = PROTOCOL_VERSION
    run_id: RunId
    rank: RankId
    world_size: WorldSize
    session: Count = 0
    heartbeat_timeout_s: Annotated[float, Field(gt=0.0, allow_inf_nan=False)]
    timeout_scale: Annotated[float, Field(ge=0.01, le=1e6, allow_inf_nan=False)] = 1.0
    data_port: Annotated[int, Field(ge=0, le=65_535)] | None = None
    store_port: Annotated[int, Field(ge=0, le=65_535)] | None = None
    incarnation: Count = 0
    """0 for a rank that formed the run; ``k`` for the k-th rejoin of this rank. A rank with
    ``incarnation > 0`` joins a running run: it takes no part in the initial broadcast and
    trains nothing before its first averaging round gives it the consensus."""


class Reject(_Frame):
    """Handshake refused; ``reason`` is printed by the rank before it exits."""

    kind: Literal["reject"] = "reject"
    reason: Text


class CoordHeartbeat(_Frame):
    kind: Literal["coord_heartbeat"] = "coord_heartbeat"


class StartEpoch(_Frame):
    """Train this slice next (a whole-epoch partition or one progressive chunk)."""

    kind: Literal["start_epoch"] = "start_epoch"
    plan: EpochPlan


class ExtendPartition(_Frame):
    """Append a dead rank's untrained slice to the in-flight partition (non-progressive)."""

    kind: Literal["extend_partition"] = "extend_partition"
    epoch: Count
    partition_offset: Count
    partition_size: Count


class RevokePartition(_Frame):
    """Give back the untrained end of a queued slice (non-progressive, a rank joined
    mid-epoch): ``[partition_offset, partition_offset + partition_size)`` is the end of one
    slice this rank was given; the rank drops the part of it it has not started and says how
    much in :class:`PartitionRevoked`."""

    kind: Literal["revoke_partition"] = "revoke_partition"
    epoch: Count
    partition_offset: Count
    partition_size: Count


class RequestParams(_Frame):
    """CPU averaging cycle ``cycle`` starts: upload the weighted parameters."""

    kind: Literal["request_params"] = "request_params"
    cycle: Count


class Update(_Frame):
    """CPU cycle ``version`` finished (the consensus comes on the data channel); in CPU
    Cadence the next chunk is folded in so the rank starts it without another round trip.
    ``global_step``: the run's global step after the cycle (what ``set_global_step`` carries
    in the collective modes; folded in here, one frame fewer per rank per cycle)."""

    kind: Literal["update"] = "update"
    version: Count
    next_plan: EpochPlan | None = None
    global_step: Count | None = None


class SyncNow(_Frame):
    """Collective averaging cycle ``cycle`` starts: all-reduce at the next step boundary.
    ``heal``: a rank awaiting the consensus takes part; the members then also copy the outer
    optimizer's state to it from the lowest member that holds one (docs/design.md §2,
    "Rejoin")."""

    kind: Literal["sync_now"] = "sync_now"
    cycle: Count
    heal: bool = False


class Throttle(_Frame):
    """Block after the current step until the next command (CPU Sync barrier / lead limit)."""

    kind: Literal["throttle"] = "throttle"


class SetGlobalStep(_Frame):
    kind: Literal["set_global_step"] = "set_global_step"
    global_step: Count


class DeclareDead(_Frame):
    kind: Literal["declare_dead"] = "declare_dead"
    rank: RankId
    reason: Text = ""


def rank_spans(ranks: Iterable[int]) -> list[tuple[int, int]]:
    """Strictly ascending global ranks as runs of consecutive ranks, ``(first, count)`` each:
    the members of a :class:`NewSession` as the frame carries them."""
    spans: list[tuple[int, int]] = []
    first = count = -1
    for r in ranks:
        if count > 0 and r == first + count:
            count += 1
            continue
        if count > 0:
            spans.append((first, count))
        first, count = r, 1
    if count > 0:
        spans.append((first, count))
    return spans


class NewSession(_Frame):
    """Re-form the collective group among the session's members (after a death, a grow or a
    ``session_failed``).

    ``spans`` are the members, ``new_world_size`` of them, as runs of consecutive global ranks
    (``(first, count)``, ascending, a gap between two runs: one spelling per member set); a
    member's rank in the new group is its position among them (:meth:`position`). Every
    member gets the same frame, and a frame grows with the gaps in the member list, not with
    the world size: the reference's message, a ``new_rank`` and the whole list per member,
    made a re-form at 4,096 ranks send 4,096 bodies of 12 KB (protocol 10).
    """

    kind: Literal["new_session"] = "new_session"
    session: Count
    store_prefix: Annotated[str, StringConstraints(min_length=1, max_length=128)]
    new_world_size: WorldSize
    spans: list[tuple[RankId, WorldSize]] = Field(max_length=MAX_WORLD_SIZE)

    @model_validator(mode="after")
    def _members(self) -> NewSession:
        total, end = 0, -1
        for first, count in self.spans:
            if first <= end:
                raise ValueError(
                    "spans must be ascending with a gap between two runs "
                    f"(({first}, {count}) starts at or before rank {end}, where the run before "
                    "ends or would go on)"
                )
            end = first + count
            if end > MAX_WORLD_SIZE:
                raise ValueError(f"span ({first}, {count}) ends past rank {MAX_WORLD_SIZE - 1}")
            total += count
        if total != self.new_world_size:
            raise ValueError(
                f"new_world_size is {self.new_world_size} but spans hold {total} members"
            )
        return self

    def members(self) -> list[int]:
        """The members' global ranks, ascending."""
        return [r for first, count in self.spans for r in range(first, first + count)]

    def position(self, rank: int) -> int | None:
        """``rank``'s rank in the new group (its position among the members), None if not a
        member."""
        before = 0
        for first, count in self.spans:
            if rank < first:
                return None
            if rank < first + count:
                return before + rank - first
            before += count
        return None


class Checkpoint(_Frame):
    kind: Literal["checkpoint"] = "checkpoint"
    version: Count
    target_rank: RankId


class SaveConsensusModel(_Frame):
    """Write the checkpoint bundle ``version``: every rank writes its
    ``<stem>.<tag>.rank<N>.optim``, ``target_rank`` also the consensus model
    ``<stem>.<tag>.fdl`` (and, collective modes, the outer optimizer state); each answers
    ``bundle_saved``. ``global_step``/``sync_round`` are stamped into the files so a resume can
    tell they belong to the meta of the same save; ``tag`` (``None``: the untagged names of the
    original layout) keeps them apart from the files the current meta names."""

    kind: Literal["save_consensus_model"] = "save_consensus_model"
    target_rank: RankId
    version: Count = 0
    global_step: Count = 0
    sync_round: Count = 0
    epoch: Count = 0
    tag: Annotated[str, Field(pattern=f"^{BUNDLE_TAG_PATTERN}$")] | None = None


class ExecuteEval(_Frame):
    kind: Literal["execute_eval"] = "execute_eval"
    schedule_id: Count
    epoch: Count
    target_rank: RankId
    adopt_consensus: bool = False


class ArmConsensusEval(_Frame):
    """CPU modes: score the consensus of the next cycle (sent before ``request_params``)."""

    kind: Literal["arm_consensus_eval"] = "arm_consensus_eval"
    schedule_id: Count
    epoch: Count
    target_rank: RankId


class SetEpochCallbackRole(_Frame):
    kind: Literal["set_epoch_callback_role"] = "set_epoch_callback_role"
    rank: RankId


class EpochAggregated(_Frame):
    kind: Literal["epoch_aggregated"] = "epoch_aggregated"
    metrics: EpochMetrics


class EvalBroadcast(_Frame):
    kind: Literal["eval_broadcast"] = "eval_broadcast"
    epoch: Count
    metric: Finite


class StageAdvisory(_Frame):
    """Advisory only, for a background data stager: per-rank counts and predicted segments
    ``(epoch, [(offset, size), …])``."""

    kind: Literal["stage_advisory"] = "stage_advisory"
    counts: list[Count] = Field(max_length=MAX_WORLD_SIZE)
    segments: list[tuple[Count, list[tuple[Count, Count]]]] = Field(max_length=MAX_SEGMENTS)


class Shutdown(_Frame):
    """The run is over: send the final snapshot, ``exiting``, and stop."""

    kind: Literal["shutdown"] = "shutdown"


class ShutdownWithSave(_Frame):
    """Unrecoverable state: the coordinator wrote the meta; write your files and exit."""

    kind: Literal["shutdown_with_save"] = "shutdown_with_save"
    reason: SaveReason
    detail: Text = ""


# ---------------------------------------------------------------------------------------------
# Unions
# ---------------------------------------------------------------------------------------------

RankFrame = (
    Hello
    | Heartbeat
    | Batch
    | SyncAck
    | SnapshotReady
    | Metrics
    | LrUpdate
    | Intent
    | EvalResult
    | CheckpointResult
    | BundleSaved
    | EpochFnElapsed
    | SessionFailed
    | ResourceSample
    | PartitionRevoked
    | Exiting
    | RankExited
)
CoordFrame = (
    Accept
    | Reject
    | CoordHeartbeat
    | StartEpoch
    | ExtendPartition
    | RevokePartition
    | RequestParams
    | Update
    | SyncNow
    | Throttle
    | SetGlobalStep
    | DeclareDead
    | NewSession
    | Checkpoint
    | SaveConsensusModel
    | ExecuteEval
    | ArmConsensusEval
    | SetEpochCallbackRole
    | EpochAggregated
    | EvalBroadcast
    | StageAdvisory
    | Shutdown
    | ShutdownWithSave
)
Frame = Annotated[RankFrame | CoordFrame, Field(discriminator="kind")]

FRAME_ADAPTER: TypeAdapter[RankFrame | CoordFrame] = TypeAdapter(Frame)
"""Built once (pydantic performance tip): validates any frame from plain Python data."""


def _kinds(union: object) -> frozenset[str]:
    members = getattr(union, "__args__", ())
    return frozenset(m.model_fields["kind"].default for m in members)


RANK_FRAME_KINDS = _kinds(RankFrame)
COORD_FRAME_KINDS = _kinds(CoordFrame)
FRAME_KINDS = RANK_FRAME_KINDS | COORD_FRAME_KINDS
