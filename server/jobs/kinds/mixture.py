"""Jobs of a weighted mixture of datasets: admitted source by source, planned by the
:class:`~..mixture_admin.MixtureAdmin` (its schedule, weight changes and quarantines)."""

from __future__ import annotations

import numpy as np

from shardserve.proto.api import MixtureStatus
from shardserve.proto.jobs import JobSpec
from shardserve.proto.parts import SOURCE_PART

from ...reading.sources import Stored
from ...registry.jobs import Job
from ...source import StreamPlan
from ...store.read.graph_shapes import item_fields
from ...store.read.graphs import check_graph_job
from .. import mixtures
from .base import Admitted, KindParts, check_fields


class MixtureJobs:
    """The kind of a job that reads a mixture (``JobSpec.kind == "mixture"``)."""

    #: Each batch says which source each sample came from; the board counts them.
    source_part: str | None = SOURCE_PART
    #: Its streams resolve each step against the steering in the main process's registry
    #: (a change must never land on a step already read), so they are served there.
    streams_anywhere: bool = False

    def __init__(self, parts: KindParts) -> None:
        self._parts = parts

    def admit(self, spec: JobSpec) -> Admitted:
        """Every source must exist and serve the same fields (see :func:`.mixtures.admit`),
        a transform chain fit the mixture's fields, and every source's shard files be
        whole; each source's current version is pinned."""
        # The read path (pyarrow under it) loads with the first job, not in an idle server.
        from ...store.read.mixed import mixture_manifest

        p = self._parts
        spec, length, sizes = mixtures.admit(spec, p.manifest, p.max_batch_bytes)
        sources = [p.manifest(s.name) for s in spec.mixture or ()]
        if spec.transforms:  # the chain reads the mixture's fields (``source`` too)
            mixed = mixture_manifest(spec.dataset, sources)
            served = p.transforms.served(spec, mixed)  # masked fields pass by the chain
            check_fields(spec, [f.name for f in served.fields])
        for source in sources:
            p.check_shards(source)
        if spec.graph is not None:
            # Every source serves the same fields as the first (checked above), so the first
            # source's stored shapes tell edge fields from node fields for all of them.
            first = (spec.mixture or ())[0]
            items = item_fields(p.open_dataset(first.name, first.version))
            served = p.transforms.served(spec, mixture_manifest(spec.dataset, sources))
            check_graph_job(served, spec.fields, spec.graph, items)
        return Admitted(spec, length, sizes)

    def created(self, spec: JobSpec) -> None:
        """Nothing to take now: the sources are opened by the first stream."""

    def open_stored(self, spec: JobSpec) -> Stored:
        """The sources as one dataset (ids concatenated in the spec's order), each at the
        version pinned when the job was created."""
        # Only the stored fields the job reads (a chain may read any): the sources were
        # checked to agree on those.
        from ...store.read.mixed import mixed_dataset

        read = None if spec.fields is None or spec.transforms else spec.fields
        stored = [self._parts.open_dataset(m.name, m.version) for m in spec.mixture or ()]
        return Stored(mixed_dataset(spec.dataset, stored, read), stored)

    def resident_plan(
        self, job: Job, epoch: int, rank: int, env: int | None, offset: int, take: bool = False
    ) -> tuple[np.ndarray, int]:
        """Ids over the sources concatenated in order; ``env``: that environment's own ids
        and batches, ``None``: the job's batches as streamed (whole steps); ``take``: no
        weight change takes effect inside the epoch from now on."""
        return self._parts.mixtures.plan(job, epoch, rank, env, offset, take)

    def steering(self, job_id: str) -> MixtureStatus | None:
        """The schedule, the weights now and the shares sent (``GET .../mixture``'s)."""
        return self._parts.mixtures.status(job_id)

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
        """A plan that follows the job's schedule batch by batch (made from the sources'
        sizes, not their shards)."""
        return self._parts.mixtures.stream_plan(job, epoch, seed, rank, offset)
