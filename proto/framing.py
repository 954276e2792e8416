"""Encode and decode data-plane messages to ZeroMQ frames. Pure functions, exact inverses.

Every message starts with one header frame::

    offset  size  field
    0       2     magic b"SS"
    2       1     protocol version (u8)
    3       1     kind (u8, :class:`~shardserve.proto.messages.Kind`)
    4       ...   body

For control messages the body is the model's JSON. For ``BATCH`` the body is packed
little-endian, then one raw frame per part follows (none when ``slot >= 0``: the payload
is in shared memory)::

    u32 stream | u32 epoch | u32 index | i32 slot | u16 count | u32 rows | u16 nparts
    nparts x ( u8 name_len | name (utf-8) | u8 dtype code | u8 ndim
               | ndim x i64 dim | u64 nbytes | u64 offset )

Batch parts are named after fields. A variable-shape or binary field ``x`` travels as three
or two parts: ``x`` (the concatenated values, 1-d), ``x.offsets`` (int64, ``batch+1``
element offsets into the values) and, for variable tensors, ``x.shapes`` (int64,
``[batch, ndim]``).

Nothing here unpickles; hostile frames raise :class:`MalformedFrame` or
:class:`UnknownMessage` before anything large is allocated.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any

from pydantic import ValidationError

from .dtypes import DTYPE_CODES, DTYPE_NAMES, ITEMSIZE
from .errors import MalformedFrame, UnknownMessage
from .messages import (
    CONTROL_MODELS,
    MAX_GROUP,
    MAX_NDIM,
    MAX_PART_BYTES,
    MAX_PARTS,
    PROTOCOL_VERSION,
    BatchHeader,
    ControlMessage,
    Kind,
    Message,
    PartHeader,
)
from .version import check_version

MAGIC = b"SS"
#: magic, protocol version, kind: the first 4 bytes of every message.
PREFIX = struct.Struct("<2sBB")
_BATCH = struct.Struct("<IIIiHIH")
_PART_TAIL = struct.Struct("<QQ")
_MAX_HEADER = 1 << 20

Frame = bytes | memoryview | Any  # zmq.Frame or any buffer-protocol object


def _prefix(kind: Kind, version: int = PROTOCOL_VERSION) -> bytes:
    return PREFIX.pack(MAGIC, version, int(kind))


def encode(msg: ControlMessage) -> list[bytes]:
    """Frames for a control message (one frame: prefix + JSON)."""
    kind = Kind(msg.kind)
    return [_prefix(kind) + msg.model_dump_json().encode()]


def encode_batch(header: BatchHeader, payload: Sequence[Frame] = ()) -> list[Frame]:
    """Frames for a batch: the packed header, then ``payload`` (one buffer per part, in order).

    ``payload`` must be empty when ``header.slot >= 0`` and hold one buffer per part otherwise.
    Buffers are passed through untouched so the caller can send them with ``copy=False``.
    """
    if (header.slot >= 0) == bool(payload) or (payload and len(payload) != len(header.parts)):
        raise ValueError(
            f"batch with slot {header.slot} needs {0 if header.slot >= 0 else len(header.parts)} "
            f"payload frames, got {len(payload)}"
        )
    out = bytearray(_prefix(Kind.BATCH))
    out += _BATCH.pack(
        header.stream,
        header.epoch,
        header.index,
        header.slot,
        header.count,
        header.rows,
        len(header.parts),
    )
    for p in header.parts:
        name = p.name.encode()
        out += struct.pack("<B", len(name)) + name
        out += struct.pack("<BB", DTYPE_CODES[p.dtype], len(p.shape))
        out += struct.pack(f"<{len(p.shape)}q", *p.shape)
        out += _PART_TAIL.pack(p.nbytes, p.offset)
    return [bytes(out), *payload]


def peek_kind(frame: Frame) -> Kind:
    """The kind of a message from its first frame, checking magic and version."""
    buf = memoryview(frame)
    if len(buf) < PREFIX.size:
        raise MalformedFrame(
            f"header frame is {len(buf)} bytes, shorter than the {PREFIX.size}-byte prefix"
        )
    magic, version, kind = PREFIX.unpack_from(buf)
    if magic != MAGIC:
        raise MalformedFrame(
            f"bad magic {bytes(magic)!r}, expected {MAGIC!r}: not a shardserve peer"
        )
    try:
        k = Kind(kind)
    except ValueError:
        raise UnknownMessage(
            f"unknown message kind {kind}; this side knows {[int(x) for x in Kind]}"
        ) from None
    check_version(version, k)
    return k


def decode(frames: Sequence[Frame]) -> Message:
    """Decode one message (without the ROUTER's identity frame).

    Returns a control model or a :class:`BatchHeader`; for a batch, the payload frames are
    ``frames[1:]`` and are not touched here (see :func:`decode_batch`).
    """
    if not frames:
        raise MalformedFrame("empty message: expected at least a header frame")
    kind = peek_kind(frames[0])
    if kind is Kind.BATCH:
        return decode_batch(frames)[0]
    if len(frames) != 1:
        raise MalformedFrame(f"{kind.name} is one frame, got {len(frames)}")
    body = memoryview(frames[0])[PREFIX.size :]
    if len(body) > _MAX_HEADER:
        raise MalformedFrame(f"{kind.name} body is {len(body)} bytes, over the {_MAX_HEADER} limit")
    model = CONTROL_MODELS[kind]
    try:
        msg = model.model_validate_json(bytes(body))
    except ValidationError as e:
        raise MalformedFrame(f"bad {kind.name} body: {e.errors(include_url=False)}") from None
    return msg  # type: ignore[return-value]


def decode_batch(frames: Sequence[Frame]) -> tuple[BatchHeader, list[Frame]]:
    """Decode a batch header and check the payload frames against it.

    Sizes are validated (dtype × shape = nbytes; frame lengths match) so a header that lies
    about its sizes is refused rather than trusted.
    """
    if not frames:
        raise MalformedFrame("empty message: expected a batch header frame")
    if peek_kind(frames[0]) is not Kind.BATCH:
        raise MalformedFrame("not a BATCH message")
    buf = memoryview(frames[0])
    pos = PREFIX.size
    try:
        stream, epoch, index, slot, count, rows, nparts = _BATCH.unpack_from(buf, pos)
        pos += _BATCH.size
        if not 1 <= count <= MAX_GROUP:
            raise MalformedFrame(f"batch claims {count} batches, allowed 1 to {MAX_GROUP}")
        if nparts > MAX_PARTS:
            raise MalformedFrame(f"batch claims {nparts} parts, more than the {MAX_PARTS} allowed")
        parts = []
        for _ in range(nparts):
            part, pos = _decode_part(buf, pos)
            parts.append(part)
    except (struct.error, UnicodeDecodeError) as e:
        raise MalformedFrame(f"truncated or garbled batch header: {e}") from None
    if pos != len(buf):
        raise MalformedFrame(f"batch header has {len(buf) - pos} trailing bytes")
    header = BatchHeader(stream, epoch, index, tuple(parts), slot, count, rows)
    payload = list(frames[1:])
    _check_payload(header, payload)
    return header, payload


def _decode_part(buf: memoryview, pos: int) -> tuple[PartHeader, int]:
    """One part's header at ``pos``, its sizes checked; and the position after it."""
    (nlen,) = struct.unpack_from("<B", buf, pos)
    pos += 1
    name = bytes(buf[pos : pos + nlen]).decode()
    if len(name.encode()) != nlen:
        raise MalformedFrame("part name is truncated")
    pos += nlen
    code, ndim = struct.unpack_from("<BB", buf, pos)
    pos += 2
    if code not in DTYPE_NAMES:
        raise MalformedFrame(f"part {name!r}: unknown dtype code {code}")
    if ndim > MAX_NDIM:
        raise MalformedFrame(f"part {name!r}: {ndim} dimensions, more than {MAX_NDIM}")
    shape = struct.unpack_from(f"<{ndim}q", buf, pos)
    pos += 8 * ndim
    nbytes, offset = _PART_TAIL.unpack_from(buf, pos)
    pos += _PART_TAIL.size
    dtype = DTYPE_NAMES[code]
    numel = 1
    for d in shape:
        if d < 0:
            raise MalformedFrame(f"part {name!r}: negative dimension in shape {shape}")
        numel *= d
    if nbytes > MAX_PART_BYTES or numel * ITEMSIZE[dtype] != nbytes:
        raise MalformedFrame(
            f"part {name!r}: {dtype}{list(shape)} is {numel * ITEMSIZE[dtype]} bytes, "
            f"header says {nbytes}"
        )
    return PartHeader(name, dtype, tuple(shape), nbytes, offset), pos


def _check_payload(header: BatchHeader, payload: list[Frame]) -> None:
    """No frames for a batch in a shared-memory slot; else one frame per part, of its size."""
    if header.slot >= 0:
        if payload:
            raise MalformedFrame(
                f"batch in slot {header.slot} must carry no payload frames, got {len(payload)}"
            )
        return
    if len(payload) != len(header.parts):
        raise MalformedFrame(
            f"batch header lists {len(header.parts)} parts but {len(payload)} frames follow"
        )
    for p, f in zip(header.parts, payload, strict=False):
        n = memoryview(f).nbytes
        if n != p.nbytes:
            raise MalformedFrame(f"part {p.name!r}: frame is {n} bytes, header says {p.nbytes}")
