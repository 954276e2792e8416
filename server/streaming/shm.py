"""A stream's batches laid out in a shared-memory slot ring (:mod:`~..rings`): the same-host
fast path's memory, owned by the server.

The server assembles a batch straight into a free slot; the socket carries only the slot
number and the header; the client reads the slot in place and hands it back with its next
credit. The ring holds exactly the stream's credit, so memory is bounded whatever the
consumer's speed. :class:`ShmSlots` lays one stream's batches out in its ring and tracks each
slot's state.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from pathlib import Path

import numpy as np

from shardserve.proto.messages import MAX_NDIM, PartHeader, ShmRing
from shardserve.proto.rings import (
    ALIGN,
    align,
)

from ..runtime.rings import SlotRing, create_ring
from ..source import BatchParts, BatchSource, FileSpan, PartShapes

#: Each part's dtype and per-sample shape (``None``: variable), as a ring lays them out.
PartLayout = tuple[tuple[str, tuple[str, tuple[int, ...]] | None], ...]
#: What a ring's layout was made for: (slots, dataset, its creation time, fields, batch size,
#: the parts' layout, the dataset's bytes). A chain changes the last two, not the others.
RingKey = tuple[int, str, str, tuple[str, ...], int, PartLayout, int] | tuple[()]
#: Headroom over the dataset's average variable bytes per batch before overflowing to the socket.
VARIABLE_HEADROOM = 2.0
#: Fewest slots a ring capped by ``--shm-ring-bytes`` keeps: one the client reads, one filled.
MIN_RING_SLOTS = 2


class SlotTail:
    """One assembly's use of a slot's variable-size region, on the worker holding the slot:
    ``take`` makes variable-size parts there (a :class:`~..source.Tail`), then ``__call__``
    copies the parts still elsewhere after them. Parts that do not fit go to fresh memory,
    and then the whole batch goes on the socket."""

    def __init__(self, ring: SlotRing, slot: int, start: int) -> None:
        self._ring, self._slot = ring, slot
        #: The next free byte of the region, from the slot's start.
        self.cursor = start

    def empty(self, part: str, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        view = self._next(shape, dtype)
        return np.empty(shape, dtype) if view is None else view

    def span_of(self, arr: np.ndarray) -> FileSpan | None:
        return self._ring.span_of(self._slot, arr)

    def __call__(self, parts: BatchParts) -> BatchParts:
        """``parts`` with every one outside the slot copied into its region, or ``parts``
        unchanged when they do not all fit (it goes on the socket)."""
        placed = dict(parts)
        for name, arr in parts.items():
            if self._ring.offset_in(self._slot, arr) is not None:
                continue  # made in the slot
            view = self._next(arr.shape, arr.dtype)
            if view is None:
                return parts  # overflow: this batch goes on the socket
            view[...] = arr
            placed[name] = view
        return placed

    def _next(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray | None:
        """The region's next array of ``shape``, or ``None`` if it does not fit."""
        nbytes = math.prod(shape) * dtype.itemsize
        if self.cursor + nbytes > self._ring.slot_bytes:
            return None
        view = self._ring.slot_array(self._slot, self.cursor, dtype, shape)
        self.cursor = align(self.cursor + nbytes)
        return view


