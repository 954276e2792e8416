"""The main process's side of its streaming processes: starting them, placing streams on
them, applying their reports, and replacing one that dies.

One thread (``ss-processes``) owns every link socket; HTTP threads reach it through a queue
and wait on an event for the replies they need (an admitted stream), each with a timeout
naming the process it waited for. A process is a fresh interpreter
(``python -m shardserve.server.processes.child``) given its configuration as JSON on stdin:
nothing crosses between the processes pickled.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import zmq
from prometheus_client import CollectorRegistry

from shardserve.proto.errors import ErrorCode, JobNotFound
from shardserve.proto.processes import (
    Ack,
    AdmitStream,
    Closed,
    Conflict,
    EndJob,
    FellBack,
    Heard,
    JobFailed,
    LinkMessage,
    Opened,
    Placement,
    PlaceRequest,
    ProcessStatus,
    Ready,
    Report,
    Sent,
    Stop,
    StreamNoted,
    UpdateJob,
)

from ..registry.jobs import Job, JobRegistry
from ..runtime.logs import log_event
from ..runtime.metrics import ShareSeries
from ..runtime.rings import DEFAULT_DIR as SHM_DIR
from ..runtime.rings import remove_stale
from ..streaming.board import StreamBoard
from ..streaming.streamer import Waker
from .asks import Asks
from .config import ChildConfig, child_endpoints
from .counters import Totals
from .placement import MAIN, PlacementTable
from .replica import job_wire
from .spawn import Child, close_child, reap, spawn

log = logging.getLogger("shardserve.processes")

#: How long a new streaming process may take to import and bind before start-up fails.
START_TIMEOUT_S = 120.0
#: A process whose reports stop for this long, with its pipe still open, is replaced.
SILENT_AFTER_S = 30.0

#: ``on_failed(job, code, message)``: a job failed in a streaming process.
OnFailed = Callable[[str, ErrorCode, str], None]


class StreamProcesses:
    """``n`` streaming processes of one server, and the table that places streams on them."""

    def __init__(
        self,
        n: int,
        settings_json: str,
        data_endpoints: list[str],
        board: StreamBoard,
        jobs: JobRegistry,
        on_failed: OnFailed,
        shm: bool,
    ) -> None:
        self.n = n
        self.table = PlacementTable(n)
        self._settings_json = settings_json
        self._data_endpoints = data_endpoints
        self._board, self._jobs, self._on_failed, self._shm = board, jobs, on_failed, shm
        self._ctx = zmq.Context()
        self._dir = Path(tempfile.mkdtemp(prefix="shardserve-links-"))
        self._children: dict[int, Child] = {}
        self._restarts = dict.fromkeys(range(1, n + 1), 0)
        self._outbox: queue.SimpleQueue[tuple[int, LinkMessage]] = queue.SimpleQueue()
        self._waker = Waker()
        self._asks = Asks(self._send)
        #: Held from reading a job to queueing it for a process, so that what a process is
        #: sent of a job arrives in the order the registry changed it (never older after
        #: newer).
        self._job_order = threading.Lock()
        self._totals = Totals()
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        #: Why start-up failed (a process exited before it was ready), once it did.
        self._failure: str | None = None
        self._started = False
        self._stopped = False
        #: When each dead process is started again.
        self._respawn: dict[int, float] = {}

    # -- lifecycle ------------------------------------------------------------------------

    def start(self) -> None:
        """Start every process and return once each has bound its data endpoints; raise
        why not (a process that exits first, or one slower than :data:`START_TIMEOUT_S`)."""
        for k in range(1, self.n + 1):
            child = self._spawn(k)
            with self._lock:
                self._children[k] = child
        self._thread = threading.Thread(target=self._run, name="ss-processes", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        for k, child in sorted(self._children.items()):
            # Woken by its Ready, or by the thread when a process exits before it.
            while not child.ready.wait(min(0.1, max(0.0, deadline - time.monotonic()))):
                if self._failure is not None or time.monotonic() >= deadline:
                    self.stop()
                    raise RuntimeError(
                        self._failure
                        or f"streaming process {k} (pid {child.proc.pid}) did not bind its data "
                        f"endpoints within {START_TIMEOUT_S:.0f} s; see its log lines above"
                    )
        self._started = True

    def stop(self, timeout: float = 10.0) -> None:
        """Tell every process to close its streams and exit; kill what is left after
        ``timeout``. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        for k in list(self._children):
            self._outbox.put((k, Stop()))
        self._stopping.set()  # after the Stops: the thread's last flush sends them
        self._waker.wake()
        if self._thread is not None:
            self._thread.join(timeout)
        deadline = time.monotonic() + timeout
        killed = False
        for child in list(self._children.values()):
            try:
                child.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.proc.kill()
                killed = True
                reap(child.proc)
            close_child(child)
        self._children.clear()
        if killed and self._shm:  # a killed process left its rings behind
            self._remove_stale_rings()
        # The thread may still hold its sockets (it outlived its join): nothing lingers.
        self._ctx.destroy(linger=0)
        self._waker.close()
        with contextlib.suppress(OSError):
            for p in self._dir.iterdir():
                p.unlink()
            self._dir.rmdir()

    def _spawn(self, k: int) -> Child:
        config = ChildConfig(
            index=k,
            processes=self.n,
            link=f"ipc://{self._dir}/link-{k}.sock",
            data_endpoints=child_endpoints(self._data_endpoints, k),
            settings=self._settings_json,
        )
        return spawn(self._ctx, config)

    # -- what the main process asks -------------------------------------------------------

    def place(self, job: Job, req: PlaceRequest, *, anywhere: bool, main: list[str]) -> Placement:
        """Where ``req``'s rank of ``job`` opens its streams; that process is told to serve
        them. ``main``: the main process's data endpoints."""
        here = Placement(process=MAIN, data_endpoints=main)
        if job.state == "failed":  # its Hello gets the job's error here, typed
            return here
        shared = job.spec.share is not None
        with self._job_order:
            k = self.table.place(job.id, req.rank, shared=shared, anywhere=anywhere)
            if k == MAIN:
                return here
            # Read again now that the rank is placed: a seed set in between reaches k, and a
            # job deleted or failed in between is not served there.
            now = self._jobs.find(job.id)
            if now is None or now.state == "failed":
                self.table.move(job.id, req.rank, MAIN)
                if now is None:
                    raise JobNotFound(f"job {job.id} was deleted while its rank was placed")
                return here
            ask = self._asks.post(
                k, lambda rid: AdmitStream(request=rid, job=job_wire(now), rank=req.rank)
            )
        endpoints = self.table.endpoints(k) if self._asks.acked([ask]) else []
        if not endpoints:  # not confirmed, or the process died since: served here instead
            self.table.move(job.id, req.rank, MAIN)
            return here
        return Placement(process=k, data_endpoints=endpoints)

    def update_job(self, job: Job) -> None:
        """``job`` changed (a seed set with its epoch): every process serving it knows before
        this returns, so the next Hello anywhere reads the new job (each waited for at most
        :data:`ADMIT_TIMEOUT_S`, together; one that did not confirm is logged by name)."""
        with self._job_order:
            now = self._jobs.find(job.id)
            if now is None:
                return
            asks = [
                self._asks.post(k, lambda rid: UpdateJob(request=rid, job=job_wire(now)))
                for k in self.table.serving(job.id)
            ]
        self._asks.acked(asks)

    def end_job(self, job_id: str, code: ErrorCode, message: str) -> None:
        """End every stream of ``job_id`` in every streaming process."""
        self.table.forget_job(job_id)
        for k in range(1, self.n + 1):
            self._send(k, EndJob(job=job_id, code=code.value, message=message))

    def render(self, registry: CollectorRegistry) -> bytes:
        """``/metrics``: the main process's families plus every process's, summed."""
        with self._lock:
            live = [c.families for c in self._children.values() if c.ready.is_set()]
        return self._totals.render(registry, live)

    def processes(self) -> list[ProcessStatus]:
        """Each streaming process now (``GET /v1/processes``, the status page); one that
        died and waits to be started again shows ``up: false``, pid 0."""
        loads = self.table.loads()
        with self._lock:
            children = dict(self._children)
        out = []
        for k in range(1, self.n + 1):
            c = children.get(k)
            streams, ranks = loads.get(k, (0, 0))
            out.append(
                ProcessStatus(
                    index=k,
                    pid=c.proc.pid if c is not None else 0,
                    up=c is not None and c.ready.is_set(),
                    streams=streams,
                    ranks=ranks,
                    restarts=self._restarts[k],
                    data_endpoints=list(c.endpoints) if c is not None else [],
                )
            )
        return out

    def _send(self, k: int, message: LinkMessage) -> None:
        self._outbox.put((k, message))
        self._waker.wake()

    # -- the thread -----------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            try:
                if self._turn():
                    return
            except Exception as e:  # one bad message or spawn must not end the supervision
                log_event(
                    log,
                    "processes.supervisor_error",
                    level=logging.ERROR,
                    error=f"{type(e).__name__}: {e}",
                )
                time.sleep(0.25)  # a repeating failure: at most four log lines a second

    def _turn(self) -> bool:
        """One round of the thread: deliver, read, watch; True once it is to end."""
        poller = zmq.Poller()
        poller.register(self._waker.fileno(), zmq.POLLIN)
        children = dict(self._children)
        for c in children.values():
            poller.register(c.link.sock, zmq.POLLIN)
            poller.register(c.pidfd, zmq.POLLIN)
        events = dict(poller.poll(250))
        self._waker.drain()
        stopping = self._stopping.is_set()
        self._flush_outbox()
        if stopping:
            return True
        for c in children.values():
            if c.link.sock in events:
                while (msg := c.link.recv()) is not None:
                    self._on_message(c, msg)
            if c.pidfd in events or self._silent(c):
                self._died(c)
        self._respawn_due()
        return False

    def _flush_outbox(self) -> None:
        while True:
            try:
                k, msg = self._outbox.get_nowait()
            except queue.Empty:
                return
            child = self._children.get(k)
            # Only a ready process reads its link: a send to one starting would block this
            # thread until it connects (a new process holds nothing an EndJob would end).
            if child is not None and child.ready.is_set() and child.link.send(msg, block=False):
                continue
            match msg:
                case AdmitStream() | UpdateJob():
                    self._asks.undelivered(msg)

    def _silent(self, c: Child) -> bool:
        """Its reports stopped, or (a replacement) it never became ready."""
        now = time.monotonic()
        if c.ready.is_set():
            return now - c.last_report > SILENT_AFTER_S
        return self._started and now - c.spawned > START_TIMEOUT_S

    def _on_message(self, c: Child, msg: LinkMessage) -> None:
        match msg:
            case Ready():
                c.endpoints = list(msg.data_endpoints)
                c.last_report = time.monotonic()
                self.table.live(c.index, msg.data_endpoints)
                c.ready.set()
                log_event(log, "processes.ready", process=c.index, endpoints=",".join(c.endpoints))
            case Ack():
                self._asks.ack(msg.request)
            case Report():
                self._on_report(c, msg)
            case _:
                log_event(log, "processes.unexpected", level=logging.ERROR, kind=msg.kind)

    def _on_report(self, c: Child, r: Report) -> None:
        c.last_report = time.monotonic()
        b = self._board
        for e in r.events:
            match e:
                case Opened():
                    if self._jobs.find(e.job) is None:  # deleted since: no record to keep
                        continue
                    c.open.add((e.job, e.rank, e.stream))
                    b.opened(
                        e.job,
                        e.rank,
                        e.stream,
                        e.epoch,
                        e.start,
                        e.num_batches,
                        e.credit,
                        e.transport,
                    )
                case Closed():
                    c.open.discard((e.job, e.rank, e.stream))
                    b.closed(e.job, e.rank, e.stream)
                case Sent():
                    b.sent(e.job, e.rank, e.nbytes, e.next_batch, e.credit, e.batches)
                case Heard():
                    b.heard(e.job, e.rank, e.credit, e.wait_s, e.compute_s, e.batches)
                case FellBack():
                    b.fell_back(e.job, e.rank, e.reason)
                case Conflict():
                    b.conflict(e.job, e.rank, e.what)
                case StreamNoted():
                    self._jobs.note_stream(e.job, e.epoch, e.origin)
                case JobFailed():
                    self._on_failed(e.job, ErrorCode(e.code), e.message)
        if r.shares is not None and r.share_series is not None:
            b.set_shares(r.shares, [ShareSeries(*s) for s in r.share_series], origin=c.index)
        if r.families is not None:
            with self._lock:
                c.families = r.families
        opened = [(e.job, e.rank) for e in r.events if e.kind == "opened"]
        self.table.reported(c.index, len(c.open), opened)

    def _died(self, c: Child) -> None:
        """Its streams are gone (its clients re-open them elsewhere, exactly once), its
        counters kept, its rings removed, and another process takes its place."""
        code = c.proc.poll()
        if code is None:  # silent with its pipe open: its loop stopped
            log_event(log, "processes.silent", level=logging.ERROR, process=c.index)
            c.proc.kill()
            code = reap(c.proc)
        self.table.down(c.index)
        with self._lock:
            self._totals.fold(c.families)
            c.families = []
        for job, rank, stream in c.open:
            self._board.closed(job, rank, stream)
        self._board.set_shares({}, [], origin=c.index)
        close_child(c)
        if self._shm:
            self._remove_stale_rings()
        self._children.pop(c.index, None)
        if not self._started:  # at start-up: the server does not start
            self._failure = (
                f"streaming process {c.index} (pid {c.proc.pid}) exited with {code} before "
                "it was ready; see its log lines above"
            )
            return
        self._restarts[c.index] += 1
        # A process that dies at once again (a port another program took) is started again
        # after a wait that doubles, up to 10 s, not in a loop.
        delay = min(10.0, 0.1 * 2 ** min(self._restarts[c.index], 7))
        self._respawn[c.index] = time.monotonic() + delay
        log_event(
            log,
            "processes.died",
            level=logging.ERROR,
            process=c.index,
            pid=c.proc.pid,
            exit_code=code,
            restarts=self._restarts[c.index],
            restart_in_s=round(delay, 2),
        )

    def _respawn_due(self) -> None:
        now = time.monotonic()
        for k, at in list(self._respawn.items()):
            if at <= now:
                # Rescheduled first: a start that fails (no memory, no pids) is tried again.
                self._respawn[k] = now + 10.0
                child = self._spawn(k)
                del self._respawn[k]
                with self._lock:
                    self._children[k] = child

    def _remove_stale_rings(self) -> None:
        for name in remove_stale(SHM_DIR):
            log_event(log, "shm.stale_removed", segment=name)
