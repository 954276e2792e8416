"""Shuffle ``"global"``: one uniform permutation of every sample in the dataset."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from .permute import shuffle_steps


def global_order(
    n_samples: int,
    rng: np.random.Generator,
    *,
    dtype: np.dtype,
    shard_rows: np.ndarray,
    block_window: int,
) -> np.ndarray:
    """Return a uniform permutation of ``range(n_samples)`` drawn from ``rng``.

    Shards play no part; 40 million samples take ~0.7 s and ~210 MB (bench/bench_plan.py).

    >>> o = global_order(5, np.random.default_rng(0), dtype=np.dtype(np.uint32),
    ...                  shard_rows=np.array([5]), block_window=1)
    >>> sorted(o.tolist())
    [0, 1, 2, 3, 4]
    """
    order, steps = global_order_steps(n_samples, rng, dtype=dtype)
    for _ in steps:
        pass
    return order


def global_order_steps(
    n_samples: int, rng: np.random.Generator, *, dtype: np.dtype
) -> tuple[np.ndarray, Iterator[int]]:
    """:func:`global_order` as its array and the steps that write it (each yields how many
    leading positions are final, see :func:`.permute.shuffle_steps`)."""
    out = np.empty(n_samples, dtype=dtype)
    return out, shuffle_steps(out, rng)
