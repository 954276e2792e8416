"""The job registry, journaled to ``<state_dir>/jobs.jsonl`` (:mod:`.journal`).

A job is its spec (``job_id(spec)`` is a hash of it), plus the little the control plane may
change: the epoch and a seed override set with ``PUT /v1/jobs/{id}/epoch``. Streams never
change them: a rank's epoch is whatever its client asks for in its Hello, so the same script
run twice against a server that kept running sees the same batches. Creations, epoch changes
and deletions are journaled and replayed at start; after a replay the journal is rewritten
with one ``create`` and at most one ``epoch`` line per job kept.

Bounded: at most :data:`MAX_JOBS` jobs, in memory and when a journal is replayed (the most
recently written ones are kept). Which of them are live, idle or finished is decided from
the streams (:mod:`.lifecycle`); the service expires and evicts jobs that are not live.

Everything here is thread-safe: HTTP handlers and the streamer thread share one registry.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from shardserve.proto.api import JobState
from shardserve.proto.errors import (
    BadRequest,
    DatasetNotFound,
    ErrorCode,
    JobNotFound,
    ShardserveError,
    StepInThePast,
)
from shardserve.proto.jobs import JobSpec, WeightChange, check_weights, job_id

from ..runtime.logs import log_event
from ..store.versions import changed_error
from .journal import (
    CreateRecord,
    DeleteRecord,
    EpochJournal,
    EpochRecord,
    MixtureRecord,
    QuarantineRecord,
)
from .quarantine import Quarantines

__all__ = ["MAX_JOBS", "EpochJournal", "Job", "JobRegistry"]

log = logging.getLogger("shardserve.jobs")

#: Refuse to track more jobs than this: each is cheap, but an unbounded registry is not.
MAX_JOBS = 4096
#: Most weight changes one job may be given while training.
MAX_CHANGES = 1024


@dataclass(frozen=True)
class Job:
    """A snapshot of one job; the registry hands out copies, never its own records."""

    id: str
    spec: JobSpec
    num_samples: int
    #: ``pending`` or ``failed``; the other states are derived from streams (``.lifecycle``).
    state: JobState = "pending"
    epoch: int = 0
    seed: int = 0
    error: str | None = None
    error_code: ErrorCode | None = None
    #: ``time.monotonic()`` of the last thing that happened to the job here (created,
    #: replayed, epoch set, a stream opened).
    touched: float = field(default=0.0, compare=False)
    #: Replayed from the journal and not streamed since: not live until a rank comes back.
    restored: bool = field(default=False, compare=False)
    #: The job of another world size whose state a rank of this one resumed (elastic resume,
    #: from ``Hello.origin``); kept in memory, said again by each stream of the resumed epoch.
    resumed_from: str | None = None
    #: A mixture job's sizes of its sources (pinned versions), in the order of the spec.
    source_sizes: tuple[int, ...] | None = None
    #: Weight changes set while training (``PUT /v1/jobs/{id}/mixture``), by step.
    changes: tuple[WeightChange, ...] = ()

    def schedule(self) -> tuple[WeightChange, ...]:
        """The whole weight schedule: the spec's weights at step 0, the spec's schedule, then
        the changes set while training (a later one at the same step replaces the earlier)."""
        mix = self.spec.mixture or ()
        by_step = {0: WeightChange(at_step=0, weights=tuple(s.weight for s in mix))}
        for c in (*(self.spec.schedule or ()), *self.changes):
            by_step[c.at_step] = c
        return tuple(by_step[k] for k in sorted(by_step))


def _with_weight_change(job: Job, rec: MixtureRecord) -> Job:
    """``job`` with the journaled weight change ``rec`` appended to its schedule; as it was
    when the weights do not fit its sources (a hand edit), with a log line saying why."""
    try:
        check_weights(rec.weights, len(job.spec.mixture or ()), "weights")
    except ValueError as e:
        log_event(log, "journal.mixture_skipped", level=logging.WARNING, job=rec.id, reason=str(e))
        return job
    return replace(
        job, changes=(*job.changes, WeightChange(at_step=rec.at_step, weights=rec.weights))
    )


class JobRegistry:
    """Jobs by id. ``journal=None`` keeps them in memory only."""

    def __init__(self, journal: EpochJournal | None = None, max_jobs: int = MAX_JOBS) -> None:
        self._journal = journal
        self.max_jobs = max_jobs
        self._jobs: dict[str, Job] = {}
        self._lock = threading.Lock()
        #: Quarantined samples per dataset; journaled here with the jobs.
        self.quarantine = Quarantines()
        #: Per mixture job, the last global step a rank's stream has taken the samples of
        #: (:meth:`resolving`): a change at or before it would rewrite what a rank read.
        self._resolved: dict[str, int] = {}
        #: Per job, bumped by every weight change and quarantine that reaches its plans: a
        #: stream's plan made before is made again.
        self._steering: dict[str, int] = {}

    def load(self) -> int:
        """Replay the journal into the registry and compact it; returns the number of jobs.

        Past :attr:`max_jobs` the least recently written jobs are dropped (one log line says
        how many): a journal grown by a bug or by hand never loads past the cap.
        """
        if self._journal is None:
            return 0
        jobs = self._replay(self._journal)
        self._drop_over_cap(jobs, self._journal)
        with self._lock:
            self._jobs = jobs
        self._journal.rewrite(
            [r for j in jobs.values() for r in _records_of(j)] + self.quarantine.records()
        )
        return len(jobs)

    def _replay(self, journal: EpochJournal) -> dict[str, Job]:
        """The jobs ``journal``'s records make, least recently written first (quarantines
        go into :attr:`quarantine` on the way)."""
        now = time.monotonic()
        jobs: dict[str, Job] = {}
        for rec in journal.replay():
            if isinstance(rec, CreateRecord):
                jobs.pop(rec.id, None)  # re-inserted last: dict order is recency order
                jobs[rec.id] = Job(
                    rec.id,
                    rec.spec,
                    rec.num_samples,
                    seed=rec.spec.seed,
                    touched=now,
                    restored=True,
                    source_sizes=rec.source_sizes,
                )
            elif isinstance(rec, EpochRecord) and rec.id in jobs:
                jobs[rec.id] = replace(jobs.pop(rec.id), epoch=rec.epoch, seed=rec.seed)
            elif isinstance(rec, DeleteRecord):
                jobs.pop(rec.id, None)
            elif isinstance(rec, MixtureRecord) and rec.id in jobs:
                jobs[rec.id] = _with_weight_change(jobs[rec.id], rec)
            elif isinstance(rec, QuarantineRecord):
                try:
                    self.quarantine.add(rec.dataset, rec.ids, rec.reason, rec.at)
                except BadRequest as e:  # a journal edited past the cap: keep what fits
                    log_event(
                        log, "journal.quarantine_skipped", level=logging.WARNING, reason=str(e)
                    )
        return jobs

    def _drop_over_cap(self, jobs: dict[str, Job], journal: EpochJournal) -> None:
        """Drop the least recently written of ``jobs`` past :attr:`max_jobs`, saying so."""
        over = len(jobs) - self.max_jobs
        if over > 0:
            for jid in list(jobs)[:over]:
                del jobs[jid]
            log_event(
                log,
                "journal.over_cap",
                level=logging.WARNING,
                path=str(journal.path),
                kept=len(jobs),
                dropped=over,
                reason=f"more than {self.max_jobs} jobs; the least recently written were dropped",
            )

    def fail_changed(self, version_of: Callable[[str], str]) -> list[str]:
        """Fail every job whose pinned dataset version is no longer the current one
        (``version_of(name)``); called after :meth:`load`, when nothing old is mapped. A
        dataset gone altogether fails its jobs too; a store that cannot answer now (remote,
        away) leaves them to fail, or not, when a rank opens its stream. Returns the ids.
        """
        failed = []
        current: dict[str, str | None] = {}
        for job in self.list():
            if job.state == "failed":
                continue
            for name, pinned in job.spec.pins:
                if pinned is None:
                    continue
                if name not in current:
                    try:
                        current[name] = version_of(name)
                    except DatasetNotFound:
                        current[name] = None
                    except ShardserveError:
                        continue
                if current[name] != pinned:
                    err = changed_error(name, pinned, current[name])
                    self.fail(job.id, err.code, str(err))
                    failed.append(job.id)
                    break
        return failed

    def pinned_versions(self) -> set[tuple[str, str | None]]:
        """``(dataset, version)`` of every job known: the versions a store must keep."""
        with self._lock:
            return {pin for j in self._jobs.values() for pin in j.spec.pins}

    def detach_journal(self) -> None:
        """Keep jobs in memory only from now on (the journal belongs to another server)."""
        self._journal = None

    def __len__(self) -> int:
        with self._lock:
            return len(self._jobs)

    def create(
        self, spec: JobSpec, num_samples: int, source_sizes: tuple[int, ...] | None = None
    ) -> tuple[Job, bool]:
        """The job for ``spec``, creating it if new; ``(job, created)``. Idempotent."""
        jid = job_id(spec)
        with self._lock:
            if jid in self._jobs:
                job = self._jobs[jid] = replace(self._jobs[jid], touched=time.monotonic())
                return job, False
            if len(self._jobs) >= self.max_jobs:
                raise BadRequest(
                    f"the server already tracks {self.max_jobs} live jobs; delete some "
                    "(DELETE /v1/jobs/{id}) or wait for idle ones to expire"
                )
            job = Job(
                jid,
                spec,
                num_samples,
                seed=spec.seed,
                touched=time.monotonic(),
                source_sizes=source_sizes,
            )
            self._jobs[jid] = job
            self._append(_records_of(job)[0])
        log_event(
            log,
            "job.created",
            job=jid,
            dataset=spec.dataset,
            batch_size=spec.batch_size,
            world_size=spec.world_size,
            shuffle=spec.shuffle,
        )
        return job, True

    def get(self, jid: str) -> Job:
        with self._lock:
            job = self._jobs.get(jid)
        if job is None:
            raise JobNotFound(
                f"no job {jid!r} on this server; POST /v1/jobs with its spec to create it"
            )
        return job

    def find(self, jid: str) -> Job | None:
        with self._lock:
            return self._jobs.get(jid)

    def list(self) -> list[Job]:
        with self._lock:
            return list(self._jobs.values())

    def set_epoch(self, jid: str, epoch: int, seed: int | None = None) -> Job:
        """Set the epoch (and optionally a new seed) a client streams when it asks for the
        job's epoch; journaled before returning."""
        with self._lock:
            job = self._get_locked(jid)
            job = replace(
                job, epoch=epoch, seed=job.seed if seed is None else seed, touched=time.monotonic()
            )
            self._jobs[jid] = job
            self._append({"op": "epoch", "id": jid, "epoch": job.epoch, "seed": job.seed})
        log_event(log, "job.epoch_set", job=jid, epoch=job.epoch, seed=job.seed)
        return job

    def resolving(self, jid: str, step: int) -> tuple[Job, int]:
        """A rank's stream is about to read global ``step`` of mixture job ``jid``: from now
        on no change may take effect at or before it. Returns the job as it is and the
        steering generation (see :meth:`steered`) its plan must have been made at."""
        with self._lock:
            job = self._get_locked(jid)
            if step > self._resolved.get(jid, -1):
                self._resolved[jid] = step
            return job, self._steering.get(jid, 0)

    def steered(self, jid: str) -> tuple[Job, int]:
        """The job as it is and the generation of its weight changes and quarantines, read
        together: a plan made from this job is current until the generation moves."""
        with self._lock:
            return self._get_locked(jid), self._steering.get(jid, 0)

    def resolved(self, jid: str) -> int:
        """The last global step a stream of ``jid`` has taken the samples of (-1: none)."""
        with self._lock:
            return self._resolved.get(jid, -1)

    def set_mixture(self, jid: str, change: WeightChange, frontier: int) -> Job:
        """Add a weight change from ``change.at_step`` on; journaled before returning.

        Refused with :class:`StepInThePast` when ``at_step`` is before ``frontier`` (the first
        step no rank has been sent) or at a step a rank's stream has already read, so
        nothing delivered is ever rewritten. The same change as the last one is taken once
        (each DDP rank may send it).
        """
        with self._lock:
            job = self._get_locked(jid)
            if job.spec.mixture is None:
                raise BadRequest(f"job {jid} reads one dataset, not a mixture: it has no weights")
            if change in job.changes[-1:]:  # every DDP rank sends the same change: once is enough
                return job
            frontier = max(frontier, self._resolved.get(jid, -1) + 1)
            if change.at_step < frontier:
                raise StepInThePast(
                    f"job {jid}: a change at step {change.at_step} is in the past; ranks were "
                    f"already sent steps up to {frontier - 1}: use at_step >= {frontier}"
                )
            if len(job.changes) >= MAX_CHANGES:
                raise BadRequest(f"job {jid} already has {MAX_CHANGES} weight changes")
            job = replace(job, changes=(*job.changes, change), touched=time.monotonic())
            self._jobs[jid] = job
            self._steering[jid] = self._steering.get(jid, 0) + 1
            self._append(
                {"op": "mixture", "id": jid, "at_step": change.at_step, "weights": change.weights}
            )
        log_event(log, "job.mixture_set", job=jid, at_step=change.at_step, weights=change.weights)
        return job

    def add_quarantine(
        self,
        dataset: str,
        ids: Sequence[int],
        reason: str,
        at: Mapping[str, int],
        align: Mapping[str, int] | None = None,
    ) -> bool:
        """Quarantine ``ids`` of ``dataset`` for each job from step ``at[job]``, or the first
        step no stream of it has read if later, rounded up to a multiple of ``align[job]``
        (a job whose epochs end when a source runs out takes changes at epoch starts);
        journaled. Ids already quarantined keep their steps and take ``reason``; a post that
        changes nothing is not journaled. Returns whether an id was added (plans change)."""
        with self._lock:
            steps = {}
            for jid, step in at.items():
                step = max(step, self._resolved.get(jid, -1) + 1)
                every = (align or {}).get(jid, 1)
                steps[jid] = -(-step // every) * every
            change = self.quarantine.add(dataset, ids, reason, steps)
            if change is None:
                return False
            if change.added:
                for jid in steps:
                    self._steering[jid] = self._steering.get(jid, 0) + 1
            self._append(
                {
                    "op": "quarantine",
                    "dataset": dataset,
                    "ids": list(change.ids),
                    "reason": reason,
                    "at": change.at,
                }
            )
        log_event(
            log,
            "dataset.quarantined",
            dataset=dataset,
            ids=len(change.ids),
            added=change.added,
            reason=reason,
        )
        return change.added > 0

    def note_stream(self, jid: str, epoch: int, origin: str = "") -> None:
        """A rank opened a stream of ``epoch``: the job is in use; ``origin``: the job (of
        another world size) whose state that stream resumes, linked on this job's status.

        The job's own epoch is left alone: it changes only through :meth:`set_epoch`, so what
        one run streamed never becomes the next run's starting point.
        """
        with self._lock:
            job = self._jobs.get(jid)
            if job is not None:
                linked = origin or job.resumed_from
                self._jobs[jid] = replace(
                    job, touched=time.monotonic(), restored=False, resumed_from=linked
                )
        if origin and (job is None or job.resumed_from != origin):
            log_event(log, "job.resumed_from", job=jid, origin=origin, epoch=epoch)

    def fail(self, jid: str, code: ErrorCode, message: str) -> Job | None:
        """Mark a job failed with a reason (kept in memory: a restart re-checks the data)."""
        with self._lock:
            job = self._jobs.get(jid)
            if job is None or job.state == "failed":
                return job
            job = replace(job, state="failed", error=message, error_code=code)
            self._jobs[jid] = job
        log_event(log, "job.failed", level=logging.ERROR, job=jid, code=code.value, reason=message)
        return job

    def delete(self, jid: str, reason: str = "deleted over the control plane") -> Job:
        """Forget a job; returns its last snapshot with state ``deleted``."""
        with self._lock:
            job = self._get_locked(jid)
            del self._jobs[jid]
            self._resolved.pop(jid, None)
            self._steering.pop(jid, None)
            self._append({"op": "delete", "id": jid})
        log_event(log, "job.deleted", job=jid, reason=reason)
        return replace(job, state="deleted")

    def _get_locked(self, jid: str) -> Job:
        job = self._jobs.get(jid)
        if job is None:
            raise JobNotFound(
                f"no job {jid!r} on this server; POST /v1/jobs with its spec to create it"
            )
        return job

    def _append(self, record: Mapping[str, object]) -> None:
        if self._journal is not None:
            self._journal.append(record)


def _records_of(job: Job) -> list[dict[str, object]]:
    create: dict[str, object] = {
        "op": "create",
        "id": job.id,
        "spec": job.spec.model_dump(mode="json"),
        "num_samples": job.num_samples,
    }
    if job.source_sizes is not None:
        create["source_sizes"] = list(job.source_sizes)
    recs = [create]
    if job.epoch != 0 or job.seed != job.spec.seed:
        recs.append({"op": "epoch", "id": job.id, "epoch": job.epoch, "seed": job.seed})
    recs += [
        {"op": "mixture", "id": job.id, "at_step": c.at_step, "weights": list(c.weights)}
        for c in job.changes
    ]
    return recs
