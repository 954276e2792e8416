"""Each job's assembly lanes: threads a job's batches are assembled on, apart from other jobs'.

A batch whose take may wait (a transform until its deadline) is assembled on a
:class:`~.lanes.Lane` of its job's own, so a batch that hangs holds only that job's threads.
The :class:`~..reading.assembly.Assembler` owns one :class:`AssemblyLanes`; the work it runs
there learns which batch it assembles from :func:`assembling_batch` (the lane, the future its
consumer waits on, the thread): a chain run on that same thread fails the batch through it
at its deadline and leaves the hung thread to the job's lane.

>>> lanes = AssemblyLanes(per_job=1)
>>> lanes.submit("job", sum, [1, 2]).result(timeout=5)
3
>>> lanes.close()
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass

from shardserve.proto.errors import TransformError

from .lanes import Lane, Lanes

#: Batches of one job assembled at once (each may wait on its transform pieces).
ASSEMBLY_PER_JOB = 2


@dataclass(frozen=True, slots=True)
class AssemblingBatch:
    """A batch being assembled on its job's lane (:meth:`AssemblyLanes.submit`): what a
    chain run on that same thread fails the batch through when it misses its deadline."""

    _lane: Lane
    #: What the batch's consumer waits on.
    _fut: Future[object]
    #: The lane thread assembling it.
    _thread: int

    @property
    def job(self) -> str:
        """The job whose lane assembles the batch."""
        return self._lane.name

    @property
    def generation(self) -> int:
        """The lane's generation: it moves on when a batch of the job is given up on (runs
        begun before then fail, their job has failed)."""
        return self._lane.generation

    def give_up(self) -> None:
        """The batch missed its deadline: its thread, which cannot be stopped, is left to
        finish apart (the lane starts another for the job's next batches) and the job's
        batches under way fail (the generation moves on)."""
        self._lane.generation += 1
        self._lane.abandon(self._thread)

    def fail(self, err: BaseException) -> None:
        """Fail the batch now with ``err`` (a no-op if it has ended meanwhile)."""
        with contextlib.suppress(InvalidStateError):
            self._fut.set_exception(err)


class _Assembling(threading.local):
    #: The batch this thread is assembling, if any.
    batch: AssemblingBatch | None = None


_assembling = _Assembling()


def assembling_batch() -> AssemblingBatch | None:
    """The batch the calling thread is assembling on its job's lane, if any."""
    return _assembling.batch


def _settle(fut: Future[object], fn: Callable[..., object], args: tuple[object, ...]) -> None:
    try:
        result = fn(*args)
    except BaseException as e:
        with contextlib.suppress(InvalidStateError):  # failed at its deadline already
            fut.set_exception(e)
    else:
        with contextlib.suppress(InvalidStateError):
            fut.set_result(result)


class AssemblyLanes:
    """Each job's assembly threads, at most ``per_job`` a job; a lane of a finished job
    costs nothing (its threads end when idle)."""

    def __init__(self, per_job: int = ASSEMBLY_PER_JOB) -> None:
        self._lanes = Lanes(max(1, per_job))

    def submit(self, job: str, fn: Callable[..., object], *args: object) -> Future[object]:
        """Run ``fn(*args)`` (the assembly of a batch) on job ``job``'s own threads; the
        future fails with ``TransformError`` once the lanes are closed (server stopping)."""
        fut: Future[object] = Future()
        try:
            lane = self._lanes.get(job)
            lane.submit(self._assemble, lane, fut, fn, args)
        except RuntimeError as e:  # closed: the server is stopping
            fut.set_exception(TransformError(f"transforms are not run any more: {e}"))
        return fut

    @staticmethod
    def _assemble(
        lane: Lane, fut: Future[object], fn: Callable[..., object], args: tuple[object, ...]
    ) -> None:
        if not fut.set_running_or_notify_cancel():
            return
        _assembling.batch = AssemblingBatch(lane, fut, threading.get_ident())
        try:
            _settle(fut, fn, args)
        finally:
            _assembling.batch = None

    def threads(self) -> int:
        """Threads assembling (or idle on) every job's lanes now."""
        return self._lanes.threads()

    def close(self) -> None:
        """Cancel queued assemblies; running ones finish on their own threads."""
        self._lanes.close()
