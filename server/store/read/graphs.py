"""``collate="graph"``: a batch of graphs put together the way message passing needs it.

The rules are ``torch_geometric``'s (``Batch.from_data_list``), done with a handful of numpy
calls per field instead of a Python loop over graphs:

* a field whose last name segment contains ``index`` (``edge_index``) or is ``face`` is
  concatenated along its **last** dimension, each graph's values shifted by the number of
  nodes before it;
* every other tensor field is concatenated along its first dimension (node and edge
  features: ``x [sum N, F]``, ``edge_attr [sum E, F]``; a per-graph ``y [1]`` becomes
  ``[B]``); scalars are stacked;
* ``batch`` (int64 ``[sum N]``: the graph of each node) and ``ptr`` (int64 ``[B+1]``) are
  added.

The node count of a graph is the first dimension of the field the job names
(``collate={"graph": {"node_field": "atom_fea"}}``), else its ``num_nodes`` field (PyG
``Data`` ingest stores it), else the first dimension of ``x``, else of ``pos``, else of the
one top-level field that can count nodes (its first dimension varies; not an index field).
An edge field never counts nodes, named or not: ``edge_attr``, and any field whose stored
shapes give it as many rows as an index field has items in every sample
(:mod:`.graph_shapes`: ``bond_fea [E, D]`` beside ``edge_index [2, E]``). Several node-level
candidates are refused, never guessed between, as is a dataset left with none (graphs that
all have as many nodes as edges included). ``num_nodes`` itself is not sent (``ptr`` says
it). Bytes fields and fields that may be missing have no place in such a batch and are
refused when the job is created, as is a dataset with no way to count nodes.

With transforms, each graph goes through the chain first and the chain's outputs are
collated: a transform sees one graph as stored.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import numpy as np

from shardserve.proto.errors import BadRequest, InvalidDataError
from shardserve.proto.graphs import is_index_field
from shardserve.proto.jobs import GraphOptions
from shardserve.proto.manifest import FieldSpec, Manifest
from shardserve.proto.parts import OFFSETS, SHAPES, SPLITS

from ...source import FRESH, BatchParts, BatchSource, FileSpan, PartShapes, Tail, Wrapped
from .graph_shapes import ItemFields

if TYPE_CHECKING:
    from .gather import Empty

#: Parts a graph batch adds; no field may have these names.
ADDED = ("batch", "ptr")
NODE_FIELDS = ("x", "pos")


def _counts_nodes(name: str, spec: FieldSpec) -> bool:
    """Whether ``name``'s first dimension may be a node count (every sample has it)."""
    return (
        spec.kind in ("tensor", "variable")
        and bool(spec.shape)
        and not spec.nullable
        and not is_index_field(name)
    )


#: PyG's name for edge features: never a node count, whatever its shapes.
EDGE_FIELDS = ("edge_attr",)
#: What a refusal says to do when no stored field can count nodes.
_FIX = (
    'name a stored node-level field: collate={"graph": {"node_field": NAME}}, or store each '
    "graph's node count as a num_nodes field (e.g. re-ingest with a --map that adds it)"
)


def _edge_reason(name: str, items: ItemFields) -> str | None:
    """Why ``name`` is an edge field and never counts nodes, or ``None`` if it is not one."""
    if name.rsplit(".", 1)[-1] in EDGE_FIELDS:
        return f"{name!r} is PyG's name for edge features"
    if name in items.follows:
        return items.why(name)
    return None


