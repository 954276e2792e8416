"""Shuffle ``"block"``: shards in random order, samples shuffled within windows of shards.

Locality for stores larger than RAM or remote: a window of ``block_window`` shards
is read while it is current, so at most about two windows are hot at once.

1. Permute the shards.
2. Lay out each shard's rows contiguously in that order (vectorised in chunks of
   positions, so a store of millions of tiny shards costs no loop per shard).
3. Cut the layout into windows of ``block_window`` consecutive shards and shuffle
   each window in place (a Python loop per window).
"""

from __future__ import annotations

import numpy as np

from .permute import shuffle_inplace

# Positions laid out per vectorised step: int64 temporaries of 8 MiB.
FILL_ROWS = 2**20


def block_order(
    n_samples: int,
    rng: np.random.Generator,
    *,
    dtype: np.dtype,
    shard_rows: np.ndarray,
    block_window: int,
) -> np.ndarray:
    """Return the block-shuffled order of ``range(n_samples)`` for shards of ``shard_rows`` rows.

    ``shard_rows`` (int64, non-negative, summing to ``n_samples``) is in store order:
    shard ``k`` holds global ids ``sum(shard_rows[:k]) ...`` onward.

    >>> o = block_order(6, np.random.default_rng(0), dtype=np.dtype(np.uint32),
    ...                 shard_rows=np.array([2, 2, 2]), block_window=1)
    >>> sorted({int(i) // 2 for i in o[:2]}) in ([0], [1], [2])
    True
    """
    n_shards = len(shard_rows)
    shard_first = np.zeros(n_shards, dtype=np.int64)
    np.cumsum(shard_rows[:-1], out=shard_first[1:])
    shard_order = rng.permutation(n_shards)
    rows = shard_rows[shard_order]
    ends = np.cumsum(rows)  # end position of each (permuted) shard in the layout
    # id = position + shift[k] for every position inside permuted shard k
    shift = shard_first[shard_order] - (ends - rows)
    out = np.empty(n_samples, dtype=dtype)
    for lo in range(0, n_samples, FILL_ROWS):
        hi = min(lo + FILL_ROWS, n_samples)
        k0 = int(np.searchsorted(ends, lo, side="right"))
        k1 = int(np.searchsorted(ends, hi - 1, side="right")) + 1
        run_hi = np.minimum(ends[k0:k1], hi)
        run_lo = np.maximum(ends[k0:k1] - rows[k0:k1], lo)
        ids = np.repeat(shift[k0:k1], run_hi - run_lo)
        ids += np.arange(lo, hi, dtype=np.int64)
        out[lo:hi] = ids
    window_ends = ends[block_window - 1 :: block_window].tolist()
    if not window_ends or window_ends[-1] != n_samples:
        window_ends.append(n_samples)
    start = 0
    for end in window_ends:
        shuffle_inplace(out[start:end], rng)
        start = end
    return out
