"""``Loader``: the iterator a training loop uses. Small on purpose; the wire protocol is in
:mod:`.stream`, one iteration in :mod:`._passes`, how a batch becomes tensors in
:mod:`._delivery`, slot ownership in :mod:`._ledger`, HTTP in :mod:`.control`."""

from __future__ import annotations

import atexit
import functools
import os
import weakref
from collections.abc import Iterator, Mapping, Sequence
from copy import deepcopy
from typing import Any

import torch

from shardserve.proto.errors import BadRequest
from shardserve.proto.jobs import job_id, rank_plan_size
from shardserve.proto.messages import MAX_GROUP, Hello

from ._delivery import Delivery, Unpacking
from ._passes import ResidentPass, StreamPass
from ._position import Position, Start
from ._spec import auto_prefetch, check_args, loader_spec
from ._staging import CopyBlocks
from .connection import Connection, choose_endpoint, read_boot_id
from .control import ControlClient, JobHandle
from .device import DeviceCopier, resolve_device
from .distributed import resolve_world
from .envs import check_env_fields
from .resident import Resident, env_devices, field_layout, resident_nbytes, stream_env_devices
from .shm import RingCache
from .state import check_same_job, make_state, parse_states, start_for
from .stats import StatsClock
from .stream import EpochStream
from .structure import rebuild_for
from .types import Batch, LoaderStats

