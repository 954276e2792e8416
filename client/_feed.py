"""One job's streams for one rank: the data-plane socket, the slot rings, how a batch becomes
tensors, and the context its passes move (:class:`._passes.PassContext`).

A :class:`~.loader.Loader` owns one Feed; resident loading (:mod:`.resident`) makes a second
one for its store-order job, with the same parts and no Loader around it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import torch

from shardserve.proto.jobs import rank_plan_size
from shardserve.proto.messages import MAX_GROUP, Hello

from ._delivery import Delivery, Unpacking
from ._passes import PassContext, StreamPass
from ._position import Position, Start
from ._staging import CopyBlocks
from .connection import Connection, choose_endpoint, read_boot_id
from .device import DeviceCopier
from .job import JobHandle
from .placing import Placer
from .shm import RingCache
from .stats import StatsClock
from .stream import EpochStream
from .types import Batch


class Feed:
    """Streams of ``job`` for ``rank``: :meth:`open` one at (epoch, start batch), :meth:`pass_`
    to iterate it. Its own socket and rings; ``close()`` releases them (not the job)."""

    def __init__(
        self,
        job: JobHandle,
        rank: int,
        *,
        transport: str,
        prefetch: int,
        timeout: float,
        device: torch.device,
        copy: bool,
        pad_variable: bool,
        step_envs: list[torch.device],
        batch_size: int,
    ) -> None:
        self.job, self.rank = job, rank
        self.prefetch, self.timeout, self.pad_variable = prefetch, timeout, pad_variable
        info = job.api.info()
        endpoint = choose_endpoint(info, job.api.host, transport)
        self._where = Placer(job, info, transport, endpoint) if info.stream_processes > 1 else None
        self.shm = transport == "auto"
        stats = StatsClock()
        self.copier = DeviceCopier(device)
        unpacking = Unpacking(self.copier, CopyBlocks(), stats, pad_variable)
        self.ctx = PassContext(
            pos=Position(job.epoch, job.batches_per_epoch),
            stats=stats,
            rings=RingCache(),
            delivery=Delivery(unpacking, copy),
            step_envs=step_envs,
            batch_size=batch_size,
        )
        self._boot_id = read_boot_id()
        try:
            self.conn = Connection(endpoint)
        except BaseException:
            self.ctx.rings.close()
            raise

    def open(self, epoch: int, start: int, offset: int = 0, origin: str = "") -> EpochStream:
        """A stream of ``epoch`` from batch ``start``; its batches start on their way now.
        ``offset``/``origin``: an epoch resumed on another world size (``Hello.offset``: the
        plan is dealt from there; ``Hello.origin``: the job the state was saved by)."""
        hello = Hello(
            job=self.job.id,
            rank=self.rank,
            epoch=epoch,
            start_batch=start,
            offset=offset,
            origin=origin,
            credit=self.prefetch,
            token=self.job.token or "",
            transport="auto" if self.shm else "socket",
            boot_id=self._boot_id,
            pid=os.getpid(),
            # Padding is per batch: a message of several would be padded to its longest.
            group=1 if self.pad_variable else MAX_GROUP,
        )
        # The stream calls back into the job, not into the Loader: no cycle keeps a dropped
        # Loader alive.
        return EpochStream(
            self.conn,
            hello=hello,
            timeout=self.timeout,
            stats=self.ctx.stats,
            recreate_job=self.job.recreate,
            describe=self.job.describe,
            rings=self.ctx.rings,
            # What every message and the Welcome are checked against: the job's own plan.
            rows=self.job.spec.batch_size,
            num_batches=self._batches(offset),
            graphs=self.job.spec.graph is not None,
            place=self._where.endpoint_for if self._where is not None else None,
        )

    def _batches(self, offset: int) -> int | None:
        """Batches of this rank's plan of an epoch dealt from ``offset``; ``None``: as the
        server's Welcome says (a mixture whose epoch ends when a source runs out)."""
        if self.job.spec.ends_early:
            return None
        if offset == 0:
            return self.ctx.pos.per_epoch
        s = self.job.spec
        rest = self.job.num_samples - offset
        return rank_plan_size(rest, s.deal_world, s.env_batch, s.drop_last)[1]

    def pass_(
        self,
        start: Start,
        stream: EpochStream,
        rebuild: Callable[[Batch], Any] | None,
        owner: object = None,
    ) -> StreamPass:
        """A new pass over ``stream`` (older passes of this feed stop), keeping ``owner`` (the
        iterable it is of) alive while it lives."""
        self.ctx.current += 1
        self.ctx.active = stream
        self.ctx.pos.begin(start)
        return StreamPass(self.ctx, self.ctx.current, start, stream, rebuild, owner)

    @property
    def transport(self) -> str:
        return self.conn.transport

    def close(self) -> None:
        """Stop its passes, close its socket and rings; idempotent."""
        if self.ctx.closed:
            return
        self.ctx.closed = True
        if self.ctx.active is not None:
            self.ctx.active.close()
            self.ctx.active = None
        self.ctx.rings.close()
        self.conn.close()


def store_order(
    job: JobHandle, *, transport: str, prefetch: int, timeout: float
) -> Iterator[Batch]:
    """Every batch of ``job`` (a ``shuffle="none"`` job of world size 1) as stored: flat
    fields, on the CPU, each batch owning its storage. Closes what it opened when done."""
    feed = Feed(
        job,
        0,
        transport=transport,
        prefetch=prefetch,
        timeout=timeout,
        device=torch.device("cpu"),
        copy=True,
        pad_variable=False,
        step_envs=[],
        batch_size=job.spec.batch_size,
    )
    try:
        yield from feed.pass_(Start(0, 0), feed.open(0, 0), None)
    finally:
        feed.close()
