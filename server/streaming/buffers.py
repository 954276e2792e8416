"""Reusable per-stream batch buffers for the socket path (:class:`~.sinks.SocketSink`).

A stream's batches are gathered into preallocated arrays (``out=`` of the
store's ``take``) so the steady state allocates nothing and touches already-faulted pages.
An array sent with ``copy=False`` still belongs to libzmq until its I/O thread has written
it, so a buffer set goes back to the free list only when the ``zmq.MessageTracker`` of its
send reports done — never earlier (that would overwrite bytes still in flight). We track
instead of copying: tracking costs a few microseconds a batch, a copy costs a memcpy of the
batch. Frames below pyzmq's copy threshold (64 KiB) are copied by pyzmq anyway, and their
trackers are done at once.

At most ``capacity`` sets are kept for reuse; when they are all in flight (a consumer with
more credit than the pool), a fresh set is allocated and simply dropped after use. Memory
is therefore bounded by the client's credit either way.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import zmq

from ..source import PartShapes

#: Bytes of reusable buffers one stream may keep (the pool is 2..8 sets within this).
POOL_BUDGET_BYTES = 64 << 20


@dataclass(eq=False)
class BufferSet:
    """One batch worth of output arrays (fixed-size parts only)."""

    arrays: dict[str, np.ndarray]
    #: False for an overflow set allocated past the pool's capacity: dropped after use.
    pooled: bool = True

    def views(self, rows: int) -> dict[str, np.ndarray]:
        """The first ``rows`` samples of every array (a short last batch)."""
        return {n: a[:rows] for n, a in self.arrays.items()}


class BufferPool:
    """Per-part output arrays of one stream, recycled after zmq is done with them."""

    def __init__(
        self, part_shapes: PartShapes, batch_size: int, capacity: int | None = None
    ) -> None:
        self.part_shapes = dict(part_shapes)
        self.batch_size = batch_size
        # Variable-size parts (None) are allocated by take itself, batch by batch.
        self._shapes = {
            name: (np.dtype(s[0]), (batch_size, *s[1]))
            for name, s in part_shapes.items()
            if s is not None
        }
        set_bytes = sum(int(np.prod(shape)) * dt.itemsize for dt, shape in self._shapes.values())
        self._set_bytes = set_bytes
        if capacity is None:
            capacity = max(2, min(8, POOL_BUDGET_BYTES // max(set_bytes, 1)))
        self.capacity = capacity
        self._free: list[BufferSet] = []
        self._pending: list[tuple[zmq.MessageTracker, BufferSet]] = []
        self._owned = 0

    @property
    def nbytes(self) -> int:
        """Bytes of the sets this pool keeps (allocated so far, at most ``capacity``)."""
        return self._owned * self._set_bytes

    def acquire(self) -> BufferSet | None:
        """A set to gather one batch into, or ``None`` when every part is variable-size."""
        if not self._shapes:
            return None
        self.reclaim()
        if self._free:
            return self._free.pop()
        pooled = self._owned < self.capacity
        self._owned += int(pooled)
        return BufferSet(
            {n: np.empty(shape, dt) for n, (dt, shape) in self._shapes.items()}, pooled
        )

    def release(self, bufs: BufferSet, tracker: zmq.MessageTracker | None = None) -> None:
        """Give a set back; with a tracker, only once zmq has finished sending from it."""
        if not bufs.pooled:
            return
        if tracker is not None and not tracker.done:
            self._pending.append((tracker, bufs))
        else:
            self._free.append(bufs)

    def forfeit(self, bufs: BufferSet) -> None:
        """Never reuse ``bufs``: a batch that failed may still be written by a transform thread
        past its deadline (a thread cannot be stopped). The pool makes a fresh set in its
        place; this one goes when the last writer lets go of it."""
        self._owned -= int(bufs.pooled)

    def reclaim(self) -> None:
        """Move sets whose sends have completed back to the free list."""
        if self._pending:
            still = []
            for tracker, bufs in self._pending:
                if tracker.done:
                    self._free.append(bufs)
                else:
                    still.append((tracker, bufs))
            self._pending = still
