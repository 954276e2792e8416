"""The epoch planner: which global sample ids each rank gets, batch by batch.

A plan is a pure function of (sample count or shard sizes, seed, epoch, world size,
rank, batch size, shuffle, drop_last). Modules:

- ``rng``: the (seed, epoch) generator and the order dtype;
- ``permute``: the cache-friendly uniform shuffle;
- ``shuffle_none`` / ``shuffle_global`` / ``shuffle_block``: one order algorithm each,
  picked by name from ``order.SHUFFLES``;
- ``order``: ``epoch_order``, the order every rank of a job shares;
- ``partition``: ``RankPlan`` and ``num_batches``, DistributedSampler's split;
- ``plan``: the one-rank shorthand.

>>> from shardserve.server.planning import epoch_order, RankPlan
>>> order = epoch_order(1000, seed=0, epoch=3)
>>> ranks = [RankPlan.from_order(order, 4, r, batch_size=32, drop_last=False) for r in range(4)]
>>> {len(p) for p in ranks}
{8}
"""

from .order import SHUFFLES, ShuffleMode, epoch_order
from .partition import RankPlan, num_batches
from .plan import plan

__all__ = ["SHUFFLES", "RankPlan", "ShuffleMode", "epoch_order", "num_batches", "plan"]
