"""The job registry and its epoch journal.

A job is its spec (``job_id(spec)`` is a hash of it), plus the little the control plane may
change: the current epoch and a seed override. Those changes and the set of jobs are appended
to ``<state_dir>/jobs.jsonl`` (one JSON object per line, fsync'd) and replayed at start, so a
restarted server keeps every job, epoch and seed::

    {"op": "create", "id": "…", "spec": {…}, "num_samples": 50000}
    {"op": "epoch",  "id": "…", "epoch": 3, "seed": 7}
    {"op": "delete", "id": "…"}

After a replay the journal is rewritten (tmp + rename) with one ``create`` and at most one
``epoch`` line per live job, so it never grows past the size of the registry. A torn last line
(a crash mid-append) is skipped with a warning.

Everything here is thread-safe: HTTP handlers and the streamer thread share one registry.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from shardserve.proto.errors import BadRequest, ErrorCode, JobNotFound
from shardserve.proto.jobs import JobSpec, JobState, job_id

from .logs import log_event

log = logging.getLogger("shardserve.jobs")

#: Refuse to track more jobs than this: each is cheap, but an unbounded registry is not.
MAX_JOBS = 4096


@dataclass(frozen=True)
class Job:
    """A snapshot of one job; the registry hands out copies, never its own records."""

    id: str
    spec: JobSpec
    num_samples: int
    state: JobState = "pending"
    epoch: int = 0
    seed: int = 0
    error: str | None = None
    error_code: ErrorCode | None = None


class EpochJournal:
    """Append-only JSON-lines file of job changes; durable once :meth:`append` returns."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def replay(self) -> list[dict[str, Any]]:
        """Every well-formed record in order; torn or garbled lines are skipped and logged."""
        try:
            text = self.path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return []
        records = []
        for lineno, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                if not isinstance(rec, dict) or "op" not in rec or "id" not in rec:
                    raise ValueError("not a journal record")
            except ValueError as e:
                log_event(
                    log,
                    "journal.skipped_line",
                    level=logging.WARNING,
                    path=str(self.path),
                    line=lineno,
                    reason=str(e),
                )
                continue
            records.append(rec)
        return records

    def append(self, record: dict[str, Any]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        line = json.dumps(record, separators=(",", ":")) + "\n"
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(line)
            f.flush()
            os.fsync(f.fileno())

    def rewrite(self, records: list[dict[str, Any]]) -> None:
        """Replace the journal with ``records`` atomically (tmp file, fsync, rename)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".jsonl.tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            for rec in records:
                f.write(json.dumps(rec, separators=(",", ":")) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)


class JobRegistry:
    """Jobs by id. ``journal=None`` keeps them in memory only."""

    def __init__(self, journal: EpochJournal | None = None) -> None:
        self._journal = journal
        self._jobs: dict[str, Job] = {}
        self._lock = threading.Lock()

    def load(self) -> int:
        """Replay the journal into the registry and compact it; returns the number of jobs."""
        if self._journal is None:
            return 0
        jobs: dict[str, Job] = {}
        for rec in self._journal.replay():
            try:
                if rec["op"] == "create":
                    spec = JobSpec.model_validate(rec["spec"])
                    jobs[rec["id"]] = Job(rec["id"], spec, int(rec["num_samples"]), seed=spec.seed)
                elif rec["op"] == "epoch" and rec["id"] in jobs:
                    jobs[rec["id"]] = replace(
                        jobs[rec["id"]], epoch=int(rec["epoch"]), seed=int(rec["seed"])
                    )
                elif rec["op"] == "delete":
                    jobs.pop(rec["id"], None)
            except (KeyError, TypeError, ValueError) as e:
                log_event(
                    log, "journal.bad_record", level=logging.WARNING, record=rec, reason=str(e)
                )
        with self._lock:
            self._jobs = jobs
        self._journal.rewrite([r for j in jobs.values() for r in _records_of(j)])
        return len(jobs)

    def create(self, spec: JobSpec, num_samples: int) -> tuple[Job, bool]:
        """The job for ``spec``, creating it if new; ``(job, created)``. Idempotent."""
        jid = job_id(spec)
        with self._lock:
            if jid in self._jobs:
                return self._jobs[jid], False
            if len(self._jobs) >= MAX_JOBS:
                raise BadRequest(f"the server already tracks {MAX_JOBS} jobs; delete some first")
            job = Job(jid, spec, num_samples, seed=spec.seed)
            self._jobs[jid] = job
            self._append(
                {
                    "op": "create",
                    "id": jid,
                    "spec": spec.model_dump(mode="json"),
                    "num_samples": num_samples,
                }
            )
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
        """Set what ranks stream next (and optionally a new seed); journaled before returning."""
        with self._lock:
            job = self._get_locked(jid)
            job = replace(job, epoch=epoch, seed=job.seed if seed is None else seed)
            self._jobs[jid] = job
            self._append({"op": "epoch", "id": jid, "epoch": job.epoch, "seed": job.seed})
        log_event(log, "job.epoch_set", job=jid, epoch=job.epoch, seed=job.seed)
        return job

    def note_stream(self, jid: str, epoch: int) -> None:
        """A rank opened ``epoch``: the job is running. Its epoch stays the one set over
        ``PUT .../epoch``: a client's own epochs must not leak into the next run's start."""
        with self._lock:
            job = self._jobs.get(jid)
            if job is not None and job.state in ("pending", "running"):
                self._jobs[jid] = replace(job, state="running")

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

    def delete(self, jid: str) -> Job:
        """Forget a job; returns its last snapshot with state ``deleted``."""
        with self._lock:
            job = self._get_locked(jid)
            del self._jobs[jid]
            self._append({"op": "delete", "id": jid})
        log_event(log, "job.deleted", job=jid)
        return replace(job, state="deleted")

    def _get_locked(self, jid: str) -> Job:
        job = self._jobs.get(jid)
        if job is None:
            raise JobNotFound(
                f"no job {jid!r} on this server; POST /v1/jobs with its spec to create it"
            )
        return job

    def _append(self, record: dict[str, Any]) -> None:
        if self._journal is not None:
            self._journal.append(record)


def _records_of(job: Job) -> list[dict[str, Any]]:
    recs: list[dict[str, Any]] = [
        {
            "op": "create",
            "id": job.id,
            "spec": job.spec.model_dump(mode="json"),
            "num_samples": job.num_samples,
        }
    ]
    if job.epoch != 0 or job.seed != job.spec.seed:
        recs.append({"op": "epoch", "id": job.id, "epoch": job.epoch, "seed": job.seed})
    return recs
