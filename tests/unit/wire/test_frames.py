"""The frame catalog: every kind round-trips, is immutable, and refuses out-of-range values.

The frame classes are enumerated from the ``RankFrame`` / ``CoordFrame`` unions, so a frame added
to the catalog is covered automatically, and :data:`FACTORIES` must name it (a test fails if not).
"""

from __future__ import annotations

import math
import re
import typing
from collections.abc import Callable
from typing import Any

import msgpack
import pytest
from pydantic import BaseModel, ValidationError

from flodl.config import ElCheConfig, JobSpec, MaxFailure, OuterConfig, Reduction
from flodl.errors import FrameError
from flodl.wire.codec import AnyFrame, decode_body, decode_frame, encode_frame
from flodl.wire.frames import (
    COORD_FRAME_KINDS,
    FRAME_ADAPTER,
    FRAME_KINDS,
    MAX_SCALARS,
    MAX_SEGMENTS,
    MAX_TEXT,
    MAX_WORLD_SIZE,
    PROTOCOL_VERSION,
    RANK_FRAME_KINDS,
    Accept,
    ArmConsensusEval,
    Batch,
    BundleSaved,
    Checkpoint,
    CheckpointResult,
    CoordFrame,
    CoordHeartbeat,
    DeclareDead,
    EpochAggregated,
    EpochFnElapsed,
    EpochMetrics,
    EpochPlan,
    EvalBroadcast,
    EvalResult,
    ExecuteEval,
    Exiting,
    ExtendPartition,
    Heartbeat,
    Hello,
    Intent,
    LrUpdate,
    Metrics,
    NewSession,
    PartitionRevoked,
    RankExited,
    RankFrame,
    Reject,
    RequestParams,
    ResourceSample,
    RevokePartition,
    SaveConsensusModel,
    SessionFailed,
    SetEpochCallbackRole,
    SetGlobalStep,
    Shutdown,
    ShutdownWithSave,
    SnapshotReady,
    StageAdvisory,
    StartEpoch,
    SyncAck,
    SyncNow,
    Throttle,
    Update,
)

SECRET = b"frames-test-secret-0123456789abcdef"
SIG = "0123456789abcdef" * 4
MAX_U63 = (1 << 63) - 1

FRAME_CLASSES: tuple[type[BaseModel], ...] = typing.get_args(RankFrame) + typing.get_args(
    CoordFrame
)
CLASS_BY_KIND: dict[str, type[BaseModel]] = {
    cls.model_fields["kind"].default: cls for cls in FRAME_CLASSES
}


def _kind_of(cls: type[BaseModel]) -> str:
    kind = cls.model_fields["kind"].default
    assert isinstance(kind, str)
    return kind


def _epoch_metrics() -> EpochMetrics:
    return EpochMetrics(
        epoch=7,
        avg_loss=0.4375,
        epoch_ms=12_345.5,
        scalars={"acc": 0.875, "top5": 0.96875},
        per_rank=[{"acc": 0.75}, {}, {"acc": 1.0, "grad/norm": 2.5}],
        per_rank_loss=[0.5, None, 0.25],
        per_rank_throughput=[1200.0, 0.0, 2400.5],
        per_rank_batch_share=[0.25, 0.0, 0.75],
        per_rank_samples=[3000, 0, 9000],
        per_rank_share_complete_ms=[11_000.0, 0.0, 12_000.25],
        per_rank_compute_only_ms=[9_000.0, 0.0, 10_500.0],
        per_rank_data_starve_ms=[125.0, 0.0, 62.5],
        device_indices=[0, None, 1],
        syncs=42,
        anchor=17,
    )


def _slice_metrics() -> Metrics:
    return Metrics(
        rank=1,
        epoch=2,
        avg_loss=0.6875,
        batches_processed=128,
        samples_processed=4096,
        epoch_ms=3_000.5,
        share_complete_ms=2_900.25,
        compute_only_ms=2_500.0,
        data_starve_ms=1.5,
        scalars={"acc": (12.5, 50), "grad/norm": (3.0, 50), "\u00e9chelle": (-1.5, 3)},
    )


