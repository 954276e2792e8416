"""Jobs of one dataset: admitted against its manifest, planned by the :class:`PlanCache`."""

from __future__ import annotations

import contextlib

import numpy as np

from shardserve.proto.api import MixtureStatus
from shardserve.proto.errors import DatasetCorruptError
from shardserve.proto.jobs import JobSpec
from shardserve.proto.jobs import job_id as spec_job_id

from ...reading.sources import Stored
from ...registry.jobs import Job
from ...source import StreamPlan
from ...store.read.graph_shapes import item_fields
from ...store.read.graphs import check_graph_job
from ...store.versions import pin_version
from ...streaming.limits import check_job_batch
from .base import Admitted, KindParts, check_fields


class PlainJobs:
    """The kind of a job that reads one dataset (``JobSpec.kind == "dataset"``)."""

    #: A dataset's own fields are served as stored: no part says where a sample came from.
    source_part: str | None = None
    #: Its plan is a pure function of the job: any process deals the same batches.
    streams_anywhere: bool = True

    def __init__(self, parts: KindParts) -> None:
        self._parts = parts

    def admit(self, spec: JobSpec) -> Admitted:
        """The dataset and its fields must exist, a batch fit the server's bound, every shard
        file be whole, and a graph job's fields be of its graphs; the job pins the
        dataset's current version (its id covers it)."""
        p = self._parts
        manifest = p.manifest(spec.dataset)
        existing = p.jobs.find(spec_job_id(spec)) if spec.version is not None else None
        if existing is not None:
            # Re-posted pinned to its version (a DDP rank taking rank 0's job through the
            # process group): that job, checked when it was made, even if the store holds a
            # newer version now.
            return Admitted(existing.spec, existing.num_samples, existing.source_sizes)
        spec = pin_version(spec, manifest)
        served = p.transforms.served(spec, manifest)  # a chain's outputs, when it has one
        sample_bytes = p.transforms.sample_bytes(spec, manifest)
        check_fields(spec, [f.name for f in served.fields])
        per_sample = manifest.total_bytes / max(manifest.num_samples, 1)
        check_job_batch(spec, manifest.num_samples, per_sample, p.max_batch_bytes)
        # A deleted or cut shard: a 409 now beats a job that fails at its first batch.
        p.check_shards(manifest)
        if spec.graph is not None:
            # The stored shapes of the pinned version tell edge fields from node fields.
            items = item_fields(p.open_dataset(spec.dataset, spec.version))
            check_graph_job(served, spec.fields, spec.graph, items)
        return Admitted(spec, manifest.num_samples, sample_bytes=sample_bytes)

    def created(self, spec: JobSpec) -> None:
        """Open the pinned version at once: the store keeps an open version while a job pins
        it, so an ``ingest --overwrite`` before the job's first stream leaves the job its
        version instead of failing it with ``DatasetChanged``."""
        # A corrupt shard is reported where every rank sees it: the first stream fails the
        # job naming the shard (the data's fault, not this spec's).
        with contextlib.suppress(DatasetCorruptError):
            self._parts.open_dataset(spec.dataset, spec.version)

    def open_stored(self, spec: JobSpec) -> Stored:
        """The dataset, at the version the job pinned."""
        dataset = self._parts.open_dataset(spec.dataset, spec.version)
        return Stored(dataset, [dataset])

    def resident_plan(
        self, job: Job, epoch: int, rank: int, env: int | None, offset: int
    ) -> tuple[np.ndarray, int]:
        """``env``: that environment's own ids and batches (:meth:`PlanCache.env_plan`);
        ``None``: the job's batches as streamed (a job of several environments: whole
        steps)."""
        p = self._parts
        ds = p.open_dataset(job.spec.dataset, job.spec.version)
        plan = (
            p.plans.rank_plan(job, epoch, job.seed, rank, shard_rows=ds.shard_rows, offset=offset)
            if env is None
            else p.plans.env_plan(
                job, epoch, job.seed, rank, env, shard_rows=ds.shard_rows, offset=offset
            )
        )
        ids = np.concatenate(list(plan)) if len(plan) else np.empty(0, dtype=np.int64)
        return ids.astype("<i8", copy=False), len(plan)

    def steering(self, job_id: str) -> MixtureStatus | None:
        """One dataset has no weights to steer."""
        return None

    def stream_plan(
        self,
        job: Job,
        epoch: int,
        seed: int,
        rank: int,
        shard_rows: np.ndarray,
        offset: int,
        start: int,
    ) -> StreamPlan:
        """Fixed when made; the next epoch's order is planned ahead while this one streams."""
        plans = self._parts.plans
        plan = plans.rank_plan(job, epoch, seed, rank, shard_rows=shard_rows, offset=offset)
        if start < len(plan):
            # Read here, on the planning lane: an order handed out before its last buckets
            # were shuffled (see PlanCache) makes a stream that starts deep in it (a resume)
            # wait for its bucket now, not on the streamer thread. Later batches lie behind
            # the shuffle, which runs tens of times faster than any stream reads.
            plan.batch(start)
        if job.spec.shuffle != "none":  # the next epoch's order, while this one streams
            plans.plan_ahead(job, epoch + 1, seed, shard_rows)
        return plan
