"""The shared-memory lane's messages and segment layout (flodl/wire/shm.py)."""

from __future__ import annotations

import pytest
import torch

from flodl.errors import FrameError, LocalProtocolError
from flodl.wire.shm import (
    ALIGN,
    ANSWER_BYTES,
    HEADER_REGION,
    OFFER_BYTES,
    SegmentLayout,
    encode_answer,
    encode_offer,
    parse_answer,
    parse_offer,
    tensor_views,
)

KEY = b"k" * 32
PROBE = bytes(range(16))


def test_offer_and_answer_round_trip_and_bind_each_other() -> None:
    offer_bytes = encode_offer(KEY, 4242, 7, 1 << 20, PROBE)
    assert len(offer_bytes) == OFFER_BYTES == 53
    offer = parse_offer(KEY, offer_bytes)
    assert (offer.pid, offer.fd, offer.size, offer.probe) == (4242, 7, 1 << 20, PROBE)
    answer_bytes = encode_answer(KEY, offer, accepted=True, pid=1, fd=2, size=3, probe=PROBE)
    assert len(answer_bytes) == ANSWER_BYTES == 54
    answer = parse_answer(KEY, offer_bytes, answer_bytes)
    assert (answer.accepted, answer.pid, answer.fd, answer.size) == (True, 1, 2, 3)
    declined = parse_answer(KEY, offer_bytes, encode_answer(KEY, offer, accepted=False))
    assert not declined.accepted
    other = encode_offer(KEY, 4242, 8, 1 << 20, PROBE)
    with pytest.raises(FrameError, match="answer auth tag"):  # it answers another offer
        parse_answer(KEY, other, answer_bytes)


@pytest.mark.parametrize(
    ("mangle", "message"),
    [
        (lambda b: b[:-1], "of 52 bytes"),
        (lambda b: b"\x00" + b[1:], "magic"),
        (lambda b: b[:4] + b"\x09" + b[5:], "version 9"),
        (lambda b: b[:-1] + bytes([b[-1] ^ 1]), "offer auth tag"),
    ],
)
def test_a_bad_offer_is_refused(mangle: object, message: str) -> None:
    good = encode_offer(KEY, 1, 2, 3, PROBE)
    with pytest.raises(FrameError, match=message):
        parse_offer(KEY, mangle(good))  # type: ignore[operator]
    with pytest.raises(FrameError, match="offer auth tag"):
        parse_offer(b"another key", good)


def test_values_the_message_cannot_carry_are_local_errors() -> None:
    with pytest.raises(LocalProtocolError, match="probe"):
        encode_offer(KEY, 1, 2, 3, b"short")
    with pytest.raises(LocalProtocolError, match="does not fit"):
        encode_offer(KEY, 1 << 32, 2, 3, PROBE)


def test_layout_is_one_aligned_region_per_accumulation_dtype_per_slot() -> None:
    shapes = [(3, 5), (7,), (2,)]
    dtypes = [torch.float32, torch.float64, torch.float32]
    layout = SegmentLayout.of(shapes, dtypes, [(4,)], [torch.float32], slots=2)
    p0, p1 = layout.params
    assert [(r.dtype, r.numel) for r in p0] == [(torch.float32, 17), (torch.float64, 7)]
    assert p0[0].offset == HEADER_REGION
    offsets = [r.offset for slot in range(2) for r in (*layout.params[slot], *layout.buffers[slot])]
    assert all(o % ALIGN == 0 for o in offsets) and offsets == sorted(offsets)
    assert p1[0].offset - p0[0].offset == (layout.nbytes - HEADER_REGION) // 2
    base = torch.zeros(layout.nbytes, dtype=torch.uint8)
    views = tensor_views(p0, shapes, dtypes, base)
    assert [tuple(v.shape) for v in views] == shapes
    views[2].fill_(1.0)  # the second f32 tensor follows the first in the f32 region
    assert torch.equal(p0[0].view(base)[15:], torch.ones(2))
    narrow = tensor_views(p0, shapes, dtypes, base, {torch.float32: torch.bfloat16})
    assert narrow[0].dtype == torch.bfloat16 and narrow[1].dtype == torch.float64