# One valid frame per kind, every optional field set to a non-default value (so a dump that
# dropped defaults, or a decoder that filled them in, would be caught by the round trip).
JOB = JobSpec(
    dataset_len=50_000,
    batch_size=64,
    num_epochs=3,
    augment=2,
    epoch_splits=4,
    seed=7,
    elche=ElCheConfig(
        mode="cpu_async",
        anchor=7,
        max_anchor=50,
        min_anchor=3,
        overhead_target=0.1,
        max_batch_diff=4,
        relax_up=True,
        partition_ratios=(1.0, 2.5),
        meta_controller=False,
        easgd_alpha=0.5,
        divergence_threshold=0.2,
        no_divergence_guard=True,
        convergence_guard="msf",
        max_overshoot=3,
        gamma=0.5,
        bf16_wire=True,
    ),
    max_failure=MaxFailure(absolute=2),
    epoch_callback_policy=1,
    has_epoch_fn=True,
    has_checkpoint_fn=True,
    checkpoint_every=2,
    checkpoint_at_epoch=1,
    has_eval=True,
    eval_every=2,
    save_bundles=True,
    reports_per_epoch=4,
    scalar_reductions={"acc": Reduction.MAX},
    outer=OuterConfig(kind="nesterov", lr=0.7, mu=0.9),
    save_path="/runs/job",
    resume_from="/runs/old",
)
"""A job description with every field off its default (nested ones too)."""

