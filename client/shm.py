"""The client's side of a shared-memory slot ring: attach, read a slot in place, detach.

The server owns the ring (it creates and unlinks the file); the client only maps it. Which
slots the client holds, and when each goes back, is the ring's :class:`~._ledger.SlotLedger`;
how a batch is read out of its slot is :mod:`._delivery`.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch

from shardserve.proto.messages import PartHeader, ShmRing
from shardserve.proto.rings import DEFAULT_DIR, part_fits, plain_name, ring_bytes, slot_start

from ._frames import views_at
from ._ledger import SlotLedger
from ._staging import storage_users


class ShmAttachError(OSError):
    """The ring named in Welcome cannot be mapped here (another host or IPC namespace)."""


class AttachedRing:
    """A read-only-by-convention mapping of a server's slot ring."""

    def __init__(self, ring: ShmRing, shm_dir: Path = DEFAULT_DIR) -> None:
        if not plain_name(ring.name):
            raise ShmAttachError(
                f"refusing shared-memory name {ring.name!r}: not a plain file name"
            )
        self.ring = ring
        path = shm_dir / ring.name
        size = ring_bytes(ring.slots, ring.slot_bytes)
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError as e:
            raise ShmAttachError(f"cannot open {path}: {e.strerror}") from None
        try:
            if os.fstat(fd).st_size < size:
                raise ShmAttachError(
                    f"{path} is {os.fstat(fd).st_size} bytes, Welcome promised {size}"
                )
            # Mapped writable so CUDA can register it as pinned memory; the client never writes.
            self._mm: mmap.mmap | None = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self._buf = np.frombuffer(self._mm, dtype=np.uint8)
        self._slots: dict[int, torch.Tensor] = {}
        #: Which slots the client holds and which go back with the next Credit.
        self.ledger = SlotLedger(ring.slots, self.in_use)
        #: Whether the mapping is registered with CUDA (None: not tried yet).
        self.registered: bool | None = None
        #: Runs before unmapping (the CUDA unregistration, after in-flight copies).
        self.on_close: Callable[[np.ndarray], None] | None = None

    def views(self, slot: int, parts: Sequence[PartHeader]) -> dict[str, torch.Tensor]:
        """Typed tensors over the ``parts`` of the batch in ``slot`` (no copy); a header that
        places a part outside its slot is refused."""
        base = self.slot_tensor(slot)
        for p in parts:
            if not part_fits(p.offset, p.nbytes, self.ring.slot_bytes):
                raise ValueError(
                    f"part {p.name!r} overflows its slot ({p.offset}+{p.nbytes} > {self.ring.slot_bytes})"
                )
        return views_at(base, parts)

    def slot_tensor(self, slot: int) -> torch.Tensor:
        """The whole of ``slot`` as a uint8 tensor (no copy), with a storage of its own so
        :meth:`in_use` can tell when no tensor of a batch delivered in it is left."""
        t = self._slots.get(slot)
        if t is None:
            start = slot_start(slot, self.ring.slots, self.ring.slot_bytes)
            end = start + self.ring.slot_bytes
            t = self._slots[slot] = torch.from_numpy(self._buf[start:end])
        return t

    def in_use(self, slot: int) -> bool:
        """Whether a tensor other than the ring's own still reads ``slot`` (True when torch
        cannot say)."""
        users = storage_users(self.slot_tensor(slot))
        return users is None or users > 1

    def pin(
        self, register: Callable[[np.ndarray], bool], unregister: Callable[[np.ndarray], None]
    ) -> bool:
        """Register the mapping for DMA once (``register``); ``unregister`` runs at close."""
        if self.registered is None:
            self.registered = register(self._buf)
            if self.registered:
                self.on_close = unregister
        return self.registered

    def slot_memory(self) -> np.ndarray:
        """The whole mapping as bytes (for registering it with CUDA once per stream)."""
        return self._buf

    def close(self) -> None:
        if self.on_close is not None and self._mm is not None:
            self.on_close(self._buf)
            self.on_close = None
        self._buf = np.empty(0, dtype=np.uint8)
        self._slots.clear()
        self.ledger.clear()
        if self._mm is not None:
            # A zero-copy tensor may still point into the ring; the mapping then dies with it.
            with contextlib.suppress(BufferError):
                self._mm.close()
            self._mm = None


class RingCache:
    """The one ring mapping a Loader keeps across its streams: the server hands a client's
    ring to its next stream (next epoch, resume), so the mapping, its faulted-in pages and
    its CUDA registration carry over too."""

    def __init__(self) -> None:
        self.ring: AttachedRing | None = None

    def attach(self, info: ShmRing) -> AttachedRing:
        if self.ring is not None and self.ring.ring == info:
            return self.ring
        self.close()
        self.ring = AttachedRing(info)
        return self.ring

    def close(self) -> None:
        if self.ring is not None:
            self.ring.close()
            self.ring = None
