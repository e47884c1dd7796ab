"""The control-frame codec: authentication, framing defects and fuzzing.

Every defect in the bytes (truncation, trailing data, oversize length, a flipped bit, a wrong
secret or sequence number, a body that is not a valid frame) must surface as ``FrameError`` and
nothing else.
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import math
import struct
import tracemalloc
import typing
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, ValidationError

from flodl.config import JobSpec
from flodl.errors import FrameError, RemoteProtocolError
from flodl.wire.codec import (
    HEADER_BYTES,
    MAX_CONTROL_FRAME_BYTES,
    MIN_SECRET_BYTES,
    TAG_BYTES,
    AnyFrame,
    SharedBodies,
    auth_tag,
    body_length,
    check_secret,
    decode_body,
    decode_frame,
    encode_body,
    encode_frame,
    seal_body,
)
from flodl.wire.frames import (
    FRAME_KINDS,
    MAX_WORLD_SIZE,
    Batch,
    CoordFrame,
    Heartbeat,
    Hello,
    Metrics,
    NewSession,
    RankFrame,
    Reject,
)

SECRET = b"codec-test-secret-0123456789abcdef"
OTHER_SECRET = b"codec-test-secret-0123456789abcdeF"
SIG = "fedcba9876543210" * 4

FUZZ = settings(
    max_examples=2000,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)

CLASS_BY_KIND: dict[str, type[BaseModel]] = {
    cls.model_fields["kind"].default: cls
    for cls in typing.get_args(RankFrame) + typing.get_args(CoordFrame)
}

HEARTBEAT = Heartbeat(rank=3, step=1_000_001)
BATCH = Batch(rank=1, epoch=2, step=3_000, batch_ms=17.25, data_ms=0.5, loss=0.693, param_norm=42.0)
METRICS = Metrics(
    rank=2,
    epoch=5,
    avg_loss=0.25,
    batches_processed=100,
    samples_processed=3_200,
    epoch_ms=9_000.5,
    share_complete_ms=8_900.0,
    compute_only_ms=8_000.0,
    data_starve_ms=12.5,
    scalars={"acc": (91.5, 100), "grad/norm": (250.0, 100), "lr": (0.03, 100)},
)
SAMPLES: list[AnyFrame] = [HEARTBEAT, BATCH, METRICS]
SAMPLE_IDS = ["heartbeat", "batch", "metrics"]


def _seal(body: bytes, *, secret: bytes = SECRET, seq: int = 0) -> bytes:
    """Frame ``body`` as the codec would: length prefix, body, auth tag."""
    header = struct.pack("!I", len(body))
    return header + body + auth_tag(secret, header, body, seq)


def _plain(obj: object) -> object:
    """``obj`` as msgpack gives it back (tuples become lists)."""
    return msgpack.unpackb(msgpack.packb(obj, use_bin_type=True), raw=False)


def _expect_frame_or_frame_error(data: bytes, *, seq: int = 0) -> AnyFrame | None:
    try:
        frame = decode_frame(data, SECRET, seq=seq)
    except FrameError:
        return None
    assert isinstance(frame, BaseModel)
    assert frame.kind in FRAME_KINDS
    # anything accepted is a well-formed frame: it re-encodes and decodes to itself
    assert decode_frame(encode_frame(frame, SECRET, seq=seq), SECRET, seq=seq) == frame
    return frame


# ---------------------------------------------------------------------------------------------
# Authentication
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("frame", SAMPLES, ids=SAMPLE_IDS)
def test_round_trip(frame: AnyFrame) -> None:
    wire = encode_frame(frame, SECRET, seq=7)
    assert len(wire) > HEADER_BYTES + TAG_BYTES
    assert struct.unpack("!I", wire[:HEADER_BYTES])[0] == len(wire) - HEADER_BYTES - TAG_BYTES
    assert decode_frame(wire, SECRET, seq=7) == frame
    assert decode_frame(memoryview(wire), SECRET, seq=7) == frame
    mutable: Any = bytearray(wire)  # accepted at run time though not in the signature
    assert decode_frame(mutable, SECRET, seq=7) == frame


# secret lengths around SHA-256's 64-byte block, where HMAC hashes a long key first
@pytest.mark.parametrize("secret_len", [16, 32, 63, 64, 65, 200])
@pytest.mark.parametrize("seq", [0, 5, 2**64 - 1])
def test_tag_is_truncated_hmac_sha256_over_seq_length_body(secret_len: int, seq: int) -> None:
    secret = bytes(range(secret_len % 256)) + b"k" * (secret_len - secret_len % 256)
    assert len(secret) == secret_len
    for frame in SAMPLES:
        wire = encode_frame(frame, secret, seq=seq)
        header, body, tag = wire[:4], wire[4:-TAG_BYTES], wire[-TAG_BYTES:]
        expected = hmac.new(secret, struct.pack("!Q", seq) + header + body, hashlib.sha256)
        assert tag == expected.digest()[:TAG_BYTES]
        assert auth_tag(secret, header, body, seq) == tag
        assert auth_tag(secret, header, memoryview(body), seq) == tag
        assert _plain(frame.model_dump()) == msgpack.unpackb(body)
        assert decode_frame(wire, secret, seq=seq) == frame


def test_wrong_secret_is_rejected() -> None:
    for frame in SAMPLES:
        wire = encode_frame(frame, SECRET)
        with pytest.raises(FrameError, match="auth tag"):
            decode_frame(wire, OTHER_SECRET)
        with pytest.raises(FrameError, match="auth tag"):
            decode_frame(encode_frame(frame, OTHER_SECRET), SECRET)


@pytest.mark.parametrize(("sent", "expected"), [(0, 1), (1, 0), (5, 4), (5, 6), (2**40, 0)])
def test_wrong_seq_is_rejected(sent: int, expected: int) -> None:
    wire = encode_frame(BATCH, SECRET, seq=sent)
    assert decode_frame(wire, SECRET, seq=sent) == BATCH
    with pytest.raises(FrameError, match="auth tag"):
        decode_frame(wire, SECRET, seq=expected)


def test_replayed_frame_fails_at_the_next_seq() -> None:
    wires = [encode_frame(Heartbeat(rank=0, step=i), SECRET, seq=i) for i in range(4)]
    for seq, wire in enumerate(wires):
        assert decode_frame(wire, SECRET, seq=seq) == Heartbeat(rank=0, step=seq)
    for seq in range(1, 4):
        with pytest.raises(FrameError):
            decode_frame(wires[seq - 1], SECRET, seq=seq)


def test_tag_differs_per_seq_and_secret() -> None:
    tags = {
        encode_frame(HEARTBEAT, secret, seq=seq)[-TAG_BYTES:]
        for secret in (SECRET, OTHER_SECRET)
        for seq in range(8)
    }
    assert len(tags) == 16


def test_other_protocol_version_is_a_valid_frame() -> None:
    # The codec carries any protocol number; refusing it is the coordinator's job.
    hello = Hello(protocol=2, run_id="run", rank=0, world_size=2, model_signature=SIG)
    decoded = decode_frame(encode_frame(hello, SECRET), SECRET)
    assert isinstance(decoded, Hello)
    assert decoded.protocol == 2


def test_frame_error_is_a_remote_protocol_error() -> None:
    with pytest.raises(RemoteProtocolError):
        decode_frame(b"", SECRET)


# ---------------------------------------------------------------------------------------------
# Length prefix
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "length", [MAX_CONTROL_FRAME_BYTES + 1, 0x7FFF_FFFF, 0x8000_0000, 0xFFFF_FFFE, 0xFFFF_FFFF]
)
def test_oversize_length_is_rejected_by_body_length(length: int) -> None:
    with pytest.raises(FrameError, match="exceeds"):
        body_length(struct.pack("!I", length))


def test_body_length_limits() -> None:
    assert body_length(struct.pack("!I", 1)) == 1
    assert body_length(struct.pack("!I", MAX_CONTROL_FRAME_BYTES)) == MAX_CONTROL_FRAME_BYTES
    assert body_length(struct.pack("!I", 100), max_bytes=100) == 100
    with pytest.raises(FrameError, match="exceeds"):
        body_length(struct.pack("!I", 101), max_bytes=100)
    with pytest.raises(FrameError, match="empty"):
        body_length(b"\x00\x00\x00\x00")
    for bad in (b"", b"\x00", b"\x00\x00\x01", b"\x00\x00\x00\x01\x00"):
        with pytest.raises(FrameError, match="header"):
            body_length(bad)


@pytest.mark.parametrize("tail", [b"", b"\x81", b"x" * 64])
def test_four_gib_header_is_rejected_before_allocation(tail: bytes) -> None:
    data = b"\xff\xff\xff\xff" + tail
    tracemalloc.start()
    try:
        with pytest.raises(FrameError, match="exceeds") as info:
            decode_frame(data, SECRET)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert "4294967295" in str(info.value)
    assert peak < 1 << 20, f"decode allocated {peak} B for a 4 GiB header"


def test_length_over_a_custom_ceiling_is_rejected() -> None:
    wire = encode_frame(METRICS, SECRET)
    body_len = len(wire) - HEADER_BYTES - TAG_BYTES
    assert decode_frame(wire, SECRET, max_bytes=body_len) == METRICS
    with pytest.raises(FrameError, match="exceeds"):
        decode_frame(wire, SECRET, max_bytes=body_len - 1)


def test_shared_bodies_encode_a_frame_once_and_seal_it_per_connection(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A frame sent to many peers (one new_session for every member) is encoded once; each
    # connection seals it with its own key and seq, to the bytes encode_frame would send.
    from flodl.wire import codec

    calls: list[AnyFrame] = []

    def counting(frame: AnyFrame) -> bytes:
        calls.append(frame)
        return encode_body(frame)

    frame = NewSession(session=3, store_prefix="run/s3", new_world_size=4, spans=[(0, 2), (9, 2)])
    twin = NewSession(session=3, store_prefix="run/s3", new_world_size=4, spans=[(0, 2), (9, 2)])
    keys = [bytes([k]) * 32 for k in range(3)]
    expected = [encode_frame(frame, key, seq=seq) for seq, key in enumerate(keys)]
    monkeypatch.setattr(codec, "encode_body", counting)
    bodies = SharedBodies()
    wires = [
        seal_body(bodies.body(frame), key, kind=frame.kind, seq=seq) for seq, key in enumerate(keys)
    ]
    assert calls == [frame]
    assert wires == expected
    decoded = [decode_frame(w, k, seq=q) for q, (w, k) in enumerate(zip(wires, keys, strict=True))]
    assert decoded == [frame] * 3
    assert bodies.body(twin) == bodies.body(frame)  # an equal frame: its own (equal) body
    assert calls == [frame, twin]
    with pytest.raises(FrameError, match=r"new_session frame body is \d+ B, over the 8 B ceiling"):
        seal_body(bodies.body(frame), keys[0], kind=frame.kind, max_bytes=8)


def test_encode_over_ceiling_raises() -> None:
    big = NewSession(
        session=1,
        store_prefix="s/",
        new_world_size=MAX_WORLD_SIZE // 2,
        spans=[(r, 1) for r in range(0, MAX_WORLD_SIZE, 2)],  # every other rank: a run each
    )
    wire = encode_frame(big, SECRET)
    body_len = len(wire) - HEADER_BYTES - TAG_BYTES
    assert body_len > 100_000
    assert encode_frame(big, SECRET, max_bytes=body_len) == wire
    with pytest.raises(FrameError, match="new_session"):
        encode_frame(big, SECRET, max_bytes=body_len - 1)
    with pytest.raises(FrameError, match="ceiling"):
        encode_frame(Reject(reason="x" * 100), SECRET, max_bytes=64)


# ---------------------------------------------------------------------------------------------
# Truncation, trailing bytes, bit flips
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("frame", SAMPLES, ids=SAMPLE_IDS)
def test_truncated_at_every_byte_boundary(frame: AnyFrame) -> None:
    wire = encode_frame(frame, SECRET, seq=3)
    for cut in range(len(wire)):
        with pytest.raises(FrameError):
            decode_frame(wire[:cut], SECRET, seq=3)


@pytest.mark.parametrize("frame", SAMPLES, ids=SAMPLE_IDS)
@pytest.mark.parametrize("tail", [b"\x00", b"\xc0", b"\x00" * TAG_BYTES, "frame"])
def test_trailing_bytes_are_rejected(frame: AnyFrame, tail: bytes | str) -> None:
    wire = encode_frame(frame, SECRET)
    extra = wire if tail == "frame" else tail
    assert isinstance(extra, bytes)
    with pytest.raises(FrameError, match="trailing"):
        decode_frame(wire + extra, SECRET)


@pytest.mark.parametrize("frame", SAMPLES, ids=SAMPLE_IDS)
def test_every_single_bit_flip_is_rejected(frame: AnyFrame) -> None:
    wire = encode_frame(frame, SECRET, seq=11)
    assert decode_frame(wire, SECRET, seq=11) == frame
    flipped = bytearray(wire)
    for bit in range(len(wire) * 8):
        byte, mask = divmod(bit, 8)
        flipped[byte] ^= 1 << mask
        with pytest.raises(FrameError):
            decode_frame(bytes(flipped), SECRET, seq=11)
        flipped[byte] ^= 1 << mask
    assert bytes(flipped) == wire


# ---------------------------------------------------------------------------------------------
# Bodies that authenticate but are not frames
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "body",
    [
        b"\xc1",  # never-used msgpack byte
        b"\x92\x01",  # array of 2 with one element
        b"\x81\xa4kind",  # map missing its value
        msgpack.packb([1, 2, 3]),
        msgpack.packb("heartbeat"),
        msgpack.packb(None),
        msgpack.packb({"kind": "heartbeat", "rank": 1, "step": 2}) + b"\x00",  # extra data
        msgpack.packb({1: 2}),  # non-string key
        msgpack.packb({"kind": "heartbeat", "rank": 1, "step": 2}, use_bin_type=False)[:-1],
        msgpack.ExtType(1, b"x").data,
        msgpack.packb(msgpack.ExtType(5, b"abc")),
        msgpack.packb({"kind": msgpack.ExtType(5, b"abc")}),
        b"\x91" * 100_000 + b"\xc0",  # deeply nested arrays
        b"\x81\xa1k" * 50_000 + b"\xc0",  # deeply nested maps
    ],
)
def test_authentic_garbage_body_is_a_frame_error(body: bytes) -> None:
    with pytest.raises(FrameError):
        decode_frame(_seal(body), SECRET)
    with pytest.raises(FrameError):
        decode_body(body)


def test_deeply_nested_valid_msgpack_in_a_field_is_a_frame_error() -> None:
    value: Any = 0
    for _ in range(500):
        value = [value]
    body = msgpack.packb({"kind": "reject", "reason": value})
    with pytest.raises(FrameError):
        decode_frame(_seal(body), SECRET)


# ---------------------------------------------------------------------------------------------
# Secrets
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "secret",
    [b"", b"x", b"x" * (MIN_SECRET_BYTES - 1), "x" * 32, None, 12345, memoryview(b"x" * 32)],
)
def test_check_secret_rejects_short_or_non_bytes(secret: Any) -> None:
    with pytest.raises(ValueError, match="secret"):
        check_secret(secret)


def test_check_secret_accepts_and_normalises() -> None:
    assert MIN_SECRET_BYTES >= 16
    assert check_secret(b"k" * MIN_SECRET_BYTES) == b"k" * MIN_SECRET_BYTES
    mutable: Any = bytearray(b"k" * 32)
    out = check_secret(mutable)
    assert type(out) is bytes
    assert out == b"k" * 32


# ---------------------------------------------------------------------------------------------
# Fuzzing: only FrameError may escape
# ---------------------------------------------------------------------------------------------

LEAVES = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=40)
    | st.binary(max_size=40)
)
MSGPACK_OBJECTS = st.recursive(
    LEAVES,
    lambda children: (
        st.lists(children, max_size=6) | st.dictionaries(st.text(max_size=12), children, max_size=6)
    ),
    max_leaves=20,
)
# values aimed at the frames' bounds, mixed with arbitrary msgpack objects
EDGE_VALUES = (
    st.sampled_from(
        [
            -1,
            0,
            1,
            MAX_WORLD_SIZE - 1,
            MAX_WORLD_SIZE,
            2**63 - 1,
            2**63,
            -0.0,
            1e308,
            math.nan,
            math.inf,
            -math.inf,
            "",
            "x" * 4097,
            SIG,
            SIG.upper(),
            "single_survivor",
            "eval_now",
            "worker",
            True,
            [],
            {},
            [0, 1],
            [[1, [[0, 1]]]],
            {"acc": [1.0, 2]},
        ]
    )
    | MSGPACK_OBJECTS
)


@FUZZ
@given(data=st.binary(max_size=256), seq=st.integers(min_value=0, max_value=3))
def test_fuzz_random_bytes(data: bytes, seq: int) -> None:
    _expect_frame_or_frame_error(data, seq=seq)


@FUZZ
@given(body=st.binary(min_size=1, max_size=256))
def test_fuzz_random_authenticated_bytes(body: bytes) -> None:
    _expect_frame_or_frame_error(_seal(body))


@FUZZ
@given(obj=MSGPACK_OBJECTS)
def test_fuzz_random_msgpack_objects(obj: object) -> None:
    _expect_frame_or_frame_error(_seal(msgpack.packb(obj, use_bin_type=True)))


_I64 = (-(2**63), 2**63 - 1)


def _from_schema(schema: dict[str, Any], defs: dict[str, Any]) -> st.SearchStrategy[Any]:
    """A strategy of plain values valid under a pydantic JSON schema (the subset frames use).

    NaN and infinities never come out: the schema cannot say a float field is finite.
    """
    if "$ref" in schema:
        return _from_schema(defs[schema["$ref"].rsplit("/", 1)[-1]], defs)
    if "anyOf" in schema:
        return st.one_of([_from_schema(s, defs) for s in schema["anyOf"]])
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    kind = schema.get("type")
    if kind == "integer":
        lo = schema.get("minimum", _I64[0])
        hi = schema.get("maximum", schema.get("exclusiveMaximum", _I64[1] + 1) - 1)
        return st.integers(lo, hi)
    if kind == "number":
        lo, hi = schema.get("minimum"), schema.get("maximum")
        if "exclusiveMinimum" in schema:
            return st.floats(
                min_value=schema["exclusiveMinimum"],
                max_value=hi,
                exclude_min=True,
                allow_nan=False,
                allow_infinity=False,
            )
        return st.floats(min_value=lo, max_value=hi, allow_nan=False, allow_infinity=False)
    if kind == "string":
        lo, hi = schema.get("minLength", 0), schema.get("maxLength", 4096)
        if "pattern" in schema:
            text = st.from_regex(schema["pattern"], fullmatch=True)
            return text.filter(lambda t: lo <= len(t) <= hi)
        return st.text(min_size=lo, max_size=min(hi, max(lo, 12)))
    if kind == "boolean":
        return st.booleans()
    if kind == "null":
        return st.none()
    if kind == "array":
        if "prefixItems" in schema:
            return st.tuples(*(_from_schema(s, defs) for s in schema["prefixItems"])).map(list)
        return st.lists(_from_schema(schema["items"], defs), max_size=4)
    if kind == "object" and "properties" not in schema:
        names = schema.get("propertyNames", {})
        keys = st.text(min_size=names.get("minLength", 0), max_size=names.get("maxLength", 12))
        values = _from_schema(schema.get("additionalProperties", {"type": "null"}), defs)
        return st.dictionaries(keys.filter(lambda k: len(k) <= 12), values, max_size=4)
    if kind == "object":
        required = set(schema.get("required", ()))
        fields = {
            name: _from_schema(sub, defs)
            if name in required
            else st.none() | _from_schema(sub, defs)
            for name, sub in schema["properties"].items()
        }

        @st.composite
        def objects(draw: st.DrawFn) -> dict[str, Any]:
            out: dict[str, Any] = {}
            for name, strategy in fields.items():
                if name in required or draw(st.booleans()):
                    value = draw(strategy)
                    if value is not None or name in required:
                        out[name] = value
            return out

        return objects()
    raise AssertionError(f"schema construct not handled: {schema}")


SCHEMA_MAPS: dict[str, st.SearchStrategy[dict[str, Any]]] = {}
for _kind, _cls in sorted(CLASS_BY_KIND.items()):
    _schema = _cls.model_json_schema(mode="validation")
    SCHEMA_MAPS[_kind] = _from_schema(_schema, _schema.get("$defs", {}))


@st.composite
def frame_like_maps(draw: st.DrawFn) -> tuple[dict[str, Any], bool]:
    """A map valid under the schema of a random kind, then perhaps mutated: a field replaced
    by an edge value or an arbitrary object, a field dropped, or an unknown field added.
    Returns the map and whether it was mutated."""
    kind = draw(st.sampled_from(sorted(FRAME_KINDS)))
    out = draw(SCHEMA_MAPS[kind])
    out["kind"] = kind
    mutations = draw(st.integers(0, 3))
    for _ in range(mutations):
        op = draw(st.sampled_from(["replace", "drop", "add"]))
        names = sorted(out)
        if not names or op == "add":
            out[draw(st.text(max_size=8))] = draw(LEAVES)
        elif op == "replace":
            out[draw(st.sampled_from(names))] = draw(EDGE_VALUES)
        else:
            del out[draw(st.sampled_from(names))]
    return out, mutations > 0


def _config_refuses(obj: dict[str, Any]) -> bool:
    """Whether the map breaks a rule its JSON schema cannot state: a hello's job
    (``MaxFailure`` wants exactly one limit; ``ElCheConfig``'s anchors and mode-only knobs), or
    a ``new_session`` whose ``spans`` are not ascending runs with gaps inside the world, or do
    not hold ``new_world_size`` members. Such a map is refused."""
    if obj.get("kind") == "new_session":
        spans = obj["spans"]
        gaps = all(a[0] + a[1] < b[0] for a, b in itertools.pairwise(spans))
        inside = all(first + count <= MAX_WORLD_SIZE for first, count in spans)
        return not (gaps and inside) or sum(c for _, c in spans) != obj["new_world_size"]
    job = obj.get("job") if obj.get("kind") == "hello" else None
    if job is None:
        return False
    try:
        JobSpec.model_validate(job)
    except ValidationError:
        return True
    return False


@FUZZ
@given(case=frame_like_maps())
def test_fuzz_frame_like_maps(case: tuple[dict[str, Any], bool]) -> None:
    obj, mutated = case
    frame = _expect_frame_or_frame_error(_seal(msgpack.packb(obj, use_bin_type=True)))
    event("valid" if frame is not None else "refused")
    if frame is not None:
        assert frame.kind == obj["kind"]
    if not mutated and not _config_refuses(obj):
        # the catalog accepts everything its own schema allows (with finite floats), but for
        # the cross-field rules (the config models a hello's job carries, new_session's members)
        assert frame is not None, f"schema-valid map refused: {obj!r}"
        dumped = frame.model_dump(exclude_unset=True) | {"kind": frame.kind}
        assert _plain(dumped) == _plain(obj)


@FUZZ
@given(
    frame=st.sampled_from(SAMPLES),
    seq=st.integers(min_value=0, max_value=2**64 - 1),
    cut=st.integers(min_value=0, max_value=400),
    junk=st.binary(max_size=8),
)
def test_fuzz_spliced_valid_frames(frame: AnyFrame, seq: int, cut: int, junk: bytes) -> None:
    wire = encode_frame(frame, SECRET, seq=seq)
    spliced = wire[:cut] + junk + wire[cut + len(junk) :]
    if spliced == wire:
        assert decode_frame(spliced, SECRET, seq=seq) == frame
    else:
        with pytest.raises(FrameError):
            decode_frame(spliced, SECRET, seq=seq)