FACTORIES: dict[str, Callable[[], AnyFrame]] = {
    # rank -> coordinator
    "hello": lambda: Hello(
        protocol=PROTOCOL_VERSION + 1,
        run_id="run-2024.06_a",
        rank=3,
        world_size=4,
        model_signature=SIG,
        role="worker",
        host="node-7.cluster",
        device="cuda:1",
        gpu="GPU-5f1c3b2a-0d4e-4f6a-9b8c-7e6d5c4b3a21",
        job=JOB,
    ),
    "heartbeat": lambda: Heartbeat(rank=3, step=1_234_567),
    "batch": lambda: Batch(
        rank=2,
        epoch=4,
        step=99,
        batch_ms=12.5,
        data_ms=0.75,
        loss=-0.125,
        param_norm=3.5,
        metrics=_slice_metrics(),
    ),
    "sync_ack": lambda: SyncAck(
        rank=1,
        cycle=7,
        step=420,
        session=2,
        divergence=0.015625,
        pre_norm=10.5,
        post_norm=10.25,
        error="all-reduce timed out \u2014 rank 3 \u2717",
    ),
    "snapshot_ready": lambda: SnapshotReady(rank=5, cycle=8, step=77),
    "metrics": _slice_metrics,
    "lr_update": lambda: LrUpdate(rank=1, lr=3e-4),
    "intent": lambda: Intent(rank=2, intent="checkpoint_now"),
    "eval_result": lambda: EvalResult(
        rank=0, schedule_id=5, epoch=3, metric=0.91, elapsed_ms=812.5, error="CUDA OOM"
    ),
    "checkpoint_result": lambda: CheckpointResult(
        rank=1, version=4, elapsed_ms=150.0, error="disk full"
    ),
    "bundle_saved": lambda: BundleSaved(
        rank=1, version=7, model=True, elapsed_ms=42.0, error="read-only file system"
    ),
    "epoch_fn_elapsed": lambda: EpochFnElapsed(rank=2, epoch=6, elapsed_ms=33.25),
    "session_failed": lambda: SessionFailed(rank=2, session=5),
    "resource_sample": lambda: ResourceSample(
        rank=3,
        cpu_percent=350.5,
        ram_used=8 << 30,
        ram_total=64 << 30,
        gpu_util_percent=87.5,
        vram_allocated=20 << 30,
        vram_reserved=24 << 30,
        vram_total=80 << 30,
        device="cuda:1",
        gpu_name="NVIDIA H200",
    ),
    "partition_revoked": lambda: PartitionRevoked(
        rank=2, epoch=1, partition_offset=640, partition_size=320, revoked_size=192
    ),
    "exiting": lambda: Exiting(rank=6),
    "rank_exited": lambda: RankExited(rank=3, exit_code=-9),
    # coordinator -> rank
    "accept": lambda: Accept(
        protocol=PROTOCOL_VERSION + 1,
        run_id="run-2024.06_a",
        rank=3,
        world_size=4,
        session=3,
        heartbeat_timeout_s=30.5,
        timeout_scale=0.25,
        data_port=40_001,
        store_port=40_002,
        incarnation=2,
    ),
    "reject": lambda: Reject(reason="duplicate rank 3"),
    "coord_heartbeat": CoordHeartbeat,
    "start_epoch": lambda: StartEpoch(
        plan=EpochPlan(epoch=2, partition_offset=1_000, partition_size=500)
    ),
    "extend_partition": lambda: ExtendPartition(
        epoch=2, partition_offset=1_500, partition_size=250
    ),
    "revoke_partition": lambda: RevokePartition(
        epoch=2, partition_offset=1_600, partition_size=150
    ),
    "request_params": lambda: RequestParams(cycle=11),
    "update": lambda: Update(
        version=12,
        next_plan=EpochPlan(epoch=3, partition_offset=0, partition_size=64),
        global_step=480,
    ),
    "sync_now": lambda: SyncNow(cycle=13, heal=True),
    "throttle": Throttle,
    "set_global_step": lambda: SetGlobalStep(global_step=10**12),
    "declare_dead": lambda: DeclareDead(rank=2, reason="heartbeat stale for 31.0 s"),
    "new_session": lambda: NewSession(
        session=2, store_prefix="session-2/", new_world_size=5, spans=[(0, 1), (2, 1), (5, 3)]
    ),
    "checkpoint": lambda: Checkpoint(version=4, target_rank=1),
    "save_consensus_model": lambda: SaveConsensusModel(
        target_rank=2, version=9, global_step=1200, sync_round=40, epoch=3, tag="b1200-9-0a1b2c"
    ),
    "execute_eval": lambda: ExecuteEval(
        schedule_id=6, epoch=3, target_rank=1, adopt_consensus=True
    ),
    "arm_consensus_eval": lambda: ArmConsensusEval(schedule_id=7, epoch=4, target_rank=0),
    "set_epoch_callback_role": lambda: SetEpochCallbackRole(rank=1),
    "epoch_aggregated": lambda: EpochAggregated(metrics=_epoch_metrics()),
    "eval_broadcast": lambda: EvalBroadcast(epoch=3, metric=0.875),
    "stage_advisory": lambda: StageAdvisory(
        counts=[100, 200, 0], segments=[(3, [(0, 100), (300, 50)]), (4, [])]
    ),
    "shutdown": Shutdown,
    "shutdown_with_save": lambda: ShutdownWithSave(
        reason="single_survivor", detail="ranks 1 and 2 lost"
    ),
}


def _build(kind: str) -> AnyFrame:
    return FACTORIES[kind]()


def _dump(kind: str) -> dict[str, Any]:
    data: dict[str, Any] = _build(kind).model_dump(mode="python")
    return data


def _packed(data: object) -> bytes:
    body: bytes = msgpack.packb(data, use_bin_type=True)
    return body


EXCLUSIVE = {("MaxFailure", "percent")}
"""Fields that must stay at their default when another one is set."""


def _assert_non_default(model: BaseModel) -> None:
    for name, field in type(model).model_fields.items():
        value = getattr(model, name)
        if isinstance(value, BaseModel):
            _assert_non_default(value)
        if name == "kind" or field.is_required() or (type(model).__name__, name) in EXCLUSIVE:
            continue
        default = field.get_default(call_default_factory=True)
        assert value != default, f"{type(model).__name__}.{name} is left at its default"


