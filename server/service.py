"""The server's parts wired together, with one start/stop order.

``Service`` is what the control plane talks to: it answers every HTTP question from the store,
the job registry and the stream board, and reaches the data plane only by queueing a command
on the streamer (never by waiting on it). Start order: journal replay -> data plane bound ->
(HTTP started by the caller). Stop order is the reverse.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from shardserve.proto.errors import BadRequest, ErrorCode
from shardserve.proto.jobs import (
    CreatedJob,
    DatasetInfo,
    EpochUpdate,
    JobSpec,
    JobStatus,
    ServerInfo,
)
from shardserve.proto.manifest import Manifest
from shardserve.proto.messages import SUPPORTED_PROTOCOLS

from .assembly import Assembler
from .jobs import EpochJournal, Job, JobRegistry
from .logs import log_event
from .metrics import Metrics
from .planning import num_batches
from .settings import Settings
from .store.catalog import Store
from .store.graphs import check_graph_job
from .streaming.board import StreamBoard
from .streaming.plans import PlanCache
from .streaming.protocol import Parts, StreamHandler
from .streaming.shm import DEFAULT_DIR as SHM_DIR
from .streaming.shm import PREFIX as SHM_PREFIX
from .streaming.shm import remove_stale
from .streaming.streamer import Streamer, StreamerConfig

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


class Service:
    """Store + jobs + data plane of one server process."""

    def __init__(self, settings: Settings, registry: CollectorRegistry | None = None) -> None:
        self.settings = settings
        self.store = Store(settings.store)
        self.jobs = JobRegistry(EpochJournal(settings.state_path / "jobs.jsonl"))
        self.metrics = Metrics(registry)
        self.board = StreamBoard()
        self.plans = PlanCache()
        self.metrics.watch_store_bytes(self._store_bytes)
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
            ),
            self._make_handler,
        )
        self.version = _version()
        self._opened: set[str] = set()
        self._open_lock = threading.Lock()

    def _make_handler(self, sock: Any, waker: Any) -> StreamHandler:
        assembler = Assembler(self.settings.assembly_threads, waker.wake, self.metrics)
        parts = Parts(self.open_dataset, self.jobs, self.plans, self.board, self.metrics)
        return StreamHandler(sock, assembler, parts, self.streamer.config)

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
        """Replay the journal and bind the data plane; returns the bound endpoints."""
        n = self.jobs.load()
        if self.settings.shm:
            # Rings of a server that was killed are nobody's now; a live server's are left alone.
            for name in remove_stale(SHM_DIR):
                log_event(log, "shm.stale_removed", segment=name)
        endpoints = self.streamer.start()
        log_event(
            log, "service.started", jobs=n, store=str(self.settings.store), data=",".join(endpoints)
        )
        return endpoints

    def stop(self) -> None:
        self.streamer.stop()
        # Every ring is unlinked when its stream closes; one still here is a bug, but it must
        # not outlive the process that alone could clean it up.
        for path in SHM_DIR.glob(f"{SHM_PREFIX}{os.getpid()}-*"):
            path.unlink(missing_ok=True)
            log_event(log, "shm.leaked_ring_removed", level=logging.ERROR, segment=path.name)
        log_event(log, "service.stopped")

    def ready(self) -> tuple[bool, str]:
        """Whether the data plane is bound and the store readable, and if not, why."""
        if not self.streamer.ready:
            return False, "data plane not bound"
        root = self.settings.store
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
        job, created = self.jobs.create(spec, manifest.num_samples)
        return CreatedJob(id=job.id, created=created, status=self.status_of(job))

    def job(self, job_id: str) -> JobStatus:
        return self.status_of(self.jobs.get(job_id))

    def all_jobs(self) -> list[JobStatus]:
        return [self.status_of(j) for j in self.jobs.list()]

    def set_epoch(self, job_id: str, update: EpochUpdate) -> JobStatus:
        return self.status_of(self.jobs.set_epoch(job_id, update.epoch, update.seed))

    def delete_job(self, job_id: str) -> JobStatus:
        job = self.jobs.delete(job_id)
        message = f"job {job_id} was deleted over the control plane"
        self.streamer.call(lambda h: h.job_gone(job_id, ErrorCode.JOB_FAILED, message))
        status = self.status_of(job)
        self.board.drop_job(job_id)
        self.plans.forget(job_id)
        self.metrics.forget_job(job_id, job.spec.world_size)
        return status

    def status_of(self, job: Job) -> JobStatus:
        s = job.spec
        return JobStatus(
            id=job.id,
            spec=s,
            state=job.state,
            epoch=job.epoch,
            seed=job.seed,
            num_samples=job.num_samples,
            batches_per_epoch=num_batches(job.num_samples, s.world_size, s.batch_size, s.drop_last),
            ranks=self.board.ranks(job.id),
            error=job.error,
        )

    def metrics_text(self) -> bytes:
        counts: dict[str, int] = {"pending": 0, "running": 0, "failed": 0}
        for j in self.jobs.list():
            counts[j.state] = counts.get(j.state, 0) + 1
        for state, n in counts.items():
            self.metrics.jobs.labels(state=state).set(n)
        return self.metrics.render()

    def _store_bytes(self) -> float:
        try:
            return float(sum(m.total_bytes for m in self.store.list()))
        except Exception:  # a scrape must not fail because one manifest is unreadable
            return float("nan")
