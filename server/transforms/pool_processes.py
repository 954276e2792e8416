"""Transforms in worker processes: a bounded set of them, started with ``spawn`` (never a
fork of the threaded server), each sent one piece of a batch at a time.

A worker reads a request's inputs from a shared-memory file of its own when they fit there
(a pipe moves 64 KiB per wake-up of the other side), and writes fixed-size outputs straight
into the slot the batch is sent from when that slot says where it lives. A worker that
misses its deadline is killed and replaced and the piece fails with a ``TransformError``;
one that dies is replaced and its piece retried once on a fresh worker (a second death fails
the batch). See :mod:`.pool` for the whole picture.

>>> from prometheus_client import CollectorRegistry
>>> runs = ProcessRuns(1, ["math"], 5.0, TransformMetrics(CollectorRegistry()))
>>> runs.pids()
[]
>>> runs.close()
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing as mp
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from multiprocessing.context import SpawnContext
from typing import Any

import numpy as np

from shardserve.proto.errors import TransformError
from shardserve.proto.rings import align

from ..runtime.rings import ShmUnavailable, SlotRing, create_ring
from ..source import Spans
from . import codec
from .errors import StepFailed
from .metrics import TransformMetrics
from .runner import Limits, Where
from .spec import Chain
from .worker import main as worker_main

log = logging.getLogger("shardserve.transforms")

#: Seconds a fresh worker process may take to import the transform modules.
START_TIMEOUT_S = 60.0
#: Bytes of a worker's input file when first made; it is made anew, in powers of two, for a
#: request that needs more.
INPUT_FILE_MIN = 1 << 20
#: The largest input file of a worker: a request with more inputs sends them on the pipe.
INPUT_FILE_MAX = 64 << 20

Describe = Callable[[str], TransformError]
#: A piece's outputs and the seconds each transform spent on it.
PieceResult = tuple[dict[str, np.ndarray], dict[str, float]]


class Worker:
    """One worker process, its pipe, and its input file."""

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
            log.warning(
                "input file %s of transform worker pid %s was removed; making a new one",
                self.inputs.path,
                self.proc.pid,
            )
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


@dataclass(frozen=True, slots=True)
class _SharedRows:
    """A piece's rows of a fixed-size output, and where they lie in a shared file."""

    rows: np.ndarray
    path: str
    offset: int
    nbytes: int


def _shared_rows(
    chain: Chain, names: Sequence[str], n: int, rows: Mapping[str, np.ndarray] | None, spans: Spans
) -> dict[str, _SharedRows]:
    """The outputs among ``names`` a worker process can write straight into ``rows``: fixed
    ones whose rows are exactly their declared shape and dtype, in the shared-memory file
    ``spans`` says they lie in."""
    found: dict[str, _SharedRows] = {}
    if rows is None:
        return found
    for name in names:
        f, a = chain.outputs.get(name), rows.get(name)
        if f is None or a is None or not f.fixed:
            continue
        if a.shape != (n, *f.shape) or a.dtype != np.dtype(f.dtype):
            continue
        span = spans.span_of(a)
        if span is not None:
            found[name] = _SharedRows(a, span.path, span.offset, span.nbytes)
    return found


def _request(
    chain: Chain,
    where: Where,
    names: Sequence[str],
    limits: Limits,
    spans: Mapping[str, _SharedRows],
) -> dict[str, Any]:
    """What a worker is told of a piece besides its arrays."""
    return {
        "chain": [
            {"name": s.transform.name, "params": s.params.model_dump(mode="json")}
            for s in chain.steps
        ],
        "inputs": {
            n: {"dtype": f.dtype, "shape": list(f.shape), "binary": f.binary}
            for n, f in chain.inputs.items()
        },
        "where": {
            "seed": where.seed,
            "epoch": where.epoch,
            "rank": where.rank,
            "batch": where.batch,
            "scheme": where.scheme,
        },
        "limits": dataclasses.asdict(limits),
        "names": list(names),
        "out": {
            n: {"path": sp.path, "offset": sp.offset, "nbytes": sp.nbytes}
            for n, sp in spans.items()
        },
    }


