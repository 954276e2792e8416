"""A streaming process's view of the jobs: those the main process placed ranks of here, and
those ranks. What the streams write to the registry goes back to the main process as events
(see :class:`~.feed.BoardFeed`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from shardserve.proto.errors import ErrorCode
from shardserve.proto.jobs import JobSpec
from shardserve.proto.messages import Error, Hello
from shardserve.proto.processes import BoardEvent, JobFailed, JobWire, StreamNoted

from ..registry.jobs import Job


def job_wire(job: Job) -> JobWire:
    """What a streaming process needs of ``job``."""
    return JobWire(
        id=job.id,
        spec=job.spec.model_dump(mode="json"),
        num_samples=job.num_samples,
        epoch=job.epoch,
        seed=job.seed,
        resumed_from=job.resumed_from,
    )


def job_of(wire: JobWire) -> Job:
    """The job a streaming process serves, from what the main process sent."""
    return Job(
        id=wire.id,
        spec=JobSpec.model_validate(wire.spec),
        num_samples=wire.num_samples,
        epoch=wire.epoch,
        seed=wire.seed,
        resumed_from=wire.resumed_from,
    )


class JobReplica:
    """Jobs and placed ranks of one streaming process (any thread).

    >>> r = JobReplica(lambda e: None)
    >>> r.find("j") is None
    True
    """

    def __init__(self, emit: Callable[[BoardEvent], None]) -> None:
        self._emit = emit
        self._lock = threading.Lock()
        self._jobs: dict[str, Job] = {}
        self._ranks: set[tuple[str, int]] = set()

    def admit(self, wire: JobWire, rank: int) -> None:
        """Serve the Hellos of the job's ``rank`` (the job as the main process knows it now)."""
        with self._lock:
            self._jobs[wire.id] = job_of(wire)
            self._ranks.add((wire.id, rank))

    def update(self, wire: JobWire) -> None:
        """The job changed in the main process (a seed set with its epoch)."""
        with self._lock:
            if wire.id in self._jobs:
                self._jobs[wire.id] = job_of(wire)

    def gate(self, hello: Hello) -> Error | None:
        """Serve only the ranks the main process placed here."""
        with self._lock:
            placed = (hello.job, hello.rank) in self._ranks
        if placed:
            return None
        return Error(
            code=ErrorCode.UNKNOWN_STREAM,
            message=(
                f"job {hello.job!r} rank {hello.rank} was not placed on this streaming "
                "process: ask the control plane where to open it (POST /v1/jobs/{id}/place) "
                "and say Hello there"
            ),
            fatal=False,
        )

    def forget(self, job_id: str) -> None:
        """The job was deleted or failed: no new stream of it opens here."""
        with self._lock:
            self._jobs.pop(job_id, None)
            self._ranks = {r for r in self._ranks if r[0] != job_id}

    # -- StreamJobs -----------------------------------------------------------------------

    def find(self, jid: str) -> Job | None:
        with self._lock:
            return self._jobs.get(jid)

    def note_stream(self, jid: str, epoch: int, origin: str = "") -> None:
        self._emit(StreamNoted(job=jid, epoch=epoch, origin=origin))

    def fail(self, jid: str, code: ErrorCode, message: str) -> Job | None:
        with self._lock:
            job = self._jobs.pop(jid, None)
        self._emit(JobFailed(job=jid, code=code.value, message=message))
        return job
