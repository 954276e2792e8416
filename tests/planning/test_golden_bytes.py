"""Orders large enough to take the bucket shuffle stay byte-identical to the planner's before."""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import numpy as np
import pytest

from shardserve.server.planning import epoch_order
from shardserve.server.planning.mixture import MixSource, Quarantine, Segment, mixture_order
from shardserve.server.planning.permute import shuffle_into


def _digest(order: np.ndarray) -> str:
    return hashlib.sha256(order.astype("<u8").tobytes()).hexdigest()[:16]


def _global() -> np.ndarray:
    return epoch_order(2_500_003, seed=2**40 + 1, epoch=3, shuffle="global")


def _block() -> np.ndarray:
    rows = [300_000, 0, 17, 400_000, 299_983]
    return epoch_order(1_000_000, seed=9, epoch=1, shuffle="block", shard_rows=rows, block_window=2)


def _small_chunks() -> np.ndarray:
    src = np.arange(10**6, 2 * 10**6 + 7, dtype=np.int64)[::-1].copy()
    out = np.empty(len(src), dtype=np.int64)
    rng = np.random.default_rng(np.random.SeedSequence([4, 2]))
    return shuffle_into(out, rng, src, bucket_rows=5000, chunk_rows=70_001)


def _mixture() -> np.ndarray:
    return mixture_order(
        [MixSource(400_000), MixSource(150_001, "stop"), MixSource(1000)],
        seed=3,
        epoch=2,
        length=600_000,
        world_size=4,
        segments=[Segment(0, (0.5, 0.3, 0.2)), Segment(250_000, (0.1, 0.6, 0.3))],
        quarantine=[Quarantine(0, 100_000, np.arange(0, 400_000, 11))],
    )


# sha256[:16] of each order as <u8, computed with the planner of main at e36fd90.
GOLDEN: list[tuple[str, Callable[[], np.ndarray], int, str]] = [
    ("global", _global, 2_500_003, "31d2c9c014f363a3"),
    ("block", _block, 1_000_000, "91a4d4d17216d4eb"),
    ("small_chunks", _small_chunks, 1_000_007, "a4ed217fcad86db4"),
    ("mixture", _mixture, 374_976, "795d600392639081"),
]


@pytest.mark.parametrize(("name", "make", "length", "digest"), GOLDEN, ids=[g[0] for g in GOLDEN])
def test_bucket_orders_are_byte_identical(
    name: str, make: Callable[[], np.ndarray], length: int, digest: str
) -> None:
    """An order of several buckets, chunks and windows hashes to the digest it had before."""
    order = make()
    assert len(order) == length
    assert _digest(order) == digest, name
