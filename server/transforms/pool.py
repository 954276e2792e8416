"""Where transforms run: each job's own threads, or a bounded pool of worker processes,
with a deadline.

Threads suit transforms that release the GIL (numpy, Pillow); worker *processes* (started
with ``spawn``: never a fork of the threaded server) suit pure-Python ones. A chain of sample
transforms only is cut into row ranges: one per worker process, so one batch uses the whole
pool; on threads, as many as leave no thread idle while a job assembles its batches at once.

Each job's batches are assembled on a :class:`~.lanes.Lane` of threads of its own
(:meth:`TransformPool.on_job_lane`), and its pieces run on another lane of its own (a thread
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

import contextlib
import dataclasses
import logging
import multiprocessing as mp
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, InvalidStateError, wait
from dataclasses import dataclass
from functools import partial
from multiprocessing.context import SpawnContext
from typing import Any, Literal

import numpy as np

from shardserve.proto.errors import TransformError

from ..deadlines import Deadlines
from ..lanes import Lane, Lanes
from ..shared_files import SHARED_FILES
from ..source import FRESH, Tail
from ..streaming.shm import ShmUnavailable, SlotRing, align, create_ring
from . import codec
from .chunks import bounds, concat_parts, slice_parts
from .errors import StepFailed
from .metrics import TransformMetrics
from .runner import Limits, Progress, Where, run_chain
from .spec import Chain
from .worker import main as worker_main

log = logging.getLogger("shardserve.transforms")

PoolSetting = Literal["auto", "thread", "process"]
#: Seconds a fresh worker process may take to import the transform modules.
START_TIMEOUT_S = 60.0
#: The lane of runs that name no job.
SHARED_LANE = ""
#: Bytes of a worker's input file when first made; it is made anew, in powers of two, for a
#: request that needs more.
INPUT_FILE_MIN = 1 << 20
#: The largest input file of a worker: a request with more inputs sends them on the pipe.
INPUT_FILE_MAX = 64 << 20


class _Worker:
    def __init__(self, ctx: SpawnContext, modules: list[str]) -> None:
        #: The shared-memory file the server lays this worker's inputs out in (one request at
        #: a time), made at its first request: a pipe moves 64 KiB per wake-up of the other
        #: side (a 270 KiB request took 240 us there, a copy into the file 10 us).
        self.inputs: SlotRing | None = None
        self.conn, child = ctx.Pipe(duplex=True)
        self.proc = ctx.Process(
            target=worker_main, args=(child, modules), name="ss-transform", daemon=True
        )
        self.proc.start()
        child.close()
        self._modules = modules

    def wait_ready(self) -> None:
        """Wait until the worker has loaded the transform modules; ``TransformError`` (the
        worker stopped) if it exits first or takes longer than ``START_TIMEOUT_S``."""
        modules = self._modules
        if not self.conn.poll(START_TIMEOUT_S):
            self.stop()
            raise TransformError(
                f"transform worker pid {self.proc.pid} did not start within {START_TIMEOUT_S} s"
            )
        try:
            self.conn.recv_bytes()
        except (EOFError, OSError):
            self.stop()
            raise TransformError(
                f"transform worker pid {self.proc.pid} exited while loading transform modules "
                f"{modules} (exit code {self.proc.exitcode}); see the server log"
            ) from None

    def input_file(self, nbytes: int) -> SlotRing:
        """This worker's input file, made anew if it holds less than ``nbytes``; raises
        ``ShmUnavailable`` when it cannot be made."""
        if self.inputs is not None and self.inputs.slot_bytes >= nbytes:
            if self.inputs.on_disk():
                return self.inputs
            # Removed by a cleanup of /dev/shm: the worker opens it by name, so make it again.
            log.warning("input file %s of transform worker pid %s was removed; making a new one",
                        self.inputs.path, self.proc.pid)  # fmt: skip
        self.close_inputs()
        size = max(INPUT_FILE_MIN, 1 << max(nbytes - 1, 0).bit_length())
        self.inputs = create_ring(self.proc.pid or 0, 1, size)
        return self.inputs

    def close_inputs(self) -> None:
        if self.inputs is not None:
            self.inputs.close()
            self.inputs = None

    def stop(self) -> None:
        self.conn.close()
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(5.0)
        self.close_inputs()


def _failed(f: Future[Any]) -> bool:
    """Whether piece ``f`` ended with an exception."""
    return f.done() and not f.cancelled() and f.exception() is not None


@dataclass(frozen=True, slots=True)
class _Batch:
    """A batch being assembled on its job's lane (:meth:`TransformPool.on_job_lane`): what a
    chain run on that same thread fails through when it misses its deadline."""

    lane: Lane
    #: What the batch's consumer waits on.
    fut: Future[object]
    #: The lane thread assembling it.
    thread: int


class _Assembling(threading.local):
    #: The batch this thread is assembling, if any.
    batch: _Batch | None = None


_assembling = _Assembling()


@dataclass(frozen=True, slots=True)
class _SharedRows:
    """A piece's rows of a fixed-size output, and where they lie in a shared file."""

    rows: np.ndarray
    path: str
    offset: int
    nbytes: int


