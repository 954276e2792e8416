"""The element types a field may hold: one table, read by the manifest (which dtype names a
field may have), the frame codec (each dtype's one-byte wire code and item size) and the server.

Names are numpy's. Wire codes are part of the protocol: append only, never renumber.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DType:
    """One numeric element type: its numpy name, wire code and size in bytes."""

    name: str
    code: int
    itemsize: int


#: Every numeric dtype, in wire-code order.
DTYPES: tuple[DType, ...] = (
    DType("bool", 1, 1),
    DType("int8", 2, 1),
    DType("uint8", 3, 1),
    DType("int16", 4, 2),
    DType("uint16", 5, 2),
    DType("int32", 6, 4),
    DType("uint32", 7, 4),
    DType("int64", 8, 8),
    DType("uint64", 9, 8),
    DType("float16", 10, 2),
    DType("float32", 11, 4),
    DType("float64", 12, 8),
)

#: The dtype of a field of raw bytes (encoded images, strings); it has no wire code because
#: it travels as ``uint8`` values plus offsets.
BINARY = "binary"

#: numpy dtype names a tensor field may have.
NUMERIC_DTYPES: tuple[str, ...] = tuple(d.name for d in DTYPES)
#: dtype name -> one-byte wire code.
DTYPE_CODES: dict[str, int] = {d.name: d.code for d in DTYPES}
#: one-byte wire code -> dtype name.
DTYPE_NAMES: dict[int, str] = {d.code: d.name for d in DTYPES}
#: dtype name -> bytes per element.
ITEMSIZE: dict[str, int] = {d.name: d.itemsize for d in DTYPES}
