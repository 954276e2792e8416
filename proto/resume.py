"""Where an epoch stands, counted in the one order every rank shares: elastic resume.

Each epoch has one canonical global order of sample ids (independent of the world size).
Ranks take it as ``DistributedSampler`` does: rank ``r`` of ``W`` takes positions
``r, r + W, r + 2W, ...``, cut into batches of ``b``. After every rank has received ``k``
batches, the positions consumed are exactly the prefix ``[0, k * b * W)`` of the order,
whatever ``W`` is: that prefix length is the epoch's **position**.

A position ``P`` resumes on any world size ``M`` by dealing the rest of the order,
``order[P:]``, over the ``M`` ranks by the same rule (padding ids, when ``drop_last`` is
off, are taken cyclically from the order's start, as an uninterrupted epoch pads). On the
wire a resume is ``(offset, start_batch)`` with ``offset = P mod (b * M)`` and
``start_batch = P div (b * M)``: the plan dealt from ``offset`` skips ``start_batch`` whole
batches on every rank, which lands exactly at ``P``. A state of the same world size thus
resumes with ``offset == 0`` and the batch index it always had.

>>> resume_point(position=96, world_size=3, batch_size=8)
ResumePoint(offset=0, start_batch=4)
>>> resume_point(position=4 * 8 * 4, world_size=3, batch_size=8)
ResumePoint(offset=8, start_batch=5)
>>> position_of(ResumePoint(offset=8, start_batch=5), world_size=3, batch_size=8)
128
"""

from __future__ import annotations

import operator
from typing import NamedTuple


class ResumePoint(NamedTuple):
    """Where a rank's plan starts: dealt from ``offset``, first batch ``start_batch``."""

    #: Positions of the epoch order skipped before the deal; ``< batch_size * world_size``.
    offset: int
    #: Whole batches of that deal every rank has already received.
    start_batch: int


def resume_point(position: int, world_size: int, batch_size: int) -> ResumePoint:
    """The canonical ``(offset, start_batch)`` that resumes ``position`` on ``world_size``
    ranks of ``batch_size`` samples a batch (for several environments: each one's batch)."""
    position, world_size, batch_size = map(operator.index, (position, world_size, batch_size))
    if position < 0 or world_size < 1 or batch_size < 1:
        raise ValueError(
            f"need position >= 0, world_size >= 1, batch_size >= 1; got {position}, "
            f"{world_size}, {batch_size}"
        )
    start_batch, offset = divmod(position, batch_size * world_size)
    return ResumePoint(offset, start_batch)


def position_of(point: ResumePoint, world_size: int, batch_size: int) -> int:
    """The epoch position after every rank received the batches before ``point.start_batch``
    of the deal from ``point.offset``."""
    return point.offset + point.start_batch * batch_size * world_size