class ProcessRuns:
    """``size`` worker processes, started at the first :meth:`piece`; thread-safe."""

    def __init__(
        self, size: int, modules: Sequence[str], timeout_s: float, metrics: TransformMetrics
    ) -> None:
        self.size, self.timeout_s = size, timeout_s
        self._modules = list(modules)
        self._metrics = metrics
        self._ctx = mp.get_context("spawn")
        self._idle: queue.Queue[Worker] = queue.Queue()
        self._all: list[Worker] = []
        self._lock = threading.Lock()
        self._started = False
        self._closed = False
        self.waiting = 0
        #: Set when shared memory cannot hold input files: every request uses the pipe.
        self._no_input_files = False

    def piece(
        self,
        chain: Chain,
        parts: Mapping[str, np.ndarray],
        indices: np.ndarray,
        where: Where,
        names: Sequence[str],
        deadline: float,
        describe: Describe,
        limits: Limits,
        rows: Mapping[str, np.ndarray] | None,
        shared: Spans,
    ) -> PieceResult:
        """Run one piece of a batch on a worker; fixed-size outputs among ``rows`` that
        ``shared`` places in a shared file are written there in place."""
        spans = _shared_rows(chain, names, len(indices), rows, shared)
        meta = _request(chain, where, names, limits, spans)
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
                log.warning(
                    "transform worker pid %s died (exit code %s); retrying on a new one",
                    w.proc.pid,
                    code,
                )
                continue
            self._idle.put(w)
            return self._answer(w, reply, out, spans, describe)
        raise AssertionError("unreachable")

    def _answer(
        self,
        w: Worker,
        reply: dict[str, Any],
        out: dict[str, np.ndarray],
        spans: Mapping[str, _SharedRows],
        describe: Describe,
    ) -> PieceResult:
        """A worker's reply as a piece's result: its outputs, those written in place taken
        from where they were written."""
        if not reply["ok"]:
            raise StepFailed.from_json(reply["failed"])
        for n in reply["in_place"]:
            if n not in spans:
                raise describe(
                    f"worker pid {w.proc.pid} says it wrote {n!r} in place; it was not asked to"
                )
            out[n] = spans[n].rows
            self._metrics.count("worker_bytes_in_place", spans[n].rows.nbytes)
        return out, reply["spent"]

    def _ask(
        self,
        w: Worker,
        meta: dict[str, Any],
        arrays: Mapping[str, np.ndarray],
        deadline: float,
        describe: Describe,
    ) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        """``w``'s reply to one request, its inputs in ``w``'s input file when they fit there.
        An input file removed before the worker mapped it (a cleanup of /dev/shm) costs one
        more request, with the inputs on the pipe, not the batch."""
        laid_out = self._lay_out(w, arrays)
        if laid_out is not None:
            reply, out = self._exchange(w, {**meta, "in": laid_out}, {}, deadline, describe)
            if "inputs_gone" not in reply:
                return reply, out
            log.warning(
                "transform worker pid %s: %s; its inputs go on the pipe this time",
                w.proc.pid,
                reply["inputs_gone"],
            )
        return self._exchange(w, meta, arrays, deadline, describe)

    def _exchange(
        self,
        w: Worker,
        meta: dict[str, Any],
        arrays: Mapping[str, np.ndarray],
        deadline: float,
        describe: Describe,
    ) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
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

    def _lay_out(self, w: Worker, arrays: Mapping[str, np.ndarray]) -> dict[str, Any] | None:
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
            laid.append(
                {
                    "name": name,
                    "dtype": a.dtype.str,
                    "shape": list(a.shape),
                    "offset": at[name],
                    "nbytes": a.nbytes,
                }
            )
        self._metrics.count("worker_input_bytes_via_shm", sum(a.nbytes for a in arrays.values()))
        return {"path": str(f.path), "arrays": laid}

    def _take_worker(self, deadline: float, describe: Describe) -> Worker:
        with self._lock:
            self.waiting += 1
            self._metrics.queue.set(self.waiting)
        try:
            return self._idle.get(timeout=max(deadline - time.monotonic(), 0.001))
        except queue.Empty:
            raise describe(
                f"waited {self.timeout_s} s for one of {self.size} transform workers; all busy"
            ) from None
        finally:
            with self._lock:
                self.waiting -= 1
                self._metrics.queue.set(self.waiting)

    def start(self) -> None:
        """Start the workers, once; ``TransformError`` when closed or a worker fails to."""
        with self._lock:
            if self._started or self._closed:
                if self._closed:
                    raise TransformError("the transform pool is closed (server stopping)")
                return
            # Started together, then waited for: each imports the transform modules (0.3 s
            # on 2 cores), which one after the other took 1.2 s for 4 workers.
            fresh = [Worker(self._ctx, self._modules) for _ in range(self.size)]
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

    def _replace_soon(self, w: Worker, reason: str) -> None:
        """Kill ``w`` now; its successor starts in the background (importing the transform
        modules takes seconds), so the error reaches the client at the deadline."""
        w.stop()
        threading.Thread(
            target=self._replace, args=(w, reason), name="ss-transform-restart", daemon=True
        ).start()

    def _replace(self, w: Worker, reason: str) -> None:
        w.stop()
        self._metrics.restarts.labels(reason).inc()
        self._metrics.count(f"workers_{reason}")
        log.warning("transform worker pid %s %s; starting a new one", w.proc.pid, reason)
        with self._lock:
            if w in self._all:
                self._all.remove(w)
            if self._closed:
                return
        fresh = Worker(self._ctx, self._modules)
        fresh.wait_ready()
        with self._lock:
            if self._closed:
                fresh.stop()
                return
            self._all.append(fresh)
            self._metrics.workers.set(len(self._all))
        self._idle.put(fresh)

    def pids(self) -> list[int]:
        return [w.proc.pid for w in list(self._all) if w.proc.pid is not None]

    def alive(self) -> int:
        return sum(w.proc.is_alive() for w in list(self._all))

    def input_file_bytes(self) -> int:
        return sum(f.nbytes for w in list(self._all) if (f := w.inputs))

    def close(self) -> None:
        """Stop every worker process (killed if it does not exit at once)."""
        with self._lock:
            self._closed = True
            workers, self._all = self._all, []
        for w in workers:
            w.stop()
        self._metrics.workers.set(0)
