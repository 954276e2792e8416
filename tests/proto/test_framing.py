"""The wire codec: golden bytes, exact round trips, and hostile frames refused by name."""

from __future__ import annotations

import contextlib
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardserve.proto.dtypes import DTYPE_CODES, ITEMSIZE
from shardserve.proto.errors import MalformedFrame, ProtocolError, UnknownMessage, VersionMismatch
from shardserve.proto.framing import (
    decode,
    decode_batch,
    encode,
    encode_batch,
    peek_kind,
)
from shardserve.proto.messages import (
    MAX_CREDIT,
    MAX_GROUP,
    PROTOCOL_VERSION,
    BatchHeader,
    Credit,
    Hello,
    Kind,
    PartHeader,
)

from .golden_cases import BATCHES, CONTROL, GOLDEN, header_bytes, names

#: What every message's header frame starts with: the magic and this protocol's version.
HEAD = b"SS" + bytes([PROTOCOL_VERSION])


@pytest.mark.parametrize("name", names())
def test_golden_bytes(name: str) -> None:
    """Every message kind encodes to exactly the pinned bytes (regenerate only on purpose)."""
    assert header_bytes(name) == (GOLDEN / f"{name}.bin").read_bytes()


@pytest.mark.parametrize("name", list(CONTROL))
def test_control_round_trip(name: str) -> None:
    """decode(encode(m)) == m for every control message."""
    msg = CONTROL[name]
    assert decode(encode(msg)) == msg


@pytest.mark.parametrize("name", list(BATCHES))
def test_batch_round_trip(name: str) -> None:
    """A batch header and its payload frames survive encode/decode unchanged."""
    h = BATCHES[name]
    payload = [] if h.slot >= 0 else [np.arange(p.nbytes, dtype=np.uint8).data for p in h.parts]
    got, frames = decode_batch(encode_batch(h, payload))
    assert got == h
    assert [bytes(f) for f in frames] == [bytes(p) for p in payload]


def test_batch_payload_is_passed_through_not_copied() -> None:
    """encode_batch hands the caller's buffers through, so they can be sent with copy=False."""
    arr = np.zeros((4, 4), dtype=np.float32)
    h = BatchHeader(0, 0, 0, (PartHeader("x", "float32", (4, 4), 64),))
    frames = encode_batch(h, [arr])
    assert frames[1] is arr


def test_version_mismatch_named() -> None:
    """A data message from a peer on another protocol version is refused, naming both versions."""
    frame = bytearray(encode(Credit(grant=1))[0])
    frame[2] = 9
    with pytest.raises(VersionMismatch, match=rf"protocol 9.*speaks {PROTOCOL_VERSION}"):
        decode([bytes(frame)])


def test_hello_of_other_version_still_decodes() -> None:
    """A Hello from a newer client decodes so the server can reject it with an explanation."""
    frame = bytearray(encode(Hello(job="j", rank=0, epoch=0, credit=1, protocols=(9,)))[0])
    frame[2] = 9
    msg = decode([bytes(frame)])
    assert isinstance(msg, Hello) and msg.protocols == (9,)


@pytest.mark.parametrize(
    ("frames", "error", "match"),
    [
        ([], MalformedFrame, "empty"),
        ([b"S"], MalformedFrame, "shorter"),
        ([b"XX\x01\x01{}"], MalformedFrame, "magic"),
        ([HEAD + b"\x63{}"], UnknownMessage, "kind 99"),
        ([HEAD + b"\x04not json"], MalformedFrame, "CREDIT"),
        ([HEAD + b"\x04{}", b"extra"], MalformedFrame, "one frame"),
        ([HEAD + b"\x05\x00\x00"], MalformedFrame, "truncated"),
    ],
)
def test_malformed_frames_rejected(frames: list[bytes], error: type, match: str) -> None:
    """Garbage frames raise a named protocol error, never something else."""
    with pytest.raises(error, match=match):
        decode(frames)


def test_absurd_credit_refused() -> None:
    """Credit above MAX_CREDIT is refused at decode time rather than clamped."""
    body = b'{"kind":4,"grant":%d}' % (MAX_CREDIT + 1)
    with pytest.raises(MalformedFrame, match="grant"):
        decode([HEAD + b"\x04" + body])


def _batch_frame(nparts: int, parts: bytes) -> bytes:
    return HEAD + b"\x05" + struct.pack("<IIIiHIH", 0, 0, 0, -1, 1, 0, nparts) + parts


