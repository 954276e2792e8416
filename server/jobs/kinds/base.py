"""What every job kind answers (:class:`JobKind`), and the server's parts it is built from."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from shardserve.proto.api import MixtureStatus
from shardserve.proto.errors import BadRequest
from shardserve.proto.jobs import JobSpec
from shardserve.proto.manifest import Manifest

from ...planning.cache import PlanCache
from ...reading.sources import OpenDataset
from ...registry.jobs import Job, JobRegistry
from ...streaming.sessions import StreamKind
from ...transforms.bound import Transforms
from ..steering import MixtureAdmin


@dataclass(frozen=True)
class Admitted:
    """A spec checked against the store, as its job is created: the spec with its version(s)
    pinned, positions per epoch, a mixture's sizes of its sources, and the bytes of one
    sample as served (said back to the client, when the kind knows it)."""

    spec: JobSpec
    num_samples: int
    source_sizes: tuple[int, ...] | None = None
    sample_bytes: float | None = None


@dataclass(frozen=True)
class KindParts:
    """The server's parts a kind uses, one set for every kind so that the table builds them
    all alike (a new kind takes what it needs from here; a part it needs and no other kind
    had is added here)."""

    #: ``Settings.max_batch_bytes``: the largest batch a job may ask for.
    max_batch_bytes: int
    jobs: JobRegistry
    #: Orders of one-dataset jobs (plan-ahead, waiters).
    plans: PlanCache
    #: Mixture schedules, orders and quarantines.
    mixtures: MixtureAdmin
    #: ``manifest(name)``: the dataset's current manifest, or ``DatasetNotFound``.
    manifest: Callable[[str], Manifest]
    #: ``check_shards(manifest)``: ``DatasetCorruptError`` for a missing or cut shard file.
    check_shards: Callable[[Manifest], None]
    transforms: Transforms
    open_dataset: OpenDataset


class JobKind(StreamKind, Protocol):
    """One kind of job: how it is admitted and planned. Streaming's part of it
    (:class:`~..streaming.sessions.StreamKind`: the stored link, stream plans, the source
    part) is called on the planning lane; the rest on the control plane's threads."""

    @property
    def streams_anywhere(self) -> bool:
        """Whether its streams may run in a streaming process (``--stream-processes``), or
        stay in the main process with what they consult on every step."""
        ...

    def admit(self, spec: JobSpec) -> Admitted:
        """Check ``spec`` against the store and pin what it reads (400/404/409 when it does
        not fit). Called by ``JobAdmin.create_job`` on an HTTP worker thread, before the
        registry's cap is checked and the job created."""
        ...

    def created(self, spec: JobSpec) -> None:
        """A job of ``spec`` (as admitted, pinned) was just created, not found: take what it
        needs from the store now. Called by ``JobAdmin.create_job`` on an HTTP worker
        thread, after the job is in the registry."""
        ...

    def resident_plan(
        self, job: Job, epoch: int, rank: int, env: int | None, offset: int
    ) -> tuple[np.ndarray, int]:
        """``rank``'s sample ids of ``epoch`` in batch order (little-endian int64) and its
        batch count, for a client that holds the data itself. Called by ``Service.plan``
        (``GET /v1/jobs/{id}/plan``) on an HTTP worker thread, with ``rank`` and ``offset``
        checked against the job."""
        ...

    def steering(self, job_id: str) -> MixtureStatus | None:
        """The job's weights, schedule and shares sent, as the status page shows them;
        ``None`` for a kind without weights. Called by the status page on an HTTP worker
        thread (``JobNotFound`` when the job was deleted since it was listed)."""
        ...


def check_fields(spec: JobSpec, known: list[str]) -> None:
    """``spec.fields`` are among the fields its job serves (``known``), or 400."""
    unknown = [f for f in spec.fields or () if f not in known]
    if unknown:
        raise BadRequest(
            f"dataset {spec.dataset!r} has no field(s) {unknown}; its fields are {known}"
        )
