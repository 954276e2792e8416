"""Per-field write buffers: check incoming values against the field spec, hold one chunk of
rows, and turn it into an Arrow array (zero-copy for fixed fields).

A fixed field's buffer is one preallocated numpy array that grows by doubling up to the chunk
size and is reused for every chunk, so its pages are faulted once per ingest, not per shard.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from shardserve.proto.errors import InvalidDataError
from shardserve.proto.manifest import FieldSpec

from .schema import BytesLike, arrow_value_type

_INT32_MAX = (1 << 31) - 1


def _suggest_variable(name: str) -> str:
    return (
        f"if this dimension varies between samples, declare the field variable "
        f"(--variable {name}, or -1 in its shape)"
    )


def native_order(arr: np.ndarray, want: np.dtype[Any]) -> np.ndarray:
    """``arr`` in the store's (native) byte order when it differs from ``want`` only in that.

    Big-endian input (``>u4`` from a file written on another machine) has the same dtype
    *name* as the store's ``uint32``; converting it once here beats an error that reads
    "has dtype uint32, expected uint32".
    """
    if arr.dtype != want and arr.dtype.newbyteorder("=") == want:
        return arr.astype(want)
    return arr


class FixedColumn:
    """A scalar or fixed-shape tensor field."""

    def __init__(self, spec: FieldSpec, max_rows: int) -> None:
        self.spec = spec
        self.dtype = np.dtype(spec.dtype)
        self.shape = spec.shape
        self.row_bytes = self.dtype.itemsize * spec.numel
        self._max_rows = max(1, max_rows)
        self._buf = np.empty((min(self._max_rows, 1024), *self.shape), dtype=self.dtype)
        self.n = 0

    def check(self, value: object, where: str) -> np.ndarray:
        """``value`` as an array of this field's dtype and shape, or ``InvalidDataError``."""
        name, want = self.spec.name, self.dtype
        if isinstance(value, (bool, int, float)) and not isinstance(value, np.generic):
            ok = (
                (want.kind == "b" and isinstance(value, bool))
                or (want.kind in "iu" and isinstance(value, int) and not isinstance(value, bool))
                or (want.kind == "f" and not isinstance(value, bool))
            )
            if not ok:
                raise InvalidDataError(
                    f"{where}: field {name!r} is a Python {type(value).__name__}, but the "
                    f"field's dtype is {want.name}"
                )
            try:
                arr = np.asarray(value, dtype=want)
            except OverflowError:
                raise InvalidDataError(
                    f"{where}: field {name!r} value {value} does not fit {want.name}"
                ) from None
        elif isinstance(value, (np.ndarray, np.generic)):
            arr = native_order(np.asarray(value), want)
            if arr.dtype != want:
                raise InvalidDataError(
                    f"{where}: field {name!r} has dtype {arr.dtype.name}, but earlier samples "
                    f"have {want.name}"
                )
        else:
            raise InvalidDataError(
                f"{where}: field {name!r} holds a {type(value).__name__}, expected {want.name} {self.shape}"
            )
        if arr.shape != self.shape:
            raise InvalidDataError(
                f"{where}: field {name!r} has shape {arr.shape}, but earlier samples have "
                f"{self.shape}; {_suggest_variable(name)}"
            )
        return arr

    def check_column(self, col: object, rows: int, where: str) -> np.ndarray:
        """A whole column ``[rows, *shape]`` of this field, checked."""
        arr = native_order(np.asarray(col), self.dtype)
        name = self.spec.name
        if arr.dtype != self.dtype:
            raise InvalidDataError(
                f"{where}: column {name!r} has dtype {arr.dtype.name}, expected {self.dtype.name}"
            )
        if arr.shape != (rows, *self.shape):
            raise InvalidDataError(
                f"{where}: column {name!r} has shape {arr.shape}, expected ({rows}, "
                f"*{self.shape}); {_suggest_variable(name)}"
            )
        return arr

    def row_sizes(self, col: np.ndarray) -> np.ndarray:
        return np.full(len(col), self.row_bytes, dtype=np.int64)

    def _reserve(self, extra: int) -> None:
        need = self.n + extra
        if need <= len(self._buf):
            return
        cap = min(max(need, 2 * len(self._buf)), max(need, self._max_rows))
        grown = np.empty((cap, *self.shape), dtype=self.dtype)
        grown[: self.n] = self._buf[: self.n]
        self._buf = grown

    def push(self, arr: np.ndarray) -> None:
        self._reserve(1)
        self._buf[self.n] = arr
        self.n += 1

    def push_rows(self, col: np.ndarray, start: int, stop: int) -> None:
        k = stop - start
        self._reserve(k)
        self._buf[self.n : self.n + k] = col[start:stop]
        self.n += k

    def to_arrow(self) -> list[pa.Array]:
        flat = pa.array(self._buf[: self.n].reshape(-1), type=arrow_value_type(self.spec))
        if self.shape == ():
            return [flat]
        return [pa.FixedSizeListArray.from_arrays(flat, self.spec.numel)]

    def reset(self) -> None:
        self.n = 0


