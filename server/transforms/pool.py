"""Where transforms run: each job's own threads (:mod:`.pool_threads`) or a bounded pool of
worker processes (:mod:`.pool_processes`), with a deadline; this module chooses between them
and cuts a batch into pieces.

Threads suit transforms that release the GIL (numpy, Pillow); worker *processes* (started
with ``spawn``: never a fork of the threaded server) suit pure-Python ones. A chain of sample
transforms only is cut into row ranges: one per worker process, so one batch uses the whole
pool; on threads, as many as leave no thread idle while a job assembles its batches at once.

Each job's batches are assembled on a :class:`~.lanes.Lane` of threads of its own (owned by
the :class:`~..reading.assembly.Assembler`, see :mod:`~..runtime.assembly_lanes`), and its
pieces run on another lane of its own, owned here (a thread
in a process run only waits on its worker). A chain cut into one piece on threads (the
default: two workers, two batches of a job at a time) runs on the thread assembling its
batch instead: a hand-off to another thread and back cost 60-90 us a batch on a quiet
2-core machine, more under load. Every run has a deadline, kept by a waiting thread or, for
a run on the assembling thread, by a :class:`~..deadlines.Deadlines` watcher. A worker
process that misses the deadline is killed and replaced and the batch fails with a
``TransformError``; one that dies is replaced and its piece retried once on a fresh worker
(a second death fails the batch). A thread cannot be killed, so a run that misses its
deadline on threads:

- fails with ``TransformError`` at the deadline, and so do the job's other batches already
  under way (queued pieces are cancelled at once; a batch whose chain runs on its
  assembling thread fails when that chain returns);
- leaves its hung thread on that job's lane, never on one another job needs (a lane whose
  thread hung starts another for the job's next batches);
- moves the transform that hung to worker processes for every later run, whatever
  ``--transform-pool`` says: there it can be killed at its deadline.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from shardserve.proto.errors import TransformError

from ..runtime.assembly_lanes import assembling_batch
from ..runtime.lanes import Lane, Lanes
from ..source import FRESH, Tail
from .chunks import bounds, concat_parts, slice_parts
from .errors import StepFailed
from .metrics import TransformMetrics
from .pool_threads import ThreadRuns
from .runner import Limits, Progress, Where, run_chain
from .spec import Chain

if TYPE_CHECKING:
    # Imported where the first run on worker processes makes them: an idle server (and one
    # whose chains all run on threads) never loads ``multiprocessing`` or the worker's code.
    from .pool_processes import Describe, PieceResult, ProcessRuns

PoolSetting = Literal["auto", "thread", "process"]
#: The lane of runs that name no job.
SHARED_LANE = ""


def _failed(f: Future[Any]) -> bool:
    """Whether piece ``f`` ended with an exception."""
    return f.done() and not f.cancelled() and f.exception() is not None


@dataclass
class _Pieces:
    """One run cut into pieces on a job's piece lane, and what became of them."""

    chain: Chain
    bounds: list[tuple[int, int]]
    remote: bool
    lane: Lane
    #: The lane's generation when the run began: it moves on when a run of the job hangs.
    generation: int
    deadline: float
    describe: Describe
    futs: list[Future[PieceResult]] = dataclasses.field(default_factory=list)
    progress: list[Progress] = dataclasses.field(default_factory=list)

    @property
    def grace(self) -> float:
        """Seconds past the deadline a run waits: a worker process's own wait ends at the
        deadline; the grace covers the hand-off."""
        return 5.0 if self.remote else 1.0


