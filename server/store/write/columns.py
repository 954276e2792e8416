"""Per-field write buffers: check incoming values against the field spec, hold one chunk of
rows, and turn it into an Arrow array (zero-copy for fixed fields).

A fixed field's buffer is one preallocated numpy array that grows by doubling up to the chunk
size and is reused for every chunk, so its pages are faulted once per ingest, not per shard.

A nullable field (some samples ``None``) keeps a validity list beside its rows; a missing row
holds zeros in the buffer (never read: the Arrow validity bitmap says it is not there).
"""

from __future__ import annotations

from collections.abc import Sequence

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


def native_order(arr: np.ndarray, want: np.dtype[np.generic]) -> np.ndarray:
    """``arr`` in the store's (native) byte order when it differs from ``want`` only in that.

    Big-endian input (``>u4`` from a file written on another machine) has the same dtype
    *name* as the store's ``uint32``; converting it once here beats an error that reads
    "has dtype uint32, expected uint32".
    """
    if arr.dtype != want and arr.dtype.newbyteorder("=") == want:
        return arr.astype(want)
    return arr


class Validity:
    """Which rows of a chunk are missing; nothing is allocated until one is."""

    def __init__(self) -> None:
        self._missing: list[int] = []

    def missing(self, row: int) -> None:
        self._missing.append(row)

    def at(self, row: int) -> bool:
        return row not in self._missing

    def mask(self, n: int) -> np.ndarray | None:
        """``True`` where a row is missing (pyarrow's ``mask``), or ``None`` if none is."""
        if not self._missing:
            return None
        m = np.zeros(n, dtype=bool)
        m[self._missing] = True
        return m

    def prefill(self, n: int) -> None:
        """The first ``n`` rows are missing (a field that appeared mid-chunk)."""
        self._missing.extend(range(n))

    def reset(self) -> None:
        self._missing.clear()


def _pa_mask(mask: np.ndarray | None) -> pa.Array | None:
    return None if mask is None else pa.array(mask, type=pa.bool_())


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
        self.valid = Validity()

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

    def push(self, arr: np.ndarray | None) -> None:
        self._reserve(1)
        if arr is None:
            self._buf[self.n] = 0
            self.valid.missing(self.n)
        else:
            self._buf[self.n] = arr
        self.n += 1

    def push_rows(self, col: np.ndarray, start: int, stop: int) -> None:
        k = stop - start
        self._reserve(k)
        self._buf[self.n : self.n + k] = col[start:stop]
        self.n += k

    def rows(self) -> np.ndarray:
        """The rows buffered in this chunk (a view)."""
        return self._buf[: self.n]

    def to_arrow(self) -> list[pa.Array]:
        mask = self.valid.mask(self.n)
        if self.shape == ():
            return [pa.array(self._buf[: self.n], type=arrow_value_type(self.spec), mask=mask)]
        flat = pa.array(self._buf[: self.n].reshape(-1), type=arrow_value_type(self.spec))
        return [pa.FixedSizeListArray.from_arrays(flat, self.spec.numel, mask=_pa_mask(mask))]

    def reset(self) -> None:
        self.n = 0
        self.valid.reset()


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
        self.valid = Validity()

    @classmethod
    def promoted(cls, spec: FieldSpec, fixed: FixedColumn) -> VariableColumn:
        """A variable column holding the rows ``fixed`` buffered so far (a field found to vary)."""
        col = cls(spec)
        col.first_shape = fixed.shape
        for i, row in enumerate(fixed.rows()):
            col.push(None if not fixed.valid.at(i) else row.copy())
        return col

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

    def row_sizes(self, col: Sequence[np.ndarray | None]) -> np.ndarray:
        # A missing row (a null of a columnar source) holds no values, only its shape.
        return np.fromiter(
            ((a.nbytes if a is not None else 0) + 8 * self.ndim + 4 for a in col),
            dtype=np.int64,
            count=len(col),
        )

    def push(self, arr: np.ndarray | None) -> None:
        if arr is None:
            self.valid.missing(self.n)
            self._values.append(np.empty(0, self.dtype))
            self._shapes.append((0,) * self.ndim)
            self.n += 1
            return
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

    def push_rows(self, col: Sequence[np.ndarray | None], start: int, stop: int) -> None:
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
            pa.array(offsets.astype(np.int32)),
            pa.array(values, type=arrow_value_type(self.spec)),
            mask=_pa_mask(self.valid.mask(self.n)),
        )
        shapes = np.asarray(self._shapes, dtype=np.int64).reshape(self.n * self.ndim)
        return [lists, pa.FixedSizeListArray.from_arrays(pa.array(shapes), self.ndim)]

    def reset(self) -> None:
        self._values.clear()
        self._shapes.clear()
        self.n = 0
        self.valid.reset()


