"""The server's parts wired together, with one start/stop order.

``Service`` is what the control plane talks to: it answers every HTTP question from the store,
the job registry and the stream board, and reaches the data plane only by queueing a command
on the streamer (never by waiting on it). Start order: journal replay -> data plane bound ->
(HTTP started by the caller). Stop order is the reverse.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import zmq
from prometheus_client import CollectorRegistry

from shardserve.proto.errors import BadRequest, ErrorCode, JobNotFound
from shardserve.proto.jobs import (
    CreatedJob,
    DatasetInfo,
    EpochUpdate,
    JobSpec,
    JobStatus,
    ServerInfo,
)
from shardserve.proto.jobs import (
    job_id as spec_job_id,
)
from shardserve.proto.manifest import Manifest
from shardserve.proto.messages import SUPPORTED_PROTOCOLS

from .assembly import Assembler
from .jobs import EpochJournal, Job, JobRegistry
from .journal import JournalLocked
from .lifecycle import ENDED, LIVE, expired, job_state, last_active
from .logs import log_event
from .metrics import JobsSnapshot, Metrics, RankSeries
from .planning import num_batches
from .settings import Settings
from .store.catalog import Store
from .store.graphs import check_graph_job
from .store.remote import RemoteStore, StoreOptions, open_store
from .streaming.board import JobActivity, StreamBoard
from .streaming.handler import HandlerDeps, StreamHandler
from .streaming.limits import check_batch
from .streaming.plans import PlanCache
from .streaming.shm import DEFAULT_DIR as SHM_DIR
from .streaming.shm import PREFIX as SHM_PREFIX
from .streaming.shm import remove_stale
from .streaming.streamer import Streamer, StreamerConfig, Waker

log = logging.getLogger("shardserve.service")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("shardserve")
    except PackageNotFoundError:
        return "0+unknown"


def boot_id() -> str:
    """This kernel's boot id: clients with the same one share our host and /dev/shm."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def dataset_info(m: Manifest) -> DatasetInfo:
    return DatasetInfo(
        name=m.name,
        num_samples=m.num_samples,
        num_shards=len(m.shards),
        bytes=m.total_bytes,
        fields=[
            {"name": f.name, "dtype": f.dtype, "shape": list(f.shape), "kind": f.kind}
            | ({"nullable": True} if f.nullable else {})
            for f in m.fields
        ],
        created_at=m.created_at,
        structure=m.structure,
    )


def _open_store(settings: Settings, registry: CollectorRegistry) -> Store | RemoteStore:
    """The store of ``settings``: a folder, or a remote store with its local shard cache."""
    if not settings.store_is_remote:
        return Store(settings.store)
    # The object store's own client reads its credentials from the environment; we read the
    # same variables only to keep their values out of every message we write.
    options = dataclasses.replace(
        StoreOptions.from_env(os.environ, settings.store_endpoint),
        request_timeout_s=settings.store_timeout_s,
        connect_timeout_s=min(5.0, settings.store_timeout_s),
    )
    return open_store(
        settings.store,
        options=options,
        cache_dir=settings.cache_dir,
        cache_limit_bytes=settings.cache_limit_bytes,
        registry=registry,
        verify=settings.verify,
    )


