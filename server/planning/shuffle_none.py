"""Shuffle ``"none"``: the identity order, for evaluation and for checking against torch."""

from __future__ import annotations

import numpy as np


def none_order(
    n_samples: int,
    rng: np.random.Generator,
    *,
    dtype: np.dtype,
    shard_rows: np.ndarray,
    block_window: int,
) -> np.ndarray:
    """Return ``arange(n_samples)``; draws nothing from ``rng``.

    >>> none_order(4, np.random.default_rng(0), dtype=np.dtype(np.uint32),
    ...            shard_rows=np.array([4]), block_window=1).tolist()
    [0, 1, 2, 3]
    """
    return np.arange(n_samples, dtype=dtype)