def _shared_rows(chain: Chain, names: Sequence[str], n: int,
                 rows: Mapping[str, np.ndarray] | None) -> dict[str, _SharedRows]:  # fmt: skip
    """The outputs among ``names`` a worker process can write straight into ``rows``: fixed
    ones whose rows are exactly their declared shape and dtype, in a shared-memory file."""
    found: dict[str, _SharedRows] = {}
    if rows is None:
        return found
    for name in names:
        f, a = chain.outputs.get(name), rows.get(name)
        if f is None or a is None or not f.fixed:
            continue
        if a.shape != (n, *f.shape) or a.dtype != np.dtype(f.dtype):
            continue
        span = SHARED_FILES.locate(a)
        if span is not None:
            found[name] = _SharedRows(a, span.path, span.offset, span.nbytes)
    return found


def _hung_message(timeout_s: float, culprits: Sequence[str], cancelled: str) -> str:
    return (
        f"did not finish within {timeout_s} s on a transform thread (stuck in {culprits}; a "
        f"thread cannot be stopped: it was left to finish on this job's own lane{cancelled}, "
        f"and {culprits} run in worker processes from now on)"
    )


def _settle(fut: Future[object], fn: Callable[..., object], args: tuple[object, ...]) -> None:
    try:
        result = fn(*args)
    except BaseException as e:
        with contextlib.suppress(InvalidStateError):  # failed at its deadline already
            fut.set_exception(e)
    else:
        with contextlib.suppress(InvalidStateError):
            fut.set_result(result)


