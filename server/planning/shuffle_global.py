"""Shuffle ``"global"``: one uniform permutation of every sample in the dataset."""

from __future__ import annotations

import numpy as np

from .permute import shuffle_into


def global_order(
    n_samples: int,
    rng: np.random.Generator,
    *,
    dtype: np.dtype,
    shard_rows: np.ndarray,
    block_window: int,
) -> np.ndarray:
    """Return a uniform permutation of ``range(n_samples)`` drawn from ``rng``.

    Shards play no part; 40 million samples take ~1.5 s and ~220 MB (bench/bench_plan.py).

    >>> o = global_order(5, np.random.default_rng(0), dtype=np.dtype(np.uint32),
    ...                  shard_rows=np.array([5]), block_window=1)
    >>> sorted(o.tolist())
    [0, 1, 2, 3, 4]
    """
    return shuffle_into(np.empty(n_samples, dtype=dtype), rng)
