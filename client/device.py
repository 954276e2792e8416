"""Moving a received batch to a CUDA device without stalling the consumer's stream.

Host data is first copied into a pinned buffer from :class:`PinnedPool`, then copied to the
device with ``non_blocking=True`` on a side stream, overlapping whatever the consumer's stream
is still computing; the consumer's current stream waits on an event recorded after the
copies, and the pinned buffer goes back to the pool with that event, so it is refilled only
after its copy finished. A shared-memory slot ring can skip the staging copy: registered
once per stream with ``cudaHostRegister``, its slots are copied from directly, and a slot goes
back to the server only after its copy event completed. Everything here is guarded by
``torch.cuda.is_available()``; on the CPU a batch passes through untouched.
"""

from __future__ import annotations

import contextlib
import logging

import numpy as np
import torch

from shardserve.proto.errors import BadRequest

from ._frames import assemble, check_variable
from ._ledger import Event
from ._staging import PinnedPool, pack_into
from .types import Batch

log = logging.getLogger(__name__)


def resolve_device(device: str | torch.device, local_rank: int) -> torch.device:
    """``"cuda"`` means this process's GPU (``LOCAL_RANK``); a CUDA device needs CUDA.

    >>> resolve_device("cpu", 3)
    device(type='cpu')
    """
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            why = "a CPU-only build" if torch.version.cuda is None else "no GPU visible"
            raise BadRequest(
                f"device={str(device)!r} but torch.cuda.is_available() is False (torch "
                f"{torch.__version__}: {why}): use device='cpu', or pick at run time with "
                "device = 'cuda' if torch.cuda.is_available() else 'cpu'"
            )
        if dev.index is None:
            dev = torch.device("cuda", local_rank % max(1, torch.cuda.device_count()))
    elif dev.type != "cpu":
        raise BadRequest(f"device {str(device)!r} is not supported: use 'cpu' or 'cuda[:N]'")
    return dev


def register_host_memory(buf: np.ndarray) -> bool:
    """Page-lock ``buf`` for DMA (``cudaHostRegister`` through torch), so host-to-device copies
    read it directly. ``False`` without CUDA or when the driver refuses; callers then stage
    through pinned buffers instead."""
    if not torch.cuda.is_available() or buf.nbytes == 0:
        return False
    try:
        err = torch.cuda.cudart().cudaHostRegister(buf.ctypes.data, buf.nbytes, 0)
    except (RuntimeError, AttributeError) as e:
        log.info("cudaHostRegister unavailable (%s); staging through pinned buffers", e)
        return False
    return int(err) == 0


def unregister_host_memory(buf: np.ndarray) -> None:
    """Undo :func:`register_host_memory` once every copy from ``buf`` has finished."""
    torch.cuda.synchronize()
    with contextlib.suppress(RuntimeError, AttributeError):
        torch.cuda.cudart().cudaHostUnregister(buf.ctypes.data)


class DeviceCopier:
    """Turns a batch's CPU parts into tensors on ``device``."""

    def __init__(self, device: torch.device, pool: PinnedPool | None = None) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.pool = pool if pool is not None else PinnedPool(pin=self.cuda)
        self._stream = torch.cuda.Stream(device=device) if self.cuda else None

    def stage(self, parts: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Copy every part into one pooled host buffer (64-byte aligned slices)."""
        return pack_into(self.pool.acquire, parts)

    def to_device(self, parts: dict[str, torch.Tensor], pad_variable: bool = False) -> Batch:
        """The batch on ``self.device``; on the CPU, ``parts`` assembled as they are."""
        if not self.cuda:
            return assemble(parts, pad_variable)
        check_variable(parts)  # here, on the CPU: on the device it would cost a sync
        block, staged = self.stage(parts)
        assert self._stream is not None
        consumer = torch.cuda.current_stream(self.device)
        # No wait for the consumer's queued work: the copy overlaps it. Destinations are fresh
        # allocations (the allocator's record_stream bookkeeping keeps them apart), and the
        # host block is reused only after ``done``.
        with torch.cuda.stream(self._stream):
            moved = {k: v.to(self.device, non_blocking=True) for k, v in staged.items()}
            done = torch.cuda.Event()
            done.record(self._stream)
        consumer.wait_event(done)
        for t in moved.values():
            # Allocated on the side stream, used on the consumer's: keep the allocator honest.
            t.record_stream(consumer)
        self.pool.release(block, done)
        return assemble(moved, pad_variable)

    def to_device_direct(
        self, parts: dict[str, torch.Tensor], pad_variable: bool = False
    ) -> tuple[Batch, Event]:
        """Copy straight from page-locked host memory (a registered shm slot), no staging.

        Returns the batch and the event after which the host memory may be reused.
        """
        assert self._stream is not None
        check_variable(parts)
        consumer = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self._stream):
            moved = {k: v.to(self.device, non_blocking=True) for k, v in parts.items()}
            done = torch.cuda.Event()
            done.record(self._stream)
        consumer.wait_event(done)
        for t in moved.values():
            t.record_stream(consumer)
        return assemble(moved, pad_variable), done
