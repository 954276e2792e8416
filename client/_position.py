"""Where the loop is, counted in batches it has received: what ``state_dict`` reports.

The position moves only when a batch reaches the loop (:meth:`Position.received`, the last
step before ``__next__`` returns it) and at an epoch's end, never when a batch arrives from the
server, so a state taken at any moment resumes exactly the batches the loop has not seen.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple

from shardserve.proto.errors import BadRequest


class Start(NamedTuple):
    """Where an iteration begins: its epoch, first batch, and the offset its plan is dealt
    from (non-zero only in an epoch resumed on another world size, see
    :mod:`shardserve.proto.resume`)."""

    epoch: int
    batch: int
    offset: int = 0


@dataclass(frozen=True)
class Marks:
    """A copy of a :class:`Position`'s fields, to put back when a batch never reached the loop."""

    pending: Start | None
    epoch: int | None
    next_batch: int
    epoch_done: bool
    #: The offset the current iteration's plan is dealt from.
    offset: int = 0


class Position:
    """The epoch in progress and the next batch the loop has not received.

    ``pending`` is the (epoch, start) the next iteration begins at, from ``set_epoch`` /
    ``load_state_dict``, or that of an iteration that has not yielded yet (an ``iter()`` that
    only checked the object): it is kept until the iteration yields its first batch.
    """

    def __init__(self, job_epoch: int, num_batches: int) -> None:
        self.job_epoch = job_epoch
        self.num_batches = num_batches
        #: Batches of a whole epoch (``num_batches`` is that of the current iteration's plan,
        #: fewer in an epoch resumed on another world size).
        self.per_epoch = num_batches
        self.marks = Marks(pending=None, epoch=None, next_batch=0, epoch_done=False)

    @property
    def epoch(self) -> int | None:
        """The epoch of the current or last iteration (None before the first)."""
        return self.marks.epoch

    def set_epoch(self, epoch: int) -> None:
        """The next iteration's epoch; a position restored for the same epoch is kept."""
        if epoch < 0:
            raise BadRequest(f"epoch {epoch} must be >= 0")
        pending = self.marks.pending
        same = pending is not None and pending.epoch == epoch
        start = Start(epoch, pending.batch, pending.offset) if pending and same else Start(epoch, 0)
        self.marks = replace(self.marks, pending=start)

    def restore(self, epoch: int, next_batch: int, offset: int = 0) -> None:
        """``load_state_dict``: the next iteration starts at batch ``next_batch`` of ``epoch``
        (of the plan dealt from ``offset``)."""
        if not 0 <= next_batch <= self.per_epoch:
            raise BadRequest(
                f"state next_batch {next_batch} out of range 0 <= next_batch <= "
                f"{self.per_epoch} (batches per epoch of this rank)"
            )
        self.marks = replace(self.marks, pending=Start(epoch, next_batch, offset))

    def next_start(self) -> Start:
        """Where the next iteration begins; kept pending until that iteration yields."""
        m = self.marks
        if m.pending is None:
            epoch = self.job_epoch if m.epoch is None else m.epoch + 1
            self.marks = replace(m, pending=Start(epoch, 0))
        assert self.marks.pending is not None
        return self.marks.pending

    def begin(self, start: Start) -> None:
        """An iteration from ``start`` was created (nothing received yet)."""
        self.marks = replace(
            self.marks, epoch=start[0], next_batch=start[1], epoch_done=False, offset=start.offset
        )

    def received(self, start: Start, index: int) -> None:
        """Batch ``index`` of the iteration from ``start`` reached the loop."""
        pending = None if self.marks.pending == start else self.marks.pending
        self.marks = replace(self.marks, pending=pending, next_batch=index + 1)

    def ended(self, start: Start) -> None:
        """The iteration from ``start`` reached its epoch's end."""
        pending = None if self.marks.pending == start else self.marks.pending
        self.marks = replace(self.marks, pending=pending, epoch_done=True)

    def state(self) -> Start:
        """(epoch, next batch, offset) as ``state_dict`` reports them."""
        m = self.marks
        if m.pending is not None:
            return m.pending
        if m.epoch is None:
            return Start(self.job_epoch, 0)
        if m.epoch_done or m.next_batch >= self.num_batches:
            return Start(m.epoch + 1, 0)
        return Start(m.epoch, m.next_batch, m.offset)
