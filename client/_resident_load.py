"""Loading a resident dataset: the stored fields streamed once, in store order, by a job of
their own, into the tensors :class:`~.resident.Resident` gathers from. A mixture's resident
data is its sources' stored fields one after the other, in the mixture's order (the ids its
plans address: source ``s``'s sample ``i`` is row ``offsets[s] + i``), plus the ``source``
part each of its batches carries."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch

from shardserve.proto.jobs import JobSpec
from shardserve.proto.parts import SOURCE_PART

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
    """Stream ``job``'s dataset (a mixture: each of its sources at the version the job
    pinned) once in store order (a job of its own) into resident tensors on ``envs_on``,
    for ``rank``'s plans of ``spec``."""
    info = job.info()
    mix = job.pinned.mixture or ()
    # A mixture's rows: its sources' samples, concatenated in the mixture's order.
    sizes = [job.api.dataset(s.name, timeout=timeout).num_samples for s in mix]
    if mix:
        info = info.model_copy(update={"name": spec.dataset, "num_samples": sum(sizes)})
    stored = None if spec.fields is None else [f for f in spec.fields if f != SOURCE_PART]
    layout = field_layout(info, stored)
    sample = max(1, resident_nbytes(layout, 1))
    chunk = max(1, min(RESIDENT_CHUNK_BYTES // sample, MAX_RESIDENT_CHUNK, info.num_samples))
    # Flat stored fields, in store order, on one rank: the resident tensors' layout.
    flat = JobArgs(
        dataset=info.name if not mix else mix[0].name,
        batch_size=chunk,
        seed=0,
        shuffle="none",
        drop_last=False,
        fields=list(layout),
        collate=None,
        transforms=None,
        on_error=None,
    ).spec(1)
    loads = [flat.model_copy(update={"dataset": s.name, "version": s.version}) for s in mix]

    def one_pass() -> Iterator[Any]:
        for spec_of in loads or [flat]:
            prefetch = auto_prefetch(info, chunk)
            with JobHandle.create(job.api.url, job.token, spec_of, timeout=timeout) as loading:
                yield from store_order(
                    loading, transport=transport, prefetch=prefetch, timeout=timeout
                )

    resident = Resident.load(
        job.api, job.id, rank, spec.env_batch, info, layout, envs_on, one_pass, timeout
    )
    if mix:
        resident.add_field(SOURCE_PART, _source_rows(sizes))
    return resident


def _source_rows(sizes: Sequence[int]) -> torch.Tensor:
    """Each resident row's source (int16, as a mixture batch's ``source`` part)."""
    counts = torch.tensor(list(sizes), dtype=torch.int64)
    return torch.repeat_interleave(torch.arange(len(sizes), dtype=torch.int16), counts)