class TransformPool:
    """``run`` a chain on a batch within ``timeout_s``; see the module docstring.
    ``batches_at_once``: how many batches of one job are assembled at a time (it sets how
    many pieces a batch is cut into on threads)."""

    def __init__(self, workers: int, kind: PoolSetting, modules: Sequence[str], timeout_s: float,
                 metrics: TransformMetrics, limits: Limits | None = None,
                 batches_at_once: int = 1) -> None:  # fmt: skip
        self.size, self.kind, self.timeout_s = workers, kind, timeout_s
        #: Pieces a batch is cut into on threads: a job assembles ``batches_at_once`` batches
        #: at a time, which already keeps that many threads busy; more pieces per batch than
        #: fill the rest only make threads of one process take turns at the GIL (a batch of
        #: 16 pure-Python samples cut in two took 30% more CPU than whole on 2 cores).
        self._thread_pieces = max(1, workers // max(1, batches_at_once))
        self.limits = limits or Limits()
        self._modules = list(modules)
        self._metrics = metrics
        self._lanes = Lanes(workers)
        #: Each job's batches with transforms are assembled on threads of its own here; a
        #: chain run on threads in one piece runs on that same thread (no hand-off), under
        #: a deadline kept by ``_deadlines``.
        self._assembly = Lanes(max(1, batches_at_once))
        self._deadlines = Deadlines("transforms")
        self._running_here = 0
        #: Transforms that hung on a thread: they run in worker processes from then on.
        self._hung: set[str] = set()
        #: Completed with an exception by :meth:`close`: wakes every run waiting on its pieces.
        self._closing: Future[Any] = Future()
        self._ctx = mp.get_context("spawn")
        self._idle: queue.Queue[_Worker] = queue.Queue()
        self._all: list[_Worker] = []
        self._lock = threading.Lock()
        self._started = False
        self._closed = False
        self._waiting = 0
        #: Set when shared memory cannot hold input files: every request uses the pipe.
        self._no_input_files = False

    # -- public ---------------------------------------------------------------------------------
    def on_job_lane(self, lane: str, fn: Callable[..., object], *args: object) -> Future[object]:
        """Run ``fn(*args)`` (the assembly of a batch) on job ``lane``'s own assembly threads."""
        fut: Future[object] = Future()
        try:
            job = self._assembly.get(lane)
            job.submit(self._assemble, job, fut, fn, args)
        except RuntimeError as e:  # closed: the server is stopping
            fut.set_exception(TransformError(f"transforms are not run any more: {e}"))
        return fut

    def uses_processes(self, chain: Chain) -> bool:
        if self.kind == "process" or any(n in self._hung for n in chain.names):
            return True
        return self.kind == "auto" and chain.wants_process

    def run(self, chain: Chain, parts: Mapping[str, np.ndarray], indices: np.ndarray,
            where: Where, names: Sequence[str], describe: Callable[[str], TransformError],
            out: Mapping[str, np.ndarray] | None = None, tail: Tail = FRESH,
            lane: str = SHARED_LANE) -> dict[str, np.ndarray]:  # fmt: skip
        """Output parts of ``names``, run on the threads of ``lane`` (the job's id); raises
        :class:`StepFailed` (the chain failed on a sample or the batch) or ``TransformError``
        from ``describe(what)`` (hung, died, the job's other batch hung, server stopping).
        Fixed-size outputs are written into ``out``, variable-size ones joined in ``tail``."""
        deadline = time.monotonic() + self.timeout_s
        remote = self.uses_processes(chain)
        cut = self.size if remote else self._thread_pieces
        pieces = [(0, len(indices))] if chain.batch_steps else bounds(len(indices), cut)
        batch = _assembling.batch
        if not remote and len(pieces) == 1 and batch is not None:
            return self._run_here(batch, chain, parts, indices, where, names, describe, out,
                                  tail, deadline)  # fmt: skip
        if remote:
            self._start()
        try:
            job_lane = self._lanes.get(lane)
        except RuntimeError as closed:
            raise describe(str(closed)) from None
        generation = job_lane.generation
        # Each piece gets its share of the batch's bound on variable-size output bytes.
        limits = dataclasses.replace(
            self.limits, max_batch_bytes=max(self.limits.max_batch_bytes // len(pieces), 1)
        )
        futs: list[Future[tuple[dict[str, np.ndarray], dict[str, float]]]] = []
        progress = [Progress() for _ in pieces]
        for (lo, hi), prog in zip(pieces, progress, strict=True):
            sub = slice_parts(parts, chain.inputs, lo, hi) if len(pieces) > 1 else parts
            # A piece writes its rows of the fixed-size outputs in place (a worker process:
            # those in shared memory).
            rows = {k: v[lo:hi] for k, v in out.items()} if out is not None else None
            if remote:
                futs.append(job_lane.submit(self._remote, chain, sub, indices[lo:hi], where,
                                            names, deadline, describe, limits, rows))  # fmt: skip
            else:
                futs.append(job_lane.submit(run_chain, chain, sub, indices[lo:hi], where, names,
                                            rows, limits, prog))  # fmt: skip
        # A worker process's own wait ends at the deadline; the grace covers the hand-off.
        grace = 5.0 if remote else 1.0
        pending = self._wait(futs, deadline + grace)
        if self._closing.done():
            job_lane.cancel_queued()
            raise describe("the server is stopping")
        if pending and not remote and any(_failed(f) for f in futs):
            # A piece failed while others run: they write into ``out``, which a retry of this
            # batch (failing samples replaced) writes too, so they end first.
            for p in pending:
                p.cancel()
            pending = self._wait([p for p in pending if not p.cancelled()], deadline + grace,
                                 until_all=True)  # fmt: skip
            if self._closing.done():
                raise describe("the server is stopping")
            if pending:
                return self._hung_run(chain, job_lane, generation, futs, progress, describe)
        for (lo, _), f in zip(pieces, futs, strict=True):
            if f.done() and not f.cancelled() and (e := f.exception()) is not None:
                for p in pending:
                    p.cancel()
                if isinstance(e, StepFailed) and e.position is not None:
                    e.position += lo
                    e.all = [(p + lo, i) for p, i in e.all]
                raise e
        if job_lane.generation != generation:
            for p in pending:
                p.cancel()
            raise describe("another batch of this job hung on its transform threads; the "
                           "job fails with it")  # fmt: skip
        if pending and remote:  # a worker's own wait ends at the deadline: a stuck hand-off
            for p in pending:
                p.cancel()
            self._metrics.count("hung")
            raise describe(f"did not come back from a worker process within {self.timeout_s} s "
                           f"and {grace} s more")  # fmt: skip
        if pending:
            return self._hung_run(chain, job_lane, generation, futs, progress, describe)
        results = [f.result() for f in futs]
        spent: dict[str, float] = {}
        for _, s in results:
            for k, v in s.items():
                spent[k] = spent.get(k, 0.0) + v
        self._metrics.ran(spent, len(indices))
        return concat_parts([r for r, _ in results], chain.outputs, names, out, tail)

    def _wait(self, futs: Sequence[Future[Any]], until: float,
              until_all: bool = False) -> set[Future[Any]]:  # fmt: skip
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

    def _run_here(self, batch: _Batch, chain: Chain, parts: Mapping[str, np.ndarray],
                  indices: np.ndarray, where: Where, names: Sequence[str],
                  describe: Callable[[str], TransformError],
                  out: Mapping[str, np.ndarray] | None, tail: Tail,
                  deadline: float) -> dict[str, np.ndarray]:  # fmt: skip
        """A chain in one piece on threads, run on the thread assembling its batch: a
        hand-off to another thread and back costs two wake-ups per batch. At the deadline
        :meth:`_late` fails the batch, as a run on another thread would fail there."""
        generation = batch.lane.generation
        progress = Progress()
        try:
            watch = self._deadlines.watch(
                deadline, partial(self._late, batch, chain, progress, describe)
            )
        except RuntimeError as closed:
            raise describe(str(closed)) from None
        with self._lock:
            self._running_here += 1
        try:
            result, spent = run_chain(chain, parts, indices, where, names, out, self.limits,
                                      progress, tail)  # fmt: skip
        finally:
            in_time = watch.finish()
            with self._lock:
                self._running_here -= 1
        if not in_time:  # its batch has failed already: nothing of this run is used
            raise describe(f"finished after its deadline of {self.timeout_s} s")
        if batch.lane.generation != generation:
            raise describe("another batch of this job hung on its transform threads; the "
                           "job fails with it")  # fmt: skip
        self._metrics.ran(spent, len(indices))
        return concat_parts([result], chain.outputs, names, out)

    def _late(self, batch: _Batch, chain: Chain, progress: Progress,
              describe: Callable[[str], TransformError], why: str) -> None:  # fmt: skip
        """A chain run on its batch's own thread missed its deadline (``why="late"``) or the
        server stops under it: fail the batch now; the thread, which cannot be stopped, is
        left to finish on its job's lane, which starts another for the job's next batches."""
        if why == "stopping":
            err = describe("the server is stopping")
        else:
            culprits = [progress.step] if progress.step else chain.names
            batch.lane.generation += 1
            batch.lane.abandon(batch.thread)
            self._metrics.count("hung")
            self._metrics.errors.labels(",".join(chain.names)).inc()
            self._move_to_processes(culprits, batch.lane.name)
            err = describe(_hung_message(self.timeout_s, culprits, ""))
        with contextlib.suppress(InvalidStateError):  # it finished meanwhile, failing
            batch.fut.set_exception(err)

    def _move_to_processes(self, culprits: Sequence[str], lane: str) -> None:
        with self._lock:
            fresh = [c for c in culprits if c not in self._hung]
            self._hung.update(culprits)
        if fresh:
            log.warning("transform(s) %s hung on a thread of lane %s; they run in worker "
                        "processes from now on", fresh, lane)  # fmt: skip

    def _hung_run(self, chain: Chain, job_lane: Lane, generation: int,
                  futs: Sequence[Future[Any]], progress: Sequence[Progress],
                  describe: Callable[[str], TransformError]) -> dict[str, np.ndarray]:  # fmt: skip
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
            _hung_message(self.timeout_s, culprits, f", {cancelled} queued piece(s) cancelled")
        )

    def status(self) -> dict[str, Any]:
        return {
            "size": self.size,
            "kind": self.kind,
            "processes": sum(w.proc.is_alive() for w in self._all),
            "pids": self.pids(),
            "waiting": self._waiting,
            "timeout_s": self.timeout_s,
            "lanes": len(self._lanes),
            "lane_threads": self._lanes.threads(),
            "assembly_threads": self._assembly.threads(),
            "running_on_assembly_threads": self._running_here,
            "moved_to_processes": sorted(self._hung),
            "input_file_bytes": sum(f.nbytes for w in list(self._all) if (f := w.inputs)),
        }

    def pids(self) -> list[int]:
        return [w.proc.pid for w in list(self._all) if w.proc.pid is not None]

    def close(self) -> None:
        """Stop every worker process (killed if it does not exit at once) and the lanes; runs
        waiting on their pieces fail at once."""
        with self._lock:
            self._closed = True
            workers, self._all = self._all, []
        if not self._closing.done():
            self._closing.set_exception(TransformError("the transform pool is closed"))
        for w in workers:
            w.stop()
        self._metrics.workers.set(0)
        self._deadlines.close()
        self._lanes.close()
        self._assembly.close()

    # -- on a pool thread ----------------------------------------------------------------------
    def _assemble(self, lane: Lane, fut: Future[object], fn: Callable[..., object],
                  args: tuple[object, ...]) -> None:  # fmt: skip
        if not fut.set_running_or_notify_cancel():
            return
        _assembling.batch = _Batch(lane, fut, threading.get_ident())
        try:
            _settle(fut, fn, args)
        finally:
            _assembling.batch = None

    def _remote(self, chain: Chain, parts: Mapping[str, np.ndarray], indices: np.ndarray,
                where: Where, names: Sequence[str], deadline: float,
                describe: Callable[[str], TransformError], limits: Limits,
                rows: Mapping[str, np.ndarray] | None,
                ) -> tuple[dict[str, np.ndarray], dict[str, float]]:  # fmt: skip
        spans = _shared_rows(chain, names, len(indices), rows)
        meta = {
            "chain": [{"name": s.transform.name, "params": s.params.model_dump(mode="json")}
                      for s in chain.steps],
            "inputs": {n: {"dtype": f.dtype, "shape": list(f.shape), "binary": f.binary}
                       for n, f in chain.inputs.items()},
            "where": {"seed": where.seed, "epoch": where.epoch, "rank": where.rank,
                      "batch": where.batch, "scheme": where.scheme},
            "limits": dataclasses.asdict(limits),
            "names": list(names),
            "out": {n: {"path": sp.path, "offset": sp.offset, "nbytes": sp.nbytes}
                    for n, sp in spans.items()},
        }  # fmt: skip
        arrays = {**parts, "__indices__": np.asarray(indices, dtype=np.int64)}
        for attempt in (1, 2):
            w = self._take_worker(deadline, describe)
            try:
                reply, out = self._ask(w, meta, arrays, deadline, describe)
            except (EOFError, OSError, BrokenPipeError):
                w.proc.join(1.0)
                code = w.proc.exitcode
                self._replace_soon(w, "died")
                if attempt == 2 or time.monotonic() >= deadline:
                    raise describe(
                        f"worker pid {w.proc.pid} died (exit code {code}) twice on these "
                        "samples; it was replaced"
                    ) from None
                log.warning("transform worker pid %s died (exit code %s); retrying on a new one",
                            w.proc.pid, code)  # fmt: skip
                continue
            self._idle.put(w)
            if not reply["ok"]:
                raise StepFailed.from_json(reply["failed"])
            for n in reply["in_place"]:
                if n not in spans:
                    raise describe(f"worker pid {w.proc.pid} says it wrote {n!r} in place; it "
                                   "was not asked to")  # fmt: skip
                out[n] = spans[n].rows
                self._metrics.count("worker_bytes_in_place", spans[n].rows.nbytes)
            return out, reply["spent"]
        raise AssertionError("unreachable")

    def _ask(self, w: _Worker, meta: dict[str, Any], arrays: Mapping[str, np.ndarray],
             deadline: float, describe: Callable[[str], TransformError],
             ) -> tuple[dict[str, Any], dict[str, np.ndarray]]:  # fmt: skip
        """``w``'s reply to one request, its inputs in ``w``'s input file when they fit there.
        An input file removed before the worker mapped it (a cleanup of /dev/shm) costs one
        more request, with the inputs on the pipe, not the batch."""
        laid_out = self._lay_out(w, arrays)
        if laid_out is not None:
            reply, out = self._exchange(w, {**meta, "in": laid_out}, {}, deadline, describe)
            if "inputs_gone" not in reply:
                return reply, out
            log.warning("transform worker pid %s: %s; its inputs go on the pipe this time",
                        w.proc.pid, reply["inputs_gone"])  # fmt: skip
        return self._exchange(w, meta, arrays, deadline, describe)

    def _exchange(self, w: _Worker, meta: dict[str, Any], arrays: Mapping[str, np.ndarray],
                  deadline: float, describe: Callable[[str], TransformError],
                  ) -> tuple[dict[str, Any], dict[str, np.ndarray]]:  # fmt: skip
        """Send one request to ``w`` and wait for its reply until ``deadline`` (a worker that
        misses it is killed and replaced, and ``describe`` says so)."""
        codec.send(w.conn, meta, arrays)
        if not w.conn.poll(max(deadline - time.monotonic(), 0)):
            self._replace_soon(w, "hung")
            raise describe(
                f"worker pid {w.proc.pid} did not finish within {self.timeout_s} s; "
                "it was killed and replaced"
            )
        return codec.recv(w.conn)

    def _lay_out(self, w: _Worker, arrays: Mapping[str, np.ndarray]) -> dict[str, Any] | None:
        """Copy a request's inputs into ``w``'s input file; what the request says of them,
        or ``None`` when they go on the pipe (too big, or no shared memory here)."""
        if self._no_input_files:
            return None
        at, end = {}, 0
        for name, a in arrays.items():
            at[name] = end
            end = align(end + a.nbytes)
        if end > INPUT_FILE_MAX:
            return None
        try:
            f = w.input_file(end)
        except ShmUnavailable as e:
            self._no_input_files = True
            log.warning("transform inputs go through pipes: %s", e)
            return None
        laid: list[dict[str, Any]] = []
        for name, a in arrays.items():
            if a.nbytes:
                np.copyto(f.slot_array(0, at[name], a.dtype, a.shape), a)
            laid.append({"name": name, "dtype": a.dtype.str, "shape": list(a.shape),
                         "offset": at[name], "nbytes": a.nbytes})  # fmt: skip
        self._metrics.count("worker_input_bytes_via_shm", sum(a.nbytes for a in arrays.values()))
        return {"path": str(f.path), "arrays": laid}

    def _take_worker(self, deadline: float, describe: Callable[[str], TransformError]) -> _Worker:
        with self._lock:
            self._waiting += 1
            self._metrics.queue.set(self._waiting)
        try:
            return self._idle.get(timeout=max(deadline - time.monotonic(), 0.001))
        except queue.Empty:
            raise describe(
                f"waited {self.timeout_s} s for one of {self.size} transform workers; all busy"
            ) from None
        finally:
            with self._lock:
                self._waiting -= 1
                self._metrics.queue.set(self._waiting)

    def _start(self) -> None:
        with self._lock:
            if self._started or self._closed:
                if self._closed:
                    raise TransformError("the transform pool is closed (server stopping)")
                return
            # Started together, then waited for: each imports the transform modules (0.3 s
            # on 2 cores), which one after the other took 1.2 s for 4 workers.
            fresh = [_Worker(self._ctx, self._modules) for _ in range(self.size)]
            try:
                for w in fresh:
                    w.wait_ready()
            except TransformError:
                for w in fresh:
                    w.stop()
                raise
            for w in fresh:
                self._all.append(w)
                self._idle.put(w)
            self._started = True
            self._metrics.workers.set(len(self._all))

    def _replace_soon(self, w: _Worker, reason: str) -> None:
        """Kill ``w`` now; its successor starts in the background (importing the transform
        modules takes seconds), so the error reaches the client at the deadline."""
        w.stop()
        threading.Thread(
            target=self._replace, args=(w, reason), name="ss-transform-restart", daemon=True
        ).start()

    def _replace(self, w: _Worker, reason: str) -> None:
        w.stop()
        self._metrics.restarts.labels(reason).inc()
        self._metrics.count(f"workers_{reason}")
        log.warning("transform worker pid %s %s; starting a new one", w.proc.pid, reason)
        with self._lock:
            if w in self._all:
                self._all.remove(w)
            if self._closed:
                return
        fresh = _Worker(self._ctx, self._modules)
        fresh.wait_ready()
        with self._lock:
            if self._closed:
                fresh.stop()
                return
            self._all.append(fresh)
            self._metrics.workers.set(len(self._all))
        self._idle.put(fresh)
