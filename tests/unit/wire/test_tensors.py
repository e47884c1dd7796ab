"""Data-plane tensor frames: round trips, in-place receive, zero copy, rejection of bad bytes."""

from __future__ import annotations

import contextlib
import hmac
import socket
import struct
import threading

import pytest
import torch
from cryptography.hazmat.primitives.poly1305 import Poly1305
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flodl.errors import FrameError, LocalProtocolError
from flodl.wire.tensor_read import (
    decode_tensor_frame,
    parse_header,
    read_frame_payloads,
    read_frame_prefix,
    read_tensor_frame,
)
from flodl.wire.tensors import (
    CONSENSUS_SENDER,
    HEADER_BYTES,
    MAC_KEY_LABEL,
    MAGIC,
    MAX_TENSORS,
    MIN_FRAME_CEILING,
    TAG_BYTES,
    VERSION,
    FrameHeader,
    TensorKind,
    TensorLayout,
    WireDtype,
    encode_frame_parts,
    encode_tensor_frame,
    entry_nbytes,
    frame_ceiling,
    frame_key,
    frame_nbytes,
    frame_tag,
    send_buffers,
    upload_sender,
)

SECRET = b"s" * 32
BIG = 1 << 30
_HEADER = struct.Struct("!IBBBBdQI")


def _encode(tensors: list[torch.Tensor], **kwargs: object) -> bytes:
    params: dict[str, object] = {
        "kind": TensorKind.MODEL_PARAMS,
        "weight": 1.0,
        "round": 3,
        "secret": SECRET,
    }
    params.update(kwargs)
    return b"".join(encode_tensor_frame(tensors, **params))  # type: ignore[arg-type]


def _head_nbytes(body: bytes) -> int:
    """Size of the header and table at the start of ``body`` (clipped to ``body``)."""
    size = HEADER_BYTES
    if len(body) >= HEADER_BYTES:
        for _ in range(_HEADER.unpack_from(body)[-1]):
            if size + 1 >= len(body):
                break
            size += entry_nbytes(body[size + 1])
    return min(size, len(body))


def _retag(frame: bytes | bytearray, secret: bytes = SECRET, sender: bytes = b"") -> bytes:
    """Recompute the tag so a deliberately malformed frame reaches the field checks."""
    body = bytes(frame[:-TAG_BYTES])
    head = body[: _head_nbytes(body)]
    key = hmac.new(secret, MAC_KEY_LABEL + head + sender, "sha256").digest()
    return body + Poly1305.generate_tag(key, body)


def _patch_header(frame: bytes, **fields: float) -> bytes:
    names = ("magic", "version", "kind", "flags", "reserved", "weight", "round", "num_tensors")
    values = dict(zip(names, _HEADER.unpack_from(frame), strict=True))
    values.update(fields)
    return _retag(_HEADER.pack(*values.values()) + frame[HEADER_BYTES:])


