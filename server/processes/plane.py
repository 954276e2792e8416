"""The parts of a streaming process: the main process's data plane, minus what lives only
there (the journal, admission of jobs, steering, HTTP).

The server-wide budgets of bytes and workers are divided among the processes, so that ``N``
processes never hold ``N`` times a limit (``--transform-workers``, ``--shm-limit-bytes``,
``--share-bytes``, ``--unread-bytes``, ``--plan-cache-bytes``).
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING

import zmq

from shardserve.proto.errors import ErrorCode

from ..jobs.kinds.base import KindParts
from ..jobs.kinds.table import JobKinds
from ..jobs.steering import MixtureAdmin
from ..planning.cache import PlanCache
from ..reading.assembly import Assembler
from ..reading.sources import open_source
from ..registry.jobs import JobRegistry
from ..runtime.metrics import Metrics
from ..settings import Settings
from ..streaming.board import StreamBoard
from ..streaming.handler import HandlerDeps, StreamHandler
from ..streaming.pipeline import Work
from ..streaming.streamer import Streamer, Waker
from ..transforms.bound import Transforms
from ..transforms.runner import Limits
from ..wiring import open_store_of, streamer_config
from .feed import BoardFeed
from .replica import JobReplica

if TYPE_CHECKING:
    # pyarrow (under the dataset) loads with the first dataset a stream opens.
    from ..store.read.dataset import Dataset


def share_of(settings: Settings, n: int) -> Settings:
    """``settings`` with the server-wide budgets divided among ``n`` processes.

    >>> s = Settings(store="/tmp", transform_workers=4, shm_limit_bytes=1 << 30)
    >>> t = share_of(s, 2)
    >>> t.transform_workers, t.shm_limit_bytes
    (2, 536870912)
    """
    return settings.model_copy(
        update={
            "transform_workers": max(1, settings.transform_workers // n),
            "shm_limit_bytes": settings.shm_limit_bytes // n,
            "share_bytes": settings.share_bytes // n,
            "unread_bytes": settings.unread_bytes // n,
            "plan_cache_bytes": settings.plan_cache_bytes // n,
        }
    )


class ChildPlane:
    """Store, plans, transforms and a streamer serving the streams placed here."""

    def __init__(
        self, settings: Settings, index: int, processes: int, stream_ids: tuple[int, int]
    ) -> None:
        self.settings = settings = share_of(settings, processes)
        self.index = index
        self.metrics = Metrics()
        self.store = open_store_of(settings, self.metrics.registry)
        self.plans = PlanCache(settings.plan_cache_bytes)
        # Its plans count in the server's plan cache gauge (summed over the processes).
        self.metrics.watch_plan_bytes(lambda: self.plans.nbytes)
        self.feed = BoardFeed()
        self.replica = JobReplica(self.feed.emit)
        self.transforms = Transforms(
            settings.transforms,
            settings.transform_workers,
            settings.transform_pool,
            settings.transform_timeout_s,
            self.metrics.registry,
            Limits(settings.max_batch_bytes, settings.max_decoded_pixels),
        )
        # Mixture streams stay in the main process (see ``placement``): this process's kinds
        # plan plain jobs only, so the registry and steering they were built with stay empty.
        jobs = JobRegistry(None)
        steering = MixtureAdmin(jobs, StreamBoard(), self.store.manifest, self.plans)
        self.kinds = JobKinds(
            KindParts(
                max_batch_bytes=settings.max_batch_bytes,
                jobs=jobs,
                plans=self.plans,
                mixtures=steering,
                manifest=self.store.manifest,
                check_shards=self.store.check_shards,
                transforms=self.transforms,
                open_dataset=self._open_dataset,
            )
        )
        self._stream_ids = stream_ids
        self.streamer: Streamer | None = None

    def start(self, endpoints: list[str]) -> list[str]:
        """Bind ``endpoints`` and serve; returns them bound (ephemeral ports resolved)."""
        self.streamer = Streamer(streamer_config(self.settings, endpoints), self._handler)
        return self.streamer.start()

    def end_job(self, job_id: str, code: ErrorCode, message: str) -> None:
        """End every stream of ``job_id`` here; no new one opens."""
        self.replica.forget(job_id)
        if self.streamer is not None:
            self.streamer.call(lambda h: h.job_gone(job_id, code, message))

    def stop(self) -> None:
        if self.streamer is not None:
            self.streamer.stop()
        self.plans.close()
        self.transforms.close()
        self.store.close()

    def _open_dataset(self, name: str, version: str | None = None) -> Dataset:
        return self.store.open(name, version=version)

    def _handler(self, sock: zmq.Socket, waker: Waker) -> StreamHandler:
        s = self.settings
        assembler: Assembler[Work] = Assembler(s.assembly_threads, waker.wake, self.metrics)
        deps = HandlerDeps(
            open_source=partial(open_source, transforms=self.transforms, quarantine=None),
            registry=self.replica,
            kind_of=lambda job: self.kinds.of(job.spec),
            board=self.feed,
            metrics=self.metrics,
            gate=self.replica.gate,
            stream_ids=self._stream_ids,
        )
        assert self.streamer is not None
        return StreamHandler(sock, assembler, deps, self.streamer.config)
