"""One stream's shared-memory slots: handed out like a buffer pool, returned by the client.

A slot's life::

    free --acquire--> assembling --send--> lent to the client --Credit(slots=[k])--> free
                           |                    (the client reads it in place)
                           +--failed / stream replaced--> free

Layout of a slot: every fixed-size part at an aligned offset sized for a full batch (a short
last batch uses the head of the same region), then a region for variable-size parts (graphs,
token sequences, bytes) sized from the dataset's average sample. A batch whose variable parts
do not fit is sent on the socket instead, so an unlucky batch costs a copy, never a failure.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from shardserve.proto.messages import MAX_NDIM, PartHeader, ShmRing

from .shm import ALIGN, SlotRing, align, create_ring

#: Headroom over the dataset's average variable bytes per batch before overflowing to the socket.
VARIABLE_HEADROOM = 2.0


class ShmSlots:
    """The slot ring of one stream and the state of each slot. Streamer thread, except
    :meth:`out` and :meth:`place`, which run on the assembly worker that holds the slot."""

    def __init__(self, ring: SlotRing, offsets: dict[str, int], shapes: Mapping[str, Any],
                 var_start: int, batch_size: int, key: tuple[Any, ...] = ()) -> None:
        self.ring = ring
        #: What the layout was made for; a next stream with the same key may reuse the ring.
        self.key = key
        self._offsets = offsets
        self._shapes = {n: (np.dtype(s[0]), tuple(s[1])) for n, s in shapes.items() if s is not None}
        self._var_start = var_start
        self._lent: set[int] = set()
        self._base = ring.address
        self._rows = batch_size
        self._full: dict[int, dict[str, np.ndarray]] = {}

    @classmethod
    def create(cls, stream: int, slots: int, dataset: Any, fields: tuple[str, ...], batch_size: int,
               shm_dir: Path, limit_bytes: int | None) -> ShmSlots:
        """Size and make the ring; raises ``ShmUnavailable`` (caller falls back to the socket)."""
        shapes = dataset.part_shapes(fields)
        offsets, cursor, fixed_per_sample = {}, 0, 0
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
            m = dataset.manifest
            avg = m.total_bytes / max(m.num_samples, 1)
            cursor += int(VARIABLE_HEADROOM * batch_size * max(avg - fixed_per_sample, 0))
            # Companions of each variable field: int64 offsets [B+1] and shapes [B, ndim], each
            # of the three parts starting on an aligned boundary.
            companions = (batch_size + 1) * 8 * (1 + MAX_NDIM) + 3 * ALIGN
            cursor += len(variable) * companions
        ring = create_ring(stream, slots, cursor, shm_dir, limit_bytes)
        return cls(ring, offsets, shapes, var_start, batch_size,
                   cls.key_for(slots, dataset, fields, batch_size))

    @staticmethod
    def key_for(slots: int, dataset: Any, fields: tuple[str, ...], batch_size: int) -> tuple[Any, ...]:
        return (slots, dataset.manifest.name, dataset.manifest.created_at, fields, batch_size)

    def reset(self, keep: Iterable[int] = ()) -> None:
        """Every slot but ``keep`` (still read by the client) free again, for the same client's
        next stream: its epochs reuse one ring (pages already faulted in on both sides, no new
        file to zero-fill), and ``keep`` comes back in a later Credit."""
        self._lent = {k for k in keep if 0 <= k < self.ring.slots}
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

    def out(self, slot: int, rows: int) -> dict[str, np.ndarray]:
        """Arrays inside ``slot`` for the fixed-size parts: ``take`` writes straight into them."""
        full = self._full.get(slot)
        if full is None:
            # Made once per slot: building views costs more than a CIFAR label's gather.
            full = self._full[slot] = {
                name: self.ring.slot_array(slot, self._offsets[name], dt.name, (self._rows, *shape))
                for name, (dt, shape) in self._shapes.items()
            }
        if rows == self._rows:
            return full
        return {name: a[:rows] for name, a in full.items()}

    def place(self, slot: int, parts: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Copy the variable-size parts into the slot's tail when they fit (else leave them)."""
        cursor = self._var_start
        placed = dict(parts)
        full = self._full.get(slot, {})
        for name, arr in parts.items():
            if full.get(name) is arr or self.offset_of(slot, arr) is not None:
                continue
            if cursor + arr.nbytes > self.ring.slot_bytes:
                return parts  # overflow: this batch goes on the socket
            view = self.ring.slot_array(slot, cursor, arr.dtype.name, arr.shape)
            view[...] = arr
            placed[name] = view
            cursor = align(cursor + arr.nbytes)
        return placed

    # -- on the streamer thread -----------------------------------------------------------

    def offset_of(self, slot: int, arr: np.ndarray) -> int | None:
        """Where ``arr`` starts inside ``slot``, or ``None`` if it is not in the slot."""
        start = self._base + slot * self.ring.slot_bytes
        addr = arr.ctypes.data
        if start <= addr and addr + arr.nbytes <= start + self.ring.slot_bytes:
            return addr - start
        return None

    def headers(self, slot: int, parts: Mapping[str, np.ndarray]) -> tuple[PartHeader, ...] | None:
        """Part headers with slot offsets, or ``None`` if some part lies outside the slot."""
        out = []
        full = self._full.get(slot, {})
        for name, a in parts.items():
            off = self._offsets[name] if full.get(name) is a else self.offset_of(slot, a)
            if off is None:
                return None
            out.append(PartHeader(name, a.dtype.name, a.shape, a.nbytes, off))
        return tuple(out)