def _garbage_like(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [torch.full_like(t, 7) for t in tensors]


SHAPES: list[tuple[int, ...]] = [(), (1,), (0,), (3, 0, 2), (5,), (2, 3, 4), (1,) * 8, (17, 33)]


def test_round_trip_f32_is_exact_for_every_shape() -> None:
    gen = torch.Generator().manual_seed(0)
    src = [torch.randn(shape, generator=gen) for shape in SHAPES]
    out = _garbage_like(src)
    header = decode_tensor_frame(
        _encode(src, kind=TensorKind.MODEL_BUFFERS, weight=2.5, round=41),
        out,
        secret=SECRET,
        max_frame_bytes=BIG,
    )
    assert header == FrameHeader(TensorKind.MODEL_BUFFERS, 2.5, 41, len(SHAPES))
    for a, b in zip(src, out, strict=True):
        assert b.shape == a.shape
        assert torch.equal(a, b)


def test_round_trip_bf16_wire_within_bf16_precision() -> None:
    gen = torch.Generator().manual_seed(1)
    src = [torch.randn(shape, generator=gen) * 100 + 1000 for shape in SHAPES]
    frame = _encode(src, wire_dtype=torch.bfloat16)
    out = _garbage_like(src)
    decode_tensor_frame(frame, out, secret=SECRET, max_frame_bytes=BIG)
    for a, b in zip(src, out, strict=True):
        assert b.dtype == torch.float32
        rel = ((b - a).abs() / a.abs()).max().item() if a.numel() else 0.0
        assert rel <= 2**-8
    f32_payload = sum(t.numel() * 4 for t in src)
    assert len(_encode(src)) - len(frame) == f32_payload // 2


def test_round_trip_other_dtypes_and_bf16_input() -> None:
    src = [
        torch.arange(-5, 5, dtype=torch.int64).reshape(2, 5),
        torch.randn(4, dtype=torch.float64),
        torch.randn(3, 3).to(torch.bfloat16),
        torch.tensor(1 << 62, dtype=torch.int64),
    ]
    # bf16 wire converts only float32: f64 and i64 ride unchanged.
    out = _garbage_like(src)
    decode_tensor_frame(
        _encode(src, wire_dtype=torch.bfloat16), out, secret=SECRET, max_frame_bytes=BIG
    )
    for a, b in zip(src, out, strict=True):
        assert torch.equal(a, b)
    out32 = [torch.empty(3, 3)]
    decode_tensor_frame(_encode([src[2]]), out32, secret=SECRET, max_frame_bytes=BIG)
    assert torch.equal(out32[0], src[2].float())  # a bf16 payload accumulates into f32


def test_zero_elision_sends_no_payload_and_zeroes_garbage() -> None:
    src = [
        torch.zeros(1000),
        torch.zeros(3, 4, dtype=torch.int64),
        torch.tensor(-0.0),
        torch.ones(2),
    ]
    frame = _encode(src)
    header = parse_header(frame)
    layout = TensorLayout.parse(frame[HEADER_BYTES:], header.num_tensors)
    assert [s.nbytes for s in layout.specs] == [0, 0, 0, 8]
    assert [s.elided for s in layout.specs] == [True, True, True, False]
    assert len(frame) == layout.frame_nbytes == HEADER_BYTES + layout.table_nbytes + 8 + TAG_BYTES
    out = _garbage_like(src)
    decode_tensor_frame(frame, out, secret=SECRET, max_frame_bytes=BIG)
    for a, b in zip(src, out, strict=True):
        assert torch.equal(a, b)


def test_zero_elision_of_large_tensors_is_exact() -> None:
    sparse = torch.zeros(100_000)
    sparse[1] = 1.0  # off the strided probe: found by the full scan
    nan = torch.zeros(100_000)
    nan[-1] = float("nan")
    src = [torch.zeros(100_000), sparse, nan]
    layout = TensorLayout.parse(_encode(src)[HEADER_BYTES:], 3)
    assert [s.elided for s in layout.specs] == [True, False, False]


def test_zero_elision_can_be_disabled_and_catches_bf16_underflow() -> None:
    src = [torch.zeros(10)]
    assert len(_encode(src, elide_zeros=False)) == len(_encode(src)) + 40
    tiny = [torch.full((4,), 1e-45)]  # f32 subnormal that rounds to 0 in bf16: zero on the wire
    layout = TensorLayout.parse(_encode(tiny, wire_dtype=torch.bfloat16)[HEADER_BYTES:], 1)
    assert layout.specs[0].elided


def test_decode_writes_into_the_same_storage() -> None:
    src = [torch.randn(64, 32), torch.randn(7)]
    out = [torch.empty(64, 32), torch.empty(7)]
    ptrs = [t.data_ptr() for t in out]
    for _ in range(2):
        decode_tensor_frame(_encode(src), out, secret=SECRET, max_frame_bytes=BIG)
    assert [t.data_ptr() for t in out] == ptrs
    assert all(torch.equal(a, b) for a, b in zip(src, out, strict=True))


def test_encode_does_not_copy_f32_payloads() -> None:
    t = torch.zeros(1024)
    t[0] = 1.0
    buffers = encode_tensor_frame([t], kind=0, weight=1.0, round=0, secret=SECRET)
    assert len(buffers) == 3
    payload = buffers[1]
    assert isinstance(payload, memoryview)
    assert payload.nbytes == t.numel() * 4
    t[5] = 42.0  # the payload is a view of the tensor's memory
    assert struct.unpack_from("<f", payload, 5 * 4)[0] == 42.0
    assert frame_nbytes(buffers) == HEADER_BYTES + entry_nbytes(1) + 4096 + TAG_BYTES


def test_non_contiguous_input_is_made_contiguous() -> None:
    base = torch.randn(6, 4)
    src = [base.t(), base[:, 1]]
    out = [torch.empty(4, 6), torch.empty(6)]
    decode_tensor_frame(_encode(src), out, secret=SECRET, max_frame_bytes=BIG)
    assert torch.equal(out[0], base.t())
    assert torch.equal(out[1], base[:, 1])


def test_non_contiguous_out_is_staged() -> None:
    src = [torch.randn(4, 6)]
    dst = torch.zeros(6, 4)
    decode_tensor_frame(_encode(src), [dst.t()], secret=SECRET, max_frame_bytes=BIG)
    assert torch.equal(dst.t(), src[0])


def test_scratch_is_grown_in_place_and_reused() -> None:
    scratch = torch.empty(0, dtype=torch.uint8)
    src = [torch.randn(100), torch.randn(300)]
    out = [torch.empty(100), torch.empty(300)]
    frame = _encode(src, wire_dtype=torch.bfloat16)
    decode_tensor_frame(frame, out, secret=SECRET, max_frame_bytes=BIG, scratch=scratch)
    assert scratch.numel() == 600
    ptr = scratch.data_ptr()
    decode_tensor_frame(frame, out, secret=SECRET, max_frame_bytes=BIG, scratch=scratch)
    assert scratch.data_ptr() == ptr
    assert torch.allclose(out[1], src[1], rtol=2**-8, atol=0)
    with pytest.raises(LocalProtocolError, match="scratch"):
        decode_tensor_frame(frame, out, secret=SECRET, max_frame_bytes=BIG, scratch=torch.empty(4))


@pytest.mark.parametrize(
    ("out", "message"),
    [
        ([torch.empty(2, 3)], "count mismatch"),
        ([torch.empty(2, 3), torch.empty(4), torch.empty(1)], "count mismatch"),
        ([torch.empty(3, 2), torch.empty(4)], "shape mismatch"),
        ([torch.empty(6), torch.empty(4)], "shape mismatch"),
        ([torch.empty(2, 3), torch.empty(4, 1)], "shape mismatch"),
        ([torch.empty(2, 3), torch.empty(4, dtype=torch.float64)], "dtype mismatch"),
        ([torch.empty(2, 3, dtype=torch.bfloat16), torch.empty(4)], "dtype mismatch"),
        ([torch.empty(2, 3), torch.empty(4, dtype=torch.int64)], "dtype mismatch"),
    ],
)
def test_mismatch_is_rejected_before_any_write(out: list[torch.Tensor], message: str) -> None:
    frame = _encode([torch.randn(2, 3), torch.zeros(4)])  # the zero tensor is elided
    for t in out:
        t.fill_(7)
    with pytest.raises(FrameError, match=message):
        decode_tensor_frame(frame, out, secret=SECRET, max_frame_bytes=BIG)
    assert all(bool((t == 7).all()) for t in out)


def test_bf16_payload_into_f64_is_a_dtype_mismatch() -> None:
    frame = _encode([torch.randn(3)], wire_dtype=torch.bfloat16)
    with pytest.raises(FrameError, match="dtype mismatch"):
        decode_tensor_frame(
            frame, [torch.empty(3, dtype=torch.float64)], secret=SECRET, max_frame_bytes=BIG
        )


def test_wrong_secret_is_rejected() -> None:
    frame = _encode([torch.randn(8)])
    with pytest.raises(FrameError, match="auth tag"):
        decode_tensor_frame(frame, [torch.empty(8)], secret=b"t" * 32, max_frame_bytes=BIG)


def _small() -> tuple[bytes, list[torch.Tensor]]:
    src = [torch.tensor([1.5, -2.0]), torch.zeros(2, 1), torch.tensor(3, dtype=torch.int64)]
    return _encode(src, weight=0.5, round=9), src


def test_every_single_bit_flip_is_rejected() -> None:
    frame, src = _small()
    decode_tensor_frame(frame, _garbage_like(src), secret=SECRET, max_frame_bytes=BIG)
    for bit in range(len(frame) * 8):
        corrupt = bytearray(frame)
        corrupt[bit // 8] ^= 1 << (bit % 8)
        with pytest.raises(FrameError):
            decode_tensor_frame(corrupt, _garbage_like(src), secret=SECRET, max_frame_bytes=BIG)


def test_truncation_at_every_byte_is_rejected() -> None:
    frame, src = _small()
    for cut in range(len(frame)):
        with pytest.raises(FrameError, match="truncated"):
            decode_tensor_frame(frame[:cut], _garbage_like(src), secret=SECRET, max_frame_bytes=BIG)


def test_trailing_bytes_are_rejected() -> None:
    frame, src = _small()
    with pytest.raises(FrameError, match="trailing"):
        decode_tensor_frame(frame + b"\0", _garbage_like(src), secret=SECRET, max_frame_bytes=BIG)


class _Recorder:
    """A ``recv_into`` over bytes that records how far the reader got."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0

    def recv_into(self, buffer: memoryview) -> int:
        n = min(buffer.nbytes, len(self.data) - self.pos, 5)  # tiny reads: many partial chunks
        buffer[:n] = self.data[self.pos : self.pos + n]
        self.pos += n
        return n


def test_oversize_is_rejected_before_reading_payloads() -> None:
    src = [torch.randn(1000), torch.randn(10)]
    frame = _encode(src)
    rec = _Recorder(frame)
    out = _garbage_like(src)
    with pytest.raises(FrameError, match="ceiling"):
        read_tensor_frame(rec.recv_into, out, secret=SECRET, max_frame_bytes=len(frame) - 1)
    assert rec.pos == HEADER_BYTES + TensorLayout.expected_table_nbytes(out)
    assert all(bool((t == 7).all()) for t in out)
    rec = _Recorder(frame)
    read_tensor_frame(rec.recv_into, out, secret=SECRET, max_frame_bytes=len(frame))
    assert rec.pos == len(frame)
    assert all(torch.equal(a, b) for a, b in zip(src, out, strict=True))


@pytest.mark.parametrize(
    ("weight", "message"),
    [(float("nan"), "NaN"), (float("inf"), "inf"), (-1.0, "negative"), (-1e-300, "negative")],
)
def test_bad_weight_is_rejected(weight: float, message: str) -> None:
    frame = _encode([torch.ones(2)])
    with pytest.raises(FrameError, match=message):
        decode_tensor_frame(
            _patch_header(frame, weight=weight),
            [torch.empty(2)],
            secret=SECRET,
            max_frame_bytes=BIG,
        )
    with pytest.raises(LocalProtocolError, match=message):
        encode_tensor_frame([], kind=0, weight=weight, round=0, secret=SECRET)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"magic": 0xF10D17F0}, "bad magic"),
        ({"version": VERSION + 1}, "unsupported tensor frame version"),
        ({"kind": 3}, "unknown tensor frame kind"),
        ({"flags": 4}, "flags"),
        ({"flags": 1}, "shared-memory frame where a frame with its payloads"),
        ({"flags": 2}, "flags"),  # the slot flag alone (it goes with the shared-memory one)
        ({"reserved": 1}, "reserved"),
        ({"num_tensors": MAX_TENSORS + 1}, "too many tensors"),
        ({"num_tensors": 2}, "count mismatch"),
    ],
)
def test_bad_header_field_is_rejected(fields: dict[str, int], message: str) -> None:
    frame = _patch_header(_encode([torch.ones(2)]), **fields)
    with pytest.raises(FrameError, match=message):
        decode_tensor_frame(frame, [torch.empty(2)], secret=SECRET, max_frame_bytes=BIG)


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        (struct.pack("!BBIQ", 4, 1, 2, 8), "unknown dtype"),
        (struct.pack("!BB", 0, 9) + struct.pack("!9I", *[1] * 9) + struct.pack("!Q", 4), "ndim 9"),
        (struct.pack("!BBIQ", 0, 1, 2, 4), "inconsistent"),
        (struct.pack("!BBIQ", 3, 1, 2, 8), "inconsistent"),
        (struct.pack("!BBIQ", 0, 1, 2, 16), "inconsistent"),
    ],
)
def test_bad_table_entry_is_rejected(entry: bytes, message: str) -> None:
    body = _encode([torch.ones(2)])
    frame = _retag(body[:HEADER_BYTES] + entry + body[HEADER_BYTES + entry_nbytes(1) :])
    with pytest.raises(FrameError, match=message):
        TensorLayout.parse(frame[HEADER_BYTES:], 1)
    with pytest.raises(FrameError, match=message):
        decode_tensor_frame(frame, [torch.empty(2)], secret=SECRET, max_frame_bytes=BIG)


def test_two_step_parse_of_header_and_table() -> None:
    src = [torch.randn(2, 3), torch.zeros(5, dtype=torch.float64), torch.tensor(1.0)]
    frame = _encode(src, kind=TensorKind.CONTROL, weight=0.0, round=2**64 - 1)
    header = parse_header(frame[:HEADER_BYTES])
    assert header.kind is TensorKind.CONTROL
    assert (header.weight, header.round, header.num_tensors) == (0.0, 2**64 - 1, 3)
    assert _HEADER.unpack_from(frame)[0] == MAGIC
    layout = TensorLayout.parse(frame[HEADER_BYTES:], header.num_tensors, out=src)
    assert [(s.dtype, s.shape) for s in layout.specs] == [
        (WireDtype.F32, (2, 3)),
        (WireDtype.F64, (5,)),
        (WireDtype.F32, ()),
    ]
    assert layout.table_nbytes == TensorLayout.expected_table_nbytes(src)
    assert layout.frame_nbytes == len(frame)
    with pytest.raises(FrameError, match="truncated"):
        parse_header(frame[: HEADER_BYTES - 1])
    with pytest.raises(FrameError, match="truncated"):
        TensorLayout.parse(frame[HEADER_BYTES : HEADER_BYTES + 5], 3)


def test_frame_ceiling() -> None:
    assert frame_ceiling(0) == MIN_FRAME_CEILING == 64 << 20
    assert frame_ceiling(32 << 20) == 64 << 20
    assert frame_ceiling(100 << 20) == 200 << 20
    with pytest.raises(LocalProtocolError):
        frame_ceiling(-1)


@pytest.mark.parametrize(
    ("tensors", "kwargs", "message"),
    [
        ([torch.ones(2, dtype=torch.float16)], {}, "unsupported dtype"),
        ([torch.ones((1,) * 9)], {}, "ndim 9"),
        ([], {"kind": 7}, "kind"),
        ([], {"round": -1}, "u64"),
        ([], {"round": 2**64}, "u64"),
        ([torch.ones(1)], {"wire_dtype": torch.float16}, "wire_dtype"),
    ],
)
def test_encode_rejects_what_the_frame_cannot_carry(
    tensors: list[torch.Tensor], kwargs: dict[str, object], message: str
) -> None:
    with pytest.raises(LocalProtocolError, match=message):
        _encode(tensors, **kwargs)


def test_encode_rejects_too_many_tensors() -> None:
    one = torch.ones(1)
    with pytest.raises(LocalProtocolError, match="too many tensors"):
        _encode([one] * (MAX_TENSORS + 1))


def test_empty_frame_round_trips() -> None:
    frame = _encode([], weight=0.0)
    assert len(frame) == HEADER_BYTES + TAG_BYTES
    assert decode_tensor_frame(frame, [], secret=SECRET, max_frame_bytes=BIG).num_tensors == 0


_FUZZ_OUT = [torch.zeros(3), torch.zeros(2, 2)]


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=256))
def test_fuzz_random_bytes_raise_only_frame_error(data: bytes) -> None:
    with pytest.raises(FrameError):
        decode_tensor_frame(data, _FUZZ_OUT, secret=SECRET, max_frame_bytes=BIG)


@settings(max_examples=400, deadline=None)
@given(
    st.integers(0, 4),
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(0, 3),
    st.binary(max_size=200),
)
def test_fuzz_valid_magic_then_random_bytes_raise_only_frame_error(
    kind: int, weight: float, num_tensors: int, tail: bytes
) -> None:
    data = _HEADER.pack(MAGIC, VERSION, kind, 0, 0, weight, 1, num_tensors) + tail
    with pytest.raises(FrameError):
        decode_tensor_frame(data, _FUZZ_OUT, secret=SECRET, max_frame_bytes=BIG)
    with contextlib.suppress(FrameError):  # parsing the table alone fails only with FrameError
        TensorLayout.parse(tail, num_tensors)


def _socketpair() -> tuple[socket.socket, socket.socket]:
    a, b = socket.socketpair()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 * 1024)  # force partial sendmsg
    return a, b


def _send_in_thread(
    sock: socket.socket, buffers: list[memoryview | bytes]
) -> tuple[threading.Thread, list[object]]:
    result: list[object] = []

    def run() -> None:
        try:
            result.append(send_buffers(sock, buffers))
        except OSError as exc:  # surfaced by the assertion in the test
            result.append(exc)

    thread = threading.Thread(target=run, name="send-tensor-frame")
    thread.start()
    return thread, result


def test_socketpair_64_mib_frame_lands_in_place() -> None:
    src = torch.randn(16 << 20)  # 64 MiB of f32
    out = torch.empty_like(src)
    ptr = out.data_ptr()
    buffers = encode_tensor_frame(
        [src, torch.zeros(3)], kind=TensorKind.MODEL_PARAMS, weight=4.0, round=12, secret=SECRET
    )
    a, b = _socketpair()
    with a, b:
        thread, result = _send_in_thread(a, buffers)
        header = read_tensor_frame(
            b.recv_into,
            [out, torch.ones(3)],
            secret=SECRET,
            max_frame_bytes=frame_ceiling(64 << 20),
        )
        thread.join(timeout=60)
    assert result == [frame_nbytes(buffers)]
    assert (header.weight, header.round, header.num_tensors) == (4.0, 12, 2)
    assert out.data_ptr() == ptr
    assert torch.equal(out, src)


def test_socketpair_more_buffers_than_iov_max() -> None:
    src = [torch.full((3,), float(i)) for i in range(1, 2500)]
    buffers = encode_tensor_frame(src, kind=0, weight=1.0, round=0, secret=SECRET)
    assert len(buffers) > 2048
    out = _garbage_like(src)
    a, b = _socketpair()
    with a, b:
        thread, result = _send_in_thread(a, buffers)
        read_tensor_frame(b.recv_into, out, secret=SECRET, max_frame_bytes=BIG)
        thread.join(timeout=60)
    assert result == [frame_nbytes(buffers)]
    assert all(torch.equal(x, y) for x, y in zip(src, out, strict=True))


def test_socket_eof_mid_frame_is_truncation() -> None:
    buffers = encode_tensor_frame([torch.randn(1000)], kind=0, weight=1.0, round=0, secret=SECRET)
    frame = b"".join(buffers)
    a, b = socket.socketpair()
    with a, b:
        a.sendall(frame[:-100])
        a.shutdown(socket.SHUT_WR)
        with pytest.raises(FrameError, match="truncated"):
            read_tensor_frame(b.recv_into, [torch.empty(1000)], secret=SECRET, max_frame_bytes=BIG)


# ------------------------------------------------------------------ Poly1305 frame MAC (v2)


def test_tag_is_poly1305_under_the_documented_one_time_key() -> None:
    frame = _encode([torch.arange(6.0).view(2, 3)], sender=upload_sender(5))
    body, tag = frame[:-TAG_BYTES], frame[-TAG_BYTES:]
    head = body[: _head_nbytes(body)]
    key = hmac.new(SECRET, b"flodl-tensor-frame-v2" + head + b"up\0\0\0\5", "sha256").digest()
    assert frame_key(SECRET, head, upload_sender(5)) == key
    assert tag == Poly1305.generate_tag(key, body)
    assert _retag(frame, sender=upload_sender(5)) == frame


def test_one_time_key_differs_per_round_kind_weight_table_and_sender() -> None:
    def key(sender: bytes = CONSENSUS_SENDER, **kwargs: object) -> bytes:
        params: dict[str, object] = {"kind": TensorKind.MODEL_PARAMS, "weight": 1.0, "round": 3}
        params.update(kwargs)
        tensors = params.pop("tensors", [torch.ones(4)])
        head, _ = encode_frame_parts(tensors, **params)  # type: ignore[arg-type]
        return frame_key(SECRET, head, sender)

    keys = [
        key(),
        key(round=4),
        key(kind=TensorKind.MODEL_BUFFERS),
        key(kind=TensorKind.CONTROL),
        key(weight=2.0),
        key(tensors=[torch.ones(4, dtype=torch.bfloat16)]),  # the bf16 consensus variant
        key(tensors=[torch.ones(5)]),
        key(sender=upload_sender(0)),
        key(sender=upload_sender(1)),
        key(sender=b""),
    ]
    assert len(set(keys)) == len(keys)
    assert all(len(k) == 32 for k in keys)
    assert key() == key()  # one consensus message, sent to every rank: one key
    assert frame_key(b"t" * 32, b"h", b"") != frame_key(SECRET, b"h", b"")


def test_frame_tag_matches_encode_and_differs_per_sender() -> None:
    t = [torch.randn(3, 4)]
    head, payloads = encode_frame_parts(t, kind=0, weight=1.0, round=9)
    up0 = frame_tag(SECRET, head, payloads, sender=upload_sender(0))
    frame = _encode(t, kind=0, weight=1.0, round=9, sender=upload_sender(0))
    assert frame[-TAG_BYTES:] == up0
    assert up0 != frame_tag(SECRET, head, payloads, sender=upload_sender(1))
    assert up0 != frame_tag(SECRET, head, payloads, sender=CONSENSUS_SENDER)


@pytest.mark.parametrize("field", ["round", "kind", "weight"])
def test_frame_replayed_under_another_header_fails_its_tag(field: str) -> None:
    frame = _encode([torch.ones(3)], round=7, sender=CONSENSUS_SENDER)
    decode_tensor_frame(
        frame, [torch.empty(3)], secret=SECRET, max_frame_bytes=BIG, sender=CONSENSUS_SENDER
    )
    patch = {"round": 8, "kind": int(TensorKind.MODEL_BUFFERS), "weight": 2.0}[field]
    replayed = bytearray(frame)
    replayed[:HEADER_BYTES] = _patch_header(frame, **{field: patch})[:HEADER_BYTES]
    with pytest.raises(FrameError, match="auth tag"):
        decode_tensor_frame(
            bytes(replayed),
            [torch.empty(3)],
            secret=SECRET,
            max_frame_bytes=BIG,
            sender=CONSENSUS_SENDER,
        )


def test_round_r_frame_replayed_as_round_r_prime_fails() -> None:
    frame = _encode([torch.ones(3)], round=1, sender=upload_sender(2))
    replayed = bytearray(frame)
    struct.pack_into("!Q", replayed, HEADER_BYTES - 12, 2)  # the round field
    assert parse_header(replayed).round == 2
    with pytest.raises(FrameError, match="auth tag"):
        decode_tensor_frame(
            bytes(replayed),
            [torch.empty(3)],
            secret=SECRET,
            max_frame_bytes=BIG,
            sender=upload_sender(2),
        )


@pytest.mark.parametrize(
    "sender", [b"", upload_sender(1), CONSENSUS_SENDER], ids=["none", "rank1", "down"]
)
def test_frame_from_another_sender_or_direction_fails(sender: bytes) -> None:
    frame = _encode([torch.ones(3)], sender=upload_sender(0))
    with pytest.raises(FrameError, match="auth tag"):
        decode_tensor_frame(
            frame, [torch.empty(3)], secret=SECRET, max_frame_bytes=BIG, sender=sender
        )
    decode_tensor_frame(
        frame, [torch.empty(3)], secret=SECRET, max_frame_bytes=BIG, sender=upload_sender(0)
    )


@pytest.mark.parametrize("table_nbytes", [None, entry_nbytes(1)])
def test_streaming_reader_checks_the_sender(table_nbytes: int | None) -> None:
    frame = _encode([torch.arange(3.0)], sender=CONSENSUS_SENDER)
    for sender, ok in ((CONSENSUS_SENDER, True), (upload_sender(0), False)):
        reader = _ChunkReader(frame, 5)
        prefix = read_frame_prefix(
            reader.recv_into,
            secret=SECRET,
            max_frame_bytes=BIG,
            table_nbytes=table_nbytes,
            sender=sender,
        )
        out = [torch.empty(3)]
        if ok:
            read_frame_payloads(reader.recv_into, prefix, out)
            assert torch.equal(out[0], torch.arange(3.0))
        else:
            with pytest.raises(FrameError, match="auth tag"):
                read_frame_payloads(reader.recv_into, prefix, out)


def test_version_1_frame_is_refused_with_a_clear_message() -> None:
    assert VERSION == 2
    # A version 1 frame: same layout, HMAC-SHA256 tag truncated to 16 bytes.
    body = _patch_header(_encode([torch.ones(2)]), version=1)[:-TAG_BYTES]
    v1 = body + hmac.new(SECRET, body, "sha256").digest()[:TAG_BYTES]
    with pytest.raises(FrameError, match=r"unsupported tensor frame version 1 .*speaks 2"):
        decode_tensor_frame(v1, [torch.empty(2)], secret=SECRET, max_frame_bytes=BIG)
    with pytest.raises(FrameError, match="Poly1305"):
        parse_header(v1)


class _ChunkReader:
    def __init__(self, data: bytes, chunk: int) -> None:
        self._data, self._pos, self._chunk = data, 0, chunk

    def recv_into(self, view: memoryview) -> int:
        n = min(view.nbytes, self._chunk, len(self._data) - self._pos)
        view[:n] = self._data[self._pos : self._pos + n]
        self._pos += n
        return n