class VariableColumn:
    """A tensor field with ``-1`` dimensions: flat values plus each sample's shape."""

    def __init__(self, spec: FieldSpec) -> None:
        self.spec = spec
        self.dtype = np.dtype(spec.dtype)
        self.ndim = len(spec.shape)
        self._values: list[np.ndarray] = []
        self._shapes: list[tuple[int, ...]] = []
        #: Which dims took more than one value so far (to narrow a ``--variable`` spec).
        self.first_shape: tuple[int, ...] | None = None
        self.varied = [False] * self.ndim
        self.n = 0

    def check(self, value: object, where: str) -> np.ndarray:
        name = self.spec.name
        if not isinstance(value, np.ndarray):
            raise InvalidDataError(
                f"{where}: field {name!r} holds a {type(value).__name__}, expected an array"
            )
        value = native_order(value, self.dtype)
        if value.dtype != self.dtype:
            raise InvalidDataError(
                f"{where}: field {name!r} has dtype {value.dtype.name}, but earlier samples have {self.dtype.name}"
            )
        if value.ndim != self.ndim or any(
            want not in (-1, got) for want, got in zip(self.spec.shape, value.shape, strict=True)
        ):
            raise InvalidDataError(
                f"{where}: field {name!r} has shape {value.shape}, which does not fit the "
                f"declared shape {self.spec.shape} (-1 marks a variable dimension)"
            )
        return value

    def row_sizes(self, col: Sequence[np.ndarray]) -> np.ndarray:
        return np.fromiter(
            (a.nbytes + 8 * self.ndim + 4 for a in col), dtype=np.int64, count=len(col)
        )

    def push(self, arr: np.ndarray) -> None:
        shape = arr.shape
        if self.first_shape is None:
            self.first_shape = shape
        elif shape != self.first_shape:
            self.varied = [
                v or a != b for v, a, b in zip(self.varied, shape, self.first_shape, strict=True)
            ]
        self._values.append(arr.reshape(-1))
        self._shapes.append(shape)
        self.n += 1

    def push_rows(self, col: Sequence[np.ndarray], start: int, stop: int) -> None:
        for i in range(start, stop):
            self.push(col[i])

    def to_arrow(self) -> list[pa.Array]:
        lens = np.fromiter((v.size for v in self._values), dtype=np.int64, count=self.n)
        offsets = np.zeros(self.n + 1, dtype=np.int64)
        np.cumsum(lens, out=offsets[1:])
        if offsets[-1] > _INT32_MAX:
            raise InvalidDataError(
                f"field {self.spec.name!r}: more than 2**31 values in one chunk; use a smaller --shard-size"
            )
        values = np.concatenate(self._values) if self._values else np.empty(0, self.dtype)
        lists = pa.ListArray.from_arrays(
            pa.array(offsets.astype(np.int32)), pa.array(values, type=arrow_value_type(self.spec))
        )
        shapes = np.asarray(self._shapes, dtype=np.int64).reshape(self.n * self.ndim)
        return [lists, pa.FixedSizeListArray.from_arrays(pa.array(shapes), self.ndim)]

    def reset(self) -> None:
        self._values.clear()
        self._shapes.clear()
        self.n = 0


class BinaryColumn:
    """Raw bytes per sample (e.g. an encoded image); ``str`` is stored as UTF-8."""

    def __init__(self, spec: FieldSpec) -> None:
        self.spec = spec
        self._items: list[bytes] = []
        self.n = 0

    def check(self, value: object, where: str) -> bytes:
        if isinstance(value, str):
            return value.encode("utf-8")
        if isinstance(value, BytesLike):
            return bytes(value)
        raise InvalidDataError(
            f"{where}: field {self.spec.name!r} holds a {type(value).__name__}, but earlier samples hold bytes"
        )

    def row_sizes(self, col: Sequence[bytes]) -> np.ndarray:
        return np.fromiter((len(b) + 4 for b in col), dtype=np.int64, count=len(col))

    def push(self, value: bytes) -> None:
        self._items.append(value)
        self.n += 1

    def push_rows(self, col: Sequence[bytes], start: int, stop: int) -> None:
        self._items.extend(col[start:stop])
        self.n += stop - start

    def to_arrow(self) -> list[pa.Array]:
        if sum(len(b) for b in self._items) > _INT32_MAX:
            raise InvalidDataError(
                f"field {self.spec.name!r}: more than 2 GiB of bytes in one chunk; use a smaller --shard-size"
            )
        return [pa.array(self._items, type=pa.binary())]

    def reset(self) -> None:
        self._items.clear()
        self.n = 0


Column = FixedColumn | VariableColumn | BinaryColumn


def make_column(spec: FieldSpec, chunk_rows: int) -> Any:
    """The buffer for ``spec``; ``chunk_rows`` bounds a fixed field's preallocation."""
    if spec.kind == "binary":
        return BinaryColumn(spec)
    if spec.kind == "variable":
        return VariableColumn(spec)
    return FixedColumn(spec, chunk_rows)
