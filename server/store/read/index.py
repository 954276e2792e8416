"""Index maths: global sample ids -> (chunk, row within chunk). Pure numpy, no I/O.

A dataset's rows are the concatenation of its chunks (record batches) in shard order.
``starts`` holds each chunk's first global row plus the total at the end, so chunk ``c``
covers ``starts[c] <= i < starts[c + 1]``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def chunk_starts(rows: Sequence[int] | np.ndarray) -> np.ndarray:
    """Cumulative row offsets ``[0, r0, r0+r1, ..., total]`` (int64) of chunks with ``rows``.

    >>> chunk_starts([3, 0, 2]).tolist()
    [0, 3, 3, 5]
    """
    starts = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum(np.asarray(rows, dtype=np.int64), out=starts[1:])
    return starts


def as_indices(indices: object) -> np.ndarray:
    """``indices`` as a 1-d int64 array; anything not integral is refused with ``TypeError``."""
    arr = np.asarray(indices)
    if arr.ndim != 1:
        arr = arr.reshape(-1)
    if arr.dtype != np.int64:
        if arr.size and arr.dtype.kind not in "iu":
            raise TypeError(f"sample indices must be integers, got dtype {arr.dtype.name}")
        arr = arr.astype(np.int64)
    return arr


def check_bounds(indices: np.ndarray, n: int) -> tuple[int, int]:
    """``(min, max)`` of non-empty ``indices``; ``IndexError`` naming an id outside ``0 <= i < n``."""
    if indices.size == 0:
        return 0, -1
    lo, hi = int(indices.min()), int(indices.max())
    if lo < 0 or hi >= n:
        bad = lo if lo < 0 else hi
        raise IndexError(f"sample {bad} out of range 0 <= i < {n}")
    return lo, hi


def chunk_of(i: int, starts: np.ndarray) -> int:
    """The chunk holding in-bounds id ``i`` (empty chunks skipped, as in :func:`locate`)."""
    return int(np.searchsorted(starts, i, side="right")) - 1


def locate(indices: np.ndarray, starts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(chunk, row)`` for each global id (ids must already be in bounds).

    >>> c, r = locate(np.array([0, 4, 3]), chunk_starts([3, 0, 2]))
    >>> c.tolist(), r.tolist()
    ([0, 2, 2], [0, 1, 0])
    """
    # side="right" skips empty chunks: an id equal to a start belongs to the last chunk that
    # begins there, which is the non-empty one.
    chunk = np.searchsorted(starts, indices, side="right") - 1
    return chunk, indices - starts[chunk]


def shard_of_chunk(chunks_per_shard: Sequence[int]) -> np.ndarray:
    """Map chunk number -> shard number.

    >>> shard_of_chunk([1, 2, 1]).tolist()
    [0, 1, 1, 2]
    """
    return np.repeat(np.arange(len(chunks_per_shard), dtype=np.int64), chunks_per_shard)
