"""``Loader``: the iterator a training loop uses. Small on purpose; the wire protocol is in
:mod:`.stream`, one iteration in :mod:`._passes`, how a batch becomes tensors in
:mod:`._delivery`, slot ownership in :mod:`._ledger`, HTTP in :mod:`.control`."""

from __future__ import annotations

import atexit
import dataclasses
import functools
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from copy import deepcopy
from typing import Any, Literal

import torch

from shardserve.proto.api import MixtureStatus
from shardserve.proto.errors import BadRequest
from shardserve.proto.jobs import CollateArg, EnvShuffle, OnError

from ._credit import auto_prefetch, check_prefetch
from ._deprecation import positional_deprecated
from ._feed import Feed
from ._loader_args import EnvPlaces, ResidentMemory, check_resident_args
from ._passes import PassContext, PassWatcher, ResidentPass
from ._position import Start
from ._resident_load import load_resident
from .device import resolve_device
from .device_steps._executor import attach, then
from .distributed import resolve_world
from .envs import check_env_fields
from .habits import BatchKeys, LoaderDataset, accelerate_watcher, gather_remainder, one_batch
from .job import JobArgs, JobHandle, Shuffle
from .mixture import Mixture, next_epoch_step
from .resident import Resident
from .state import check_resumable, make_state, parse_states, start_for
from .stream import EpochStream
from .structure import rebuild_for
from .types import LoaderStats

Transport = Literal["auto", "socket", "ipc", "tcp"]