class Service:
    """Store + jobs + data plane of one server process."""

    def __init__(self, settings: Settings, registry: CollectorRegistry | None = None) -> None:
        self.settings = settings
        self.journal = EpochJournal(settings.state_path / "jobs.jsonl")
        #: Why jobs are not journaled (another server owns the journal), if they are not.
        self.journal_problem: str | None = None
        self.jobs = JobRegistry(self.journal, max_jobs=settings.max_jobs)
        self.metrics = Metrics(registry)
        self.store = _open_store(settings, self.metrics.registry)
        self.board = StreamBoard()
        self.plans = PlanCache()
        self.metrics.watch_store_bytes(self._store_bytes)
        self.metrics.watch_jobs(self._jobs_snapshot)
        # Admission (cap check, eviction, creation) is one step, or two POSTs could both
        # take the last free place.
        self._admit_lock = threading.Lock()
        self.streamer = Streamer(
            StreamerConfig(
                endpoints=settings.data_endpoints,
                token=settings.token,
                heartbeat_s=settings.heartbeat_s,
                stream_timeout_s=settings.stream_timeout_s,
                # Clients map rings from their own /dev/shm, so the server makes them there too.
                shm_dir=SHM_DIR if settings.shm else None,
                shm_limit_bytes=settings.shm_limit_bytes,
                boot_id=boot_id(),
                max_batch_bytes=settings.max_batch_bytes,
            ),
            self._make_handler,
        )
        self.version = _version()
        self._opened: set[str] = set()
        self._open_lock = threading.Lock()

    def _make_handler(self, sock: zmq.Socket, waker: Waker) -> StreamHandler:
        assembler = Assembler(self.settings.assembly_threads, waker.wake, self.metrics)
        deps = HandlerDeps(
            open_dataset=self.open_dataset,
            registry=self.jobs,
            plans=self.plans,
            board=self.board,
            metrics=self.metrics,
        )
        return StreamHandler(sock, assembler, deps, self.streamer.config)

    def open_dataset(self, name: str) -> Any:
        """The shared ``Dataset`` for ``name``, verified per ``--verify`` on its first open only.

        ``Store.open(verify="full")`` re-checks a cached dataset every time; a server opens a
        dataset for every stream, so only the first open of each name asks for it.
        """
        with self._open_lock:
            first = name not in self._opened
            self._opened.add(name)
        try:
            return self.store.open(name, verify=self.settings.verify if first else "lazy")
        except BaseException:
            if first:
                with self._open_lock:
                    self._opened.discard(name)
            raise

    # -- lifecycle ----------------------------------------------------------------------

    def start(self) -> list[str]:
        """Own and replay the journal, bind the data plane; returns the bound endpoints.

        When another live server already writes the journal (two servers on one store with
        the default state dir), this one neither reads nor writes it: its jobs live in memory
        only, and the log and the status page say so (``journal_problem``).
        """
        try:
            self.journal.acquire()
        except JournalLocked as e:
            self.journal_problem = f"{e}; until then this server's jobs are not journaled"
        except OSError as e:  # a read-only store mount with the default state dir
            self.journal_problem = (
                f"cannot write the job journal in {self.journal.path.parent} ({e.strerror}): "
                "jobs are not journaled; give the server a writable --state-dir"
            )
        if self.journal_problem is not None:
            self.jobs.detach_journal()
            log_event(
                log, "journal.unavailable", level=logging.WARNING, reason=self.journal_problem
            )
        n = self.jobs.load()
        if self.settings.shm:
            # Rings of a server that was killed are nobody's now; a live server's are left alone.
            for name in remove_stale(SHM_DIR):
                log_event(log, "shm.stale_removed", segment=name)
        endpoints = self.streamer.start()
        log_event(
            log,
            "service.started",
            jobs=n,
            store=self.settings.store_shown,
            data=",".join(endpoints),
        )
        return endpoints

    def stop(self) -> None:
        self.streamer.stop()
        self.journal.release()
        if isinstance(self.store, RemoteStore) and self.store.cache is not None:
            self.store.cache.close()  # no prefetch outlives the service
        # Every ring is unlinked when its stream closes; one still here is a bug, but it must
        # not outlive the process that alone could clean it up.
        for path in SHM_DIR.glob(f"{SHM_PREFIX}{os.getpid()}-*"):
            path.unlink(missing_ok=True)
            log_event(log, "shm.leaked_ring_removed", level=logging.ERROR, segment=path.name)
        log_event(log, "service.stopped")

    def ready(self) -> tuple[bool, str]:
        """Whether the data plane is bound and the store readable, and if not, why."""
        if self.streamer.failure is not None:
            return False, self.streamer.failure
        if not self.streamer.ready:
            return False, "data plane not serving (not bound yet, or stopping)"
        if isinstance(self.store, RemoteStore):
            return True, "ready"  # a store that is away fails the streams that need it, by name
        root = self.settings.store
        assert isinstance(root, Path)
        if not root.is_dir() or not os.access(root, os.R_OK | os.X_OK):
            return False, f"store {root} is not a readable folder"
        return True, "ready"

    # -- what HTTP asks -----------------------------------------------------------------

    def info(self) -> ServerInfo:
        return ServerInfo(
            version=self.version,
            protocols=list(SUPPORTED_PROTOCOLS),
            data_endpoints=self.streamer.endpoints,
            host=socket.gethostname(),
            boot_id=boot_id(),
            auth_required=self.settings.token is not None,
        )

    def datasets(self) -> list[DatasetInfo]:
        return [dataset_info(m) for m in self.store.list()]

    def dataset(self, name: str) -> DatasetInfo:
        return dataset_info(self.store.manifest(name))

    def create_job(self, spec: JobSpec) -> CreatedJob:
        """Create (or find) the job for ``spec``; its dataset and fields must exist."""
        manifest = self.store.manifest(spec.dataset)
        known = [f.name for f in manifest.fields]
        unknown = [f for f in spec.fields or () if f not in known]
        if unknown:
            raise BadRequest(
                f"dataset {spec.dataset!r} has no field(s) {unknown}; its fields are {known}"
            )
        if spec.collate == "graph":
            check_graph_job(manifest, spec.fields)
        per_sample = manifest.total_bytes / max(manifest.num_samples, 1)
        check_batch(
            spec.batch_size,
            manifest.num_samples,
            int(per_sample * spec.batch_size),
            self.settings.max_batch_bytes,
        )
        with self._admit_lock:
            self.sweep()
            if self.jobs.find(spec_job_id(spec)) is None:
                self._make_room()
            job, created = self.jobs.create(spec, manifest.num_samples)
        return CreatedJob(id=job.id, created=created, status=self.status_of(job))

    def job(self, job_id: str) -> JobStatus:
        return self.status_of(self.jobs.get(job_id))

    def all_jobs(self) -> list[JobStatus]:
        """Every job, live ones first (running, then pending), each group newest first."""
        self.sweep()
        activity = self.board.activity()
        now = time.monotonic()
        order = {"running": 0, "pending": 1, "failed": 2, "idle": 3, "finished": 4}
        rows = [
            (job, job_state(job, activity.get(job.id), now, self.settings.idle_after_s))
            for job in self.jobs.list()
        ]
        rows.sort(key=lambda r: (order.get(r[1], 5), -last_active(r[0], activity.get(r[0].id))))
        return [self.status_of(job, state) for job, state in rows]

    def set_epoch(self, job_id: str, update: EpochUpdate) -> JobStatus:
        return self.status_of(self.jobs.set_epoch(job_id, update.epoch, update.seed))

    def plan(self, job_id: str, epoch: int, rank: int, env: int = 0) -> tuple[np.ndarray, int]:
        """``rank``'s sample ids of ``epoch`` in batch order (int64) and its batch count: what
        the data plane would stream, for clients that hold the data themselves (resident mode).
        """
        job = self.jobs.get(job_id)
        world = job.spec.world_size
        if not 0 <= rank < world:
            raise BadRequest(f"rank {rank} is out of range for job {job_id}: 0 <= rank < {world}")
        ds = self.open_dataset(job.spec.dataset)
        plan = self.plans.rank_plan(job, epoch, job.seed, rank, shard_rows=ds.shard_rows, env=env)
        ids = np.concatenate(list(plan)) if len(plan) else np.empty(0, dtype=np.int64)
        return ids.astype("<i8", copy=False), len(plan)

    def delete_job(self, job_id: str) -> JobStatus:
        return self._forget(job_id, "deleted over the control plane")

    def _forget(self, job_id: str, why: str) -> JobStatus:
        """Delete a job, end its streams, drop its rank records, plans and metric series."""
        job = self.jobs.delete(job_id, reason=why)
        message = f"job {job_id} was {why}"
        self.streamer.call(lambda h: h.job_gone(job_id, ErrorCode.JOB_FAILED, message))
        status = self.status_of(job, "deleted")
        self.board.drop_job(job_id)
        self.plans.forget(job_id)
        return status

    # -- lifecycle of jobs --------------------------------------------------------------

    def _states(self) -> list[tuple[Job, str, JobActivity | None]]:
        activity = self.board.activity()
        now = time.monotonic()
        return [
            (
                j,
                job_state(j, activity.get(j.id), now, self.settings.idle_after_s),
                activity.get(j.id),
            )
            for j in self.jobs.list()
        ]

    def sweep(self) -> list[str]:
        """Forget jobs that are not live and had no stream for ``job_ttl_s``; their ids."""
        now = time.monotonic()
        gone = []
        for job, state, act in self._states():
            if state not in LIVE and expired(job, act, now, self.settings.job_ttl_s):
                try:
                    self._forget(
                        job.id, f"expired after {self.settings.job_ttl_s:g} s without a stream"
                    )
                except JobNotFound:
                    continue  # deleted meanwhile
                gone.append(job.id)
        return gone

    def _make_room(self) -> None:
        """At the cap, evict the least recently used job that is not live, or refuse."""
        cap = self.settings.max_jobs
        if len(self.jobs) < cap:
            return
        states = self._states()
        idle = [(last_active(j, a), j.id) for j, st, a in states if st not in LIVE]
        if not idle:
            raise BadRequest(
                f"the server already has {cap} live jobs (pending or running), its cap "
                "(--max-jobs); delete some with DELETE /v1/jobs/{id} or wait for them to go idle"
            )
        _, victim = min(idle)
        with contextlib.suppress(JobNotFound):
            self._forget(victim, f"evicted to make room: {cap} jobs is the cap (--max-jobs)")

    def _jobs_snapshot(self) -> JobsSnapshot:
        """The per-job metric series of one scrape: ended jobs export none."""
        snap = JobsSnapshot()
        exported = set()
        for job, state, act in self._states():
            snap.states[state] = snap.states.get(state, 0) + 1
            if state not in ENDED:
                exported.add(job.id)
                snap.connected[job.id] = act.connected if act is not None else 0
        snap.ranks = [
            RankSeries(c.job, c.rank, c.batches, c.bytes, c.wait_s, c.compute_s)
            for c in self.board.counters()
            if c.job in exported
        ]
        return snap

    def status_of(self, job: Job, state: str | None = None) -> JobStatus:
        s = job.spec
        if state is None:
            act = self.board.activity().get(job.id)
            state = job_state(job, act, time.monotonic(), self.settings.idle_after_s)
        return JobStatus(
            id=job.id,
            spec=s,
            state=state,  # type: ignore[arg-type]
            epoch=job.epoch,
            seed=job.seed,
            num_samples=job.num_samples,
            batches_per_epoch=num_batches(
                job.num_samples, s.world_size, s.batch_size // s.envs, s.drop_last
            ),
            ranks=self.board.ranks(job.id),
            error=job.error,
        )

    def cache_summary(self) -> dict[str, float] | None:
        """The shard cache's counters, or ``None`` for a local store."""
        cache = getattr(self.store, "cache", None)
        if cache is None or cache.metrics is None:
            return None
        return cache.metrics.summary()

    def metrics_text(self) -> bytes:
        self.sweep()
        return self.metrics.render()

    def _store_bytes(self) -> float:
        if isinstance(self.store, RemoteStore):
            # A scrape must not list a bucket: count the datasets this server has opened.
            return float(self.store.opened_bytes())
        try:
            return float(sum(m.total_bytes for m in self.store.list()))
        except Exception:  # a scrape must not fail because one manifest is unreadable
            return float("nan")
