"""Batch assembly: a bounded pool of threads that turns planned indices into batch buffers.

The streamer decides *what* to assemble (strictly within each stream's credit) and hands it
here; a worker runs the store's vectorised ``take`` (numpy and pyarrow release the GIL, so two
workers really run in parallel) writing into the stream's reusable buffers, then puts the
result on a queue and wakes the streamer. The streamer alone touches sockets.

A batch whose source names a ``lane`` (a job with transforms, which may wait on one until its
deadline) is assembled instead on that job's own threads, on lanes this assembler owns
(:class:`~..runtime.assembly_lanes.AssemblyLanes`): a batch that hangs holds only its job's.

Work items carry an opaque ``tag`` (the stream and batch index) so that results of a stream
that was replaced or closed meanwhile are recognised and dropped by the streamer — there is
no cancellation of a running ``take``, and none is needed: it is bounded by one batch.
"""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import numpy as np

from ..runtime.assembly_lanes import ASSEMBLY_PER_JOB, AssemblyLanes
from ..runtime.metrics import Metrics
from ..source import FRESH, BatchParts, BatchSource, Placer, Tail

log = logging.getLogger("shardserve.assembly")

#: What the consumer tags its work with, to recognise each result.
Tag = TypeVar("Tag")


@dataclass(frozen=True, slots=True)
class Done(Generic[Tag]):
    """A finished work item: its tag and either a value or the exception it raised."""

    tag: Tag
    #: What the work returned: the consumer knows from its tag what that is.
    value: Any = None
    error: BaseException | None = None


def assemble_batch(
    ds: BatchSource,
    indices: np.ndarray,
    fields: Sequence[str],
    out: Mapping[str, np.ndarray] | None,
    batch: int | None = None,
    tail: Tail = FRESH,
) -> BatchParts:
    """The parts of one batch, in frame order, each C-contiguous (so it can be sent zero-copy).

    ``out`` holds preallocated arrays for the fixed-size parts (``take`` writes into them);
    variable-size parts are made in ``tail`` (fresh memory by default). ``batch``: the
    batch's index in its stream (a transform chain's batch steps draw from (seed, epoch,
    rank, batch)).
    """
    parts = ds.take(indices, fields, out=out, batch=-1 if batch is None else batch, tail=tail)
    return {name: np.ascontiguousarray(arr) for name, arr in parts.items()}


class Assembler(Generic[Tag]):
    """A bounded pool whose results are collected by one consumer thread.

    ``notify`` is called (from a worker thread) after each result is queued; it must be
    cheap and thread-safe — the streamer passes its :class:`~.streaming.streamer.Waker`.
    The batches of a source with a ``lane`` (a job's transforms) run on that job's own
    threads, at most ``per_job`` of them, on lanes this assembler makes and closes.

    >>> asm = Assembler(1, lambda: None)
    >>> asm.lane_threads()
    0
    >>> asm.close()
    """

    def __init__(
        self,
        threads: int,
        notify: Callable[[], None],
        metrics: Metrics | None = None,
        per_job: int = ASSEMBLY_PER_JOB,
    ) -> None:
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="ss-assembly")
        # Planning (seconds for tens of millions of samples) gets its own lane: a flood of
        # Hellos then delays other Hellos' Welcomes, never the batches of running streams.
        self._plan_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ss-plan")
        self._results: queue.SimpleQueue[Done[Tag]] = queue.SimpleQueue()
        self._notify = notify
        self._metrics = metrics
        self._lanes = AssemblyLanes(per_job)

    def submit(self, tag: Tag, fn: Callable[..., object], *args: object) -> None:
        """Run ``fn(*args)`` on the pool; its :class:`Done` arrives through :meth:`results`."""
        fut = self._pool.submit(fn, *args)
        fut.add_done_callback(lambda f: self._finish(tag, f))

    def plan(self, tag: Tag, fn: Callable[..., object], *args: object) -> None:
        """Like :meth:`submit`, on the planning lane (one thread, apart from assembly)."""
        fut = self._plan_pool.submit(fn, *args)
        fut.add_done_callback(lambda f: self._finish(tag, f))

    def gather(
        self,
        tag: Tag,
        ds: BatchSource,
        indices: np.ndarray,
        fields: Sequence[str],
        out: Mapping[str, np.ndarray] | None,
        place: Placer | None = None,
        batch: int | None = None,
    ) -> None:
        """Assemble one batch (timed into ``shardserve_assembly_seconds``); ``place`` is where
        it is sent from (a shared-memory slot): ``take`` makes its variable-size parts there
        and ``place`` moves the rest in, still on the worker. A batch
        with transforms is assembled on its job's own lane: one that waits on a hung transform
        until its deadline never holds a thread another job's batches need."""
        if ds.lane is not None:
            fut = self._lanes.submit(
                ds.lane, self.assemble_now, ds, indices, fields, out, place, batch
            )
            fut.add_done_callback(lambda f: self._finish(tag, f))
            return
        self.submit(tag, self.assemble_now, ds, indices, fields, out, place, batch)

    def assemble_now(
        self,
        ds: BatchSource,
        indices: np.ndarray,
        fields: Sequence[str],
        out: Mapping[str, np.ndarray] | None,
        place: Placer | None = None,
        batch: int | None = None,
    ) -> dict[str, np.ndarray]:
        """What :meth:`gather` runs on a worker, run on the calling thread instead: a small
        batch of a lone stream costs less than the two thread hand-offs of the pool."""
        t0 = time.perf_counter()
        parts = assemble_batch(ds, indices, fields, out, batch, FRESH if place is None else place)
        if place is not None:
            parts = place(parts)
        if self._metrics is not None:
            self._metrics.assembly_seconds.observe(time.perf_counter() - t0)
        return parts

    def _finish(self, tag: Tag, fut: Future[object]) -> None:
        if fut.cancelled():
            return
        err = fut.exception()
        self._results.put(Done(tag, None if err else fut.result(), err))
        self._notify()

    def results(self) -> list[Done[Tag]]:
        """Every result queued so far (non-blocking)."""
        out = []
        while True:
            try:
                out.append(self._results.get_nowait())
            except queue.Empty:
                return out

    def lane_threads(self) -> int:
        """Threads on the jobs' own lanes now (assembling, or idle until they end)."""
        return self._lanes.threads()

    def close(self) -> None:
        """Drop queued work; running items finish on their own (each is one bounded take,
        or a transform's until its deadline)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._plan_pool.shutdown(wait=False, cancel_futures=True)
        self._lanes.close()