def test_batch_header_claiming_huge_size_refused() -> None:
    """A header whose nbytes disagrees with dtype x shape is refused before any allocation."""
    part = b"\x01x" + struct.pack("<BB", DTYPE_CODES["uint8"], 1) + struct.pack("<q", 10)
    part += struct.pack("<QQ", 1 << 40, 0)
    with pytest.raises(MalformedFrame, match="header says"):
        decode_batch([_batch_frame(1, part), b"\x00" * 10])


@pytest.mark.parametrize("count", [0, MAX_GROUP + 1])
def test_batch_header_with_an_impossible_batch_count_refused(count: int) -> None:
    """A message holds 1 to MAX_GROUP batches; anything else is refused at decode."""
    frame = HEAD + b"\x05" + struct.pack("<IIIiHIH", 0, 0, 0, 0, count, 4, 0)
    with pytest.raises(MalformedFrame, match=f"claims {count} batches"):
        decode_batch([frame])


def test_batch_frame_length_mismatch_refused() -> None:
    """A payload frame shorter than its header claims is refused."""
    h = BatchHeader(0, 0, 0, (PartHeader("x", "uint8", (8,), 8),))
    frames = encode_batch(h, [b"\x00" * 8])
    with pytest.raises(MalformedFrame, match="frame is 4 bytes"):
        decode_batch([frames[0], b"\x00" * 4])


def test_too_many_parts_refused() -> None:
    """A header claiming more parts than allowed is refused without reading them."""
    with pytest.raises(MalformedFrame, match="parts"):
        decode_batch([_batch_frame(60000, b"")])


_dtypes = st.sampled_from(sorted(DTYPE_CODES))
_names = st.text(alphabet="abcdefghijklmnopqrstuvwxyz._", min_size=1, max_size=20)


@st.composite
def batch_headers(draw: st.DrawFn) -> BatchHeader:
    parts = []
    for _ in range(draw(st.integers(0, 6))):
        dtype = draw(_dtypes)
        shape = tuple(draw(st.lists(st.integers(0, 5), max_size=4)))
        n = int(np.prod(shape, dtype=np.int64)) * ITEMSIZE[dtype]
        parts.append(PartHeader(draw(_names), dtype, shape, n, draw(st.integers(0, 1 << 40))))
    return BatchHeader(
        stream=draw(st.integers(0, 2**32 - 1)),
        epoch=draw(st.integers(0, 2**32 - 1)),
        index=draw(st.integers(0, 2**32 - 1)),
        parts=tuple(parts),
        slot=draw(st.integers(0, 1024)),
    )


@given(batch_headers())
def test_batch_header_round_trip_property(h: BatchHeader) -> None:
    """Any valid batch header in a shared-memory slot round-trips exactly."""
    assert decode_batch(encode_batch(h))[0] == h


@settings(max_examples=300)
@given(st.lists(st.binary(max_size=200), min_size=0, max_size=4))
def test_decode_fuzz_only_protocol_errors(frames: list[bytes]) -> None:
    """Arbitrary bytes either decode or raise a ProtocolError; never another exception."""
    with contextlib.suppress(ProtocolError):
        decode(frames)


@settings(max_examples=300)
@given(batch_headers(), st.data())
def test_mutated_batch_headers_only_protocol_errors(h: BatchHeader, data: st.DataObject) -> None:
    """Flipping, truncating or extending a valid batch header never escapes as a non-protocol error."""
    raw = bytearray(encode_batch(h)[0])
    op = data.draw(st.sampled_from(["flip", "truncate", "extend"]))
    if op == "flip" and len(raw) > 4:
        i = data.draw(st.integers(4, len(raw) - 1))
        raw[i] ^= data.draw(st.integers(1, 255))
    elif op == "truncate":
        raw = raw[: data.draw(st.integers(0, len(raw)))]
    else:
        raw += data.draw(st.binary(min_size=1, max_size=16))
    with contextlib.suppress(ProtocolError):
        decode_batch([bytes(raw)])


@settings(max_examples=200)
@given(st.sampled_from(list(Kind)), st.binary(max_size=300))
def test_control_bodies_fuzz(kind: Kind, body: bytes) -> None:
    """Any body under any kind decodes or raises a ProtocolError."""
    try:
        peek_kind(HEAD + bytes([kind]))
        decode([HEAD + bytes([kind]) + body])
    except ProtocolError:
        pass
