"""LitData's ``json`` leaf: a compact tagged encoding of lists and dicts, read without LitData.

LitData stores a list or dict inside a sample (``{"tokens": [1, 2, 3]}``) as one leaf. Its
bytes start with a tag byte (learnt from ``litdata/streaming/serializers.py``); a first byte
above ``0x20`` is plain JSON text (older writers). All numbers little-endian::

    0  JSON        u32 length, UTF-8 JSON text
    1  STRS        u32 n, n x (u32 length, UTF-8)
    2  I64S        u32 n, n x i64
    3  F64S        u32 n, n x f64
    4  BOOLS       u32 n, n x u8
    5  DICT        u32 n, n x (u32 length, UTF-8 key, value)
    6  RECS        u32 rows, u32 keys, keys x (u32 length, UTF-8), rows x keys x record value
    7  STR         u32 length, UTF-8
    8  I64  9 F64  10 BOOL (u8)  11 NONE
    record value: 0x10 none, 0x11 str, 0x12 i64, 0x13 f64, 0x14 bool (tag then as above)

Every length is checked against the bytes left before it is used, so a corrupt leaf is an
:class:`InvalidDataError`, never a huge allocation.
"""

from __future__ import annotations

import json
import struct

import numpy as np

from shardserve.proto.errors import InvalidDataError


class _Cursor:
    """Reads ``data`` from the front, refusing to read past its end."""

    def __init__(self, data: bytes, where: str) -> None:
        self.data = data
        self.pos = 0
        self.where = where

    def take(self, n: int) -> bytes:
        end = self.pos + n
        if n < 0 or end > len(self.data):
            raise InvalidDataError(
                f"{self.where}: the json leaf is cut short ({n} bytes wanted at "
                f"{self.pos} of {len(self.data)})"
            )
        out = self.data[self.pos : end]
        self.pos = end
        return out

    def u8(self) -> int:
        return self.take(1)[0]

    def u32(self) -> int:
        return int(struct.unpack("<I", self.take(4))[0])

    def i64(self) -> int:
        return int(struct.unpack("<q", self.take(8))[0])

    def f64(self) -> float:
        return float(struct.unpack("<d", self.take(8))[0])

    def utf8(self) -> str:
        raw = self.take(self.u32())
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise InvalidDataError(f"{self.where}: json leaf text is not UTF-8 ({e})") from None

    def array(self, dtype: str) -> list[object]:
        n = self.u32()
        return list(np.frombuffer(self.take(8 * n), dtype=dtype).tolist())


def _text(raw: bytes, where: str) -> object:
    try:
        return json.loads(raw)
    except ValueError as e:
        raise InvalidDataError(f"{where}: the json leaf is not valid JSON ({e})") from None


_RECORD = {0x11: 7, 0x12: 8, 0x13: 9, 0x14: 10}  # record tag -> the value tag it reads as


def _value(c: _Cursor, tag: int) -> object:
    if tag == 0:
        return _text(c.take(c.u32()), c.where)
    if tag == 1:
        return [c.utf8() for _ in range(c.u32())]
    if tag == 2:
        return c.array("<i8")
    if tag == 3:
        return c.array("<f8")
    if tag == 4:
        return [b != 0 for b in c.take(c.u32())]
    if tag == 5:
        n = c.u32()
        out: dict[str, object] = {}
        for _ in range(n):
            key = c.utf8()
            out[key] = _value(c, c.u8())
        return out
    if tag == 6:
        rows, n_keys = c.u32(), c.u32()
        keys = [c.utf8() for _ in range(n_keys)]
        return [{k: _record(c) for k in keys} for _ in range(rows)]
    if tag == 7:
        return c.utf8()
    if tag == 8:
        return c.i64()
    if tag == 9:
        return c.f64()
    if tag == 10:
        return c.u8() != 0
    if tag == 11:
        return None
    raise InvalidDataError(f"{c.where}: unknown json leaf tag {tag}")


def _record(c: _Cursor) -> object:
    kind = c.u8()
    if kind == 0x10:
        return None
    if kind not in _RECORD:
        raise InvalidDataError(f"{c.where}: unknown json record tag {kind:#x}")
    return _value(c, _RECORD[kind])


def loads(data: bytes, where: str) -> object:
    """The list / dict / scalar a ``json`` leaf holds."""
    if not data or data[0] > 0x20:
        return _text(data, where)
    c = _Cursor(data, where)
    value = _value(c, c.u8())
    if c.pos != len(data):
        raise InvalidDataError(f"{where}: {len(data) - c.pos} bytes follow the json leaf's value")
    return value
