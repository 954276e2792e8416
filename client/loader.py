"""``Loader``: the iterator a training loop uses. Small on purpose; the wire protocol is in
:mod:`.stream`, tensors in :mod:`.buffers` and :mod:`.device`, HTTP in :mod:`.control`."""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from shardserve.proto.errors import BadRequest, ShardserveError
from shardserve.proto.jobs import JobSpec, ShuffleMode, job_id
from shardserve.proto.messages import MAX_CREDIT, BatchHeader, Hello

from .buffers import COUNTS_USERS, CopyBlocks, assemble, tensor_from_frame
from .connection import Connection, choose_endpoint, read_boot_id
from .control import ControlClient, JobHandle
from .device import (
    DeviceCopier,
    register_host_memory,
    resolve_device,
    unregister_host_memory,
)
from .distributed import resolve_world
from .shm import RingCache
from .state import parse_state
from .stats import StatsClock
from .stream import EpochStream
from .types import Batch, LoaderStats

STATE_VERSION = 1
_SHUFFLE: dict[object, ShuffleMode] = {
    True: "global",
    False: "none",
    "global": "global",
    "block": "block",
    "none": "none",
}


class Loader:
    """Pre-collated batches of ``dataset`` from a shardserve server, for this rank.

    >>> loader = Loader("http://127.0.0.1:7070", dataset="cifar10", batch_size=256)  # doctest: +SKIP
    >>> for epoch in range(3):                                                     # doctest: +SKIP
    ...     loader.set_epoch(epoch)
    ...     for batch in loader:                    # dict[str, torch.Tensor | VarTensor]
    ...         train_step(batch["image"], batch["label"])
    >>> loader.stats().stall_fraction                                              # doctest: +SKIP
    0.02

    Epochs: ``set_epoch(e)`` chooses the next iteration's epoch. Without it, the first
    iteration uses the job's epoch (``PUT /v1/jobs/{id}/epoch``) and each later one advances,
    so a forgotten ``set_epoch`` never repeats an order. ``state_dict()`` records the epoch in
    progress and the next batch the loop has not received; ``load_state_dict()`` makes the
    next iteration yield exactly the rest of that epoch.

    Every wait is bounded by ``timeout``: a stalled stream raises ``DataStallError``, a
    server-side failure raises its typed error (``DatasetCorruptError``, ``JobFailed``...).
    A server restart is survived: the stream is re-opened at the next undelivered batch.

    Arguments: ``shuffle`` True/False or ``"global"``/``"block"``/``"none"``; ``fields``
    limits and orders the fields served; ``rank``/``world_size`` default to
    ``torch.distributed``, then ``RANK``/``WORLD_SIZE``, then 0/1; ``device="cuda"`` copies
    through pinned buffers on a side stream to this rank's GPU (``LOCAL_RANK``); ``prefetch``
    is the credit: batches in flight or queued, bounding memory on both sides; ``timeout``
    the longest wait for one batch; ``token`` (or ``SHARDSERVE_TOKEN``) the server's bearer
    token; ``transport`` ``"auto"`` (shared-memory slots on the same host, falling back to
    ipc, then tcp), ``"socket"`` (ipc or tcp, never shared memory), ``"ipc"`` or ``"tcp"``;
    ``pad_variable`` pads variable fields to dense tensors plus ``x.lengths`` instead of
    :class:`VarTensor`.

    ``copy`` (shared-memory transport only): by default each delivered batch owns its storage.
    It is handed out in place, in its shared-memory slot, and the slot goes back to the server
    once no tensor of that batch is left (torch's storage use count, checked at each ``next``);
    while the loop still holds half the ring's batches, further batches are copied out instead
    so the server never runs out of slots (counted in ``stats().copied``). ``copy=False``
    yields views into the slot that are valid only until the next batch is requested (the
    slot is then handed back and refilled whatever still points into it), so use or copy them
    within the loop body. With ``device="cuda"`` the copy into pinned memory is the copy.
    """

    def __init__(
        self,
        url: str,
        dataset: str,
        batch_size: int,
        seed: int = 0,
        shuffle: bool | str = True,
        drop_last: bool = False,
        fields: Sequence[str] | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        device: str | torch.device = "cpu",
        prefetch: int = 4,
        timeout: float = 60.0,
        token: str | None = None,
        transport: str = "auto",
        pad_variable: bool = False,
        copy: bool = True,
    ) -> None:
        self._closed = True  # until the sockets exist, close() has nothing to do
        if shuffle not in _SHUFFLE:
            raise BadRequest(f"shuffle={shuffle!r}: use True, False, 'global', 'block' or 'none'")
        if not 1 <= prefetch <= MAX_CREDIT:
            raise BadRequest(f"prefetch={prefetch} is out of range 1 <= prefetch <= {MAX_CREDIT}")
        if not timeout > 0:
            raise BadRequest(f"timeout={timeout} must be a positive number of seconds")
        self.world = resolve_world(rank, world_size)
        self.spec = JobSpec(
            dataset=dataset, batch_size=batch_size, seed=seed, shuffle=_SHUFFLE[shuffle],
            drop_last=drop_last, world_size=self.world.world_size,
            fields=tuple(fields) if fields is not None else None,
        )  # fmt: skip
        self.job_id = job_id(self.spec)
        self.device = resolve_device(device, self.world.local_rank)
        self.prefetch, self.timeout, self.pad_variable = prefetch, timeout, pad_variable
        self.copy = copy
        self._shm = transport == "auto"
        self._held_slot: tuple[EpochStream, int] | None = None
        # Slots being copied to the GPU straight from shared memory, freed when their event is.
        self._copying: list[tuple[Any, EpochStream, int]] = []
        self._rings = RingCache()
        self._blocks = CopyBlocks()
        self._token = token or os.environ.get("SHARDSERVE_TOKEN") or ""
        # A server that is restarting refuses connections for a moment: retry within timeout.
        self._api = ControlClient(
            url, self._token or None, timeout=min(timeout, 10.0), connect_retry_s=timeout
        )
        self._stats = StatsClock()
        try:
            created = self._api.create_job(self.spec)
            # The server is up; later calls run inside a stream's own deadline, so no retries.
            self._api.connect_retry_s = 0.0
            self._job_epoch = created.status.epoch
            self._num_batches = created.status.batches_per_epoch
            endpoint = choose_endpoint(self._api.info(), self._api.host, transport)
        except BaseException:
            self._api.close()
            raise
        self._conn = Connection(endpoint)
        # The stream calls back into this, not into the Loader: no cycle keeps a dropped Loader alive.
        self._job = JobHandle(self._api, self.spec)
        self._closed = False
        self._copier = DeviceCopier(self.device)
        self._boot_id = read_boot_id()
        # (epoch, start batch) for the next iteration, from set_epoch / load_state_dict.
        self._pending: tuple[int, int] | None = None
        self._epoch: int | None = None  # epoch of the current or last iteration
        self._next_batch = 0
        self._epoch_done = False
        # Open the first epoch's stream now: batches are on their way before the loop asks.
        self._stream: EpochStream | None = self._open(self._job_epoch, 0)
        self._active: EpochStream | None = None
        self._atexit = functools.partial(_close_ref, weakref.ref(self))
        atexit.register(self._atexit)

    # -- epochs and resume -----------------------------------------------------------------

    def set_epoch(self, epoch: int) -> None:
        """The epoch the next iteration streams (like ``DistributedSampler.set_epoch``).

        A position restored by ``load_state_dict`` for the same epoch is kept.
        """
        if epoch < 0:
            raise BadRequest(f"epoch {epoch} must be >= 0")
        start = self._pending[1] if self._pending and self._pending[0] == epoch else 0
        self._pending = (epoch, start)

    def __len__(self) -> int:
        """Batches per epoch for this rank."""
        return self._num_batches

    def state_dict(self) -> dict[str, Any]:
        """Where the loop is: the epoch in progress and the next batch it has not received."""
        if self._pending is not None:
            epoch, nxt = self._pending
        elif self._epoch is None:
            epoch, nxt = self._job_epoch, 0
        elif self._epoch_done:
            epoch, nxt = self._epoch + 1, 0
        else:
            epoch, nxt = self._epoch, self._next_batch
        return {
            "version": STATE_VERSION, "spec": self.spec.model_dump(mode="json"), "epoch": epoch,
            "next_batch": nxt, "rank": self.world.rank, "world_size": self.world.world_size,
        }  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Make the next iteration start where ``state`` left off (``BadRequest`` naming the
        problem if ``state`` is damaged or belongs to another job, rank or version)."""
        st = parse_state(state, STATE_VERSION)
        if st.spec != self.spec:
            raise BadRequest(f"state is for job {st.spec!r}, this loader serves {self.spec!r}")
        if (st.rank, st.world_size) != (self.world.rank, self.world.world_size):
            raise BadRequest(
                f"state is for rank {st.rank} of {st.world_size}, this loader is rank "
                f"{self.world.rank} of {self.world.world_size}"
            )
        if st.next_batch > self._num_batches:
            raise BadRequest(
                f"state next_batch {st.next_batch} out of range 0 <= next_batch <= "
                f"{self._num_batches} (batches per epoch of this rank)"
            )
        self._pending = (st.epoch, st.next_batch)

    def _next_position(self) -> tuple[int, int]:
        if self._pending is not None:
            pos, self._pending = self._pending, None
            return pos
        if self._epoch is None:
            return self._job_epoch, 0
        # The control plane's epoch is advice; the stream itself reports real trouble.
        with contextlib.suppress(ShardserveError):
            self._job_epoch = self._api.job(self.job_id, timeout=min(self.timeout, 2.0)).epoch
        return max(self._epoch + 1, self._job_epoch), 0

    # -- iteration -------------------------------------------------------------------------

    def _open(self, epoch: int, start: int) -> EpochStream:
        hello = Hello(
            job=self.job_id, rank=self.world.rank, epoch=epoch, start_batch=start, credit=self.prefetch,
            token=self._token, transport="auto" if self._shm else "socket",
            boot_id=self._boot_id, pid=os.getpid(),
        )  # fmt: skip
        return EpochStream(
            self._conn, hello=hello, timeout=self.timeout, stats=self._stats,
            recreate_job=self._job.recreate, describe=self._job.describe, rings=self._rings,
        )  # fmt: skip

    def __iter__(self) -> Iterator[Batch]:
        if self._closed:
            raise RuntimeError("this Loader is closed")
        epoch, start = self._next_position()
        stream = self._stream
        self._stream = None
        if (
            stream is None
            or stream.epoch != epoch
            or stream.hello.start_batch != start
            or stream.next_index != start
        ):
            stream = self._open(epoch, start)
        self._epoch, self._next_batch, self._epoch_done = epoch, start, False
        self._active = stream
        return self._run(stream)

    def _run(self, stream: EpochStream) -> Iterator[Batch]:
        try:
            while True:
                if self._closed:
                    raise RuntimeError("this Loader was closed while iterating")
                if self._active is not stream:
                    # Both would read one socket: the newer iterator would lose batches to this one.
                    raise RuntimeError(
                        "this iterator was replaced by a newer iter(loader); use that one"
                    )
                self._return_held_slot(stream)
                t0 = self._stats.start_wait()
                item = stream.next()
                if item is None:
                    break
                header, frames = item
                if stream.welcome is not None:
                    self._num_batches = stream.welcome.num_batches
                if header.slot >= 0:
                    batch = self._from_slot(stream, header)
                else:
                    parts = {
                        p.name: tensor_from_frame(p, f)
                        for p, f in zip(header.parts, frames, strict=True)
                    }
                    batch = self._copier.to_device(parts, self.pad_variable)
                self._next_batch = header.index + 1
                self._stats.delivered(t0, header.nbytes)
                stream.consumed()
                yield batch
            self._epoch_done = True
        finally:
            self._stats.pause()

    def _from_slot(self, stream: EpochStream, header: BatchHeader) -> Batch:
        """A batch read from its shared-memory slot: lent in place until its tensors are gone,
        copied out (slot back at once) when half the ring is lent, or, with ``copy=False``,
        views kept until the next batch is requested."""
        ring = stream.ring
        assert ring is not None
        views = ring.views(header.slot, header.parts)
        if self.copy and not self._copier.cuda:
            # At most half the ring is lent, so the server always has a slot to fill (a
            # ring of one is never lent).
            if len(ring.owned) < ring.ring.slots // 2 and COUNTS_USERS:
                # Lent in place: the batch owns the slot until its last tensor is gone.
                ring.owned.add(header.slot)
                return assemble(views, self.pad_variable)
            self._stats.copied += 1
            copied = self._blocks.copy_slot(ring.slot_tensor(header.slot), header.parts)
            if copied is not None:
                stream.release_slot(header.slot)
                return assemble(copied, self.pad_variable)
        if self._copier.cuda:
            if ring.registered is None:
                ring.registered = register_host_memory(ring.slot_memory())
                if ring.registered:
                    ring.on_close = unregister_host_memory
            if ring.registered:
                batch, done = self._copier.to_device_direct(views, self.pad_variable)
                self._copying.append((done, stream, header.slot))
                return batch
            # Staging into pinned memory is synchronous: the slot is free once it returns.
            batch = self._copier.to_device(views, self.pad_variable)
        elif self.copy:
            batch = assemble(self._blocks.copy_out(views), self.pad_variable)
        else:
            self._held_slot = (stream, header.slot)
            return assemble(views, self.pad_variable)
        stream.release_slot(header.slot)
        return batch

    def _return_held_slot(self, stream: EpochStream) -> None:
        ring = stream.ring
        if ring is not None and ring.owned:
            for slot in [k for k in ring.owned if not ring.in_use(k)]:
                ring.owned.discard(slot)
                stream.release_slot(slot)
        if self._copying:
            still = []
            for done, stream, slot in self._copying:
                if done.query():
                    stream.release_slot(slot)
                else:
                    still.append((done, stream, slot))
            self._copying = still
        if self._held_slot is not None:
            stream, slot = self._held_slot
            self._held_slot = None
            stream.release_slot(slot)

    # -- lifecycle -------------------------------------------------------------------------

    def stats(self) -> LoaderStats:
        """Batches, bytes and time spent waiting vs. computing since construction."""
        active = self._active or self._stream
        return self._stats.snapshot(active.transport if active else self._conn.transport)

    def close(self) -> None:
        """Say Bye, close the socket and the HTTP client; idempotent."""
        if self._closed:
            return
        self._closed = True
        for s in (self._stream, self._active):
            if s is not None:
                s.close()
        self._stream = self._active = None
        self._held_slot = None
        self._copying = []
        self._rings.close()
        atexit.unregister(self._atexit)
        self._conn.close()
        self._api.close()

    def __enter__(self) -> Loader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_closed", True) is False:
            self.close()

    def __repr__(self) -> str:
        return (
            f"Loader(job={self.job_id}, dataset={self.spec.dataset!r}, rank={self.world.rank}/"
            f"{self.world.world_size}, epoch={self._epoch}, endpoint={self._conn.endpoint!r})"
        )


def _close_ref(ref: weakref.ReferenceType[Loader]) -> None:
    loader = ref()
    if loader is not None:
        loader.close()