def node_source(
    specs: Mapping[str, FieldSpec], node_field: str | None, where: str, items: ItemFields
) -> str:
    """The field that counts each graph's nodes (see the module docstring), or ``BadRequest``
    naming what to change. Chosen from every field of the dataset, served or not: leaving a
    field out with ``fields=`` never changes what counts the nodes. ``items``: the fields
    whose stored shapes show they follow an index field's edges (:mod:`.graph_shapes`)."""
    if node_field is not None:
        return _named_node_field(specs, node_field, where, items)
    if "num_nodes" in specs and specs["num_nodes"].kind == "scalar":
        return "num_nodes"
    edges = {n: why for n in specs if (why := _edge_reason(n, items)) is not None}
    for n in NODE_FIELDS:
        if n in specs and _counts_nodes(n, specs[n]) and n not in edges:
            return n
    # Top-level fields only: nested ones (a HeteroData's "paper.x") count one node type of
    # several, and shifting every index by them would be wrong.
    varying = [
        n for n, f in specs.items() if "." not in n and _counts_nodes(n, f) and f.shape[0] == -1
    ]
    nodes = [n for n in varying if n not in edges]
    if len(nodes) == 1:
        return nodes[0]
    how = 'say which field counts them: collate={"graph": {"node_field": NAME}}'
    if nodes:
        raise BadRequest(
            f"{where}: more than one field could count each graph's nodes: {nodes} (node "
            f"features and edge features look alike); {how}"
        )
    excluded = [n for n in dict.fromkeys([*NODE_FIELDS, *varying]) if n in edges and n in specs]
    if excluded:
        raise BadRequest(
            f"{where}: no stored field can count each graph's nodes ({excluded} are edge "
            f"fields): {'; '.join(edges[n] for n in excluded)}; {_FIX}"
        )
    raise BadRequest(
        f"{where}: no way to count each graph's nodes: it needs a num_nodes field, or x or "
        f"pos, or a top-level field whose first dimension varies; its fields are "
        f"{list(specs)}. Else {how}"
    )


def _named_node_field(
    specs: Mapping[str, FieldSpec], node_field: str, where: str, items: ItemFields
) -> str:
    """``node_field`` as the job named it, if it can count nodes; else ``BadRequest``."""
    spec = specs.get(node_field)
    if spec is None or not _counts_nodes(node_field, spec):
        what = (
            "is not a field"
            if spec is None
            else f"is {spec.kind} {spec.dtype}{list(spec.shape)}"
            + (", missing in some samples" if spec.nullable else "")
        )
        raise BadRequest(
            f"{where}: node_field {node_field!r} {what}; it must be a tensor every sample "
            f"has, whose first dimension is the graph's node count, not an index field. "
            f"Fields: {list(specs)}"
        )
    if (why := _edge_reason(node_field, items)) is not None:
        raise BadRequest(f"{where}: node_field {node_field!r} cannot count nodes: {why}; {_FIX}")
    return node_field


def check_graph_job(
    manifest: Manifest, fields: Sequence[str] | None, graph: GraphOptions, items: ItemFields
) -> str:
    """Refuse (``BadRequest``) a graph job this dataset's fields cannot make; returns the
    field that counts nodes. ``manifest``: what the job's batches are made from (a chain's
    outputs when it has transforms); ``items``: what the stored shapes say
    (:func:`~.graph_shapes.item_fields`)."""
    specs = {f.name: f for f in manifest.fields}
    names = list(fields) if fields is not None else list(specs)
    where = f'collate="graph" on dataset {manifest.name!r}'
    counter = node_source(specs, graph.node_field, where, items)
    for n in names:
        s = specs[n]
        if n in ADDED:
            raise BadRequest(f"{where}: field {n!r} clashes with the {n!r} a graph batch adds")
        if s.kind == "binary" or s.nullable:
            why = "holds bytes" if s.kind == "binary" else "is missing in some samples"
            raise BadRequest(f"{where}: field {n!r} {why}; leave it out with fields=")
        if s.kind == "variable" and -1 in (s.shape[:-1] if is_index_field(n) else s.shape[1:]):
            raise BadRequest(
                f"{where}: field {n!r} has shape {list(s.shape)}; only its "
                f"{'last' if is_index_field(n) else 'first'} dimension may vary to be concatenated"
            )
    return counter


#: Average edges per graph from which each graph's rows are copied as slices (a Python step
#: each) rather than through an index per value.
SLICE_MIN_EDGES = 16


