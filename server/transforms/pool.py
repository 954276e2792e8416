"""Where transforms run: a bounded pool of threads or of worker processes, with a deadline.

Threads suit transforms that release the GIL (numpy, Pillow); worker *processes* (started
with ``spawn``: never a fork of the threaded server) suit pure-Python ones. A chain of sample
transforms only is cut into one row range per worker, so one batch uses the whole pool.

Every run has a deadline. A worker process that misses it is killed and replaced and the
batch fails with a ``TransformError``; one that dies is replaced and its piece retried once
on a fresh worker (a second death fails the batch). A thread cannot be killed: the batch
fails at the deadline and the thread is left to finish on its own (counted as ``hung``).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from typing import Any, Literal

import numpy as np

from shardserve.proto.errors import TransformError

from . import codec
from .chunks import bounds, concat_parts, slice_parts
from .errors import StepFailed
from .metrics import TransformMetrics
from .runner import Where, run_chain
from .spec import Chain
from .worker import main as worker_main

log = logging.getLogger("shardserve.transforms")

PoolSetting = Literal["auto", "thread", "process"]
#: Seconds a fresh worker process may take to import the transform modules.
START_TIMEOUT_S = 60.0


class _Worker:
    def __init__(self, ctx: Any, modules: list[str]) -> None:
        self.conn, child = ctx.Pipe(duplex=True)
        self.proc = ctx.Process(
            target=worker_main, args=(child, modules), name="ss-transform", daemon=True
        )
        self.proc.start()
        child.close()
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

    def stop(self) -> None:
        self.conn.close()
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(5.0)


class TransformPool:
    """``run`` a chain on a batch within ``timeout_s``; see the module docstring."""

    def __init__(self, workers: int, kind: PoolSetting, modules: Sequence[str], timeout_s: float,
                 metrics: TransformMetrics) -> None:  # fmt: skip
        self.size, self.kind, self.timeout_s = workers, kind, timeout_s
        self._modules = list(modules)
        self._metrics = metrics
        self._threads = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ss-transform")
        self._ctx = mp.get_context("spawn")
        self._idle: queue.Queue[_Worker] = queue.Queue()
        self._all: list[_Worker] = []
        self._lock = threading.Lock()
        self._started = False
        self._closed = False
        self._waiting = 0

    # -- public ---------------------------------------------------------------------------------
    def uses_processes(self, chain: Chain) -> bool:
        return self.kind == "process" or (self.kind == "auto" and chain.wants_process)

    def run(self, chain: Chain, parts: Mapping[str, np.ndarray], indices: np.ndarray,
            where: Where, names: Sequence[str], describe: Callable[[str], TransformError],
            out: Mapping[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:  # fmt: skip
        """Output parts of ``names``; raises :class:`StepFailed` (the chain failed on a sample
        or the batch) or ``TransformError`` from ``describe(what)`` (hung, died)."""
        deadline = time.monotonic() + self.timeout_s
        pieces = [(0, len(indices))] if chain.batch_steps else bounds(len(indices), self.size)
        remote = self.uses_processes(chain)
        if remote:
            self._start()
        futs: list[Future[tuple[dict[str, np.ndarray], dict[str, float]]]] = []
        for lo, hi in pieces:
            sub = slice_parts(parts, chain.inputs, lo, hi) if len(pieces) > 1 else parts
            fn = self._remote if remote else self._local
            futs.append(self._threads.submit(fn, chain, sub, indices[lo:hi], where, names,
                                             deadline, describe))  # fmt: skip
        # A worker process's own wait ends at the deadline; the grace covers the hand-off.
        grace = 5.0 if remote else 1.0
        _, pending = wait(
            futs, timeout=max(deadline - time.monotonic(), 0) + grace, return_when=FIRST_EXCEPTION
        )
        for (lo, _), f in zip(pieces, futs, strict=True):
            if f.done() and (e := f.exception()) is not None:
                for p in pending:
                    p.cancel()
                if isinstance(e, StepFailed) and e.position is not None:
                    e.position += lo
                    e.all = [(p + lo, i) for p, i in e.all]
                raise e
        if pending:
            self._metrics.count("hung")
            self._metrics.errors.labels(",".join(chain.names)).inc()
            raise describe(f"did not finish within {self.timeout_s} s on a transform thread "
                           "(a thread cannot be stopped; it was left to finish)")  # fmt: skip
        results = [f.result() for f in futs]
        spent: dict[str, float] = {}
        for _, s in results:
            for k, v in s.items():
                spent[k] = spent.get(k, 0.0) + v
        self._metrics.ran(spent, len(indices))
        return concat_parts([r for r, _ in results], chain.outputs, names, out)

    def status(self) -> dict[str, Any]:
        return {
            "size": self.size,
            "kind": self.kind,
            "processes": sum(w.proc.is_alive() for w in self._all),
            "pids": self.pids(),
            "waiting": self._waiting,
            "timeout_s": self.timeout_s,
        }

    def pids(self) -> list[int]:
        return [w.proc.pid for w in list(self._all) if w.proc.pid is not None]

    def close(self) -> None:
        """Stop every worker process (killed if it does not exit at once) and the threads."""
        with self._lock:
            self._closed = True
            workers, self._all = self._all, []
        for w in workers:
            w.stop()
        self._metrics.workers.set(0)
        self._threads.shutdown(wait=False, cancel_futures=True)

    # -- on a pool thread ----------------------------------------------------------------------
    @staticmethod
    def _local(chain: Chain, parts: Mapping[str, np.ndarray], indices: np.ndarray, where: Where,
               names: Sequence[str], deadline: float,
               describe: Callable[[str], TransformError]) -> tuple[dict[str, np.ndarray], dict[str, float]]:  # fmt: skip
        return run_chain(chain, parts, indices, where, names)

    def _remote(self, chain: Chain, parts: Mapping[str, np.ndarray], indices: np.ndarray,
                where: Where, names: Sequence[str], deadline: float,
                describe: Callable[[str], TransformError]) -> tuple[dict[str, np.ndarray], dict[str, float]]:  # fmt: skip
        meta = {
            "chain": [{"name": s.transform.name, "params": s.params.model_dump(mode="json")}
                      for s in chain.steps],
            "inputs": {n: {"dtype": f.dtype, "shape": list(f.shape), "binary": f.binary}
                       for n, f in chain.inputs.items()},
            "where": {"seed": where.seed, "epoch": where.epoch, "rank": where.rank,
                      "batch": where.batch},
            "names": list(names),
        }  # fmt: skip
        arrays = {**parts, "__indices__": np.asarray(indices, dtype=np.int64)}
        for attempt in (1, 2):
            w = self._take_worker(deadline, describe)
            try:
                codec.send(w.conn, meta, arrays)
                if not w.conn.poll(max(deadline - time.monotonic(), 0)):
                    self._replace_soon(w, "hung")
                    raise describe(
                        f"worker pid {w.proc.pid} did not finish within {self.timeout_s} s; "
                        "it was killed and replaced"
                    )
                reply, out = codec.recv(w.conn)
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
            return out, reply["spent"]
        raise AssertionError("unreachable")

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
            for _ in range(self.size):
                w = _Worker(self._ctx, self._modules)
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
        with self._lock:
            if self._closed:
                fresh.stop()
                return
            self._all.append(fresh)
            self._metrics.workers.set(len(self._all))
        self._idle.put(fresh)