class Loader:
    """Pre-collated batches of ``dataset`` from a shardserve server, for this rank.

    ```python
    loader = Loader("http://127.0.0.1:7070", "cifar10", 256, seed=0)
    for epoch in range(3):
        loader.set_epoch(epoch)
        for batch in loader:  # dict[str, torch.Tensor | VarTensor]
            train_step(batch["image"], batch["label"])
    print(loader.stats().stall_fraction)  # 0.02: waited for data 2% of the time
    ```

    Args:
        url: the server's HTTP URL; ``None``: ``SHARDSERVE_URL``, else
            ``http://127.0.0.1:7070`` (one sidecar per node, each rank talks to its own).
        dataset: the dataset's name in the server's store; ``{name: weight, ...}``: a mixture
            of datasets, each batch position drawing its dataset with that probability, and
            a ``source`` field saying which (see
            [set_mixture][shardserve.client.Loader.set_mixture]); a list of
            ``MixtureSource`` (or dicts) says more per dataset (``on_exhausted="stop"``).
        batch_size: samples per batch (per environment with ``envs``).
        seed: the seed of every epoch's order; same seed, same batches on any machine.
        shuffle: ``True`` (default, ``"global"``), ``False`` (``"none"``: store order) or
            ``"block"`` (shards shuffled, then samples within a window of shards).
        drop_last: drop each rank's last batch when it is short, as ``DataLoader`` does;
            without it ranks are padded to equal length (``DistributedSampler``'s rule).
        fields: the fields to serve, in this order (default: all).
        rank: this process's rank; with ``world_size``, default from ``torch.distributed``,
            then ``RANK``/``WORLD_SIZE``, then 0 of 1.
        world_size: the number of ranks (see ``rank``).
        device: where batches land; ``"cuda"``: this rank's GPU (``LOCAL_RANK``), copied
            through pinned buffers on a side stream.
        prefetch: the credit, batches in flight or queued (bounds memory on both sides);
            ``None``: 4, or up to 64 small batches (about 8 MiB).
        timeout: the longest wait in seconds for one batch (``DataStallError`` after it).
        token: the server's bearer token; ``None``: ``SHARDSERVE_TOKEN``.
        transport: ``"auto"`` (shared memory on the same host, else ipc, then tcp),
            ``"socket"`` (ipc or tcp), ``"ipc"`` or ``"tcp"``.
        pad_variable: pad variable-shape fields to dense tensors plus ``NAME.lengths``
            instead of ``VarTensor``.
        copy: ``False`` (shared memory only): batches are views into their slot, valid until
            the next batch is asked for.
        resident: ``"cuda"`` or ``"cpu"``: load the dataset once into that memory and gather
            each batch there; the server then sends only plans.
        envs: environments per step: a list of ``envs`` batches, each from its own plan.
        devices: the device of each environment (``devices[e % len(devices)]``).
        collate: ``"graph"``: the server collates graphs for message passing (see [what a
            batch is](../concepts/batches.md)); ``{"graph": {"node_field": "atom_fea"}}`` names the field whose
            first dimension counts each graph's nodes, when it is not ``num_nodes``, ``x``
            or ``pos``.
        transforms: ``[{"name": ..., "params": {...}}, ...]``, transforms installed on the
            server, run on every batch there.
        device_transforms: steps run on ``device`` after them, on parameters the server draws
            (decode, crops, flips, unpack bits, expansions registered on this client).
        on_error: ``"replace"``: a sample whose transform raises is swapped for a
            deterministic other one; ``"quarantine"`` (a mixture): swapped too, and skipped
            from the next epoch on; default: ``TransformError``.
        epoch_samples: a mixture's samples per epoch, all ranks together (``None``: its
            datasets' sizes summed).
        share: a share group's name: Loaders with the same arguments and ``share`` (trials
            of a sweep, notebooks on one machine) get the same batches from one pass of the
            server, planned, gathered and transformed once (see the "Sweeps and notebooks"
            guide). Without it a second Loader of the same arguments and rank gets
            ``RankInUse`` in another process; in the same process the two take turns at the
            rank (each turn after a silence, with a warning logged).
        env_shuffle: ``"independent"`` (default): each environment shuffles on its own;
            ``"split"``: one shuffle dealt across the environments, so no two take the same
            sample in a step or an epoch (an epoch is ``len / (world_size * envs * batch_size)``
            steps).

    Everything after ``batch_size`` is keyword-only (passing it by position still works,
    with a ``DeprecationWarning``).

    Epochs are the trainer's: ``set_epoch(e)`` chooses the next iteration's epoch. Without
    it, a new Loader starts at epoch 0 (or at the epoch an operator set with
    ``PUT /v1/jobs/{id}/epoch``), and ``iter()`` moves on to the next epoch only after a pass
    that yielded batches (completed or abandoned), so a forgotten ``set_epoch`` never repeats
    an order and an ``iter()`` that only checks the object (as Lightning does) moves nothing.
    ``state_dict()`` records the epoch in progress and the next batch the loop has not
    received; ``load_state_dict()`` makes the next iteration yield exactly the rest.

    Every wait is bounded by ``timeout``: a stalled stream raises ``DataStallError``, a
    server-side failure raises its typed error (``DatasetCorruptError``, ``JobFailed``...).
    A server restart is survived: the stream is re-opened at the next undelivered batch.
    Under an initialised ``torch.distributed``, the ranks' Loaders agree on rank 0's job (and
    so on one dataset version) before streaming.

    Nested datasets come back in the shape their samples were saved in (``batch["params"]
    ["nu"]``, a tuple ``(images, labels)``), and a field missing in some samples as
    [Masked][shardserve.client.Masked].

    Resident mode gives the same batches, order and ``state_dict`` as streaming, for data
    that fits (refused up front when it does not). With ``envs=n`` each environment's batch
    has storage of its own; while streaming, one step is one message (fixed-shape fields).

    ``copy`` (shared-memory transport only): by default each delivered batch owns its storage.
    It is handed out in place, in its shared-memory slot, and the slot goes back to the server
    once no tensor of that batch is left; while the loop still holds half the ring's batches,
    further batches are copied out instead (counted in ``stats().copied``).

    DataLoader habits: ``batch_size``, ``drop_last``, ``shuffle`` (a bool: whether the order
    is shuffled) and ``dataset`` (``len()`` is its sample count) read as on a ``DataLoader``;
    Accelerate's ``skip_first_batches`` and ``gather_for_metrics`` work on a Loader (see
    [Lightning, Accelerate, torchrun](../guides/frameworks.md)).
    """

    #: DataLoader attributes frameworks read: no worker processes (so no worker timeout:
    #: the Loader's own wait, the ``timeout`` argument, is ``batch_timeout``), no sampler of
    #: its own, batches already collated.
    num_workers = 0
    timeout = 0.0
    prefetch_factor = None
    sampler = None
    collate_fn = staticmethod(one_batch)

    @positional_deprecated
    def __init__(
        self,
        url: str | None,
        dataset: str | Mixture,
        batch_size: int,
        *,
        seed: int = 0,
        shuffle: Shuffle = True,  # a literal, so the API page shows it; plan()'s is the same
        drop_last: bool = False,
        fields: Sequence[str] | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        device: str | torch.device = "cpu",
        prefetch: int | None = None,
        timeout: float = 60.0,
        token: str | None = None,
        transport: Transport = "auto",
        pad_variable: bool = False,
        copy: bool = True,
        resident: ResidentMemory | None = None,
        envs: int = 1,
        devices: Sequence[str | torch.device] | None = None,
        collate: CollateArg | None = None,
        transforms: Sequence[Mapping[str, Any]] | None = None,
        device_transforms: Sequence[Mapping[str, Any]] | None = None,
        on_error: OnError | None = None,
        epoch_samples: int | None = None,
        share: str | None = None,
        env_shuffle: EnvShuffle = "independent",
    ) -> None:
        self._closed = True  # until the sockets exist, close() has nothing to do
        check_prefetch(prefetch)
        check_resident_args(resident, dataset, transforms, share)
        self.world = resolve_world(rank, world_size)
        self.device = resolve_device(device, self.world.local_rank)
        places = EnvPlaces.of(resident, envs, devices, env_shuffle, self.device, self.world)
        self.spec = JobArgs(
            dataset=dataset,
            batch_size=batch_size,
            seed=seed,
            shuffle=shuffle,
            drop_last=drop_last,
            fields=fields,
            collate=collate,
            envs=places.job_envs,
            env_shuffle=env_shuffle,
            transforms=transforms,
            on_error=on_error,
            epoch_samples=epoch_samples,
            share=share,
        ).spec(self.world.world_size)
        self.spec, lands, self._device_steps = attach(
            self.spec, device_transforms, self.device, resident is not None
        )
        # Serialized once: state_dict() must not run pydantic while a Ctrl-C may land.
        self._spec_dump = self.spec.model_dump(mode="json")
        #: (epoch, job id): the epoch resumed from a state of another world size.
        self._origin: tuple[int, str] | None = None
        self.batch_timeout, self.pad_variable, self.copy = timeout, pad_variable, copy
        self.envs = envs
        self.batch_size, self.drop_last = batch_size, drop_last
        self.shuffle = self.spec.shuffle != "none"
        self._transport: Transport = transport
        self.prefetch = prefetch or 4
        self._open_job(url, token, places.step, lands, size_prefetch=prefetch is None)
        self._expose_habits(collate)
        self._begin(places.resident)

    def _open_job(
        self,
        url: str | None,
        token: str | None,
        step_envs: list[torch.device],
        lands: torch.device,
        size_prefetch: bool,
    ) -> None:
        """Post the job (a streamed step's fields checked first) and set up its feed: the
        transport, the credit (``size_prefetch``: sized by the samples as served, which a
        chain may grow) and how a batch becomes tensors; the job is closed on failure."""
        spec = self.spec
        check = (lambda info: check_env_fields(info, spec.fields)) if step_envs else None
        self._job = job = JobHandle.create(
            url, token, spec, timeout=self.batch_timeout, world=self.world, check=check
        )
        try:
            if size_prefetch:
                self.prefetch = auto_prefetch(job.info(), spec.batch_size, job.sample_bytes)
            self._rebuild = then(self._device_steps, rebuild_for(job.api, spec, self.pad_variable))
            self._feed = Feed(
                job,
                self.world.rank,
                transport=self._transport,
                prefetch=self.prefetch,
                timeout=self.batch_timeout,
                device=lands,
                copy=self.copy,
                pad_variable=self.pad_variable,
                step_envs=step_envs,
                batch_size=self.batch_size,
            )
        except BaseException:
            job.close()
            raise

    def _expose_habits(self, collate: CollateArg | None) -> None:
        """What DataLoader habits read: ``dataset``, ``batch_sampler``, Accelerate's watcher.
        What these hold refers to the Loader weakly or not at all: a dropped Loader is freed
        (and closed) at once, not at the next garbage collection."""
        self._ctx = ctx = self._feed.ctx
        if self.spec.envs == 1 and collate is None:
            ctx.watch = _watcher(
                self._job, self.world.world_size, self.batch_size, self.drop_last, ctx
            )
        self.dataset = LoaderDataset(self.spec.dataset, self._job.num_samples, weakref.ref(self))
        self.batch_sampler = BatchKeys(lambda: ctx.pos.num_batches, self.dataset.rewind)

    def _begin(self, resident_on: list[torch.device]) -> None:
        """Open: load the resident tensors on ``resident_on``, or, streaming, the first
        epoch's stream, so batches are on their way before the loop asks."""
        self._resident: Resident | None = None
        self._stream: EpochStream | None = None
        self._closed = False
        self._atexit = functools.partial(_close_ref, weakref.ref(self))
        atexit.register(self._atexit)
        if not resident_on:
            self._stream = self._feed.open(self._ctx.pos.job_epoch, 0)
            return
        try:
            self._resident = load_resident(
                self._job,
                self.spec,
                self.world.rank,
                resident_on,
                self._transport,
                self.batch_timeout,
            )
        except BaseException:
            self.close()
            raise

    @property
    def job_id(self) -> str:
        """The server's id of the job this Loader streams (it covers the pinned version)."""
        return self._job.id

    # -- epochs and resume -----------------------------------------------------------------

    def set_epoch(self, epoch: int) -> None:
        """The epoch the next iteration streams (like ``DistributedSampler.set_epoch``).

        A position restored by ``load_state_dict`` for the same epoch is kept.
        """
        self._ctx.pos.set_epoch(epoch)

    def skip_to(self, batch: int) -> None:
        """Start the next iteration at batch ``batch`` of its epoch (what Accelerate's
        ``skip_first_batches(loader, batch)`` asks for); the batches before it are never sent.

        ```python
        loader.set_epoch(3)
        loader.skip_to(10)
        batch = next(iter(loader))  # batch 10 of epoch 3
        ```
        """
        pos = self._ctx.pos
        if isinstance(batch, bool) or not isinstance(batch, int) or not 0 <= batch <= pos.per_epoch:
            raise BadRequest(
                f"skip_to({batch!r}): batch must be an integer 0 <= batch <= {pos.per_epoch} "
                "(batches per epoch of this rank)"
            )
        pos.restore(pos.next_start().epoch, batch)

    def set_mixture(
        self, weights: Mapping[str, float], at_step: int | None = None
    ) -> MixtureStatus:
        """New weights for a mixture Loader's datasets, from global step ``at_step`` on
        (``epoch * len(loader) + batch``); ``None``: the first step of the epoch after the
        one in progress, which every DDP rank names alike without talking (each rank may call
        this: the server takes the change once). ``StepInThePast`` (409) if a rank already
        read that step. Deterministic: a restart or a resume replays the same batches.

        ```python
        loader = Loader(url, {"web": 0.7, "code": 0.3}, 256)
        loader.set_mixture({"web": 0.5, "code": 0.5})  # from the next epoch
        ```
        """
        if self.spec.mixture is None:
            raise BadRequest(
                f"Loader of dataset {self.spec.dataset!r} reads one dataset: create it with "
                "dataset={name: weight, ...} to mix and steer datasets"
            )
        if at_step is None:
            pos = self._ctx.pos
            epoch = pos.epoch if pos.epoch is not None else pos.next_start().epoch
            at_step = next_epoch_step(epoch, self._job.batches_per_epoch)
        return self._job.api.set_mixture(self.job_id, weights, at_step)

    def __len__(self) -> int:
        """Batches per epoch for this rank."""
        return self._ctx.pos.num_batches

    def state_dict(self) -> dict[str, Any]:
        """Where the loop is: the epoch in progress, the next batch it has not received and
        the epoch's global ``position`` (ids of the epoch's order every rank together has
        consumed, see [elastic resume](../guides/elastic-resume.md)); after an epoch's last batch, the start of the next."""
        return make_state(
            deepcopy(self._spec_dump),
            self.job_id,
            self.world.rank,
            self.world.world_size,
            self._ctx.pos.state(),
            self._job.versions,
        )

    def load_state_dict(
        self, state: dict[str, Any] | list[dict[str, Any]], *, allow_other_version: bool = False
    ) -> None:
        """Make the next iteration start where ``state`` left off, on this world size or any
        other (elastic resume: the samples no rank consumed are dealt over this job's ranks).

        ``state``: any one rank's ``state_dict()`` (DDP ranks step together, so each says the
        same position), or a list of every rank's, which must agree. ``BadRequest`` if it is
        damaged or another job's; ``ResumeRefused`` (before any batch) if taken mid-epoch on
        another or an unknown dataset version ([versions](../concepts/versions.md)), or a
        mixture's of another world size. ``allow_other_version=True``: resume on this version
        knowingly."""
        st, pos, job, world = parse_states(state), self._ctx.pos, self._job, self.world.world_size
        check_resumable(st, self.spec, job.pinned, world, "loader", allow_other_version)
        start, origin = start_for(st, world, job.num_samples, pos.per_epoch)
        pos.restore(*start)
        self._origin = (start.epoch, origin) if origin else None

    # -- iteration -------------------------------------------------------------------------

    def __iter__(self) -> Iterator[Any]:
        if self._closed:
            raise RuntimeError("this Loader is closed")
        ctx = self._ctx
        start = ctx.pos.next_start()
        ctx.stats.pause()  # an earlier pass that was dropped stopped its compute clock
        if self._resident is not None:
            ctx.current += 1
            ctx.pos.begin(start)
            return ResidentPass(ctx, ctx.current, start, self._resident, self._rebuild, self)
        return self._feed.pass_(start, self._stream_for(start), self._rebuild, self)

    def _stream_for(self, start: Start) -> EpochStream:
        """The stream opened ahead, or that of an iteration that never delivered (an iter() to
        check the object), when it starts at ``start``; else a new one."""
        stream = self._stream or self._ctx.active
        self._stream = None
        if (
            stream is None
            or stream.epoch != start[0]
            or stream.hello.start_batch != start[1]
            or stream.hello.offset != start.offset
            or stream.next_index != start[1]
        ):
            origin = self._origin[1] if self._origin and self._origin[0] == start.epoch else ""
            stream = self._feed.open(start.epoch, start.batch, start.offset, origin)
        return stream

    # -- lifecycle -------------------------------------------------------------------------

    def stats(self) -> LoaderStats:
        """Batches, bytes and time spent waiting vs. computing since construction."""
        if self._resident is not None:
            return self._ctx.stats.snapshot("resident")
        active = self._ctx.active or self._stream
        snap = self._ctx.stats.snapshot(active.transport if active else self._feed.transport)
        steps = self._device_steps
        return snap if steps is None else dataclasses.replace(snap, device=steps.stats())

    def close(self) -> None:
        """Say Bye, close the socket and the HTTP client; idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._stream is not None:
            self._stream.close()
            self._stream = None
        if self._resident is not None:
            self._resident.close()
        atexit.unregister(self._atexit)
        self._feed.close()
        self._job.close()

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
            f"{self.world.world_size}, epoch={self._ctx.pos.epoch}, "
            f"endpoint={self._feed.conn.endpoint!r})"
        )


def _watcher(
    job: JobHandle, world_size: int, batch_size: int, drop_last: bool, ctx: PassContext
) -> Callable[[], PassWatcher | None]:
    """A new pass's watcher for Accelerate, when it is loaded (see :mod:`.habits`)."""

    def watcher() -> PassWatcher | None:
        return accelerate_watcher(
            lambda: gather_remainder(
                job.num_samples, world_size, batch_size, drop_last, ctx.pos.num_batches
            )
        )

    return watcher


def _close_ref(ref: weakref.ReferenceType[Loader]) -> None:
    loader = ref()
    if loader is not None:
        loader.close()