class TransformPool:
    """``run`` a chain on a batch within ``timeout_s``; see the module docstring.
    ``batches_at_once``: how many batches of one job are assembled at a time (it sets how
    many pieces a batch is cut into on threads).

    >>> from prometheus_client import CollectorRegistry
    >>> pool = TransformPool(2, "thread", [], 5.0, TransformMetrics(CollectorRegistry()))
    >>> pool.status()["kind"]
    'thread'
    >>> pool.close()
    """

    def __init__(
        self,
        workers: int,
        kind: PoolSetting,
        modules: Sequence[str],
        timeout_s: float,
        metrics: TransformMetrics,
        limits: Limits | None = None,
        batches_at_once: int = 1,
    ) -> None:
        self.size, self.kind, self.timeout_s = workers, kind, timeout_s
        #: Pieces a batch is cut into on threads: a job assembles ``batches_at_once`` batches
        #: at a time, which already keeps that many threads busy; more pieces per batch than
        #: fill the rest only make threads of one process take turns at the GIL (a batch of
        #: 16 pure-Python samples cut in two took 30% more CPU than whole on 2 cores).
        self._thread_pieces = max(1, workers // max(1, batches_at_once))
        self.limits = limits or Limits()
        self._metrics = metrics
        #: Each job's pieces run on a lane of its own (a thread in a process run only waits
        #: on its worker).
        self._lanes = Lanes(workers)
        self._threads = ThreadRuns(metrics, timeout_s, self.limits)
        self._modules = list(modules)
        #: The worker processes, made by :meth:`_remote` at the first run that needs them.
        self._processes: ProcessRuns | None = None
        self._processes_lock = threading.Lock()
        #: Completed with an exception by :meth:`close`: wakes every run waiting on its pieces.
        self._closing: Future[Any] = Future()

    # -- public ---------------------------------------------------------------------------------
    def uses_processes(self, chain: Chain) -> bool:
        if self.kind == "process" or any(n in self._threads.hung for n in chain.names):
            return True
        return self.kind == "auto" and chain.wants_process

    def run(
        self,
        chain: Chain,
        parts: Mapping[str, np.ndarray],
        indices: np.ndarray,
        where: Where,
        names: Sequence[str],
        describe: Describe,
        out: Mapping[str, np.ndarray] | None = None,
        tail: Tail = FRESH,
        lane: str = SHARED_LANE,
    ) -> dict[str, np.ndarray]:
        """Output parts of ``names``, run on the threads of ``lane`` (the job's id); raises
        :class:`StepFailed` (the chain failed on a sample or the batch) or ``TransformError``
        from ``describe(what)`` (hung, died, the job's other batch hung, server stopping).
        Fixed-size outputs are written into ``out``, variable-size ones joined in ``tail``."""
        deadline = time.monotonic() + self.timeout_s
        remote = self.uses_processes(chain)
        cut = self.size if remote else self._thread_pieces
        pieces = [(0, len(indices))] if chain.batch_steps else bounds(len(indices), cut)
        batch = assembling_batch()
        if not remote and len(pieces) == 1 and batch is not None:
            return self._threads.run_here(
                batch, chain, parts, indices, where, names, describe, out, tail, deadline
            )
        if remote:
            self._remote(describe).start()
        try:
            job_lane = self._lanes.get(lane)
        except RuntimeError as closed:
            raise describe(str(closed)) from None
        run = _Pieces(chain, pieces, remote, job_lane, job_lane.generation, deadline, describe)
        self._submit(run, parts, indices, where, names, out, tail)
        self._settle(run)
        spent: dict[str, float] = {}
        results = [f.result() for f in run.futs]
        for _, s in results:
            for k, v in s.items():
                spent[k] = spent.get(k, 0.0) + v
        self._metrics.ran(spent, len(indices))
        return concat_parts([r for r, _ in results], chain.outputs, names, out, tail)

    # -- a run in pieces ---------------------------------------------------------------------
    def _submit(
        self,
        run: _Pieces,
        parts: Mapping[str, np.ndarray],
        indices: np.ndarray,
        where: Where,
        names: Sequence[str],
        out: Mapping[str, np.ndarray] | None,
        tail: Tail,
    ) -> None:
        """Submit each piece of ``run`` to its job's piece lane; a worker process writes
        rows of ``out`` in place where ``tail`` (the batch's slot) says they lie."""
        chain, n = run.chain, len(run.bounds)
        # Each piece gets its share of the batch's bound on variable-size output bytes.
        limits = dataclasses.replace(
            self.limits, max_batch_bytes=max(self.limits.max_batch_bytes // n, 1)
        )
        for lo, hi in run.bounds:
            prog = Progress()
            run.progress.append(prog)
            sub = slice_parts(parts, chain.inputs, lo, hi) if n > 1 else parts
            # A piece writes its rows of the fixed-size outputs in place (a worker process:
            # those in shared memory).
            rows = {k: v[lo:hi] for k, v in out.items()} if out is not None else None
            if run.remote:
                run.futs.append(
                    run.lane.submit(
                        self._remote(run.describe).piece,
                        chain,
                        sub,
                        indices[lo:hi],
                        where,
                        names,
                        run.deadline,
                        run.describe,
                        limits,
                        rows,
                        tail,
                    )
                )
            else:
                run.futs.append(
                    run.lane.submit(
                        run_chain, chain, sub, indices[lo:hi], where, names, rows, limits, prog
                    )
                )

    def _settle(self, run: _Pieces) -> None:
        """Wait for the pieces of ``run``; raises what failed it (a piece, a hang, the job's
        other batch, the server stopping), else every piece has its result."""
        pending = self._wait(run.futs, run.deadline + run.grace)
        if self._closing.done():
            run.lane.cancel_queued()
            raise run.describe("the server is stopping")
        if pending and not run.remote and any(_failed(f) for f in run.futs):
            # A piece failed while others run: they write into ``out``, which a retry of this
            # batch (failing samples replaced) writes too, so they end first.
            for p in pending:
                p.cancel()
            pending = self._wait(
                [p for p in pending if not p.cancelled()], run.deadline + run.grace, until_all=True
            )
            if self._closing.done():
                raise run.describe("the server is stopping")
            if pending:
                self._threads.hung_run(
                    run.chain, run.lane, run.generation, run.futs, run.progress, run.describe
                )
        self._raise_failed(run, pending)
        if pending and run.remote:  # a worker's own wait ends at the deadline: a stuck hand-off
            for p in pending:
                p.cancel()
            self._metrics.count("hung")
            raise run.describe(
                f"did not come back from a worker process within "
                f"{self.timeout_s} s and {run.grace} s more"
            )
        if pending:
            self._threads.hung_run(
                run.chain, run.lane, run.generation, run.futs, run.progress, run.describe
            )

    @staticmethod
    def _raise_failed(run: _Pieces, pending: set[Future[Any]]) -> None:
        """Raise the first piece's failure (its sample positions made the batch's), or that
        another batch of the job hung."""
        for (lo, _), f in zip(run.bounds, run.futs, strict=True):
            if f.done() and not f.cancelled() and (e := f.exception()) is not None:
                for p in pending:
                    p.cancel()
                if isinstance(e, StepFailed) and e.position is not None:
                    e.position += lo
                    e.all = [(p + lo, i) for p, i in e.all]
                raise e
        if run.lane.generation != run.generation:
            for p in pending:
                p.cancel()
            raise run.describe(
                "another batch of this job hung on its transform threads; the job fails with it"
            )

    def _wait(
        self, futs: Sequence[Future[Any]], until: float, until_all: bool = False
    ) -> set[Future[Any]]:
        """Wait until every piece is done, one raised (unless ``until_all``), the pool closes
        or ``until`` passes; the pieces still pending."""
        pending: set[Future[Any]] = set(futs)
        while pending and not self._closing.done():
            left = until - time.monotonic()
            if left <= 0:
                break
            done, _ = wait([*pending, self._closing], timeout=left, return_when=FIRST_COMPLETED)
            pending -= done
            if not until_all and any(_failed(f) for f in done):
                break
        return pending

    def _remote(self, describe: Describe) -> ProcessRuns:
        """The worker processes, made (not started) at the first call; ``describe``'s error
        once the pool is closed."""
        with self._processes_lock:
            if self._closing.done():
                raise describe("the server is stopping")
            if self._processes is None:
                from .pool_processes import ProcessRuns

                self._processes = ProcessRuns(
                    self.size, self._modules, self.timeout_s, self._metrics
                )
            return self._processes

    def status(self) -> dict[str, Any]:
        procs = self._processes
        return {
            "size": self.size,
            "kind": self.kind,
            "processes": procs.alive() if procs is not None else 0,
            "pids": self.pids(),
            "waiting": procs.waiting if procs is not None else 0,
            "timeout_s": self.timeout_s,
            "lanes": len(self._lanes),
            "lane_threads": self._lanes.threads(),
            "running_on_assembly_threads": self._threads.running_here,
            "moved_to_processes": sorted(self._threads.hung),
            "input_file_bytes": procs.input_file_bytes() if procs is not None else 0,
        }

    def pids(self) -> list[int]:
        procs = self._processes
        return procs.pids() if procs is not None else []

    def close(self) -> None:
        """Stop every worker process (killed if it does not exit at once) and the lanes; runs
        waiting on their pieces fail at once."""
        if not self._closing.done():
            self._closing.set_exception(TransformError("the transform pool is closed"))
        with self._processes_lock:
            procs = self._processes
        if procs is not None:
            procs.close()
        self._threads.close()
        self._lanes.close()
