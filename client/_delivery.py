"""How a received batch becomes the tensors the loop gets: one small strategy per way.

A socket batch's parts are tensors over their own frames (moved to the GPU when asked). A
batch in a shared-memory slot is read one of five ways, picked once per ring by
:func:`choose_slot_delivery` from the Loader's ``device`` and ``copy``:

==================  ================================  =====================================
strategy            when                              the slot goes back
==================  ================================  =====================================
``lend_in_place``   CPU, ``copy=True``                once no tensor of the batch is left
                                                      (copied out instead while half the ring
                                                      is lent)
``copy_out``        CPU, ``copy=True``, torch cannot  at once
                    count a storage's users
``views_until_next`` CPU, ``copy=False``              at the next batch
``dma_direct``      CUDA, ring registered for DMA     once the copy's event completed
``staged_to_device`` CUDA, registration refused       at once (staging is synchronous)
==================  ================================  =====================================

Every strategy tells the ring's :class:`~._ledger.SlotLedger` what it did with the slot; a third
way to deliver is one more function here and one more line in :func:`choose_slot_delivery`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from shardserve.proto.framing import Frame
from shardserve.proto.messages import BatchHeader

from ._frames import assemble, parts_from_frames
from ._staging import COUNTS_USERS, CopyBlocks
from .device import DeviceCopier, register_host_memory, unregister_host_memory
from .shm import AttachedRing
from .stats import StatsClock
from .types import Batch


@dataclass
class Unpacking:
    """What every strategy may use: the device copier, copy-out blocks, stats, options."""

    copier: DeviceCopier
    blocks: CopyBlocks
    stats: StatsClock
    pad_variable: bool = False


#: A strategy: the batch ``header`` describes, read out of its slot in ``ring``.
SlotDelivery = Callable[[Unpacking, AttachedRing, BatchHeader], Batch]


def from_socket(u: Unpacking, header: BatchHeader, frames: Sequence[Frame]) -> Batch:
    """Tensors over the batch's own frames (no copy on the CPU; staged to the GPU)."""
    return u.copier.to_device(parts_from_frames(header, frames), u.pad_variable)


def lend_in_place(u: Unpacking, ring: AttachedRing, header: BatchHeader) -> Batch:
    """The batch is its slot, lent until its last tensor is gone; copied out instead while
    half the ring is lent, so the server never runs out of slots to fill."""
    if not ring.ledger.can_lend():
        return copy_out(u, ring, header)
    views = ring.views(header.slot, header.parts)
    ring.ledger.lend(header.slot)
    return assemble(views, u.pad_variable)


def copy_out(u: Unpacking, ring: AttachedRing, header: BatchHeader) -> Batch:
    """A copy in a reused host block (one memcpy of the slot's span when the parts lie close
    together); the slot goes back at once."""
    u.stats.copied += header.count  # batches, however many the message holds
    copied = u.blocks.copy_slot(ring.slot_tensor(header.slot), header.parts)
    if copied is None:
        copied = u.blocks.copy_out(ring.views(header.slot, header.parts))
    ring.ledger.release(header.slot)
    return assemble(copied, u.pad_variable)


def views_until_next(u: Unpacking, ring: AttachedRing, header: BatchHeader) -> Batch:
    """``copy=False``: views into the slot, valid until the next batch is requested."""
    views = ring.views(header.slot, header.parts)
    ring.ledger.lend_view(header.slot)
    return assemble(views, u.pad_variable)


def dma_direct(u: Unpacking, ring: AttachedRing, header: BatchHeader) -> Batch:
    """An async copy straight from the registered slot; the slot stays held until the copy's
    event completed, across streams too (it travels in the next Hello's ``keep``)."""
    batch, done = u.copier.to_device_direct(ring.views(header.slot, header.parts), u.pad_variable)
    ring.ledger.lend_to_copy(header.slot, done)
    return batch


def staged_to_device(u: Unpacking, ring: AttachedRing, header: BatchHeader) -> Batch:
    """Through a pinned buffer: the slot is free once the synchronous staging copy returns."""
    batch = u.copier.to_device(ring.views(header.slot, header.parts), u.pad_variable)
    ring.ledger.release(header.slot)
    return batch


def choose_slot_delivery(ring: AttachedRing, copier: DeviceCopier, copy: bool) -> SlotDelivery:
    """The strategy for batches in ``ring`` (registers the ring for DMA on a GPU)."""
    if copier.cuda:
        pinned = ring.pin(register_host_memory, unregister_host_memory)
        return dma_direct if pinned else staged_to_device
    if not copy:
        return views_until_next
    return lend_in_place if COUNTS_USERS else copy_out


class Delivery:
    """Turns each received batch into the loop's tensors, with the strategy of its ring."""

    def __init__(self, unpacking: Unpacking, copy: bool) -> None:
        self.unpacking = unpacking
        self.copy = copy
        self._ring: AttachedRing | None = None
        self._slot: SlotDelivery = copy_out

    def __call__(
        self, ring: AttachedRing | None, header: BatchHeader, frames: Sequence[Frame]
    ) -> Batch:
        if header.slot < 0:  # a socket batch, or one that outgrew its slot
            return from_socket(self.unpacking, header, frames)
        if ring is None:
            raise ValueError(f"batch {header.index} names slot {header.slot} but no ring is mapped")
        if ring is not self._ring:
            self._ring = ring
            self._slot = choose_slot_delivery(ring, self.unpacking.copier, self.copy)
        return self._slot(self.unpacking, ring, header)
