"""Host staging: the pinned buffers a device copy goes through, and the reusable blocks a
shared-memory batch is copied out into.

Both reuse memory only when nothing can still read it: a pinned block once its device copy's
event completed, a copy-out block once no tensor of the batch that used it is alive (torch's
storage use count, :func:`storage_users`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from shardserve.proto.messages import PartHeader

from ._frames import own_storage, views_at
from ._ledger import Event

log = logging.getLogger(__name__)

#: Alignment of parts copied into one host block (cache lines; safe for every dtype).
_ALIGN = 64
#: Unused bytes between a slot's parts that one span copy may carry along (alignment gaps).
_SPAN_SLACK = 64 << 10


@dataclass
class _Block:
    buf: torch.Tensor
    event: Event | None = None


@dataclass
class PinnedPool:
    """Reusable host staging buffers; pinned when CUDA is there, plain otherwise.

    A block handed back with an event is reused only once that event has completed (its
    device copy finished), so a copy in flight can never read a buffer being refilled.

    >>> pool = PinnedPool(pin=False)
    >>> buf = pool.acquire(1000)
    >>> pool.release(buf, event=None); pool.stats()["free"]
    1
    """

    pin: bool | None = None
    max_blocks: int = 16
    _free: list[_Block] = field(default_factory=list)
    _pending: list[_Block] = field(default_factory=list)
    allocated: int = 0

    def __post_init__(self) -> None:
        available = torch.cuda.is_available()
        if self.pin is None:
            self.pin = available
        elif self.pin and not available:
            log.warning(
                "pinned host memory needs CUDA, which torch cannot see: using plain buffers"
            )
            self.pin = False

    @staticmethod
    def size_class(nbytes: int) -> int:
        """Blocks come in powers of two (at least 4 KiB) so batches of varying size share them."""
        return max(4096, 1 << max(0, nbytes - 1).bit_length())

    def _reap(self) -> None:
        still: list[_Block] = []
        for b in self._pending:
            (self._free if b.event is None or b.event.query() else still).append(b)
        self._pending = still

    def acquire(self, nbytes: int) -> torch.Tensor:
        """A uint8 buffer of at least ``nbytes`` that no copy in flight is reading."""
        self._reap()
        want = self.size_class(nbytes)
        for i, b in enumerate(self._free):
            if b.buf.numel() == want:
                return self._free.pop(i).buf
        if not self._free and self._pending and self.allocated >= self.max_blocks:
            # Every block is still being read by a device copy (the consumer's stream lags
            # behind the host): wait for the oldest copy instead of pinning more memory.
            oldest = self._pending.pop(0)
            if oldest.event is not None:
                oldest.event.synchronize()
            if oldest.buf.numel() == want:
                return oldest.buf
            self.allocated -= 1
        if self._free and self.allocated >= self.max_blocks:
            self._free.pop(0)  # a block of the wrong size: let it go rather than grow
            self.allocated -= 1
        self.allocated += 1
        return torch.empty(want, dtype=torch.uint8, pin_memory=bool(self.pin))

    def release(self, buf: torch.Tensor, event: Event | None) -> None:
        """Hand ``buf`` back; it becomes reusable once ``event`` (if any) has completed."""
        self._pending.append(_Block(buf, event))
        self._reap()

    def stats(self) -> dict[str, int]:
        self._reap()
        return {"allocated": self.allocated, "free": len(self._free), "pending": len(self._pending)}


_use_count = getattr(torch._C, "_storage_Use_Count", None)
#: Whether this torch reports how many tensors share a storage (see :func:`storage_users`).
COUNTS_USERS = _use_count is not None


def storage_users(block: torch.Tensor) -> int | None:
    """How many tensors share ``block``'s storage (None where torch does not say)."""
    count = _use_count
    if count is None:
        return None
    storage = block.untyped_storage()
    # The temporary storage object counts as one user while it lives.
    return int(count(storage._cdata)) - 1


class CopyBlocks:
    """Host blocks that shared-memory batches are copied into, reused once nothing uses them.

    A fresh multi-MiB allocation per batch costs a page fault per 4 KiB (a 16 MiB batch copied
    at ~2 GB/s instead of ~10). A block is handed out again only when no tensor of the batch
    that used it is alive (torch's storage use count), so no two live batches ever share
    memory; a consumer that keeps every batch simply gets a new block each time.
    """

    def __init__(self, keep: int = 4) -> None:
        self.keep = keep
        self._blocks: list[torch.Tensor] = []

    def acquire(self, nbytes: int) -> torch.Tensor:
        for i, block in enumerate(self._blocks):
            if block.numel() >= nbytes and storage_users(block) == 1:
                # Most recently used first next time: its pages are the warmest.
                self._blocks.append(self._blocks.pop(i))
                return block[:nbytes]
        block = torch.empty(max(nbytes, 1), dtype=torch.uint8)
        if storage_users(block) is not None:
            self._blocks.append(block)
            if len(self._blocks) > self.keep:
                self._blocks.pop(0)
        return block[:nbytes]

    def copy_out(self, views: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """One block holding a copy of every part."""
        return pack_into(self.acquire, views, own=True)[1]

    def copy_slot(
        self, slot: torch.Tensor, parts: Sequence[PartHeader]
    ) -> dict[str, torch.Tensor] | None:
        """A copy of a batch's ``parts`` out of ``slot`` (uint8, the whole slot) in one memcpy,
        keeping their offsets; ``None`` when the parts lie too far apart for that to pay (a
        short last batch: most of each part's region unused)."""
        lo = min((p.offset for p in parts), default=0)
        hi = max((p.offset + p.nbytes for p in parts), default=0)
        if hi - lo > sum(p.nbytes for p in parts) + _SPAN_SLACK:
            return None
        block = self.acquire(hi - lo)
        block.copy_(slot[lo:hi])
        return views_at(block, parts, lo)


def pack_into(
    acquire: Callable[[int], torch.Tensor], parts: dict[str, torch.Tensor], own: bool = False
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Copy every part into one uint8 block from ``acquire(nbytes)``, each part starting on a
    64-byte boundary; returns the block and the parts' views into it (``own``: each with a
    storage of its own, see :func:`._frames.own_storage`)."""
    sizes = [(t.numel() * t.element_size() + _ALIGN - 1) // _ALIGN * _ALIGN for t in parts.values()]
    block = acquire(sum(sizes))
    packed, pos = {}, 0
    for (name, t), size in zip(parts.items(), sizes, strict=True):
        n = t.numel() * t.element_size()
        dst = block[pos : pos + n].view(t.dtype)
        dst.copy_(t.reshape(-1))
        packed[name] = (own_storage(dst) if own else dst).view(t.shape)
        pos += size
    return block, packed