@dataclass(frozen=True, slots=True)
class _Except:
    """A tail that leaves ``parts`` in fresh memory: the index fields' values as stored are
    laid out anew (and shifted) into the tail afterwards."""

    tail: Tail
    parts: frozenset[str]

    def empty(self, part: str, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        if part in self.parts:
            return np.empty(shape, dtype)
        return self.tail.empty(part, shape, dtype)

    def span_of(self, arr: np.ndarray) -> FileSpan | None:
        return self.tail.span_of(arr)


def _cat_last(
    values: np.ndarray, offsets: np.ndarray, shapes: np.ndarray, empty: Empty
) -> np.ndarray:
    """Concatenate ``[k, E_g]`` blocks (flat, row-major, one per graph) into ``[k, sum E]``,
    in memory from ``empty``."""
    b = len(shapes)
    if b == 0:
        return values.reshape(0, 0)
    k = int(shapes[0, 0])
    e = shapes[:, -1]
    total = int(e.sum())
    if total >= SLICE_MIN_EDGES * b:
        # Row r of graph g is one slice: k * B slices, no index of sum-E entries to build.
        out = empty((k, total), values.dtype)
        starts, counts = offsets[:-1].tolist(), e.tolist()
        for r in range(k):
            pieces = [
                values[o + r * n : o + (r + 1) * n] for o, n in zip(starts, counts, strict=True)
            ]
            np.concatenate(pieces, out=out[r])
        return out
    start = np.repeat(offsets[:-1], e)
    col = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(e) - e, e)
    rows = np.repeat(e, e)
    idx = start[None, :] + np.arange(k, dtype=np.int64)[:, None] * rows[None, :] + col[None, :]
    return np.take(values, idx, out=empty(idx.shape, values.dtype))


