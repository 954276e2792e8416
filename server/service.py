"""The server's parts wired together, with one start/stop order.

``Service`` is what the control plane talks to: it answers questions about the store and the
server itself, hands job questions to its :class:`~.job_admin.JobAdmin`, and reaches the data
plane only by queueing a command on the streamer (never by waiting on it). Start order: journal replay -> data plane bound ->
(HTTP started by the caller). Stop order is the reverse.
"""

from __future__ import annotations

import json
import logging
import os
import socket
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np
import zmq
from prometheus_client import CollectorRegistry

from shardserve.proto.api import CreatedJob, DatasetInfo, ServerInfo
from shardserve.proto.errors import BadRequest, ErrorCode
from shardserve.proto.host import read_boot_id
from shardserve.proto.jobs import MIXTURE_PREFIX, JobSpec
from shardserve.proto.manifest import FieldSpec, Manifest
from shardserve.proto.messages import SUPPORTED_PROTOCOLS, Error, Hello
from shardserve.proto.processes import Placement, PlaceRequest, stream_ids_of

from .jobs.admin import JobAdmin
from .jobs.kinds.base import JobKind, KindParts
from .jobs.kinds.table import JobKinds
from .jobs.steering import MixtureAdmin
from .planning.cache import PlanCache
from .processes.parent import StreamProcesses
from .processes.placement import MAIN
from .reading.assembly import Assembler
from .reading.sources import open_source
from .registry.jobs import EpochJournal, Job, JobRegistry
from .registry.journal import JournalLocked
from .runtime.logs import log_event
from .runtime.metrics import Metrics
from .runtime.rings import DEFAULT_DIR as SHM_DIR
from .runtime.rings import PREFIX as SHM_PREFIX
from .runtime.rings import remove_stale
from .settings import Settings
from .streaming.board import StreamBoard
from .streaming.handler import HandlerDeps, StreamHandler
from .streaming.handshake import offset_bound
from .streaming.pipeline import Work
from .streaming.sessions import ALL_STREAM_IDS
from .streaming.streamer import Streamer, Waker
from .transforms.bound import Transforms
from .transforms.runner import Limits
from .wiring import open_store_of, streamer_config

if TYPE_CHECKING:
    # pyarrow (under the dataset) is imported when the first dataset is opened, not by an
    # idle server.
    from .store.read.dataset import Dataset

log = logging.getLogger("shardserve.service")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("shardserve")
    except PackageNotFoundError:
        return "0+unknown"


def _field_info(f: FieldSpec) -> dict[str, object]:
    out: dict[str, object] = {
        "name": f.name,
        "dtype": f.dtype,
        "shape": list(f.shape),
        "kind": f.kind,
    }
    if f.nullable:
        out["nullable"] = True
    if f.encoding:
        out["encoding"] = f.encoding
    return out


