"""The control connection's challenge and key (:mod:`flodl.wire.control_hello`)."""

from __future__ import annotations

import struct

import pytest

from flodl.errors import FrameError, LocalProtocolError
from flodl.wire.codec import decode_frame, encode_frame
from flodl.wire.control_hello import (
    CHALLENGE_BYTES,
    CHALLENGE_MAGIC,
    CONTROL_PROTOCOL_VERSION,
    NONCE_BYTES,
    connection_key,
    encode_challenge,
    new_nonce,
    parse_challenge,
)
from flodl.wire.frames import PROTOCOL_VERSION, Heartbeat

SECRET = b"control-hello-test-secret-0123456789"


def test_the_challenge_is_magic_version_and_nonce() -> None:
    nonce = new_nonce()
    challenge = encode_challenge(nonce)
    assert len(challenge) == CHALLENGE_BYTES == 24
    assert challenge == b"FDLC" + struct.pack("!I", PROTOCOL_VERSION) + nonce
    assert CONTROL_PROTOCOL_VERSION == PROTOCOL_VERSION == 10
    assert parse_challenge(challenge) == nonce
    assert encode_challenge()[8:] != encode_challenge()[8:]  # a fresh nonce each time


def test_a_wrong_magic_is_not_a_flodl_coordinator() -> None:
    data = b"HTTP" + encode_challenge()[4:]
    with pytest.raises(FrameError, match="not a flodl coordinator"):
        parse_challenge(data)


def test_another_version_names_both_versions() -> None:
    data = CHALLENGE_MAGIC + struct.pack("!I", 2) + new_nonce()
    with pytest.raises(FrameError, match=f"version 2, this build {CONTROL_PROTOCOL_VERSION}"):
        parse_challenge(data)


@pytest.mark.parametrize("size", [0, 23, 25])
def test_a_challenge_of_another_size_is_refused(size: int) -> None:
    with pytest.raises(FrameError, match=f"challenge of {size} bytes"):
        parse_challenge((encode_challenge() + b"x")[:size])


def test_bad_nonces_are_our_bug() -> None:
    with pytest.raises(LocalProtocolError):
        encode_challenge(b"short")
    with pytest.raises(LocalProtocolError):
        connection_key(SECRET, new_nonce(), b"x" * (NONCE_BYTES + 1))


def test_the_key_depends_on_the_secret_and_both_nonces() -> None:
    s, c = new_nonce(), new_nonce()
    key = connection_key(SECRET, s, c)
    assert len(key) == 32 and key == connection_key(SECRET, s, c)
    others = {
        connection_key(SECRET, new_nonce(), c),
        connection_key(SECRET, s, new_nonce()),
        connection_key(SECRET, c, s),
        connection_key(SECRET + b"!", s, c),
    }
    assert key not in others and len(others) == 4
    # a frame tagged on one connection fails on another (same secret, same seq)
    frame = encode_frame(Heartbeat(rank=0, step=1), key)
    assert isinstance(decode_frame(frame, key), Heartbeat)
    for other in others:
        with pytest.raises(FrameError, match="bad auth tag"):
            decode_frame(frame, other)
