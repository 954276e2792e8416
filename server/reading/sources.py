"""The one place a stream's source chain is built: what the job reads as stored (the
dataset, or a mixture's datasets as one: its kind's :meth:`~.kinds.base.JobKind.open_stored`),
then its decorators.

To add a decorator of sources (see :class:`~.source.Wrapped`), add its step here, in the
order it applies; streaming and assembly then serve it without a change.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from shardserve.proto.jobs import JobSpec

from ..source import BatchSource
from ..transforms.bound import Quarantine, Transforms
from ..transforms.device_plan import plan_device
from ..transforms.runner import Limits

if TYPE_CHECKING:
    # The store's read path (and pyarrow under it) is imported when the first dataset is
    # opened, so that an idle server does not hold it.
    from ..store.read.dataset import Dataset

#: ``open_dataset(name, version)``: the shared, cached dataset of the version a job pinned,
#: or ``DatasetChanged`` (see ``Service.open_dataset``).
OpenDataset = Callable[[str, "str | None"], "Dataset"]


@dataclass(frozen=True)
class Stored:
    """The first link of a job's chain, and the datasets under it as stored (their shapes
    tell a graph job's edge fields from its node fields)."""

    source: BatchSource
    datasets: list[Dataset]


#: ``open_source(stored, spec, epoch, seed, rank)``: :func:`open_source` with the server's
#: parts bound.
OpenSource = Callable[[Stored, JobSpec, int, int, int], BatchSource]


def open_source(
    stored: Stored,
    spec: JobSpec,
    epoch: int,
    seed: int,
    rank: int,
    *,
    transforms: Transforms | None,
    quarantine: Quarantine | None = None,
) -> BatchSource:
    """What stream (``epoch``, ``seed``, ``rank``) of job ``spec`` reads its batches from,
    over what it reads as stored (``stored``, from its kind); ``quarantine``: where its
    transform chain's failing samples go (``on_error="quarantine"``).

    >>> stored = kind.open_stored(spec)                                   # doctest: +SKIP
    >>> source = open_source(stored, spec, 0, spec.seed, 0, transforms=None)  # doctest: +SKIP
    >>> source.take([0, 1], ["label"])                                    # doctest: +SKIP
    """
    source = stored.source
    if transforms is not None:
        source = transforms.bind(source, spec, epoch, seed, rank, quarantine)
    if spec.device_transforms:  # their parameters drawn here, beside the compact fields
        source = plan_device(
            source, spec, epoch, seed, transforms.limits if transforms else Limits()
        )
    if spec.graph is not None:
        from ..store.read.graph_shapes import item_fields_of
        from ..store.read.graphs import GraphCollated

        # Graphs collated for message passing, each batch on its own terms; a chain has
        # already run on each graph. Nodes are counted as the job's admission chose.
        source = GraphCollated(source, spec.batch_size, spec.graph, item_fields_of(stored.datasets))
    return source
