"""Loading a resident dataset: the stored fields streamed once, in store order, by a job of
their own, into the tensors :class:`~.resident.Resident` gathers from."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from shardserve.proto.jobs import JobSpec

from ._credit import auto_prefetch
from ._feed import store_order
from .job import JobArgs, JobHandle
from .resident import Resident, field_layout, resident_nbytes

#: Resident mode loads the dataset in batches of about this many bytes.
RESIDENT_CHUNK_BYTES = 16 << 20
MAX_RESIDENT_CHUNK = 1 << 16


def load_resident(
    job: JobHandle,
    spec: JobSpec,
    rank: int,
    envs_on: list[torch.device],
    transport: str,
    timeout: float,
) -> Resident:
    """Stream ``job``'s dataset once in store order (a job of its own) into resident tensors
    on ``envs_on``, for ``rank``'s plans of ``spec``."""
    info = job.info()
    layout = field_layout(info, spec.fields)
    sample = max(1, resident_nbytes(layout, 1))
    chunk = max(1, min(RESIDENT_CHUNK_BYTES // sample, MAX_RESIDENT_CHUNK, info.num_samples))
    # Flat stored fields, in store order, on one rank: the resident tensors' layout.
    flat = JobArgs(
        dataset=spec.dataset,
        batch_size=chunk,
        seed=0,
        shuffle="none",
        drop_last=False,
        fields=list(layout),
        collate=None,
        transforms=None,
        on_error=None,
    ).spec(1)

    def one_pass() -> Iterator[Any]:
        with JobHandle.create(job.api.url, job.token, flat, timeout=timeout) as loading:
            yield from store_order(
                loading, transport=transport, prefetch=auto_prefetch(info, chunk), timeout=timeout
            )

    return Resident.load(
        job.api, job.id, rank, spec.env_batch, info, layout, envs_on, one_pass, timeout
    )