def dataset_info(m: Manifest) -> DatasetInfo:
    return DatasetInfo(
        name=m.name,
        num_samples=m.num_samples,
        num_shards=len(m.shards),
        bytes=m.total_bytes,
        fields=[_field_info(f) for f in m.fields],
        created_at=m.created_at,
        structure=m.structure,
        classes=json.loads(m.source["classes"]) if "classes" in m.source else None,
        label_names={
            k.removeprefix("labels."): json.loads(v)
            for k, v in m.source.items()
            if k.startswith("labels.")
        }
        or None,
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
        self.store = open_store_of(settings, self.metrics.registry)
        self.board = StreamBoard()
        self.plans = PlanCache(settings.plan_cache_bytes)
        self.metrics.watch_store_bytes(self._store_bytes)
        self.metrics.watch_mapped_versions(self.store.mapped_versions)
        # Loaded at start so a bad --transforms module stops the server at once.
        self.transforms = Transforms(
            settings.transforms,
            settings.transform_workers,
            settings.transform_pool,
            settings.transform_timeout_s,
            self.metrics.registry,
            Limits(settings.max_batch_bytes, settings.max_decoded_pixels),
        )
        # One order cache for every kind of job: one byte bound, one plan-ahead lane.
        self.mixture_admin = MixtureAdmin(self.jobs, self.board, self.store.manifest, self.plans)
        #: Every job kind's object; a job's is taken from here, once per question.
        self.kinds = JobKinds(
            KindParts(
                max_batch_bytes=settings.max_batch_bytes,
                jobs=self.jobs,
                plans=self.plans,
                mixtures=self.mixture_admin,
                manifest=self.store.manifest,
                check_shards=self.store.check_shards,
                transforms=self.transforms,
                open_dataset=self.open_dataset,
            )
        )
        self.job_admin = JobAdmin(
            settings,
            self.jobs,
            self.board,
            self.plans,
            self.kinds,
            self._end_streams,
            lambda: self.store.release_unpinned(self.jobs.pinned_versions()),
            self._job_changed,
        )
        self.metrics.watch_plan_bytes(lambda: self.plans.nbytes)
        self.metrics.watch_jobs(lambda: self.mixture_admin.add_to(self.job_admin.snapshot()))
        self.streamer = Streamer(
            streamer_config(settings, settings.data_endpoints), self._make_handler
        )
        #: The streaming processes beside this one (``--stream-processes`` > 1), else ``None``.
        self.processes: StreamProcesses | None = None
        if settings.stream_processes > 1:
            self.processes = StreamProcesses(
                settings.stream_processes,
                settings.model_dump_json(),
                settings.data_endpoints,
                self.board,
                self.jobs,
                self._job_failed_elsewhere,
                settings.shm,
            )
        self.version = _version()
        #: The data plane's assembler (it owns the jobs' assembly lanes), once made.
        self._assembler: Assembler[Work] | None = None

    def _make_handler(self, sock: zmq.Socket, waker: Waker) -> StreamHandler:
        assembler: Assembler[Work] = Assembler(
            self.settings.assembly_threads, waker.wake, self.metrics
        )
        self._assembler = assembler
        deps = HandlerDeps(
            open_source=partial(
                open_source,
                transforms=self.transforms,
                quarantine=self.mixture_admin.quarantine_failed,
            ),
            registry=self.jobs,
            kind_of=self._kind_of,
            board=self.board,
            metrics=self.metrics,
            gate=self._main_gate,
            # Beside streaming processes, ids of its own range (they never collide).
            stream_ids=ALL_STREAM_IDS if self.processes is None else stream_ids_of(MAIN),
            spread_failure=self._end_in_processes,
        )
        handler = StreamHandler(sock, assembler, deps, self.streamer.config)
        # A stream skipped while its re-plan ran on the planning lane goes on once it lands.
        self.plans.on_landed(lambda: self.streamer.call(lambda _h: handler.replanned()))
        return handler

    def _main_gate(self, hello: Hello) -> Error | None:
        """A Hello that reached this process for a rank placed in a streaming process is sent
        back to ask where to go (the rank's holder and its fencing live there)."""
        if self.processes is None:
            return None
        k = self.processes.table.claim_main(hello.job, hello.rank)
        if k == MAIN:
            return None
        return Error(
            code=ErrorCode.UNKNOWN_STREAM,
            message=(
                f"job {hello.job!r} rank {hello.rank} is served by streaming process {k}: ask "
                f"the control plane where to open it (POST /v1/jobs/{hello.job}/place)"
            ),
            fatal=False,
        )

    def _job_changed(self, job: Job) -> None:
        """A job's epoch or seed was set: the streaming processes serving it learn it."""
        if self.processes is not None:
            self.processes.update_job(job)

    def _job_failed_elsewhere(self, job_id: str, code: ErrorCode, message: str) -> None:
        """A streaming process found the job's bytes or chain failing: every rank stops."""
        self.jobs.fail(job_id, code, message)
        self._end_streams(job_id, message, code)

    def _end_in_processes(self, job_id: str, code: ErrorCode, message: str) -> None:
        """This process found the job failing: its ranks in streaming processes stop too."""
        if self.processes is not None:
            self.processes.end_job(job_id, code, message)

    def place(self, job_id: str, req: PlaceRequest) -> Placement:
        """Where to open ``req``'s stream of ``job_id`` (see :mod:`.processes.placement`): a
        server of one process answers its own data endpoints."""
        job = self.jobs.get(job_id)
        if not 0 <= req.rank < job.spec.world_size:
            raise BadRequest(
                f"rank {req.rank} is out of range for job {job_id}: 0 <= rank < "
                f"{job.spec.world_size}"
            )
        main = self.streamer.endpoints
        if self.processes is None:
            return Placement(process=MAIN, data_endpoints=main)
        anywhere = self.kinds.of(job.spec).streams_anywhere
        return self.processes.place(job, req, anywhere=anywhere, main=main)

    def create_job(self, spec: JobSpec) -> CreatedJob:
        """Create (or find) the job for ``spec`` (see :meth:`JobAdmin.create_job`)."""
        return self.job_admin.create_job(spec)

    def _kind_of(self, job: Job) -> JobKind:
        """The kind of ``job``, which plans its streams (``HandlerDeps.kind_of``)."""
        return self.kinds.of(job.spec)

    def open_dataset(self, name: str, version: str | None = None) -> Dataset:
        """The shared ``Dataset`` for ``name``; the store verifies each shard file once, per
        ``--verify``. With ``version`` (a job's pinned version), that version or
        ``DatasetChanged``."""
        if name.startswith(MIXTURE_PREFIX):  # a mixture job's label, not a dataset
            raise BadRequest(
                f"{name!r} names a mixture job, not a dataset: name one of its datasets"
            )
        return self.store.open(name, version=version)

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
        self.jobs.fail_changed(self.store.version)  # jobs of versions replaced while we were down
        if self.settings.shm:
            # Rings of a server that was killed are nobody's now; a live server's are left alone.
            for name in remove_stale(SHM_DIR):
                log_event(log, "shm.stale_removed", segment=name)
        endpoints = self.streamer.start()
        if self.processes is not None:
            self.processes.start()
        log_event(
            log,
            "service.started",
            jobs=n,
            store=self.settings.store_shown,
            data=",".join(endpoints),
        )
        return endpoints

    def stop(self) -> None:
        if self.processes is not None:
            self.processes.stop()
        self.streamer.stop()
        self.plans.close()
        self.transforms.close()
        self.journal.release()
        self.store.close()  # and its cache: no prefetch outlives the service
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
        why = self.store.unready()
        return (False, why) if why is not None else (True, "ready")

    # -- what HTTP asks -----------------------------------------------------------------

    def describe_transforms(self) -> dict[str, Any]:
        """The transforms' runtime (``GET /v1/transforms``), its ``pool`` with the threads
        assembling jobs' batches on their own lanes (the assembler's) as ``assembly_threads``."""
        d = self.transforms.describe()
        asm = self._assembler
        d["pool"]["assembly_threads"] = 0 if asm is None else asm.lane_threads()
        return d

    def info(self) -> ServerInfo:
        return ServerInfo(
            version=self.version,
            protocols=list(SUPPORTED_PROTOCOLS),
            data_endpoints=self.streamer.endpoints,
            host=socket.gethostname(),
            boot_id=read_boot_id(),
            auth_required=self.settings.token is not None,
            stream_processes=self.settings.stream_processes,
        )

    def datasets(self) -> list[DatasetInfo]:
        return [dataset_info(m) for m in self.store.list()]

    def dataset(self, name: str) -> DatasetInfo:
        return dataset_info(self.store.manifest(name))

    def _end_streams(
        self, job_id: str, message: str, code: ErrorCode = ErrorCode.JOB_FAILED
    ) -> None:
        self.streamer.call(lambda h: h.job_gone(job_id, code, message))
        self._end_in_processes(job_id, code, message)

    def plan(
        self,
        job_id: str,
        epoch: int,
        rank: int,
        env: int | None = None,
        offset: int = 0,
        take: bool = False,
        origin: str = "",
    ) -> tuple[np.ndarray, int]:
        """``rank``'s sample ids of ``epoch`` in batch order (int64) and its batch count: what
        the data plane would stream, for clients that hold the data themselves (resident mode).
        ``env``: that environment's own ids and batches (:meth:`PlanCache.env_plan`); ``None``:
        the job's batches as streamed (a job of several environments: whole steps).
        ``offset``: dealt from that position of the order, as a ``Hello.offset`` streams it;
        ``origin``: the job whose state that resumes, linked as a ``Hello.origin`` links it.
        ``take``: the client gathers the epoch from the plan itself (see ``JobKind``).
        """
        if origin:
            self.jobs.note_stream(job_id, epoch, origin)
        job = self.jobs.get(job_id)
        world = job.spec.world_size
        if not 0 <= rank < world:
            raise BadRequest(f"rank {rank} is out of range for job {job_id}: 0 <= rank < {world}")
        bound = offset_bound(job)
        if offset >= bound:
            raise BadRequest(
                f"offset {offset} out of range 0 <= offset < {bound} for job {job_id} (one "
                f"batch of every rank, within its {job.num_samples} samples)"
            )
        return self.kinds.of(job.spec).resident_plan(job, epoch, rank, env, offset, take)

    def cache_summary(self) -> dict[str, float] | None:
        """The shard cache's counters, or ``None`` for a local store."""
        cache = self.store.cache
        if cache is None or cache.metrics is None:
            return None
        return cache.metrics.summary()

    def metrics_text(self) -> bytes:
        self.job_admin.sweep()
        if self.processes is not None:
            return self.processes.render(self.metrics.registry)
        return self.metrics.render()

    def _store_bytes(self) -> float:
        return self.store.served_bytes()
