"""The job half of the control plane: admit jobs under the cap, report their status, and
forget them (deleted, expired, or evicted to make room).

Job states come from :mod:`.lifecycle`; the records from :class:`~.jobs.JobRegistry`; what
the streams do from the :class:`~.streaming.board.StreamBoard`. Ending a job's open streams is
the data plane's work: it is handed over through ``end_streams`` and never waited on.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Callable

from shardserve.proto.api import CreatedJob, EpochUpdate, JobState, JobStatus
from shardserve.proto.errors import BadRequest, JobNotFound, VersionConflict
from shardserve.proto.jobs import JobSpec
from shardserve.proto.jobs import job_id as spec_job_id

from ..planning import num_batches
from ..planning.cache import PlanCache
from ..registry.jobs import Job, JobRegistry
from ..runtime.metrics import JobsSnapshot, RankSeries, fold_ranks
from ..settings import Settings
from ..streaming.board import JobActivity, StreamBoard
from .kinds.base import Admitted
from .kinds.table import JobKinds
from .lifecycle import ENDED, LIVE, expired, job_state, last_active


class JobAdmin:
    """Create, list, update and forget jobs; see the module docstring."""

    def __init__(
        self,
        settings: Settings,
        jobs: JobRegistry,
        board: StreamBoard,
        plans: PlanCache,
        kinds: JobKinds,
        end_streams: Callable[[str, str], None],
        release_versions: Callable[[], None],
        job_changed: Callable[[Job], None],
    ) -> None:
        """``kinds``: the table a spec's kind is taken from, which admits it;
        ``end_streams(job_id, message)``: tell the job's open streams it is gone;
        ``release_versions()``: let go of replaced dataset versions no job pins any more;
        ``job_changed(job)``: a job's epoch or seed was set (streaming processes learn it)."""
        self.settings = settings
        self.jobs = jobs
        self.board = board
        self.plans = plans
        self.kinds = kinds
        self._end_streams = end_streams
        self._release_versions = release_versions
        self._job_changed = job_changed
        # Admission (cap check, eviction, creation) is one step, or two POSTs could both
        # take the last free place.
        self._admit_lock = threading.Lock()

    def create_job(self, spec: JobSpec) -> CreatedJob:
        """Create (or find) the job for ``spec``, admitted by its kind (which pins the
        version(s) it reads: the job's id covers them); a new job's kind then takes what
        the job needs from the store."""
        # numpy.random (under the transforms' generators) loads with the first job, not in
        # an idle server.
        from ..transforms.rng import pin_scheme

        kind = self.kinds.of(spec)
        admitted = kind.admit(pin_scheme(spec))
        # A job made before randomness schemes were recorded (journaled across an upgrade)
        # goes on with its own: the same spec finds it rather than a job drawing otherwise.
        older = admitted.spec.model_copy(update={"transform_rng": None})
        if (
            spec.transform_rng is None
            and older != admitted.spec
            and self.jobs.find(spec_job_id(older)) is not None
        ):
            admitted = dataclasses.replace(admitted, spec=older)
        created = self._admit(admitted)
        if created.created:
            kind.created(admitted.spec)
        return created

    def _admit(self, admitted: Admitted) -> CreatedJob:
        spec = admitted.spec
        with self._admit_lock:
            self.sweep()
            if self.jobs.find(spec_job_id(spec)) is None:
                self._refuse_other_version(spec)
                self._make_room()
            job, created = self.jobs.create(spec, admitted.num_samples, admitted.source_sizes)
        return CreatedJob(
            id=job.id,
            created=created,
            status=self.status_of(job),
            sample_bytes=admitted.sample_bytes,
        )

    def job(self, job_id: str) -> JobStatus:
        return self.status_of(self.jobs.get(job_id))

    def _refuse_other_version(self, spec: JobSpec) -> None:
        """Ranks of one run agree on one dataset version, without talking to each other.

        Every rank posts the same spec and so gets the same job, unless ``ingest --overwrite``
        published a new version between two ranks' posts: the later rank's job would pin the
        new version while its peers stream the old one (different sample counts desynchronise
        DDP). Its peers are found here, as a live (pending or running) job of the same spec
        except the pinned version, and the new job is refused naming both versions. A run of
        one rank has no peers; a run whose job has ended (finished, idle, failed) is not live.
        """
        if spec.world_size < 2:
            return
        unpinned = spec.unpinned()
        activity = self.board.activity()
        now = time.monotonic()
        for peer in self.jobs.list():
            if peer.spec == spec or peer.spec.unpinned() != unpinned:
                continue
            state = job_state(peer, activity.get(peer.id), now, self.settings.idle_after_s)
            if state in LIVE:
                raise VersionConflict(
                    f"dataset {spec.dataset!r} is now version {spec.versions}, but job {peer.id} "
                    f"of the same spec ({state}) streams version {peer.spec.versions} to its "
                    f"{spec.world_size} ranks: ranks of one run must train on one version. A "
                    "rank of that run: restart the whole run so every rank pins the new version; "
                    f"a new run: end the old one first (close its Loaders, or DELETE /v1/jobs/{peer.id})"
                )

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
        job = self.jobs.set_epoch(job_id, update.epoch, update.seed)
        self._job_changed(job)
        return self.status_of(job)

    def delete_job(self, job_id: str) -> JobStatus:
        return self._forget(job_id, "deleted over the control plane")

    def _forget(self, job_id: str, why: str) -> JobStatus:
        """Delete a job, end its streams, drop its rank records, plans and metric series."""
        job = self.jobs.delete(job_id, reason=why)
        message = f"job {job_id} was {why}"
        self._end_streams(job_id, message)
        status = self.status_of(job, "deleted")
        self.board.drop_job(job_id)
        self.plans.forget(job_id)
        self._release_versions()
        return status

    # -- lifecycle of jobs --------------------------------------------------------------

    def _states(self) -> list[tuple[Job, JobState, JobActivity | None]]:
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
        self._release_versions()  # replaced, no job left on it
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

    def snapshot(self) -> JobsSnapshot:
        """The per-job metric series of one scrape: ended jobs export none."""
        snap = JobsSnapshot()
        exported = set()
        states = self._states()
        for job, state, act in states:
            snap.states[state] = snap.states.get(state, 0) + 1
            if state not in ENDED:
                exported.add(job.id)
                snap.connected[job.id] = act.connected if act is not None else 0
        ranks = [
            RankSeries(c.job, c.rank, c.batches, c.bytes, c.wait_s, c.compute_s)
            for c in self.board.counters()
            if c.job in exported
        ]
        shares = [sh for sh in self.board.share_series() if sh.job_id in exported]
        sizes = {job.id: job.spec.world_size for job, _, _ in states}
        snap.ranks, snap.shares = fold_ranks(ranks, shares, sizes)
        return snap

    def status_of(self, job: Job, state: JobState | None = None) -> JobStatus:
        s = job.spec
        if state is None:
            act = self.board.activity().get(job.id)
            state = job_state(job, act, time.monotonic(), self.settings.idle_after_s)
        return JobStatus(
            id=job.id,
            spec=s,
            state=state,
            epoch=job.epoch,
            seed=job.seed,
            num_samples=job.num_samples,
            batches_per_epoch=num_batches(job.num_samples, s.deal_world, s.env_batch, s.drop_last),
            ranks=self.board.ranks(job.id),
            shares=self.board.shares(job.id),
            error=job.error,
            resumed_from=job.resumed_from,
        )
