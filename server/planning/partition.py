"""Split an epoch order across ranks and into batches, as DistributedSampler + DataLoader do.

One ``drop_last`` flag for both the sampler and the batches:

- ``drop_last=False``: the order is padded to ``ceil(n / ws) * ws`` by repeating it
  from its start (several times over when ``n < ws``); rank ``r`` takes
  ``padded[r::ws]``; the last batch may be short, and is equally short on every rank.
- ``drop_last=True``: the order is cut to ``floor(n / ws) * ws``; rank ``r`` takes
  ``order[r::ws]``; a short final batch is dropped.

Padding is never more than one id a rank (its last), so a rank keeps a strided view
of the shared order plus at most one extra id: no copy of the order per rank.
Every rank gets the same number of batches: a DDP rank that ran out early would
hang the others.

Elastic resume (see :mod:`shardserve.proto.resume`): ``offset`` deals only the rest of the
order, ``order[offset:]``, by the same rule; padding still repeats the order cyclically from
its start (position ``offset + i`` of the padded deal is ``order[(offset + i) % n]``), so a
deal from ``offset = k * batch_size * world_size`` is exactly the plan from offset 0 without
its first ``k`` batches, padding ids included.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np


def _check(n_samples: int, world_size: int, rank: int, batch_size: int) -> None:
    if n_samples < 0:
        raise ValueError(f"n_samples must be >= 0, got {n_samples}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} out of range 0 <= rank < {world_size}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")


def rank_length(n_samples: int, world_size: int, drop_last: bool) -> int:
    """Return how many ids each rank's sampler yields (``len(DistributedSampler)``).

    >>> rank_length(10, 3, drop_last=False), rank_length(10, 3, drop_last=True)
    (4, 3)
    """
    return n_samples // world_size if drop_last else -(-n_samples // world_size)


def num_batches(n_samples: int, world_size: int, batch_size: int, drop_last: bool) -> int:
    """Return the number of batches every rank gets; pure arithmetic, no RNG.

    >>> num_batches(1000, world_size=3, batch_size=64, drop_last=False)
    6
    >>> num_batches(1000, world_size=3, batch_size=64, drop_last=True)
    5
    """
    n_samples, world_size, batch_size = map(operator.index, (n_samples, world_size, batch_size))
    _check(n_samples, world_size, 0, batch_size)
    per_rank = rank_length(n_samples, world_size, drop_last)
    return per_rank // batch_size if drop_last else -(-per_rank // batch_size)


@dataclass(frozen=True, eq=False)
class RankPlan:
    """One rank's batches of one epoch: global sample ids, random access by batch index.

    >>> import numpy as np
    >>> p = RankPlan.from_order(np.arange(10, dtype=np.uint32), world_size=3, rank=2,
    ...                         batch_size=2, drop_last=False)
    >>> len(p), p.num_samples, [b.tolist() for b in p]
    (2, 4, [[2, 5], [8, 1]])
    >>> p.batch(2)
    Traceback (most recent call last):
    IndexError: batch 2 out of range 0 <= i < 2
    """

    world_size: int
    rank: int
    batch_size: int
    drop_last: bool
    num_samples: int  # ids across this rank's batches, padding included
    num_batches: int
    _ids: np.ndarray = field(repr=False)  # strided view of the shared order
    _pad: int = field(repr=False)  # the padding id, when _ids is one short
    #: ``ready(p)`` returns once position ``p`` of the order is final (an order whose last
    #: buckets are still being shuffled, see :meth:`PlanCache.rank_plan`); ``None``: all is.
    _ready: Callable[[int], None] | None = field(default=None, repr=False)
    _first: int = field(default=0, repr=False)  # the order position of _ids[0]

    @classmethod
    def from_order(
        cls,
        order: np.ndarray,
        world_size: int,
        rank: int,
        batch_size: int,
        drop_last: bool,
        offset: int = 0,
        ready: Callable[[int], None] | None = None,
    ) -> RankPlan:
        """Partition ``order`` (the epoch order every rank shares) for ``rank`` of ``world_size``;
        ``offset``: deal only ``order[offset:]``, the rest of an epoch resumed elastically;
        ``ready``: see the field (every read of the order waits on it first).

        >>> o = np.arange(10, dtype=np.uint32)
        >>> [b.tolist() for b in RankPlan.from_order(o, 3, 2, 2, False, offset=5)]  # pads with o[0]
        [[7, 0]]
        """
        world_size, rank, batch_size, offset = map(
            operator.index, (world_size, rank, batch_size, offset)
        )
        n = len(order)
        _check_order(order, world_size, rank, batch_size, offset)
        rest = n - offset
        per_rank = rank_length(rest, world_size, drop_last)
        batches = num_batches(rest, world_size, batch_size, drop_last)
        num_samples = batches * batch_size if drop_last else per_rank
        ids = order[offset + rank : n : world_size][:num_samples]
        pad = 0
        if len(ids) < num_samples:
            # Only the last id can be padding: the padded tail is shorter than world_size.
            pad = _padding(order, offset + rank + (per_rank - 1) * world_size, ready)
        return cls(
            world_size,
            rank,
            batch_size,
            drop_last,
            num_samples,
            batches,
            ids,
            pad,
            ready,
            offset + rank,
        )

    def _wait_for(self, count: int) -> None:
        """Wait until the first ``count`` ids of this rank are final in the order."""
        if self._ready is not None and count > 0:
            self._ready(self._first + (count - 1) * self.world_size)

    def __len__(self) -> int:
        return self.num_batches

    def sample_ids(self) -> np.ndarray:
        """Every sample id of this rank's epoch, in reading order (padding included); a view
        of the shared order when there is no padding.

        >>> RankPlan.from_order(np.arange(5, dtype=np.uint32), 2, 1, 2, False).sample_ids().tolist()
        [1, 3, 0]
        """
        self._wait_for(len(self._ids))
        if len(self._ids) == self.num_samples:
            return self._ids
        return np.append(self._ids.astype(np.int64), self._pad)

    def batch(self, i: int) -> np.ndarray:
        """Return batch ``i``'s global sample ids as a new int64 array."""
        return self.span(i, 1)

    def ready(self, i: int, count: int) -> bool:
        """Always: the order this plan deals is made (a position still being shuffled is
        waited for by :meth:`span`, bounded).

        >>> RankPlan.from_order(np.arange(4, dtype=np.uint32), 1, 0, 2, False).ready(0, 1)
        True
        """
        return True

    def span(self, i: int, count: int) -> np.ndarray:
        """Batches ``i`` to ``i + count - 1``'s ids, in order, as one new int64 array (a
        message of several small batches reads them with one slice).

        >>> RankPlan.from_order(np.arange(10, dtype=np.uint32), 2, 0, 2, False).span(1, 2).tolist()
        [4, 6, 8]
        """
        i, count = operator.index(i), operator.index(count)
        if not (i >= 0 and count >= 1 and i + count <= self.num_batches):
            which = f"batch {i}" if count == 1 else f"batches {i}..{i + count - 1}"
            raise IndexError(f"{which} out of range 0 <= i < {self.num_batches}")
        lo = i * self.batch_size
        hi = min(lo + count * self.batch_size, self.num_samples)
        self._wait_for(min(hi, len(self._ids)))
        if hi <= len(self._ids):
            return self._ids[lo:hi].astype(np.int64)
        out = np.empty(hi - lo, dtype=np.int64)
        out[: len(self._ids) - lo] = self._ids[lo:]
        out[len(self._ids) - lo :] = self._pad
        return out

    def __iter__(self) -> Iterator[np.ndarray]:
        for i in range(self.num_batches):
            yield self.batch(i)


def _check_order(
    order: np.ndarray, world_size: int, rank: int, batch_size: int, offset: int
) -> None:
    """Refuse an order that is not 1-D, what :func:`_check` refuses, and an offset outside
    the order."""
    if order.ndim != 1:
        raise ValueError(f"order must be 1-D, got shape {order.shape}")
    _check(len(order), world_size, rank, batch_size)
    if not 0 <= offset <= len(order):
        raise ValueError(
            f"offset {offset} out of range 0 <= offset <= {len(order)} (the order's length)"
        )


def _padding(order: np.ndarray, position: int, ready: Callable[[int], None] | None) -> int:
    """The id a short rank is padded with: the order's id at ``position`` (wrapped around),
    once it is final."""
    at = position % len(order)
    if ready is not None:
        ready(at)
    return int(order[at])
