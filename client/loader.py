"""``Loader``: the iterator a training loop uses. Small on purpose; the wire protocol is in
:mod:`.stream`, tensors in :mod:`.buffers` and :mod:`.device`, HTTP in :mod:`.control`."""

from __future__ import annotations

import atexit
import functools
import os
import weakref
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from shardserve.proto.errors import BadRequest
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
from .resident import Resident, field_layout, resident_nbytes
from .shm import RingCache
from .state import parse_state
from .stats import StatsClock
from .stream import EpochStream
from .structure import rebuild_for
from .types import Batch, LoaderStats

STATE_VERSION = 1
#: Resident mode loads the dataset in batches of about this many bytes.
RESIDENT_CHUNK_BYTES = 16 << 20
MAX_RESIDENT_CHUNK = 1 << 16
MAX_ENVS = 1024
#: Where ``Loader(None, ...)`` looks without ``SHARDSERVE_URL``: the node-local sidecar.
DEFAULT_URL = "http://127.0.0.1:7070"
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

    Epochs are the trainer's: ``set_epoch(e)`` chooses the next iteration's epoch. Without
    it, a new Loader starts at epoch 0 (or at the epoch an operator set with
    ``PUT /v1/jobs/{id}/epoch``), and ``iter()`` moves on to the next epoch only after a pass
    that yielded batches (completed or abandoned), so a forgotten ``set_epoch`` never repeats
    an order and an ``iter()`` that only checks the object (as Lightning does) moves nothing.
    Two runs of the same script see the same batches. ``state_dict()`` records the epoch in
    progress and the next batch the loop has not received (at an epoch's end: the next epoch,
    batch 0); ``load_state_dict()`` makes the next iteration yield exactly the rest.

    Every wait is bounded by ``timeout``: a stalled stream raises ``DataStallError``, a
    server-side failure raises its typed error (``DatasetCorruptError``, ``JobFailed``...).
    A server restart is survived: the stream is re-opened at the next undelivered batch.

    Arguments: ``url`` ``None`` means ``SHARDSERVE_URL``, else ``http://127.0.0.1:7070`` (one
    sidecar per node: each rank talks to its own node's); ``shuffle`` True/False or ``"global"``/``"block"``/``"none"``; ``fields``
    limits and orders the fields served; ``rank``/``world_size`` default to
    ``torch.distributed``, then ``RANK``/``WORLD_SIZE``, then 0/1; ``device="cuda"`` copies
    through pinned buffers on a side stream to this rank's GPU (``LOCAL_RANK``); ``prefetch``
    is the credit: batches in flight or queued, bounding memory on both sides; ``timeout``
    the longest wait for one batch; ``token`` (or ``SHARDSERVE_TOKEN``) the server's bearer
    token; ``transport`` ``"auto"`` (shared-memory slots on the same host, falling back to
    ipc, then tcp), ``"socket"`` (ipc or tcp, never shared memory), ``"ipc"`` or ``"tcp"``;
    ``pad_variable`` pads variable fields to dense tensors plus ``x.lengths`` instead of
    :class:`VarTensor`; ``transforms=[{"name": ..., "params": {...}}, ...]`` runs transforms
    installed on the server on every batch (``on_error="replace"`` swaps a sample whose
    transform raises for a deterministic other one; a failure raises ``TransformError``);
    ``collate="graph"`` has the server collate graphs for message passing
    (see :mod:`.graphs`).

    Nested datasets come back in the shape their samples were saved in (``batch["params"]
    ["nu"]``, a tuple ``(images, labels)``), and a field missing in some samples as
    :class:`~.structure.Masked` (see :mod:`.structure`).

    ``resident="cuda"`` (or ``"cpu"``) loads the dataset's fields once into that memory (one
    store-order pass through the server; refused up front when it does not fit), after which
    the server sends only each epoch's plan and every batch is an ``index_select`` into fresh
    storage: the same batches, order and ``state_dict`` as streaming, for data that fits.
    ``envs=n`` (resident only) yields a list of ``n`` batches per step, environment ``e`` from
    its own deterministic plan, on ``devices[e % len(devices)]``.

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
        url: str | None,
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
        resident: str | None = None,
        envs: int = 1,
        devices: Sequence[str | torch.device] | None = None,
        collate: str | None = None,
        transforms: Sequence[Mapping[str, Any]] | None = None,
        on_error: str | None = None,
    ) -> None:
        self._closed = True  # until the sockets exist, close() has nothing to do
        if shuffle not in _SHUFFLE:
            raise BadRequest(f"shuffle={shuffle!r}: use True, False, 'global', 'block' or 'none'")
        if not 1 <= prefetch <= MAX_CREDIT:
            raise BadRequest(f"prefetch={prefetch} is out of range 1 <= prefetch <= {MAX_CREDIT}")
        if not timeout > 0:
            raise BadRequest(f"timeout={timeout} must be a positive number of seconds")
        if transforms is not None and resident is not None:
            raise BadRequest("resident mode holds the stored fields; it cannot run transforms")
        self.world = resolve_world(rank, world_size)
        self.spec = JobSpec(
            dataset=dataset, batch_size=batch_size, seed=seed, shuffle=_SHUFFLE[shuffle],
            drop_last=drop_last, world_size=self.world.world_size,
            fields=tuple(fields) if fields is not None else None,
            **({"collate": collate} if collate is not None else {}),
            # Issue 15: transforms installed on the server, named with JSON params.
            **({"transforms": tuple(transforms)} if transforms is not None else {}),
            **({"on_error": on_error} if on_error is not None else {}),
        )  # fmt: skip
        self.job_id = job_id(self.spec)
        self.device = resolve_device(device, self.world.local_rank)
        env_devices = _env_devices(resident, envs, devices, self.device, self.world.local_rank)
        self.prefetch, self.timeout, self.pad_variable = prefetch, timeout, pad_variable
        self.copy = copy
        self._shm = transport == "auto"
        self._held_slot: tuple[EpochStream, int] | None = None
        self._rings = RingCache()
        self._blocks = CopyBlocks()
        self._token = token or os.environ.get("SHARDSERVE_TOKEN") or ""
        # None: this node's sidecar, as the launcher set it (SHARDSERVE_URL) or the default.
        url = url or os.environ.get("SHARDSERVE_URL") or DEFAULT_URL
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
            self._rebuild = rebuild_for(self._api, self.spec, pad_variable)
        except BaseException:
            self._api.close()
            raise
        self._conn = Connection(endpoint)
        # The stream calls back into this, not into the Loader: no cycle keeps a dropped Loader alive.
        self._job = JobHandle(self._api, self.spec)
        self._closed = False
        self._copier = DeviceCopier(self.device)
        self._boot_id = read_boot_id()
        # (epoch, start batch) for the next iteration, from set_epoch / load_state_dict, or
        # that of an iteration which has not yielded yet (an iter() that moved nothing).
        self._pending: tuple[int, int] | None = None
        self._epoch: int | None = None  # epoch of the current or last iteration
        self._next_batch = 0
        self._epoch_done = False
        self._pass = 0  # which iter() the live generator belongs to
        self._resident: Resident | None = None
        self.envs = envs
        self._active: EpochStream | None = None
        self._stream: EpochStream | None = None
        self._atexit = functools.partial(_close_ref, weakref.ref(self))
        atexit.register(self._atexit)
        if env_devices:
            try:
                self._resident = self._load_resident(url, env_devices)
            except BaseException:
                self.close()
                raise
        else:
            # Open the first epoch's stream now: batches are on their way before the loop asks.
            self._stream = self._open(self._job_epoch, 0)

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
        """Where the loop is: the epoch in progress and the next batch it has not received;
        after an epoch's last batch, the start of the next epoch."""
        if self._pending is not None:
            epoch, nxt = self._pending
        elif self._epoch is None:
            epoch, nxt = self._job_epoch, 0
        elif self._epoch_done or self._next_batch >= self._num_batches:
            epoch, nxt = self._epoch + 1, 0
        else:
            epoch, nxt = self._epoch, self._next_batch
        return {
            "version": STATE_VERSION, "spec": self.spec.model_dump(mode="json"), "epoch": epoch,
            "next_batch": nxt, "rank": self.world.rank, "world_size": self.world.world_size,
        }  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Make the next iteration start where ``state`` left off: a state of any rank of the
        same world size (DDP ranks share their position); ``BadRequest`` naming the problem if
        ``state`` is damaged or belongs to another job, world size or version."""
        st = parse_state(state, STATE_VERSION)
        if st.spec != self.spec:
            raise BadRequest(f"state is for job {st.spec!r}, this loader serves {self.spec!r}")
        # Another rank's state of the same world is accepted: DDP ranks step together, so
        # their positions are equal, and a checkpoint (Lightning's) holds rank 0's only.
        if st.world_size != self.world.world_size:
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
        # Kept until the iteration yields: an iter() that is dropped unused moves nothing.
        if self._pending is None:
            if self._epoch is None:
                self._pending = (self._job_epoch, 0)
            else:  # the last iteration yielded batches or ended its epoch
                self._pending = (self._epoch + 1, 0)
        return self._pending

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

    def _load_resident(self, url: str, env_devices: list[torch.device]) -> Resident:
        """Stream the dataset once in store order (its own job) into resident tensors."""
        info = self._api.dataset(self.spec.dataset, timeout=self.timeout)
        layout = field_layout(info, self.spec.fields)
        sample = max(1, resident_nbytes(layout, 1))
        chunk = max(1, min(RESIDENT_CHUNK_BYTES // sample, MAX_RESIDENT_CHUNK, info.num_samples))

        def one_pass() -> Iterator[Batch]:
            with Loader(
                url, self.spec.dataset, batch_size=chunk, shuffle="none", rank=0, world_size=1,
                fields=list(layout), timeout=self.timeout, token=self._token or None,
                transport="auto" if self._shm else "socket",
            ) as source:  # fmt: skip
                source._rebuild = None  # resident tensors hold the flat, stored fields
                source.set_epoch(0)
                yield from source

        return Resident.load(
            self._api, self.job_id, self.world.rank, self.spec.batch_size, info, layout,
            env_devices, one_pass, self.timeout,
        )  # fmt: skip

    def __iter__(self) -> Iterator[Batch]:
        if self._closed:
            raise RuntimeError("this Loader is closed")
        epoch, start = self._next_position()
        if self._resident is not None:
            self._epoch, self._next_batch, self._epoch_done = epoch, start, False
            self._pass += 1
            return self._run_resident(self._resident, self._pass, (epoch, start))
        # The stream opened ahead, or that of an iteration that never delivered (an iter() to
        # check the object): both still hold their batches for the loop.
        stream = self._stream or self._active
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
        self._pass += 1
        return self._run(stream, self._pass, (epoch, start))

    def _run(self, stream: EpochStream, this_pass: int, pos: tuple[int, int]) -> Iterator[Batch]:
        try:
            while True:
                if self._closed:
                    raise RuntimeError("this Loader was closed while iterating")
                if self._pass != this_pass:
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
                if self._pending == pos:
                    self._pending = None  # begun: the next iter() moves on
                yield self._rebuild(batch) if self._rebuild is not None else batch
            if self._pending == pos:
                self._pending = None
            self._epoch_done = True
        finally:
            self._stats.pause()

    def _run_resident(
        self, resident: Resident, this_pass: int, pos: tuple[int, int]
    ) -> Iterator[Any]:
        epoch, start = pos
        plans = resident.epoch(epoch)
        self._num_batches = plans[0].num_batches
        nbytes = resident.sample_nbytes * self.spec.batch_size * len(plans)
        try:
            for i in range(start, self._num_batches):
                if self._closed:
                    raise RuntimeError("this Loader was closed while iterating")
                if self._pass != this_pass:
                    raise RuntimeError(
                        "this iterator was replaced by a newer iter(loader); use that one"
                    )
                t0 = self._stats.start_wait()
                batches = [p.batch(i) for p in plans]
                if self._rebuild is not None:
                    batches = [self._rebuild(b) for b in batches]
                self._next_batch = i + 1
                self._stats.delivered(t0, nbytes)
                if self._pending == pos:
                    self._pending = None  # begun: the next iter() moves on
                yield batches if self.envs > 1 else batches[0]
            if self._pending == pos:
                self._pending = None
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
                # Owned until the copy is done, so a new stream (next epoch) keeps it too.
                ring.lend_to_copy(header.slot, done)
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
            if len(ring.owned) >= ring.ring.slots:
                # Every slot is held, some by device copies still queued behind the consumer's
                # stream: the server has none to fill, so wait for the oldest copy.
                ring.wait_oldest_copy()
            for slot in [k for k in ring.owned if not ring.in_use(k)]:
                ring.owned.discard(slot)
                stream.release_slot(slot)
        if self._held_slot is not None:
            stream, slot = self._held_slot
            self._held_slot = None
            stream.release_slot(slot)

    # -- lifecycle -------------------------------------------------------------------------

    def stats(self) -> LoaderStats:
        """Batches, bytes and time spent waiting vs. computing since construction."""
        if self._resident is not None:
            return self._stats.snapshot("resident")
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
        if self._resident is not None:
            self._resident.close()
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


def _env_devices(
    resident: str | None,
    envs: int,
    devices: Sequence[str | torch.device] | None,
    device: torch.device,
    local_rank: int,
) -> list[torch.device]:
    """The device of every environment in resident mode; empty when streaming."""
    if not 1 <= envs <= MAX_ENVS:
        raise BadRequest(f"envs={envs} is out of range 1 <= envs <= {MAX_ENVS}")
    if resident is None:
        if envs > 1 or devices is not None:
            raise BadRequest(
                "envs and devices need resident='cuda' or resident='cpu' (the data held by the "
                "trainer); streaming hands out one batch per step"
            )
        return []
    if resident not in ("cuda", "cpu"):
        raise BadRequest(f"resident={resident!r}: use 'cuda', 'cpu' or None (streaming)")
    default = device if device.type == resident else torch.device(resident)
    resolved = [resolve_device(d, local_rank) for d in (devices or [default])]
    wrong = [str(d) for d in resolved if d.type != resident]
    if wrong:
        raise BadRequest(f"devices {wrong} do not match resident={resident!r}")
    return [resolved[e % len(resolved)] for e in range(envs)]


def _close_ref(ref: weakref.ReferenceType[Loader]) -> None:
    loader = ref()
    if loader is not None:
        loader.close()
