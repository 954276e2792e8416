"""Transforms on threads: a chain run on the thread assembling its batch, and what happens
when a run on threads misses its deadline.

A chain cut into one piece on threads runs on the thread assembling its batch (a hand-off to
another thread and back cost 60-90 us a batch on a quiet 2-core machine, more under load),
under a deadline kept by a :class:`~..deadlines.Deadlines` watcher. A thread cannot be
killed, so a run that misses its deadline fails, leaves its hung thread on its job's lane,
and moves the transform that hung to worker processes for every later run
(:attr:`ThreadRuns.hung`). See :mod:`.pool` for the whole picture.

>>> from prometheus_client import CollectorRegistry
>>> runs = ThreadRuns(TransformMetrics(CollectorRegistry()), 5.0, Limits())
>>> sorted(runs.hung)
[]
>>> runs.close()
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from functools import partial
from typing import Any, NoReturn

import numpy as np

from shardserve.proto.errors import TransformError

from ..runtime.assembly_lanes import AssemblingBatch
from ..runtime.deadlines import Deadlines
from ..runtime.lanes import Lane
from ..source import Tail
from .chunks import concat_parts
from .metrics import TransformMetrics
from .runner import Limits, Progress, Where, run_chain
from .spec import Chain

log = logging.getLogger("shardserve.transforms")


def hung_message(timeout_s: float, culprits: Sequence[str], cancelled: str) -> str:
    return (
        f"did not finish within {timeout_s} s on a transform thread (stuck in {culprits}; a "
        f"thread cannot be stopped: it was left to finish on this job's own lane{cancelled}, "
        f"and {culprits} run in worker processes from now on)"
    )


class ThreadRuns:
    """Chains run on the threads assembling their batches (the assembler's job lanes), and
    the transforms that hung on a thread (run in worker processes from then on)."""

    def __init__(self, metrics: TransformMetrics, timeout_s: float, limits: Limits) -> None:
        self.timeout_s, self.limits = timeout_s, limits
        self._metrics = metrics
        # A chain run on threads in one piece runs on the thread assembling its batch (no
        # hand-off), under a deadline kept by ``_deadlines``.
        self._deadlines = Deadlines("transforms")
        self.running_here = 0
        #: Transforms that hung on a thread: they run in worker processes from then on.
        self.hung: set[str] = set()
        self._lock = threading.Lock()

    def run_here(
        self,
        batch: AssemblingBatch,
        chain: Chain,
        parts: Mapping[str, np.ndarray],
        indices: np.ndarray,
        where: Where,
        names: Sequence[str],
        describe: Callable[[str], TransformError],
        out: Mapping[str, np.ndarray] | None,
        tail: Tail,
        deadline: float,
    ) -> dict[str, np.ndarray]:
        """A chain in one piece on threads, run on the thread assembling its batch: a
        hand-off to another thread and back costs two wake-ups per batch. At the deadline
        :meth:`_late` fails the batch, as a run on another thread would fail there."""
        generation = batch.generation
        progress = Progress()
        try:
            watch = self._deadlines.watch(
                deadline, partial(self._late, batch, chain, progress, describe)
            )
        except RuntimeError as closed:
            raise describe(str(closed)) from None
        with self._lock:
            self.running_here += 1
        try:
            result, spent = run_chain(
                chain, parts, indices, where, names, out, self.limits, progress, tail
            )
        finally:
            in_time = watch.finish()
            with self._lock:
                self.running_here -= 1
        if not in_time:  # its batch has failed already: nothing of this run is used
            raise describe(f"finished after its deadline of {self.timeout_s} s")
        if batch.generation != generation:
            raise describe(
                "another batch of this job hung on its transform threads; the job fails with it"
            )
        self._metrics.ran(spent, len(indices))
        return concat_parts([result], chain.outputs, names, out)

    def _late(
        self,
        batch: AssemblingBatch,
        chain: Chain,
        progress: Progress,
        describe: Callable[[str], TransformError],
        why: str,
    ) -> None:
        """A chain run on its batch's own thread missed its deadline (``why="late"``) or the
        server stops under it: fail the batch now; the thread, which cannot be stopped, is
        left to finish on its job's lane, which starts another for the job's next batches."""
        if why == "stopping":
            err = describe("the server is stopping")
        else:
            culprits = [progress.step] if progress.step else chain.names
            batch.give_up()
            self._metrics.count("hung")
            self._metrics.errors.labels(",".join(chain.names)).inc()
            self._move_to_processes(culprits, batch.job)
            err = describe(hung_message(self.timeout_s, culprits, ""))
        batch.fail(err)  # a no-op if it finished meanwhile, failing

    def _move_to_processes(self, culprits: Sequence[str], lane: str) -> None:
        with self._lock:
            fresh = [c for c in culprits if c not in self.hung]
            self.hung.update(culprits)
        if fresh:
            log.warning(
                "transform(s) %s hung on a thread of lane %s; they run in worker "
                "processes from now on",
                fresh,
                lane,
            )

    def hung_run(
        self,
        chain: Chain,
        job_lane: Lane,
        generation: int,
        futs: Sequence[Future[Any]],
        progress: Sequence[Progress],
        describe: Callable[[str], TransformError],
    ) -> NoReturn:
        """A run on threads missed its deadline: fail it and the job's other runs under way,
        cancel their queued pieces, and send the transform that hung to worker processes."""
        for f in futs:
            f.cancel()
        running = [p.step for f, p in zip(futs, progress, strict=True) if not f.done()]
        culprits = sorted({s for s in running if s}) or chain.names
        if job_lane.generation == generation:
            job_lane.generation += 1
        cancelled = job_lane.cancel_queued()
        self._metrics.count("hung")
        self._metrics.errors.labels(",".join(chain.names)).inc()
        self._move_to_processes(culprits, job_lane.name)
        raise describe(
            hung_message(self.timeout_s, culprits, f", {cancelled} queued piece(s) cancelled")
        )

    def close(self) -> None:
        """Stop the deadline watcher: chains running on assembling threads fail now."""
        self._deadlines.close()