# ---------------------------------------------------------------------------------------------
# Catalog shape
# ---------------------------------------------------------------------------------------------


def test_factory_table_covers_every_kind() -> None:
    missing = sorted(FRAME_KINDS - FACTORIES.keys())
    stale = sorted(FACTORIES.keys() - FRAME_KINDS)
    assert not missing, f"add a factory for {missing}"
    assert not stale, f"factories for unknown kinds {stale}"


def test_kind_sets_match_the_unions() -> None:
    assert len(CLASS_BY_KIND) == len(FRAME_CLASSES), "two frame classes share a kind"
    assert frozenset(_kind_of(c) for c in typing.get_args(RankFrame)) == RANK_FRAME_KINDS
    assert frozenset(_kind_of(c) for c in typing.get_args(CoordFrame)) == COORD_FRAME_KINDS
    assert not RANK_FRAME_KINDS & COORD_FRAME_KINDS
    assert RANK_FRAME_KINDS | COORD_FRAME_KINDS == FRAME_KINDS


@pytest.mark.parametrize("cls", FRAME_CLASSES, ids=_kind_of)
def test_kind_is_snake_case_class_name(cls: type[BaseModel]) -> None:
    assert _kind_of(cls) == re.sub(r"(?<!^)(?=[A-Z])", "_", cls.__name__).lower()


# ---------------------------------------------------------------------------------------------
# Round trip and immutability, for every kind
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cls", FRAME_CLASSES, ids=_kind_of)
def test_factory_builds_a_representative_instance(cls: type[BaseModel]) -> None:
    kind = _kind_of(cls)
    assert kind in FACTORIES, f"add a factory for {kind!r}"
    frame = _build(kind)
    assert type(frame) is cls
    assert frame.kind == kind
    _assert_non_default(frame)


@pytest.mark.parametrize("seq", [0, 1, 2**40])
@pytest.mark.parametrize("cls", FRAME_CLASSES, ids=_kind_of)
def test_encode_decode_round_trip(cls: type[BaseModel], seq: int) -> None:
    frame = _build(_kind_of(cls))
    wire = encode_frame(frame, SECRET, seq=seq)
    decoded = decode_frame(wire, SECRET, seq=seq)
    assert type(decoded) is cls
    assert decoded == frame
    assert decoded.model_dump() == frame.model_dump()
    # deterministic: re-encoding the decoded frame gives the same bytes
    assert encode_frame(decoded, SECRET, seq=seq) == wire


@pytest.mark.parametrize("cls", FRAME_CLASSES, ids=_kind_of)
def test_adapter_validates_the_dump(cls: type[BaseModel]) -> None:
    frame = _build(_kind_of(cls))
    assert FRAME_ADAPTER.validate_python(frame.model_dump(mode="python")) == frame
    assert decode_body(_packed(frame.model_dump(mode="python"))) == frame


@pytest.mark.parametrize("cls", FRAME_CLASSES, ids=_kind_of)
def test_frames_are_immutable(cls: type[BaseModel]) -> None:
    frame = _build(_kind_of(cls))
    before = frame.model_dump()
    names = [n for n in cls.model_fields if n != "kind"] or ["kind"]
    for name in names:
        with pytest.raises(ValidationError, match="frozen"):
            setattr(frame, name, getattr(frame, name))
    with pytest.raises(ValidationError):
        setattr(frame, "kind", "heartbeat" if frame.kind != "heartbeat" else "batch")  # noqa: B010
    assert frame.model_dump() == before


def test_nested_payloads_are_immutable() -> None:
    start = FACTORIES["start_epoch"]()
    assert isinstance(start, StartEpoch)
    with pytest.raises(ValidationError, match="frozen"):
        start.plan.epoch = 99  # type: ignore[misc]
    agg = FACTORIES["epoch_aggregated"]()
    assert isinstance(agg, EpochAggregated)
    with pytest.raises(ValidationError, match="frozen"):
        agg.metrics.avg_loss = 0.0  # type: ignore[misc]