class BinaryColumn:
    """Raw bytes per sample (e.g. an encoded image); ``str`` is stored as UTF-8.

    Rows come one by one (bytes) or, from columnar sources, as slices of an Arrow binary
    array, which are kept as they are (no Python object per row)."""

    def __init__(self, spec: FieldSpec) -> None:
        self.spec = spec
        self._items: list[bytes | None] = []
        self._arrays: list[pa.Array] = []
        self._nbytes = 0
        self.n = 0
        self.valid = Validity()

    def check(self, value: object, where: str) -> bytes:
        if isinstance(value, str):
            return value.encode("utf-8")
        if isinstance(value, BytesLike):
            return bytes(value)
        raise InvalidDataError(
            f"{where}: field {self.spec.name!r} holds a {type(value).__name__}, but earlier samples hold bytes"
        )

    def row_sizes(self, col: Sequence[bytes | None] | pa.Array) -> np.ndarray:
        if isinstance(col, pa.Array):
            offsets = np.frombuffer(col.buffers()[1], np.int32)[
                col.offset : col.offset + len(col) + 1
            ]
            return np.diff(offsets).astype(np.int64) + 4
        return np.fromiter((len(b or b"") + 4 for b in col), dtype=np.int64, count=len(col))

    def push(self, value: bytes | None) -> None:
        if value is None:
            self.valid.missing(self.n)
        self._items.append(value)
        self._nbytes += len(value or b"")
        self.n += 1

    def _flush_items(self) -> None:
        if self._items:
            self._arrays.append(pa.array(self._items, type=pa.binary()))
            self._items = []

    def push_rows(self, col: Sequence[bytes] | pa.Array, start: int, stop: int) -> None:
        if isinstance(col, pa.Array):
            self._flush_items()
            part = col.slice(start, stop - start)
            self._arrays.append(part)
            self._nbytes += int(self.row_sizes(part).sum()) - 4 * len(part)
        else:
            rows = col[start:stop]
            self._items.extend(rows)
            self._nbytes += sum(len(b or b"") for b in rows)
        self.n += stop - start

    def to_arrow(self) -> list[pa.Array]:
        if self._nbytes > _INT32_MAX:
            raise InvalidDataError(
                f"field {self.spec.name!r}: more than 2 GiB of bytes in one chunk; use a smaller --shard-size"
            )
        self._flush_items()
        if not self._arrays:
            return [pa.array([], type=pa.binary())]
        if len(self._arrays) == 1:
            return [self._arrays[0]]
        return [pa.concat_arrays(self._arrays)]

    def reset(self) -> None:
        self._items = []
        self._arrays = []
        self._nbytes = 0
        self.n = 0
        self.valid.reset()


#: A field's buffer, by the field's kind (:func:`make_column`).
Column = FixedColumn | VariableColumn | BinaryColumn


def make_column(spec: FieldSpec, chunk_rows: int) -> Column:
    """The buffer for ``spec``; ``chunk_rows`` bounds a fixed field's preallocation."""
    if spec.kind == "binary":
        return BinaryColumn(spec)
    if spec.kind == "variable":
        return VariableColumn(spec)
    return FixedColumn(spec, chunk_rows)