#: Resident mode loads the dataset in batches of about this many bytes.
RESIDENT_CHUNK_BYTES = 16 << 20
MAX_RESIDENT_CHUNK = 1 << 16
#: Where ``Loader(None, ...)`` looks without ``SHARDSERVE_URL``: the node-local sidecar.
DEFAULT_URL = "http://127.0.0.1:7070"


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
    is the credit: batches in flight or queued, bounding memory on both sides (default: 4,
    or up to 64 small batches, about 8 MiB; small batches then travel several to a message,
    see ``stats().messages``); ``timeout``
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
    ``envs=n`` yields a list of ``n`` batches per step, environment ``e`` from its own
    deterministic plan, on ``devices[e % len(devices)]``, each with storage of its own; while
    streaming, one step is one message (fixed-shape fields only).

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
        prefetch: int | None = None,
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
        check_args(shuffle, prefetch, timeout)
        if transforms is not None and resident is not None:
            raise BadRequest("resident mode holds the stored fields; it cannot run transforms")
        self.world = resolve_world(rank, world_size)
        self.device = resolve_device(device, self.world.local_rank)
        envs_on = env_devices(resident, envs, devices, self.device, self.world.local_rank)
        # Streaming envs (issue 22): one job whose batches are steps of `envs` env batches.
        self._step_envs = (
            stream_env_devices(envs, devices, self.device, self.world.local_rank)
            if resident is None and envs > 1
            else []
        )
        per_step = len(self._step_envs) or 1
        self.spec = loader_spec(
            dataset, batch_size, seed=seed, shuffle=shuffle, drop_last=drop_last,
            world_size=self.world.world_size, fields=fields, collate=collate, envs=per_step,
            transforms=transforms, on_error=on_error,
        )  # fmt: skip
        self.job_id = job_id(self.spec)
        # Serialized once: state_dict() must not run pydantic while a Ctrl-C may land.
        self._spec_dump = self.spec.model_dump(mode="json")
        self.prefetch = prefetch or 4  # None: set from the dataset by _create_job
        self.timeout, self.pad_variable = timeout, pad_variable
        self.copy = copy
        self.envs = envs
        self._shm = transport == "auto"
        self._token = token or os.environ.get("SHARDSERVE_TOKEN") or ""
        # None: this node's sidecar, as the launcher set it (SHARDSERVE_URL) or the default.
        url = url or os.environ.get("SHARDSERVE_URL") or DEFAULT_URL
        self._stats = StatsClock()
        self._resident: Resident | None = None
        self._active: EpochStream | None = None
        self._stream: EpochStream | None = None
        self._connect(self._create_job(url, transport, auto=prefetch is None))
        if envs_on:
            try:
                self._resident = self._load_resident(url, envs_on)
            except BaseException:
                self.close()
                raise
        else:
            # Open the first epoch's stream now: batches are on their way before the loop asks.
            self._stream = self._open(Start(self._pos.job_epoch, 0))

    def _connect(self, endpoint: str) -> None:
        """The data-plane socket and what delivering batches needs; close() works after it."""
        self._rings = RingCache()
        self._copier = DeviceCopier(self.device)
        unpacking = Unpacking(self._copier, CopyBlocks(), self._stats, self.pad_variable)
        self._delivery = Delivery(unpacking, self.copy)
        self._boot_id = read_boot_id()
        self._pass = 0  # which iter() the live pass belongs to
        self._conn = Connection(endpoint)
        # The stream calls back into this, not into the Loader: no cycle keeps a dropped Loader alive.
        self._job = JobHandle(self._api, self.spec, self.job_id, self._pinned)
        self._closed = False
        self._atexit = functools.partial(_close_ref, weakref.ref(self))
        atexit.register(self._atexit)

    def _create_job(self, url: str, transport: str, auto: bool) -> str:
        """Create (or find) the job over HTTP; the data endpoint to connect to. ``auto``: set
        ``prefetch`` from the dataset's sample size."""
        # A server that is restarting refuses connections for a moment: retry within timeout.
        self._api = ControlClient(
            url, self._token or None, timeout=min(self.timeout, 10.0), connect_retry_s=self.timeout
        )
        try:
            if self._step_envs or auto:
                info = self._api.dataset(self.spec.dataset)
                if self._step_envs:
                    check_env_fields(info, self.spec.fields)
                if auto:
                    self.prefetch = auto_prefetch(info, self.spec.batch_size)
            created = self._api.create_job(self.spec)
            # The server's id: it covers the dataset version the job pinned (issue 20).
            self.job_id = created.id
            self._pinned = created.status.spec.version
            # The server is up; later calls run inside a stream's own deadline, so no retries.
            self._api.connect_retry_s = 0.0
            self._pos = Position(created.status.epoch, created.status.batches_per_epoch)
            self._num_samples = created.status.num_samples
            #: (epoch, job id): the epoch resumed from a state of another world size.
            self._origin: tuple[int, str] | None = None
            endpoint = choose_endpoint(self._api.info(), self._api.host, transport)
            self._rebuild = rebuild_for(self._api, self.spec, self.pad_variable)
        except BaseException:
            self._api.close()
            raise
        return endpoint

    # -- epochs and resume -----------------------------------------------------------------

    def set_epoch(self, epoch: int) -> None:
        """The epoch the next iteration streams (like ``DistributedSampler.set_epoch``).

        A position restored by ``load_state_dict`` for the same epoch is kept.
        """
        self._pos.set_epoch(epoch)

    def __len__(self) -> int:
        """Batches per epoch for this rank."""
        return self._pos.num_batches

    def state_dict(self) -> dict[str, Any]:
        """Where the loop is: the epoch in progress, the next batch it has not received and
        the epoch's global ``position`` (ids of the epoch's order every rank together has
        consumed, see :mod:`.state`); after an epoch's last batch, the start of the next."""
        return make_state(
            deepcopy(self._spec_dump), self.job_id, self.world.rank, self.world.world_size,
            self._pos.state(),
        )  # fmt: skip

    def load_state_dict(self, state: dict[str, Any] | list[dict[str, Any]]) -> None:
        """Make the next iteration start where ``state`` left off, on this world size or any
        other (elastic resume: the samples no rank consumed are dealt over this job's ranks).

        ``state``: any one rank's ``state_dict()`` (DDP ranks step together, so each says the
        same position; Lightning and Accelerate checkpoint rank 0's), or a list of every
        rank's, which must agree. ``BadRequest`` naming the problem if ``state`` is damaged,
        inconsistent, or belongs to another job or version."""
        st = parse_states(state)
        check_same_job(st, self.spec, "loader")
        start, origin = start_for(st, self.world.world_size, self._num_samples, self._pos.per_epoch)
        self._pos.restore(*start)
        self._origin = (start.epoch, origin) if origin else None

    # -- iteration -------------------------------------------------------------------------

    def _open(self, start: Start) -> EpochStream:
        epoch = start.epoch
        origin = self._origin[1] if self._origin and self._origin[0] == epoch else ""
        hello = Hello(
            job=self.job_id, rank=self.world.rank, epoch=epoch, start_batch=start.batch,
            offset=start.offset, origin=origin, credit=self.prefetch,
            token=self._token, transport="auto" if self._shm else "socket",
            boot_id=self._boot_id, pid=os.getpid(),
            # Padding is per batch: a message of several would be padded to its longest.
            group=1 if self.pad_variable else MAX_GROUP,
        )  # fmt: skip
        return EpochStream(
            self._conn, hello=hello, timeout=self.timeout, stats=self._stats,
            recreate_job=self._job.recreate, describe=self._job.describe, rings=self._rings,
            rows=self.spec.batch_size, num_batches=self._batches(start.offset),
            graphs=self.spec.collate == "graph",
        )  # fmt: skip

    def _batches(self, offset: int) -> int:
        """Batches of this rank's plan of an epoch dealt from ``offset``."""
        if offset == 0:
            return self._pos.per_epoch
        s = self.spec
        rest = self._num_samples - offset
        return rank_plan_size(rest, s.world_size, s.batch_size // s.envs, s.drop_last)[1]

    def _load_resident(self, url: str, envs_on: list[torch.device]) -> Resident:
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
            envs_on, one_pass, self.timeout,
        )  # fmt: skip

    def __iter__(self) -> Iterator[Any]:
        if self._closed:
            raise RuntimeError("this Loader is closed")
        start = self._pos.next_start()
        self._stats.pause()  # an earlier pass that was dropped stopped its compute clock
        self._pass += 1
        if self._resident is not None:
            self._pos.begin(start)
            return ResidentPass(self, self._pass, start, self._resident, self._rebuild)
        self._active = self._stream_for(start)
        self._pos.begin(start)
        return StreamPass(self, self._pass, start, self._active, self._rebuild)

    def _stream_for(self, start: Start) -> EpochStream:
        """The stream opened ahead, or that of an iteration that never delivered (an iter() to
        check the object), when it starts at ``start``; else a new one."""
        stream = self._stream or self._active
        self._stream = None
        if (
            stream is None
            or stream.epoch != start[0]
            or stream.hello.start_batch != start[1]
            or stream.hello.offset != start.offset
            or stream.next_index != start[1]
        ):
            stream = self._open(start)
        return stream

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
            f"{self.world.world_size}, epoch={self._pos.epoch}, endpoint={self._conn.endpoint!r})"
        )


def _close_ref(ref: weakref.ReferenceType[Loader]) -> None:
    loader = ref()
    if loader is not None:
        loader.close()