def test_defaults_are_filled_in() -> None:
    hello = Hello(run_id="r", rank=0, world_size=1, model_signature=SIG)
    assert hello.protocol == PROTOCOL_VERSION
    assert hello.role == "rank"
    body = {"kind": "batch", "rank": 0, "epoch": 0, "step": 0, "batch_ms": 1.0, "loss": 0.5}
    batch = decode_body(_packed(body))
    assert isinstance(batch, Batch)
    assert batch.data_ms == 0.0
    assert batch.param_norm is None


# ---------------------------------------------------------------------------------------------
# Range checks: rejected at construction (ValidationError) and on the wire (FrameError)
# ---------------------------------------------------------------------------------------------


def _metrics_with(**over: object) -> dict[str, Any]:
    data: dict[str, Any] = _epoch_metrics().model_dump(mode="python")
    data.update(over)
    return data


def _plan_with(**over: object) -> dict[str, Any]:
    data: dict[str, Any] = {"epoch": 1, "partition_offset": 0, "partition_size": 10}
    data.update(over)
    return data


NAN = math.nan
INF = math.inf

BAD: list[tuple[str, str, dict[str, Any]]] = [
    # (id, kind, overrides applied to the factory's dump)
    # negative rank / rank >= MAX_WORLD_SIZE
    ("heartbeat-rank-negative", "heartbeat", {"rank": -1}),
    ("heartbeat-rank-world", "heartbeat", {"rank": MAX_WORLD_SIZE}),
    ("batch-rank-negative", "batch", {"rank": -1}),
    ("hello-rank-world", "hello", {"rank": MAX_WORLD_SIZE}),
    ("hello-rank-huge", "hello", {"rank": 2**40}),
    ("declare_dead-rank-world", "declare_dead", {"rank": MAX_WORLD_SIZE}),
    ("checkpoint-target-negative", "checkpoint", {"target_rank": -3}),
    ("new_session-span-negative", "new_session", {"spans": [(-1, 2), (2, 1), (5, 2)]}),
    ("new_session-span-world", "new_session", {"spans": [(0, 1), (2, 1), (MAX_WORLD_SIZE, 3)]}),
    ("new_session-span-past-world", "new_session", {"spans": [(MAX_WORLD_SIZE - 2, 5)]}),
    ("new_session-span-empty", "new_session", {"spans": [(0, 1), (2, 0), (5, 4)]}),
    ("new_session-spans-unsorted", "new_session", {"spans": [(5, 3), (0, 1), (2, 1)]}),
    ("new_session-spans-overlap", "new_session", {"spans": [(0, 3), (2, 1), (5, 1)]}),
    ("new_session-spans-adjacent", "new_session", {"spans": [(0, 1), (1, 1), (5, 3)]}),
    ("new_session-world-not-members", "new_session", {"new_world_size": 4}),
    ("new_session-new_rank-gone", "new_session", {"new_rank": 1}),
    ("new_session-ranks-gone", "new_session", {"ranks": [0, 2, 5, 6, 7]}),
    ("hello-world_size-zero", "hello", {"world_size": 0}),
    ("hello-world_size-over", "hello", {"world_size": MAX_WORLD_SIZE + 1}),
    ("accept-world_size-zero", "accept", {"world_size": 0}),
    # counters
    ("heartbeat-step-negative", "heartbeat", {"step": -1}),
    ("heartbeat-step-over-u63", "heartbeat", {"step": MAX_U63 + 1}),
    ("set_global_step-negative", "set_global_step", {"global_step": -5}),
    ("stage_advisory-count-negative", "stage_advisory", {"counts": [1, -1]}),
    ("stage_advisory-segment-negative", "stage_advisory", {"segments": [(1, [(0, -4)])]}),
    ("hello-protocol-over-u16", "hello", {"protocol": 65_536}),
    ("hello-protocol-negative", "hello", {"protocol": -1}),
    ("accept-port-over-u16", "accept", {"data_port": 65_536}),
    ("accept-incarnation-negative", "accept", {"incarnation": -1}),
    ("rank_exited-code-over", "rank_exited", {"exit_code": 256}),
    ("rank_exited-code-under", "rank_exited", {"exit_code": -256}),
    # NaN / inf losses and metrics
    ("batch-loss-nan", "batch", {"loss": NAN}),
    ("batch-loss-inf", "batch", {"loss": INF}),
    ("batch-loss-minus-inf", "batch", {"loss": -INF}),
    ("metrics-avg_loss-nan", "metrics", {"avg_loss": NAN}),
    ("metrics-scalar-sum-inf", "metrics", {"scalars": {"acc": (INF, 1)}}),
    ("eval_result-metric-nan", "eval_result", {"metric": NAN}),
    ("eval_broadcast-metric-inf", "eval_broadcast", {"metric": INF}),
    ("epoch_aggregated-avg_loss-nan", "epoch_aggregated", {"metrics": _metrics_with(avg_loss=NAN)}),
    (
        "epoch_aggregated-per_rank_loss-inf",
        "epoch_aggregated",
        {"metrics": _metrics_with(per_rank_loss=[0.5, INF, None])},
    ),
    # NaN / inf / negative durations (ms)
    ("batch-batch_ms-nan", "batch", {"batch_ms": NAN}),
    ("batch-batch_ms-inf", "batch", {"batch_ms": INF}),
    ("batch-batch_ms-negative", "batch", {"batch_ms": -1.0}),
    ("batch-data_ms-negative", "batch", {"data_ms": -0.5}),
    ("metrics-epoch_ms-inf", "metrics", {"epoch_ms": INF}),
    ("metrics-compute_only_ms-negative", "metrics", {"compute_only_ms": -1.0}),
    ("metrics-data_starve_ms-nan", "metrics", {"data_starve_ms": NAN}),
    ("eval_result-elapsed-nan", "eval_result", {"elapsed_ms": NAN}),
    ("checkpoint_result-elapsed-negative", "checkpoint_result", {"elapsed_ms": -2.0}),
    ("epoch_fn_elapsed-elapsed-inf", "epoch_fn_elapsed", {"elapsed_ms": INF}),
    ("session_failed-session-negative", "session_failed", {"session": -1}),
    ("accept-timeout-zero", "accept", {"heartbeat_timeout_s": 0.0}),
    ("accept-timeout-inf", "accept", {"heartbeat_timeout_s": INF}),
    ("accept-scale-below-floor", "accept", {"timeout_scale": 0.001}),
    ("save-tag-not-a-tag", "save_consensus_model", {"tag": "../../etc/passwd"}),
    (
        "epoch_aggregated-share_complete-negative",
        "epoch_aggregated",
        {"metrics": _metrics_with(per_rank_share_complete_ms=[1.0, -1.0, 2.0])},
    ),
    # negative / non-finite weights and norms
    ("lr_update-lr-negative", "lr_update", {"lr": -1e-3}),
    ("lr_update-lr-nan", "lr_update", {"lr": NAN}),
    ("batch-param_norm-negative", "batch", {"param_norm": -0.1}),
    ("sync_ack-divergence-negative", "sync_ack", {"divergence": -1.0}),
    ("sync_ack-pre_norm-inf", "sync_ack", {"pre_norm": INF}),
    (
        "epoch_aggregated-batch_share-negative",
        "epoch_aggregated",
        {"metrics": _metrics_with(per_rank_batch_share=[0.5, -0.1, 0.6])},
    ),
    (
        "epoch_aggregated-throughput-nan",
        "epoch_aggregated",
        {"metrics": _metrics_with(per_rank_throughput=[NAN])},
    ),
    ("resource_sample-cpu-negative", "resource_sample", {"cpu_percent": -1.0}),
    ("resource_sample-gpu-over-100", "resource_sample", {"gpu_util_percent": 100.5}),
    ("metrics-scalar-count-negative", "metrics", {"scalars": {"acc": (1.0, -1)}}),
    # over-long / malformed strings
    ("reject-reason-too-long", "reject", {"reason": "x" * (MAX_TEXT + 1)}),
    ("sync_ack-error-too-long", "sync_ack", {"error": "e" * (MAX_TEXT + 1)}),
    ("declare_dead-reason-too-long", "declare_dead", {"reason": "r" * (MAX_TEXT + 1)}),
    ("hello-run_id-too-long", "hello", {"run_id": "r" * 65}),
    ("hello-run_id-empty", "hello", {"run_id": ""}),
    ("hello-run_id-bad-chars", "hello", {"run_id": "run 1/../x"}),
    ("hello-host-too-long", "hello", {"host": "h" * 256}),
    ("hello-device-too-long", "hello", {"device": "d" * 65}),
    ("metrics-scalar-name-too-long", "metrics", {"scalars": {"n" * 129: (1.0, 1)}}),
    ("metrics-scalar-name-empty", "metrics", {"scalars": {"": (1.0, 1)}}),
    ("new_session-store_prefix-empty", "new_session", {"store_prefix": ""}),
    ("new_session-store_prefix-too-long", "new_session", {"store_prefix": "p" * 129}),
    # over-long lists / maps
    (
        "metrics-too-many-scalars",
        "metrics",
        {"scalars": {f"s{i}": (1.0, 1) for i in range(MAX_SCALARS + 1)}},
    ),
    (
        "epoch_aggregated-too-many-scalars",
        "epoch_aggregated",
        {"metrics": _metrics_with(scalars={f"s{i}": 1.0 for i in range(MAX_SCALARS + 1)})},
    ),
    ("new_session-too-many-ranks", "new_session", {"ranks": [0] * (MAX_WORLD_SIZE + 1)}),
    ("stage_advisory-too-many-counts", "stage_advisory", {"counts": [0] * (MAX_WORLD_SIZE + 1)}),
    (
        "stage_advisory-too-many-segments",
        "stage_advisory",
        {"segments": [(0, [])] * (MAX_SEGMENTS + 1)},
    ),
    ("metrics-scalar-not-a-pair", "metrics", {"scalars": {"acc": (1.0, 2, 3)}}),
    # bad model_signature
    ("hello-signature-uppercase", "hello", {"model_signature": SIG.upper()}),
    ("hello-signature-short", "hello", {"model_signature": SIG[:-1]}),
    ("hello-signature-long", "hello", {"model_signature": SIG + "0"}),
    ("hello-signature-non-hex", "hello", {"model_signature": "g" + SIG[1:]}),
    ("hello-signature-empty", "hello", {"model_signature": ""}),
    ("hello-signature-newline", "hello", {"model_signature": SIG + "\n"}),
    # bad literals and types
    ("hello-role-unknown", "hello", {"role": "admin"}),
    ("intent-unknown", "intent", {"intent": "sleep"}),
    ("shutdown_with_save-reason-unknown", "shutdown_with_save", {"reason": "whim"}),
    ("heartbeat-step-fractional", "heartbeat", {"step": 1.5}),
    ("heartbeat-rank-list", "heartbeat", {"rank": [1]}),
    ("batch-loss-string", "batch", {"loss": "low"}),
    ("start_epoch-plan-missing-field", "start_epoch", {"plan": {"epoch": 1}}),
    ("start_epoch-plan-negative", "start_epoch", {"plan": _plan_with(partition_size=-1)}),
    ("start_epoch-plan-extra", "start_epoch", {"plan": _plan_with(bogus=1)}),
    ("update-next_plan-extra", "update", {"next_plan": _plan_with(weight=0.5)}),
    (
        "epoch_aggregated-metrics-extra",
        "epoch_aggregated",
        {"metrics": _metrics_with(secret_field=1)},
    ),
]


