"""The epoch's global sample order, shared by every rank: validation plus the shuffle table."""

from __future__ import annotations

import operator
from collections.abc import Iterator, Sequence
from typing import Protocol

import numpy as np

from shardserve.proto.jobs import ShuffleMode

from .rng import epoch_rng, order_dtype
from .shuffle_block import block_order
from .shuffle_global import global_order, global_order_steps
from .shuffle_none import none_order

# With no shard sizes, "block" treats the store as shards of this many rows.
DEFAULT_SHARD_ROWS = 2**16


class ShuffleFn(Protocol):
    """An epoch-order algorithm: ids ``0 .. n_samples-1`` in the epoch's order."""

    def __call__(
        self,
        n_samples: int,
        rng: np.random.Generator,
        *,
        dtype: np.dtype,
        shard_rows: np.ndarray,
        block_window: int,
    ) -> np.ndarray: ...


SHUFFLES: dict[ShuffleMode, ShuffleFn] = {
    "global": global_order,
    "block": block_order,
    "none": none_order,
}


def shard_sizes(n_samples: int, shard_rows: Sequence[int] | np.ndarray | None) -> np.ndarray:
    """Return ``shard_rows`` as int64 after checking it, or fixed-size shards when it is None.

    >>> shard_sizes(5, None).tolist(), shard_sizes(5, [2, 3]).tolist()
    ([5], [2, 3])
    """
    if shard_rows is None:
        full, rest = divmod(n_samples, DEFAULT_SHARD_ROWS)
        return np.array([DEFAULT_SHARD_ROWS] * full + ([rest] if rest else []), dtype=np.int64)
    rows = np.asarray(shard_rows)
    if rows.ndim != 1 or (rows.size and rows.dtype.kind not in "iu"):
        raise ValueError(
            f"shard_rows must be a 1-D sequence of ints, got shape {rows.shape} dtype {rows.dtype}"
        )
    rows = rows.astype(np.int64)
    if rows.size and int(rows.min()) < 0:
        k = int(np.argmin(rows))
        raise ValueError(f"shard_rows[{k}] = {int(rows[k])} must be >= 0")
    total = int(rows.sum())
    if total != n_samples:
        raise ValueError(
            f"shard_rows sum to {total} over {rows.size} shards, but n_samples is {n_samples}"
        )
    return rows


def epoch_order(
    n_samples: int,
    seed: int,
    epoch: int,
    shuffle: ShuffleMode = "global",
    shard_rows: Sequence[int] | np.ndarray | None = None,
    block_window: int = 4,
    env: int = 0,
) -> np.ndarray:
    """Return the epoch's global sample order, the same for every rank of a job.

    uint32 while ``n_samples < 2**32`` (4 bytes a sample), else int64. The same
    ``(seed, epoch)`` gives the same order in any process; another epoch, another order.
    ``"block"`` uses ``shard_rows`` (rows per shard, in store order; default: shards of
    65,536 rows) and shuffles within windows of ``block_window`` shards. ``env > 0`` gives
    the order of that environment of the job (see :func:`.rng.epoch_rng`).

    >>> epoch_order(5, seed=0, epoch=0, shuffle="none").tolist()
    [0, 1, 2, 3, 4]
    >>> bool((epoch_order(100, 0, 1) == epoch_order(100, 0, 1)).all())
    True
    """
    order, steps = epoch_order_steps(n_samples, seed, epoch, shuffle, shard_rows, block_window, env)
    for _ in steps:
        pass
    return order


def epoch_order_steps(
    n_samples: int,
    seed: int,
    epoch: int,
    shuffle: ShuffleMode = "global",
    shard_rows: Sequence[int] | np.ndarray | None = None,
    block_window: int = 4,
    env: int = 0,
) -> tuple[np.ndarray, Iterator[int]]:
    """:func:`epoch_order` as the array it is written into and the steps that write it:
    each step yields how many leading positions are final. ``"global"`` does its work in
    the steps (the first: the bucket layout and the first bucket, see
    :func:`.permute.shuffle_steps`), so a caller can use the first positions while the rest
    are shuffled; the other shuffles are computed in this call and yield once.

    >>> order, steps = epoch_order_steps(5, 0, 0, "none")
    >>> list(steps), order.tolist()
    ([5], [0, 1, 2, 3, 4])
    """
    n_samples = operator.index(n_samples)
    block_window = operator.index(block_window)
    if n_samples < 0:
        raise ValueError(f"n_samples must be >= 0, got {n_samples}")
    if block_window < 1:
        raise ValueError(f"block_window must be >= 1, got {block_window}")
    try:
        algorithm = SHUFFLES[shuffle]
    except KeyError:
        raise ValueError(f"shuffle must be one of {sorted(SHUFFLES)}, got {shuffle!r}") from None
    rows = shard_sizes(n_samples, shard_rows)
    rng = epoch_rng(seed, epoch, env)
    dtype = order_dtype(n_samples)
    if shuffle == "global":
        return global_order_steps(n_samples, rng, dtype=dtype)
    order = algorithm(n_samples, rng, dtype=dtype, shard_rows=rows, block_window=block_window)
    return order, iter([n_samples])
