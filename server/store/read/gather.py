"""Vectorised gathers of many rows from per-chunk views into one contiguous batch.

Callers have already located each requested id as ``(chunk, row)`` (:mod:`.index`). Loops
are over the chunks a batch touches, not over samples, except for big rows (below).

* fixed fields: one ``np.take`` straight into the output when the batch lies in one chunk
  (one copy), else one ``np.take`` per touched chunk into a scratch array grouped by chunk
  and one more into batch order (rows of 16 KiB and more: one copy per row into place, the
  one loop over samples here). A local dataset reads across chunks through :mod:`.stitch`
  instead where it can: one copy there too;
* variable / binary fields (:func:`take_ragged`): each touched chunk's offsets are read with
  one fancy index, the batch's offsets are one ``cumsum``, and the values of every sample are
  moved by one ``np.take`` per touched chunk over an index of *units* (the row of the fixed
  dims: ``x[-1, 16]`` moves 64-byte rows), built with ``repeat``/``cumsum``, straight into
  their place in one output. No Python runs per sample, and the values are copied once
  whatever number of shards the batch touches. Samples of a few dozen units and more (graphs
  of ~100 atoms, encoded images, long sequences) are moved as one slice each instead, joined
  by one ``np.concatenate``: one Python step per sample costs less than an index entry per
  unit, and far less than ``pyarrow.compute.take`` on a list array, which builds an index
  per *value* (64 CHGNet-sized graphs: 3.1 ms against 0.47 ms for ``bond_fea [E, 8]``).
  Only bit-packed bools, which have no byte view, go through ``pyarrow.compute.take``. A
  local dataset's batch spanning chunks reads the values through :mod:`.stitch` instead
  where it can (:func:`take_ragged_across`): no step per chunk, no scatter.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence

import numpy as np
import pyarrow as pa

from .arrow_numpy import bits, buffer_view, indices
from .stitch import Stitched

#: Chunk ids from which :func:`groups` sorts full-width keys (a radix sort takes 16 bits).
WIDE_CHUNKS = 1 << 16
#: Row size from which a batch spanning several chunks is copied row by row (see take_fixed).
ROW_COPY_BYTES = 16 << 10
#: Positions of a batch: an index array, or every position.
Positions = np.ndarray | slice
ALL = slice(None)


def groups(chunk: np.ndarray) -> list[tuple[int, Positions]]:
    """``[(chunk id, positions in the batch)]`` for each chunk the batch touches, in chunk
    order, positions ascending; the positions are :data:`ALL` (a full slice) when one chunk
    holds the whole batch, else consecutive slices of one array (the batch's positions
    ordered by chunk).

    >>> [(c, p.tolist()) for c, p in groups(np.array([2, 0, 2, 1]))]
    [(0, [1]), (1, [3]), (2, [0, 2])]
    """
    if chunk.size == 0:
        return []
    first = int(chunk[0])
    if (chunk == first).all():
        return [(first, ALL)]
    counts = np.bincount(chunk)
    # A stable sort of 16-bit keys is a radix sort: linear in the batch whatever number of
    # chunks it touches (32 ids over 3 chunks: 5 us, against 16 us for a comparison per
    # chunk; 4,096 ids over 40 chunks: 33 us against 182 us).
    keys = chunk.astype(np.uint16) if counts.size <= WIDE_CHUNKS else chunk
    order = np.argsort(keys, kind="stable")
    out: list[tuple[int, Positions]] = []
    a = 0
    for c, n in enumerate(counts.tolist()):
        if n:
            out.append((c, order[a : a + n]))
            a += n
    return out


def take_fixed(
    views: Sequence[np.ndarray],
    chunk_groups: list[tuple[int, Positions]],
    rows: np.ndarray,
    out: np.ndarray,
) -> np.ndarray:
    """Gather ``views[chunk][row]`` for every position into ``out`` (``[B, *shape]``)."""
    if len(chunk_groups) == 1:
        c, _ = chunk_groups[0]
        # mode="clip": ids are already bounds-checked, and mode="raise" would buffer the output.
        return views[c].take(rows, axis=0, out=out, mode="clip")
    if out.ndim and out[:1].nbytes >= ROW_COPY_BYTES:
        # Big rows: one copy per row straight into place beats a take into a temporary plus
        # a scatter (every byte copied twice) once the row outweighs a Python step.
        for c, pos in chunk_groups:
            src = views[c]
            for p, r in zip(np.asarray(pos).tolist(), rows[pos].tolist(), strict=True):
                out[p] = src[r]
        return out
    # Each chunk's rows into consecutive rows of a scratch array, then one take puts them in
    # batch order: two copies and a step per chunk, against a take into a temporary and a
    # fancy-index scatter per chunk (896 CIFAR rows from 3 mapped shards into a
    # shared-memory slot: 584-595 us against 625-653; 32 rows: 30-34 us against 44).
    by_chunk = np.empty_like(out)
    a = 0
    for c, pos in chunk_groups:
        r = rows[pos]
        views[c].take(r, axis=0, out=by_chunk[a : a + r.size], mode="clip")
        a += r.size
    order = np.concatenate([pos for _, pos in chunk_groups])
    return by_chunk.take(_scatter(np.arange(order.size), order), axis=0, out=out, mode="clip")


#: Bytes a joined copy of one small fixed column may take (see :class:`JoinedColumns`).
JOIN_MAX_BYTES = 64 << 20
#: Widest row worth joining: past it a batch's cost is its copy, not a step per chunk.
JOIN_MAX_ROW_BYTES = 64


class JoinedColumns:
    """Small fixed columns (labels, a variable field's shapes, null masks) joined end to end
    across chunks, each made on first use: a batch spanning many chunks then reads them with
    one ``take`` by global id instead of a take and a scatter per chunk (16 shards: a
    64-graph batch's four small columns cost ~4x more than with 3). Thread-safe: a copy two
    threads make at once is made twice, and either serves."""

    def __init__(self) -> None:
        self._joined: dict[object, np.ndarray | None] = {}

    def get(self, key: object, chunks: Sequence[np.ndarray]) -> np.ndarray | None:
        """The column of ``chunks`` joined, or ``None`` when its rows or total are too big."""
        if key not in self._joined:
            first = chunks[0] if chunks else None
            row = first.dtype.itemsize * math.prod(first.shape[1:]) if first is not None else 0
            small = sum(c.nbytes for c in chunks) <= JOIN_MAX_BYTES
            ok = first is not None and row <= JOIN_MAX_ROW_BYTES and small
            self._joined[key] = np.concatenate(chunks) if ok else None
        return self._joined[key]


def take_arrow(
    arrays: Sequence[pa.Array], chunk_groups: list[tuple[int, Positions]], rows: np.ndarray
) -> pa.Array:
    """Gather rows of variable-length Arrow arrays (list or binary) in batch order."""
    # Imported at first use: pyarrow.compute's function registry is ~9 MiB of an idle server.
    import pyarrow.compute as pc

    if len(chunk_groups) == 1:
        c, _ = chunk_groups[0]
        return pc.take(arrays[c], indices(rows))
    pieces = [pc.take(arrays[c], indices(rows[pos])) for c, pos in chunk_groups]
    grouped = pa.concat_arrays(pieces)
    order = np.concatenate([pos for _, pos in chunk_groups])
    return pc.take(grouped, indices(_scatter(np.arange(order.size), order)))


def ragged_parts(arr: pa.Array, value_dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """``(values 1-d, offsets int64 [B+1] from 0)`` of a list or binary array fresh from take.

    The values view the take's own new buffer (not the mapped file), so they own their
    storage as far as any consumer can tell.
    """
    n = len(arr)
    raw_offsets = buffer_view(arr.buffers()[1], np.dtype(np.int32), arr.offset, arr.offset + n + 1)
    offsets = raw_offsets.astype(np.int64)
    lo, hi = (int(offsets[0]), int(offsets[-1])) if n else (0, 0)
    offsets -= lo
    if pa.types.is_binary(arr.type):
        return buffer_view(arr.buffers()[2], np.dtype(np.uint8), lo, hi), offsets
    child = arr.values
    if value_dtype == "bool":  # bit-packed in Arrow
        return bits(child.buffers()[1], child.offset + lo, hi - lo), offsets
    dt = np.dtype(value_dtype)
    return buffer_view(child.buffers()[1], dt, child.offset + lo, child.offset + hi), offsets


#: Average units per sample from which :func:`take_ragged` moves each sample as one slice
#: (a Python step each, ~0.3 us) instead of an index entry per unit (~10-20 ns each).
SLICE_MIN_UNITS = 24
#: Rows up to which :class:`RaggedChunks` keeps a joined copy of its offsets (4 bytes a row).
JOIN_MAX_ROWS = 1 << 26


def _chunk_parts(arr: pa.Array, dt: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """``(offsets int32 [len+1], values 1-d of dt)`` views of a list or binary chunk (no copy)."""
    n = len(arr)
    offsets = buffer_view(arr.buffers()[1], np.dtype(np.int32), arr.offset, arr.offset + n + 1)
    if pa.types.is_binary(arr.type):
        buf = arr.buffers()[2]
        start = 0
    else:
        child = arr.values
        buf, start = child.buffers()[1], child.offset
    values = np.frombuffer(buf, dtype=dt)[start:] if buf is not None else np.empty(0, dt)
    return offsets, values


class RaggedChunks(list[pa.Array]):
    """The chunks of one list or binary field, with their numpy views made once (a list, so
    anything that reads the chunks still can). :func:`take_ragged` takes a plain list too and
    then makes the views of the chunks it touches on every call."""

    def __init__(self, arrays: Sequence[pa.Array], value_dtype: str) -> None:
        super().__init__(arrays)
        self.value_dtype = value_dtype
        self._views: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._joined: tuple[np.ndarray, np.ndarray] | None = None
        self._units: dict[tuple[int, int], np.ndarray] = {}

    def views(self, c: int) -> tuple[np.ndarray, np.ndarray]:
        """``(offsets, values)`` views of chunk ``c`` (see :func:`_chunk_parts`)."""
        v = self._views.get(c)
        if v is None:
            v = self._views[c] = _chunk_parts(self[c], _values_dtype(self[c], self.value_dtype))
        return v

    def units(self, c: int, item: np.dtype) -> np.ndarray:
        """Chunk ``c``'s values seen as items of ``item`` (rows of the fixed dims), made once."""
        key = (c, item.itemsize)
        u = self._units.get(key)
        if u is None:
            u = self._units[key] = _as_units(self.views(c)[1], item)
        return u

    def joined_offsets(self) -> tuple[np.ndarray, np.ndarray] | None:
        """Every chunk's offsets end to end (int32, 4 bytes a sample, made on first use) and
        where each chunk's begin, so that a batch reads all its offsets in one ``take``
        whatever the number of chunks; ``None`` past :data:`JOIN_MAX_ROWS` rows."""
        if self._joined is None:
            rows = sum(len(a) for a in self)
            if rows > JOIN_MAX_ROWS:
                return None
            parts = [self.views(c)[0] for c in range(len(self))]
            base = np.zeros(len(parts), dtype=np.int64)
            np.cumsum([p.size for p in parts[:-1]], out=base[1:])
            self._joined = (np.concatenate(parts) if parts else np.zeros(0, np.int32), base)
        return self._joined


def _as_units(values: np.ndarray, item: np.dtype) -> np.ndarray:
    """``values`` (1-d) as opaque items of ``item``'s size (a trailing partial item dropped)."""
    per = item.itemsize // values.itemsize
    return values[: values.size - values.size % per].view(item)


def _values_dtype(arr: pa.Array, value_dtype: str) -> np.dtype:
    return np.dtype(np.uint8) if pa.types.is_binary(arr.type) else np.dtype(value_dtype)


def _ranges(starts: np.ndarray, lens: np.ndarray, total: int) -> np.ndarray:
    """``concatenate([arange(s, s + n) for s, n in zip(starts, lens)])`` without a loop."""
    ends = np.cumsum(lens)
    return np.repeat(starts - (ends - lens), lens) + np.arange(total, dtype=np.int64)


#: ``empty(shape, dtype)``: where a gather's result is made (a part's share of a
#: :class:`~shardserve.server.source.Tail`).
Empty = Callable[[tuple[int, ...], np.dtype], np.ndarray]


def _fresh(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    return np.empty(shape, dtype)


def take_ragged(
    arrays: Sequence[pa.Array],
    chunk_groups: list[tuple[int, Positions]],
    rows: np.ndarray,
    value_dtype: str,
    shape: Sequence[int] = (-1,),
    empty: Empty = _fresh,
) -> tuple[np.ndarray, np.ndarray]:
    """``(values 1-d, offsets int64 [B+1] from 0)`` of rows of list or binary chunks, in batch
    order (see the module docstring), the values in memory from ``empty`` (fresh by default;
    a :class:`~shardserve.server.source.Tail`'s). ``shape`` is the field's declared shape; the
    product of its fixed dims is the unit one index entry moves."""
    if not chunk_groups or value_dtype == "bool":  # bool values are bit-packed: no views
        return ragged_parts(take_arrow(arrays, chunk_groups, rows), value_dtype)
    first = arrays[chunk_groups[0][0]]
    unit = ragged_unit(shape, pa.types.is_binary(first.type))
    dtype = _values_dtype(first, value_dtype)
    if isinstance(arrays, RaggedChunks):
        views = {c: arrays.views(c) for c, _ in chunk_groups}
    else:
        views = {c: _chunk_parts(arrays[c], dtype) for c, _ in chunk_groups}
    b = rows.size
    single = len(chunk_groups) == 1
    # Work in chunk order (the groups' order): each chunk then reads and writes one
    # contiguous slice of every array below; ``order`` maps back to the batch order.
    order = None if single else np.concatenate([p for _, p in chunk_groups])
    rs = rows if order is None else rows[order]
    sizes = [b] if single else [len(p) for _, p in chunk_groups]  # type: ignore[arg-type]
    cuts = [0, *itertools.accumulate(sizes)]
    joined = arrays.joined_offsets() if isinstance(arrays, RaggedChunks) and not single else None
    if joined is not None:
        off_all, base = joined
        at = rs + np.repeat(base[[c for c, _ in chunk_groups]], sizes)
        starts, ends = off_all[at], off_all[at + 1]
    else:
        starts = np.empty(b, dtype=np.int32)  # the chunks' own offsets are int32
        ends = np.empty(b, dtype=np.int32)
        for (c, _), a, z in zip(chunk_groups, cuts[:-1], cuts[1:], strict=True):
            off = views[c][0]
            np.take(off, rs[a:z], out=starts[a:z], mode="clip")
            np.take(off, rs[a:z] + 1, out=ends[a:z], mode="clip")
    lens = (ends - starts).astype(np.int64)
    offsets = np.zeros(b + 1, dtype=np.int64)
    np.cumsum(lens if order is None else _scatter(lens, order), out=offsets[1:])
    total = int(offsets[-1])
    if unit > 1 and ((starts % unit).any() or (lens % unit).any()):
        unit = 1  # values that do not start on a unit (not written by our writer)
    out = empty((total,), dtype)
    if total == 0:
        return out, offsets
    # Whole units (rows of the fixed dims) move as opaque items: fewer, wider index entries.
    item = np.dtype((np.void, unit * dtype.itemsize))
    ulens = lens // unit
    n_units = total // unit
    cached = arrays.units if isinstance(arrays, RaggedChunks) else None

    def units_of(c: int) -> np.ndarray:
        return cached(c, item) if cached is not None else _as_units(views[c][1], item)

    if n_units >= SLICE_MIN_UNITS * b:
        # Long samples (graphs of ~100 atoms): one slice each, joined by one concatenate,
        # costs less than building and reading an index entry per unit.
        pieces: list[np.ndarray] = [out.view(item)[:0]] * b
        ustarts, ul = (starts // unit).tolist(), ulens.tolist()
        for (c, _), a, z in zip(chunk_groups, cuts[:-1], cuts[1:], strict=True):
            u = units_of(c)
            where = range(a, z) if order is None else order[a:z].tolist()
            for k, p in zip(range(a, z), where, strict=True):
                pieces[p] = u[ustarts[k] : ustarts[k] + ul[k]]
        np.concatenate(pieces, out=out.view(item))
        return out, offsets
    src_idx = _ranges((starts // unit).astype(np.int64), ulens, n_units)
    ucuts = np.zeros(len(cuts), dtype=np.int64)
    np.cumsum(np.add.reduceat(ulens, cuts[:-1]) if b else [], out=ucuts[1:])
    moved = out.view(item) if order is None else np.empty(n_units, dtype=item)
    for (c, _), a, z in zip(chunk_groups, ucuts[:-1].tolist(), ucuts[1:].tolist(), strict=True):
        np.take(units_of(c), src_idx[a:z], out=moved[a:z], mode="clip")
    if order is not None:
        # Back to batch order: each sample's units go to its place in the output, one scatter.
        dst = _ranges((offsets[:-1] // unit)[order], ulens, n_units)
        out.view(item)[dst] = moved
    return out, offsets


def ragged_unit(shape: Sequence[int], binary: bool) -> int:
    """Items one index entry of a variable field moves: the product of its fixed dims (a
    row of them), 1 for bytes."""
    return 1 if binary else max(1, math.prod(d for d in shape if d != -1))


def take_ragged_across(
    across: Stitched,
    arrays: RaggedChunks,
    chunk: np.ndarray,
    rows: np.ndarray,
    unit: int,
    dtype: np.dtype,
    empty: Empty = _fresh,
) -> tuple[np.ndarray, np.ndarray] | None:
    """:func:`take_ragged` of a batch spanning chunks whose values are stitched into one
    array of items (:mod:`.stitch`): each sample is located in it directly, so there is no
    step per chunk and no scatter back into batch order. Long samples move as one slice each;
    short ones by one ``take`` over an index of units when every sample starts on a unit of
    the stitched array, else of items (a chunk's values lie at any 8-byte offset of their
    file, so a unit of 64 bytes need not line up across chunks). ``None`` where the offsets
    are not joined (too many rows): then :func:`take_ragged` serves."""
    joined = arrays.joined_offsets()
    if joined is None:
        return None
    off_all, base = joined
    at = rows + base[chunk]
    starts = off_all[at].astype(np.int64) + across.first[chunk]
    lens = off_all[at + 1] - off_all[at]
    b = rows.size
    offsets = np.zeros(b + 1, dtype=np.int64)
    np.cumsum(lens, out=offsets[1:])
    total = int(offsets[-1])
    out = empty((total,), dtype)
    if total == 0:
        return out, offsets
    items = across.array
    if total >= SLICE_MIN_UNITS * unit * b:  # long samples: one slice each (see take_ragged)
        pieces = [items[a : a + n] for a, n in zip(starts.tolist(), lens.tolist(), strict=True)]
        np.concatenate(pieces, out=out)
    elif unit > 1 and not (starts % unit).any() and not (lens % unit).any():
        item = np.dtype((np.void, unit * dtype.itemsize))
        units = items[: items.size - items.size % unit].view(item)
        idx = _ranges(starts // unit, lens // unit, total // unit)
        np.take(units, idx, out=out.view(item), mode="clip")
    else:
        np.take(items, _ranges(starts, lens, total), out=out, mode="clip")
    return out, offsets


def _scatter(sorted_values: np.ndarray, order: np.ndarray) -> np.ndarray:
    """``x`` with ``x[order] = sorted_values``."""
    x = np.empty_like(sorted_values)
    x[order] = sorted_values
    return x
