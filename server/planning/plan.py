"""``plan``: one rank's batches of one epoch, as a pure function of its arguments."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from shardserve.proto.jobs import ShuffleMode

from .order import epoch_order
from .partition import RankPlan


def plan(
    n_samples: int,
    seed: int,
    epoch: int,
    world_size: int,
    rank: int,
    batch_size: int,
    shuffle: ShuffleMode = "global",
    drop_last: bool = False,
    shard_rows: Sequence[int] | np.ndarray | None = None,
    block_window: int = 4,
    position: int = 0,
) -> RankPlan:
    """Return ``rank``'s batches for ``epoch``: ``epoch_order`` then ``RankPlan.from_order``.

    A server with several ranks of one job should compute ``epoch_order`` once and
    call ``RankPlan.from_order`` per rank; this is the one-rank shorthand.

    ``position`` resumes an epoch elastically: the first ``position`` ids of the epoch's order
    were consumed (by a job of any world size, see :mod:`shardserve.proto.resume`), and the
    rest is dealt over ``world_size`` ranks by the same rule. ``position=0`` is the plain plan.

    >>> p = plan(10, seed=0, epoch=0, world_size=2, rank=1, batch_size=4, shuffle="none")
    >>> [b.tolist() for b in p]
    [[1, 3, 5, 7], [9]]
    >>> [b.tolist() for b in plan(10, 0, 0, 3, 1, 4, shuffle="none", position=4)]
    [[5, 8]]
    """
    order = epoch_order(n_samples, seed, epoch, shuffle, shard_rows, block_window)
    return RankPlan.from_order(order, world_size, rank, batch_size, drop_last, offset=position)
