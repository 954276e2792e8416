"""Vectorised gathers of many rows from per-chunk views into one contiguous batch.

Callers have already located each requested id as ``(chunk, row)`` (:mod:`.index`). Loops
are over the chunks a batch touches, not over samples, except for big rows (below).

* fixed fields: one ``np.take`` straight into the output when the batch lies in one chunk
  (one copy), else one ``np.take`` per touched chunk, scattered into place (rows of 16 KiB
  and more: one copy per row into place, the one loop over samples here);
* variable / binary fields: ``pyarrow.compute.take`` per touched chunk (a C++ memcpy per
  row), then, if several chunks were touched, one more take to restore the requested order.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

#: Row size from which a batch spanning several chunks is copied row by row (see take_fixed).
ROW_COPY_BYTES = 16 << 10
#: Positions of a batch: an index array, or every position.
Positions = np.ndarray | slice
ALL = slice(None)


def groups(chunk: np.ndarray) -> list[tuple[int, Positions]]:
    """``[(chunk id, positions in the batch)]`` for each chunk the batch touches; the
    positions are :data:`ALL` (a full slice) when one chunk holds the whole batch."""
    if chunk.size == 0:
        return []
    first = int(chunk[0])
    if (chunk == first).all():
        return [(first, ALL)]
    order = np.argsort(chunk, kind="stable")
    sorted_chunks = chunk[order]
    cuts = np.flatnonzero(np.diff(sorted_chunks)) + 1
    return [(int(chunk[p[0]]), p) for p in np.split(order, cuts)]


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
    for c, pos in chunk_groups:
        out[pos] = np.take(views[c], rows[pos], axis=0, mode="clip")
    return out


def take_arrow(
    arrays: Sequence[pa.Array], chunk_groups: list[tuple[int, Positions]], rows: np.ndarray
) -> pa.Array:
    """Gather rows of variable-length Arrow arrays (list or binary) in batch order."""
    if len(chunk_groups) == 1:
        c, _ = chunk_groups[0]
        return pc.take(arrays[c], pa.array(rows))
    pieces = [pc.take(arrays[c], pa.array(rows[pos])) for c, pos in chunk_groups]
    grouped = pa.concat_arrays(pieces)
    order = np.concatenate([pos for _, pos in chunk_groups])
    inverse = np.empty_like(order)
    inverse[order] = np.arange(order.size)
    return pc.take(grouped, pa.array(inverse))


def _buffer_view(buf: pa.Buffer | None, dtype: np.dtype, start: int, stop: int) -> np.ndarray:
    if buf is None or stop <= start:
        return np.empty(0, dtype=dtype)
    return np.frombuffer(buf, dtype=dtype)[start:stop]


def ragged_parts(arr: pa.Array, value_dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """``(values 1-d, offsets int64 [B+1] from 0)`` of a list or binary array fresh from take.

    The values view the take's own new buffer (not the mapped file), so they own their
    storage as far as any consumer can tell.
    """
    n = len(arr)
    raw_offsets = _buffer_view(arr.buffers()[1], np.dtype(np.int32), arr.offset, arr.offset + n + 1)
    offsets = raw_offsets.astype(np.int64)
    lo, hi = (int(offsets[0]), int(offsets[-1])) if n else (0, 0)
    offsets -= lo
    if pa.types.is_binary(arr.type):
        return _buffer_view(arr.buffers()[2], np.dtype(np.uint8), lo, hi), offsets
    child = arr.values
    if value_dtype == "bool":  # bit-packed in Arrow
        return child.slice(lo, hi - lo).to_numpy(zero_copy_only=False), offsets
    dt = np.dtype(value_dtype)
    return _buffer_view(child.buffers()[1], dt, child.offset + lo, child.offset + hi), offsets