@pytest.mark.parametrize(("kind", "over"), [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_out_of_range_is_rejected_at_construction(kind: str, over: dict[str, Any]) -> None:
    data = {**_dump(kind), **over}
    del data["kind"]
    with pytest.raises(ValidationError):
        CLASS_BY_KIND[kind](**data)
    with pytest.raises(ValidationError):
        FRAME_ADAPTER.validate_python({"kind": kind, **data})


@pytest.mark.parametrize(("kind", "over"), [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_out_of_range_is_rejected_on_the_wire(kind: str, over: dict[str, Any]) -> None:
    body = _packed({**_dump(kind), **over})
    with pytest.raises(FrameError, match=re.escape(repr(kind))):
        decode_body(body)


@pytest.mark.parametrize("cls", FRAME_CLASSES, ids=_kind_of)
def test_missing_required_field_is_rejected(cls: type[BaseModel]) -> None:
    kind = _kind_of(cls)
    required = [n for n, f in cls.model_fields.items() if f.is_required()]
    for name in required:
        data = _dump(kind)
        del data[name]
        with pytest.raises(FrameError):
            decode_body(_packed(data))


@pytest.mark.parametrize("cls", FRAME_CLASSES, ids=_kind_of)
def test_extra_field_is_rejected(cls: type[BaseModel]) -> None:
    kind = _kind_of(cls)
    data = {**_dump(kind), "extra_field": 1}
    with pytest.raises(ValidationError, match="extra"):
        cls.model_validate(data)
    with pytest.raises(ValidationError):
        cls(**{k: v for k, v in data.items() if k != "kind"})
    with pytest.raises(FrameError, match="extra"):
        decode_body(_packed(data))


@pytest.mark.parametrize(
    "kind", ["nope", "Heartbeat", "heartbeat ", "", "x" * 10_000, 5, None, True, 1.5, [], {}]
)
def test_unknown_kind_is_rejected(kind: object) -> None:
    data = {"kind": kind, "rank": 1, "step": 2}
    with pytest.raises(ValidationError):
        FRAME_ADAPTER.validate_python(data)
    with pytest.raises(FrameError):
        decode_body(_packed(data))


def test_missing_kind_is_rejected() -> None:
    with pytest.raises(FrameError):
        decode_body(_packed({"rank": 1, "step": 2}))


def test_kind_cannot_be_overridden_at_construction() -> None:
    fields: dict[str, Any] = {"kind": "batch", "rank": 1, "step": 2}
    with pytest.raises(ValidationError):
        Heartbeat(**fields)


def test_kind_of_another_frame_is_validated_as_that_frame() -> None:
    # a heartbeat's fields under the batch kind: missing batch fields, so refused
    with pytest.raises(FrameError, match="'batch'"):
        decode_body(_packed({"kind": "batch", "rank": 1, "step": 2}))


@pytest.mark.parametrize("value", [0, MAX_WORLD_SIZE - 1])
def test_rank_bounds_are_inclusive_exclusive(value: int) -> None:
    assert Heartbeat(rank=value, step=0).rank == value
    assert decode_body(_packed({"kind": "heartbeat", "rank": value, "step": MAX_U63})) == (
        Heartbeat(rank=value, step=MAX_U63)
    )


def test_limits_at_the_edge_are_accepted() -> None:
    assert len(Reject(reason="x" * MAX_TEXT).reason) == MAX_TEXT
    m = Metrics(
        rank=0,
        epoch=0,
        avg_loss=0.0,
        batches_processed=0,
        samples_processed=0,
        epoch_ms=0.0,
        share_complete_ms=0.0,
        compute_only_ms=0.0,
        scalars={f"s{i}": (0.0, 0) for i in range(MAX_SCALARS)},
    )
    assert decode_frame(encode_frame(m, SECRET), SECRET) == m
    hello = Hello(run_id="r" * 64, rank=0, world_size=MAX_WORLD_SIZE, model_signature=SIG)
    assert decode_frame(encode_frame(hello, SECRET), SECRET) == hello
