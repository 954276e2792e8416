"""The one place a stream's source chain is built: the job's dataset (or its mixture's
datasets as one), then its decorators.

To add a decorator of sources (see :class:`~.source.Wrapped`), add its step here, in the
order it applies; streaming and assembly then serve it without a change.
"""

from __future__ import annotations

from collections.abc import Callable

from shardserve.proto.jobs import JobSpec

from .source import BatchSource
from .store.dataset import Dataset
from .store.graph_shapes import item_fields_of
from .store.graphs import GraphCollated
from .store.mixed import mixed_dataset
from .transforms.bound import Quarantine, Transforms

#: ``open_dataset(name, version)``: the shared, cached dataset of the version a job pinned,
#: or ``DatasetChanged`` (see ``Service.open_dataset``).
OpenDataset = Callable[[str, str | None], Dataset]
#: ``open_source(spec, epoch, seed, rank)``: :func:`open_source` with the server's parts bound.
OpenSource = Callable[[JobSpec, int, int, int], BatchSource]


def open_source(
    spec: JobSpec,
    epoch: int,
    seed: int,
    rank: int,
    *,
    open_dataset: OpenDataset,
    transforms: Transforms | None,
    quarantine: Quarantine | None = None,
) -> BatchSource:
    """What stream (``epoch``, ``seed``, ``rank``) of job ``spec`` reads its batches from;
    ``quarantine``: where its transform chain's failing samples go (``on_error="quarantine"``).

    >>> source = open_source(spec, 0, spec.seed, 0, open_dataset=store.open,
    ...                      transforms=None)                              # doctest: +SKIP
    >>> source.take([0, 1], ["label"])                                    # doctest: +SKIP
    """
    source: BatchSource
    stored: list[Dataset]  # what the job reads, as stored: their shapes tell edge fields
    if spec.mixture is not None:  # each source's version pinned at the job's creation
        # Only the stored fields the job reads (a chain may read any): the sources were
        # checked to agree on those.
        read = None if spec.fields is None or spec.transforms else spec.fields
        stored = [open_dataset(m.name, m.version) for m in spec.mixture]
        source = mixed_dataset(spec.dataset, stored, read)
    else:
        dataset = open_dataset(spec.dataset, spec.version)  # the version the job pinned
        source, stored = dataset, [dataset]
    if transforms is not None:
        source = transforms.bind(source, spec, epoch, seed, rank, quarantine)
    if spec.graph is not None:
        # Graphs collated for message passing, each batch on its own terms; a chain has
        # already run on each graph. Nodes are counted as the job's admission chose.
        source = GraphCollated(source, spec.batch_size, spec.graph, item_fields_of(stored))
    return source