class ShmSlots:
    """The slot ring of one stream and the state of each slot. Streamer thread, except
    :meth:`out` and :meth:`tail`, used by the assembly worker that holds the slot.

    A slot's life::

        free --acquire--> assembling --send--> lent to the client --Credit(slots=[k])--> free
                               |                    (the client reads it in place)
                               +--failed / stream replaced--> free

    Layout of a slot: every fixed-size part at an aligned offset sized for a full batch (a
    short last batch uses the head of the same region), then a region for variable-size parts
    (graphs, token sequences, bytes) sized from the dataset's average sample. A batch whose
    variable parts do not fit is sent on the socket instead, so an unlucky batch costs a copy,
    never a failure.
    """

    def __init__(
        self,
        ring: SlotRing,
        offsets: dict[str, int],
        shapes: PartShapes,
        var_start: int,
        batch_size: int,
        key: RingKey = (),
    ) -> None:
        self.ring = ring
        #: What the layout was made for; a next stream with the same key may reuse the ring.
        self.key = key
        self._offsets = offsets
        self._shapes = {
            n: (np.dtype(s[0]), tuple(s[1])) for n, s in shapes.items() if s is not None
        }
        self._var_start = var_start
        self._lent: set[int] = set()
        self._rows = batch_size
        self._full: dict[int, dict[str, np.ndarray]] = {}

    @classmethod
    def create(
        cls,
        stream: int,
        slots: int,
        dataset: BatchSource,
        fields: tuple[str, ...],
        batch_size: int,
        shm_dir: Path,
        limit_bytes: int | None,
        *,
        ring_bytes: int | None = None,
    ) -> ShmSlots:
        """Size and make the ring; raises ``ShmUnavailable`` (caller falls back to the socket).

        ``slots`` is the credit's; ``ring_bytes`` caps the ring at fewer (at least
        ``MIN_RING_SLOTS``) when its slots are big: batches that grow in a transform (bits
        unpacked to floats) would otherwise map credit x their size. The pump then waits for
        a slot the client hands back, and the client copies out rather than lend past half
        the ring, so fewer slots cost neither correctness nor a deadlock."""
        shapes = dataset.part_shapes(fields)
        offsets: dict[str, int] = {}
        cursor = fixed_per_sample = 0
        for name, s in shapes.items():
            if s is None:
                continue
            offsets[name] = cursor
            per_sample = int(np.prod(s[1], dtype=np.int64)) * np.dtype(s[0]).itemsize
            fixed_per_sample += per_sample
            cursor = align(cursor + per_sample * batch_size)
        var_start = cursor
        variable = [n for n, s in shapes.items() if s is None]
        if variable:
            avg = dataset.sample_bytes
            cursor += int(VARIABLE_HEADROOM * batch_size * max(avg - fixed_per_sample, 0))
            # Companions of each variable field: int64 offsets [B+1] and shapes [B, ndim], each
            # of the three parts starting on an aligned boundary.
            companions = (batch_size + 1) * 8 * (1 + MAX_NDIM) + 3 * ALIGN
            cursor += len(variable) * companions
        key = cls.key_for(slots, dataset, fields, batch_size)  # what was asked: reuse matches it
        if ring_bytes is not None:
            slots = min(slots, max(MIN_RING_SLOTS, ring_bytes // align(max(cursor, 1))))
        ring = create_ring(stream, slots, cursor, shm_dir, limit_bytes)
        return cls(ring, offsets, shapes, var_start, batch_size, key)

    @staticmethod
    def key_for(
        slots: int, dataset: BatchSource, fields: tuple[str, ...], batch_size: int
    ) -> RingKey:
        """What a ring's layout depends on: a next stream with the same key may reuse it."""
        m = dataset.manifest
        layout = tuple(
            (n, None if s is None else (np.dtype(s[0]).str, tuple(s[1])))
            for n, s in dataset.part_shapes(fields).items()
        )
        return (slots, m.name, m.created_at, fields, batch_size, layout, m.total_bytes)

    def reset(self, keep: Iterable[int] = ()) -> None:
        """Every slot but ``keep`` (still read by the client) free again, for the same client's
        next stream: its epochs reuse one ring (pages already faulted in on both sides, no new
        file to zero-fill), and ``keep`` comes back in a later Credit."""
        # Only slots this ring lent can still be read: a keep naming others is a stale Hello's.
        self._lent = {k for k in keep if k in self._lent}
        self.ring.free = [k for k in range(self.ring.slots) if k not in self._lent]

    @property
    def info(self) -> ShmRing:
        return ShmRing(name=self.ring.name, slots=self.ring.slots, slot_bytes=self.ring.slot_bytes)

    # -- the slot's life ------------------------------------------------------------------

    def acquire(self) -> int | None:
        """A free slot to assemble into, or ``None`` when all are busy or lent."""
        return self.ring.free.pop() if self.ring.free else None

    def release(self, slot: int) -> None:
        """A slot that was never sent (failed, or its stream was replaced) is free again."""
        self._lent.discard(slot)
        self.ring.free.append(slot)

    def lend(self, slot: int) -> None:
        self._lent.add(slot)

    def give_back(self, slots: Iterable[int]) -> list[int]:
        """Slots the client is done with; returns those it did not hold (ignored)."""
        bad = []
        for k in slots:
            if k in self._lent:
                self._lent.remove(k)
                self.ring.free.append(k)
            else:
                bad.append(k)
        return bad

    def close(self) -> None:
        self._full.clear()  # views into the mapping would keep it from closing
        self.ring.close()

    # -- on the assembly worker -----------------------------------------------------------

    def out(self, slot: int, rows: int) -> BatchParts:
        """Arrays inside ``slot`` for the fixed-size parts: ``take`` writes straight into them."""
        full = self._full.get(slot)
        if full is None:
            # Made once per slot: building views costs more than a CIFAR label's gather.
            full = self._full[slot] = {
                name: self.ring.slot_array(slot, self._offsets[name], dt, (self._rows, *shape))
                for name, (dt, shape) in self._shapes.items()
            }
        if rows == self._rows:
            return full
        return {name: a[:rows] for name, a in full.items()}

    def tail(self, slot: int) -> SlotTail:
        """The variable-size region of ``slot`` for one assembly (on its worker)."""
        return SlotTail(self.ring, slot, self._var_start)

    def copy_in(self, slot: int, parts: BatchParts) -> BatchParts:
        """Copy a batch assembled elsewhere into ``slot``: fixed-size parts to their places,
        the others into the tail as :meth:`place` does (left out when they do not fit)."""
        fixed = {n: a for n, a in parts.items() if n in self._shapes}
        rows = len(next(iter(fixed.values()))) if fixed else self._rows
        if rows > self._rows:
            return parts  # more rows than a slot holds: the socket carries it
        out = self.out(slot, rows)
        placed = dict(parts)
        for name, a in fixed.items():
            view = out[name]
            if view.shape != a.shape or view.dtype != a.dtype:
                return parts  # not this ring's layout: the socket carries it
            view[...] = a
            placed[name] = view
        return self.tail(slot)(placed)

    # -- on the streamer thread -----------------------------------------------------------

    def headers(self, slot: int, parts: Mapping[str, np.ndarray]) -> tuple[PartHeader, ...] | None:
        """Part headers with slot offsets, or ``None`` if some part lies outside the slot."""
        out = []
        full = self._full.get(slot, {})
        for name, a in parts.items():
            off = self._offsets[name] if full.get(name) is a else self.ring.offset_in(slot, a)
            if off is None:
                return None
            out.append(PartHeader(name, a.dtype.name, a.shape, a.nbytes, off))
        return tuple(out)
