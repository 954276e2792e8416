"""The steering half of the control plane: a mixture job's schedule, its weight changes and
plans, and quarantined samples of a dataset.

Every change is journaled with the step it takes effect at (:class:`~.jobs.JobRegistry`), and
that step is never before the job's frontier (:func:`.mixtures.frontier`), so what a rank was
sent is never rewritten and a restart, a resume or a second sidecar plan the same batches.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from shardserve.proto.api import MixtureStatus, MixtureUpdate, QuarantineList, QuarantineRequest
from shardserve.proto.api import QuarantineEntry as QuarantineBody
from shardserve.proto.errors import BadRequest, StepInThePast
from shardserve.proto.jobs import WeightChange, check_weights
from shardserve.proto.manifest import Manifest, validate_dataset_name

from ..planning.cache import PlanCache
from ..planning.mixture import MixSource, source_offsets, split_ids
from ..registry.jobs import Job, JobRegistry
from ..runtime.metrics import JobsSnapshot
from ..streaming.board import StreamBoard
from . import mixtures


class MixtureAdmin:
    """Schedules and quarantines; see the module docstring."""

    def __init__(
        self,
        jobs: JobRegistry,
        board: StreamBoard,
        manifest: Callable[[str], Manifest],
        orders: PlanCache,
    ) -> None:
        """``manifest(name)``: the dataset's current manifest (raising ``DatasetNotFound``);
        ``orders``: the server's one order cache, which keeps mixture orders beside the others."""
        self.jobs = jobs
        self.board = board
        self.plans = mixtures.MixturePlans(jobs.quarantine, orders, self._origin)
        self._manifest = manifest

    def _mixture_job(self, job_id: str) -> Job:
        job = self.jobs.get(job_id)
        if job.spec.mixture is None:
            raise BadRequest(
                f"job {job_id} reads one dataset ({job.spec.dataset!r}), not a mixture: "
                "create it with mixture=[{name, weight}, ...] to steer its weights"
            )
        return job

    def _origin(self, job: Job) -> Job | None:
        """The job of another world size whose state ``job`` resumed (its steps keep their
        places in ``job``'s plans, see :func:`.mixtures.segments`), or ``None``."""
        if job.resumed_from is None:
            return None
        origin = self.jobs.find(job.resumed_from)
        if origin is None:
            raise BadRequest(
                f"mixture job {job.id} resumes a state of job {job.resumed_from}, which this "
                "server no longer holds: its weight schedule and quarantines (counted in its "
                "steps) are unknown here. Resume on the server that ran it, or start the "
                "epoch again (do not load the state: loader.set_epoch(epoch))"
            )
        return origin if origin.spec.world_size != job.spec.world_size else None

    def frontier(self, job: Job) -> int:
        """The first step no rank has been sent, has in flight, or has had read by its
        stream (assembled ahead of what the board shows)."""
        front = mixtures.frontier(job, self.board.ranks(job.id))
        return max(front, self.jobs.resolved(job.id) + 1)

    def status(self, job_id: str) -> MixtureStatus:
        """The job's sources, its schedule, the weights at its frontier and the frontier."""
        job = self._mixture_job(job_id)
        schedule = job.schedule()
        front = self.frontier(job)
        k = len(job.spec.mixture or ())
        windows = self.board.mixture_windows(job.id)
        sent = [0] * k
        for w in windows:
            for i, c in enumerate(w.sent[:k]):
                sent[i] += c
        n, shares, targets, sigmas = mixtures.share_figures(job, windows)
        return MixtureStatus(
            job=job.id,
            sources=[s.name for s in job.spec.mixture or ()],
            schedule=[{"at_step": c.at_step, "weights": list(c.weights)} for c in schedule],
            weights_now=list(mixtures.weights_at(schedule, front)),
            frontier=front,
            batches_per_epoch=mixtures.steps_per_epoch(job),
            sent=sent,
            window_samples=n,
            window_shares=shares,
            target_shares=targets,
            deviation_sigmas=sigmas,
        )

    def set_mixture(self, job_id: str, update: MixtureUpdate) -> MixtureStatus:
        """New weights from ``update.at_step`` (default: the frontier) on; 409 if earlier."""
        job = self._mixture_job(job_id)
        names = [s.name for s in job.spec.mixture or ()]
        if isinstance(update.weights, dict):
            unknown = sorted(set(update.weights) - set(names))
            missing = [n for n in names if n not in update.weights]
            if unknown or missing:
                raise BadRequest(
                    f"weights must name every source of job {job_id} ({names}) and no other: "
                    f"unknown {unknown}, missing {missing}"
                )
            weights = tuple(float(update.weights[n]) for n in names)
        else:
            weights = tuple(float(w) for w in update.weights)
        try:
            check_weights(weights, len(names), "weights")
        except ValueError as e:
            raise BadRequest(f"job {job_id}: {e}") from None
        mixtures.check_empty(job.spec, job.source_sizes or (), weights)
        front = self.frontier(job)
        if update.at_step is None and job.restored and not self.board.ranks(job.id):
            raise StepInThePast(
                f"job {job_id} was restored after a restart and no rank has reconnected, so the "
                "server does not know which steps its ranks were sent: name at_step (every rank "
                "agrees on, e.g., the next epoch's first step)"
            )
        S = mixtures.steps_per_epoch(job)
        at = front if update.at_step is None else update.at_step
        if update.at_step is None and job.spec.ends_early:
            at = -(-front // S) * S  # an epoch's first step (see below)
        if job.spec.ends_early and at % S:
            raise BadRequest(
                f"job {job_id} has a source that ends its epochs when it runs out "
                "(on_exhausted='stop'), so an epoch's length depends on its weights: a change "
                f"takes effect at an epoch's first step; use at_step={-(-at // S) * S}"
            )
        self.jobs.set_mixture(job_id, WeightChange(at_step=at, weights=weights), front)
        self._warm(job_id)
        return self.status(job_id)

    def stream_plan(
        self, job: Job, epoch: int, seed: int, rank: int, offset: int = 0
    ) -> mixtures.SteeredPlan:
        """``rank``'s batches of ``epoch`` as its stream reads them (following the schedule);
        ``offset``: dealt from that position (an elastic resume)."""
        return mixtures.SteeredPlan(self.plans, self.jobs, job, epoch, seed, rank, offset)

    def _warm(self, job_id: str) -> None:
        """Plan the epochs the job's ranks stream now with the change on the planning lane
        (40 M positions take about 2 s): a stream that reaches the change before the order
        lands is skipped until it does, and the other streams go on."""
        job = self.jobs.find(job_id)
        if job is None:
            return
        for epoch, seed in {(r.epoch, job.seed) for r in self.board.ranks(job_id)}:
            if epoch is not None:
                self.plans.ready(job, epoch, seed)

    def plan(
        self,
        job: Job,
        epoch: int,
        rank: int,
        env: int | None = None,
        offset: int = 0,
        take: bool = False,
    ) -> tuple[np.ndarray, int]:
        """``rank``'s concatenated ids of ``epoch`` in batch order, and its batch count;
        ``env``: that environment's own batches (``None``: whole steps). ``take``: the epoch
        is taken whole (a client holding the data gathers all of it): from now on a weight
        change takes effect at the next epoch's start at the earliest. ``offset``: dealt
        from that position, for a job linked to the state's job only (``origin``)."""
        if offset and job.resumed_from is None:
            raise BadRequest(
                f"job {job.id} is a mixture: its plan dealt from position {offset} (a state of "
                "another world size) needs the job that saved the state: pass its id as "
                "origin=<job id> (GET .../plan?offset=...&origin=...), or resume on the world "
                "size that saved the state"
            )
        if take:
            job, _ = self.jobs.resolving(job.id, (epoch + 1) * mixtures.steps_per_epoch(job) - 1)
        plan = (
            self.plans.rank_plan(job, epoch, job.seed, rank, offset)
            if env is None
            else self.plans.env_plan(job, epoch, job.seed, rank, env, offset)
        )
        ids = np.concatenate(list(plan)) if len(plan) else np.empty(0, dtype=np.int64)
        return ids.astype("<i8", copy=False), len(plan)

    def add_to(self, snap: JobsSnapshot) -> JobsSnapshot:
        """``snap`` with the mixture series of every job it exports, and the quarantine counts."""
        for jid in snap.connected:  # the jobs whose series are exported (not ended)
            job = self.jobs.find(jid)
            if job is None or job.spec.mixture is None:
                continue
            st = self.status(jid)
            total = sum(st.weights_now)
            for k, (name, w) in enumerate(zip(st.sources, st.weights_now, strict=True)):
                snap.mixture_weights.append((jid, name, w / total))
                snap.mixture_sent.append((jid, name, st.sent[k]))
                if st.window_shares:
                    snap.mixture_shares.append((jid, name, st.window_shares[k]))
            if st.deviation_sigmas is not None:
                snap.mixture_sigmas[jid] = st.deviation_sigmas
        for name in self.jobs.quarantine.datasets():
            snap.quarantined[name] = self.jobs.quarantine.count(name)
        return snap

    # -- quarantine ---------------------------------------------------------------------

    def quarantine(self, dataset: str, req: QuarantineRequest) -> QuarantineList:
        """Quarantine ``req.ids`` of ``dataset`` from each reading job's frontier on."""
        validate_dataset_name(dataset)
        n = self._manifest(dataset).num_samples  # DatasetNotFound names it
        bad = [i for i in req.ids if not 0 <= i < n]
        if bad:
            raise BadRequest(
                f"quarantine ids {bad[:5]} are out of range for dataset {dataset!r}: 0 <= id < {n}"
            )
        self._add(dataset, n, req.ids, req.reason)
        return self.quarantine_list(dataset)

    def quarantine_failed(self, job_id: str, ids: Sequence[int], reason: str) -> None:
        """Samples of mixture job ``job_id`` (ids over its sources concatenated) whose
        transform failed (``on_error="quarantine"``): quarantined in their datasets, for this
        job from the first epoch start none of its ranks has read (the epoch in progress
        serves deterministic replacements for them, so its batches do not depend on when the
        failure was seen), for the datasets' other readers from their frontier. Ids already
        quarantined are left as they are. Runs on the job's own assembly threads."""
        job = self.jobs.get(job_id)
        sizes = job.source_sizes or ()
        offsets = source_offsets([MixSource(n) for n in sizes])
        which, local = split_ids(np.unique(np.asarray(ids, dtype=np.int64)), offsets)
        for k, src in enumerate(job.spec.mixture or ()):
            new = self.jobs.quarantine.unknown(src.name, local[which == k])
            if len(new):
                self._add(src.name, sizes[k], new.tolist(), reason, whole_epochs=job_id)

    def _add(
        self, dataset: str, n: int, ids: Sequence[int], reason: str, whole_epochs: str = ""
    ) -> None:
        """Quarantine ``ids`` of ``dataset`` (``n`` samples) for every job reading it, from
        its frontier (from an epoch start: a job whose epochs end when a source runs out,
        and ``whole_epochs``)."""
        new = self.jobs.quarantine.unknown(dataset, np.unique(np.asarray(ids, dtype=np.int64)))
        if self.jobs.quarantine.count(dataset) + len(new) >= n:
            raise BadRequest(
                f"quarantining these ids would leave dataset {dataset!r} no sample: "
                "drop it from the mixture instead (weight 0)"
            )
        readers = [
            job
            for job in self.jobs.list()
            if any(s.name == dataset for s in job.spec.mixture or ())
        ]
        at = {job.id: self.frontier(job) for job in readers}
        align = {
            job.id: mixtures.steps_per_epoch(job)
            for job in readers
            if job.spec.ends_early or job.id == whole_epochs
        }
        if not self.jobs.add_quarantine(dataset, ids, reason, at, align):
            return  # no id new: every plan stays as it is
        for job in readers:
            self._warm(job.id)

    def quarantine_list(self, dataset: str) -> QuarantineList:
        validate_dataset_name(dataset)
        entries = self.jobs.quarantine.entries(dataset)
        return QuarantineList(
            dataset=dataset,
            entries=[QuarantineBody(ids=list(e.ids), reason=e.reason, at=e.at) for e in entries],
            total_ids=self.jobs.quarantine.count(dataset),
            held_bytes=self.jobs.quarantine.held_bytes(dataset),
        )