class GraphCollated(Wrapped):
    """A dataset whose ``take`` returns graph batches (see module docstring); everything
    else is the wrapped dataset's.

    A take of more than ``batch_size`` graphs is a message of several batches:
    each batch of ``batch_size`` consecutive graphs is collated on its own terms (``batch``,
    ``ptr`` and index fields count from that batch's first graph and node), the batches lie
    one after the other in every part, and a ``.splits`` part (int64 ``[parts, batches + 1]``)
    says where each batch's rows begin in each part, along the dimension the part
    concatenates (:func:`~shardserve.proto.graphs.concat_dim`).
    """

    def __init__(
        self,
        inner: BatchSource,
        batch_size: int = 0,
        graph: GraphOptions | None = None,
        items: ItemFields | None = None,
    ) -> None:
        """``items``: the fields whose stored shapes follow an index field's edges (the same
        answer the job's admission had: :func:`~.graph_shapes.item_fields`)."""
        super().__init__(inner)
        self._specs = {f.name: f for f in inner.manifest.fields}
        self.batch_size = batch_size
        where = f'collate="graph" on dataset {inner.manifest.name!r}'
        #: The field that counts each graph's nodes (checked when the job was made).
        self._counter = node_source(
            self._specs, graph.node_field if graph else None, where, items or ItemFields()
        )

    def part_shapes(self, fields: Sequence[str] | None = None) -> PartShapes:
        """Every part's size depends on the graphs in the batch: all variable."""
        names = [n for n in self.inner.field_names(fields) if n != "num_nodes"]
        return dict.fromkeys([*names, *ADDED])

    def take(
        self,
        indices: np.ndarray | Sequence[int],
        fields: Sequence[str] | None = None,
        out: Mapping[str, np.ndarray] | None = None,
        batch: int = -1,
        tail: Tail = FRESH,
    ) -> BatchParts:
        """Graphs ``indices`` collated (``out`` is not used: every part is variable)."""
        names = self.inner.field_names(fields)
        source = self._counter
        want = list(names)
        if source not in want:
            want.append(source)
        # Node and edge features are sent as gathered: straight into the tail.
        stored = _Except(tail, frozenset(n for n in want if is_index_field(n)))
        parts = self.inner.take(indices, want, batch=batch, tail=stored)
        b = len(np.asarray(indices).reshape(-1))
        if self._specs[source].kind == "scalar":  # num_nodes
            counts = parts[source].astype(np.int64)
            self._agree(counts, parts, np.asarray(indices).reshape(-1))
        elif self._specs[source].kind == "variable":
            counts = parts[source + SHAPES][:, 0]
        else:
            counts = np.full(b, self._specs[source].shape[0], dtype=np.int64)
        bs = self.batch_size if 0 < self.batch_size < b else b
        edges = np.append(np.arange(0, b, bs, dtype=np.int64), b)  # where each batch begins
        first, sizes = edges[:-1], np.diff(edges)
        node = np.zeros(b + 1, dtype=np.int64)  # the first node of each graph, in its message
        np.cumsum(counts, out=node[1:])
        # Each graph's first node within its own batch: what its index fields are shifted by.
        base = node[:-1] - np.repeat(node[first], sizes)
        out_parts: dict[str, np.ndarray] = {}
        rows: dict[str, np.ndarray] = {}  # rows of each part per graph, along its concat dim
        for n in names:
            if n == "num_nodes":  # ptr says it
                continue
            out_parts[n], rows[n] = self._field(n, self._specs[n], parts, b, base, tail)
        out_parts["batch"] = np.arange(b, dtype=np.int64).repeat(counts)
        out_parts["ptr"] = _ptrs(node, edges)
        if bs == b:
            return out_parts
        # Several batches: graph numbers count from each batch's first graph, and the cuts.
        out_parts["batch"] -= np.repeat(first, sizes).repeat(counts)
        rows["batch"] = counts
        splits = [_cuts(rows[n], edges) for n in out_parts if n != "ptr"]
        splits.insert(list(out_parts).index("ptr"), edges + np.arange(len(edges)))
        out_parts[SPLITS] = np.stack(splits)
        return out_parts

    def _agree(self, counts: np.ndarray, parts: BatchParts, ids: np.ndarray) -> None:
        """``num_nodes`` against the rows of a served ``x`` / ``pos`` (ingest checked them as
        stored; a transform before collation may have changed the nodes)."""
        for n in NODE_FIELDS:
            spec = self._specs.get(n)
            if n not in parts or spec is None or not _counts_nodes(n, spec):
                continue
            rows = (
                parts[n + SHAPES][:, 0]
                if n + SHAPES in parts
                else np.full(counts.size, spec.shape[0], dtype=np.int64)
            )
            if (bad := np.flatnonzero(rows != counts)).size:
                i = int(bad[0])
                raise InvalidDataError(
                    f'collate="graph" on dataset {self.manifest.name!r}: sample {int(ids[i])} '
                    f"has num_nodes {int(counts[i])} but {n!r} has {int(rows[i])} rows (did a "
                    f"transform change its nodes?); count them by {n!r}: "
                    f'collate={{"graph": {{"node_field": "{n}"}}}}'
                )

    @staticmethod
    def _field(
        n: str,
        spec: FieldSpec,
        parts: Mapping[str, np.ndarray],
        b: int,
        base: np.ndarray,
        tail: Tail,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Field ``n`` collated, and its rows per graph along the dimension it concatenates."""
        index = is_index_field(n)
        if spec.kind == "variable":
            values, offsets, shapes = parts[n], parts[n + OFFSETS], parts[n + SHAPES]
            if index:
                # Fresh or the tail's memory, not the store's: shifted in place.
                cat = _cat_last(values, offsets, shapes, partial(tail.empty, n))
                e = shapes[:, -1] if b else np.zeros(0, np.int64)
                cat += np.repeat(base, e)[None, :].astype(cat.dtype, copy=False)
                return cat, e
            rest = (
                tuple(int(d) for d in shapes[0, 1:])
                if b
                else tuple(max(d, 0) for d in spec.shape[1:])
            )
            return values.reshape(-1, *rest), shapes[:, 0] if b else np.zeros(0, np.int64)
        arr = parts[n]
        if spec.kind == "scalar":
            return arr, np.ones(b, dtype=np.int64)
        if index:
            width = spec.shape[-1]
            cat = np.moveaxis(arr, 0, -2).reshape(*spec.shape[:-1], b * width)
            shifted = np.add(
                cat,
                np.repeat(base, width).astype(cat.dtype, copy=False),
                out=tail.empty(n, cat.shape, cat.dtype),
            )
            return shifted, np.full(b, width, np.int64)
        per = spec.shape[0]
        return arr.reshape(b * per, *spec.shape[1:]), np.full(b, per, np.int64)


def _ptrs(node: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """``ptr`` of each batch (its graphs' first nodes from 0, and its node count), end to end:
    ``node`` itself for a single batch."""
    if len(edges) == 2:
        return node
    lo_hi = edges.tolist()
    return np.concatenate([node[lo : hi + 1] - node[lo] for lo, hi in itertools.pairwise(lo_hi)])


def _cuts(per_graph: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """Where each batch's rows begin in a part with ``per_graph`` rows per graph."""
    at = np.zeros(len(per_graph) + 1, dtype=np.int64)
    np.cumsum(per_graph, out=at[1:])
    return at[edges]
