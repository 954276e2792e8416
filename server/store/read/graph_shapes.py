"""Which fields of a graph dataset hold one row per edge, read from the shapes it stores.

The schema cannot tell node features from edge features: ``atom_fea [n, F]`` and
``bond_fea [E, D]`` are both variable in their first dimension. Each sample's shapes can: a
variable field stores its shape per sample (a small column beside its values, verified when
its shard is opened), so whether a field's first dimension equals an index field's item
count (``edge_index [2, E]``: its last dimension) in every sample is known without reading a
single value. Such a field follows the index field's items (edges, faces) and never counts
nodes.

The scan is bounded: it reads the shape columns of the first :data:`SCAN_SAMPLES` samples
(16 bytes per sample and field for a two-dimensional field), one shard held at a time and one
stored chunk compared at a time, and stops as soon as every field has differed from every
index field in some sample. Its answer is kept with the dataset version (which never
changes), so a version is scanned once per process, not once per job or stream. Where the
cap cut the scan short, a field that matched in every sample read is taken as following the
items: a later sample could differ, and the answer then errs towards refusing a job, never
towards counting nodes by edges.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from shardserve.proto.graphs import is_index_field
from shardserve.proto.manifest import FieldSpec

if TYPE_CHECKING:
    from .dataset import Dataset

#: Samples whose stored shapes are read at most, from the first.
SCAN_SAMPLES = 1 << 20
#: The key a dataset version keeps the answer under (:meth:`.Dataset.derived`).
_KEY = "graph.item_fields"


@dataclass(frozen=True, slots=True)
class ItemFields:
    """What the stored shapes of a graph dataset say: each field whose first dimension
    equals an index field's item count in every sample read, and that index field."""

    #: field -> the index field whose items (its last dimension) it has as many rows as.
    follows: Mapping[str, str] = field(default_factory=dict)
    #: Samples whose shapes were read (all of them, or the first :data:`SCAN_SAMPLES`).
    samples: int = 0
    #: Samples in the dataset(s).
    total: int = 0

    def why(self, name: str) -> str:
        """Why ``name`` cannot count nodes, for a message (it must be in :attr:`follows`)."""
        index = self.follows[name]
        read = (
            "every sample"
            if self.samples == self.total
            else f"each of the first {self.samples:,} samples"
        )
        return (
            f"{name!r} has as many rows as {index!r} has items (its last dimension) in {read}: "
            "an edge field, or a node field of graphs that all have as many nodes as edges, "
            "which cannot be told apart"
        )


def _counters(specs: Iterable[FieldSpec]) -> list[FieldSpec]:
    """Fields whose first dimension could be a node count (every sample has it)."""
    return [
        s
        for s in specs
        if s.kind in ("tensor", "variable")
        and s.shape
        and not s.nullable
        and not is_index_field(s.name)
    ]


def _indexes(specs: Iterable[FieldSpec]) -> list[FieldSpec]:
    """Index fields whose last dimension counts items (``edge_index [2, E]``, ``face [3, F]``)."""
    return [
        s
        for s in specs
        if s.kind in ("tensor", "variable")
        and len(s.shape) >= 2
        and not s.nullable
        and is_index_field(s.name)
    ]


class _Scan:
    """The pairs (field, index field) that have agreed in every chunk seen so far."""

    def __init__(self, counters: list[FieldSpec], indexes: list[FieldSpec]) -> None:
        self.alive = [(c, i) for c in counters for i in indexes if c.name != i.name]

    def visit(self, shapes: Mapping[str, np.ndarray]) -> bool:
        """Drop the pairs that differ in one chunk's samples; whether any is left."""
        self.alive = [(c, i) for c, i in self.alive if self._agree(c, i, shapes)]
        return bool(self.alive)

    @staticmethod
    def _agree(c: FieldSpec, i: FieldSpec, shapes: Mapping[str, np.ndarray]) -> bool:
        rows = shapes[c.name][:, 0] if c.name in shapes else c.shape[0]
        items = shapes[i.name][:, -1] if i.name in shapes else i.shape[-1]
        return bool(np.all(np.equal(rows, items)))


def _scan(dataset: Dataset, limit: int) -> ItemFields:
    specs = dataset.fields
    scan = _Scan(_counters(specs), _indexes(specs))
    n = dataset.num_samples
    if not scan.alive or n == 0:
        return ItemFields(samples=min(n, limit), total=n)
    variable = sorted({s.name for pair in scan.alive for s in pair if s.kind == "variable"})
    if variable:
        read = dataset.stored_shapes(variable, limit, scan.visit)
    else:  # every shape is fixed: one look decides for every sample
        scan.visit({})
        read = min(n, limit)
    return ItemFields({c.name: i.name for c, i in scan.alive}, read, n)


def item_fields(dataset: Dataset, limit: int = SCAN_SAMPLES) -> ItemFields:
    """The fields of ``dataset`` that follow an index field's items (see the module
    docstring), scanned once per dataset version."""
    return dataset.derived(f"{_KEY}:{limit}", lambda: _scan(dataset, limit))


def item_fields_of(datasets: Iterable[Dataset], limit: int = SCAN_SAMPLES) -> ItemFields:
    """:func:`item_fields` of samples from several datasets (a mixture's sources): a field
    follows an index field only where it does in every one of them."""
    found = [item_fields(ds, limit) for ds in datasets]
    if not found:
        return ItemFields()
    follows = dict(found[0].follows)
    for f in found[1:]:
        follows = {k: v for k, v in follows.items() if f.follows.get(k) == v}
    return ItemFields(follows, sum(f.samples for f in found), sum(f.total for f in found))
