"""Rewrite a shard written before the dataset's schema last changed, to the final schema.

Ingest finds some things only as samples arrive (a tensor whose shape varies, a place that
was ``None`` until now). Rows already written keep their values; what changes is how they are
held: a fixed tensor column becomes a list column plus its shape column, and a field a shard
never saw becomes an all-missing column. One record batch at a time, so memory stays bounded
by one chunk; the file is replaced in the ingest's temporary folder, before publishing.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pyarrow as pa

from shardserve.proto.manifest import SHAPE_COLUMN_PREFIX, FieldSpec

from .schema import arrow_schema, arrow_value_type


def needs_upgrade(old: tuple[FieldSpec, ...], new: tuple[FieldSpec, ...]) -> bool:
    """Whether a shard written with ``old`` specs lacks a column, or holds one of another kind."""
    kinds = {s.name: s.kind for s in old}
    return any(kinds.get(s.name) != s.kind for s in new)


def _missing_column(spec: FieldSpec, n: int) -> list[pa.Array]:
    mask = pa.array(np.ones(n, dtype=bool))
    vt = arrow_value_type(spec)
    if spec.kind == "binary":
        return [pa.nulls(n, pa.binary())]
    if spec.kind == "scalar":
        return [pa.array(np.zeros(n, dtype=spec.dtype), type=vt, mask=mask.to_numpy(False))]
    if spec.kind == "tensor":
        zeros = pa.array(np.zeros(n * spec.numel, dtype=spec.dtype), type=vt)
        return [pa.FixedSizeListArray.from_arrays(zeros, spec.numel, mask=mask)]
    ndim = len(spec.shape)
    lists = pa.ListArray.from_arrays(
        pa.array(np.zeros(n + 1, dtype=np.int32)), pa.array([], type=vt), mask=mask
    )
    shapes = pa.FixedSizeListArray.from_arrays(pa.array(np.zeros(n * ndim, dtype=np.int64)), ndim)
    return [lists, shapes]


def _fixed_to_variable(col: pa.Array, old: FieldSpec) -> list[pa.Array]:
    n, k = len(col), old.numel
    values = col.values.slice(col.offset * k, n * k)
    offsets = pa.array((np.arange(n + 1, dtype=np.int64) * k).astype(np.int32))
    mask = col.is_null() if col.null_count else None
    lists = pa.ListArray.from_arrays(offsets, values, mask=mask)
    shape = np.tile(np.asarray(old.shape, dtype=np.int64), n)
    if col.null_count:  # a missing row has no shape: all zeros, as the writer stores it
        shape.reshape(n, -1)[col.is_null().to_numpy(zero_copy_only=False)] = 0
    return [lists, pa.FixedSizeListArray.from_arrays(pa.array(shape), len(old.shape))]


def _columns(batch: pa.RecordBatch, old: dict[str, FieldSpec], spec: FieldSpec) -> list[pa.Array]:
    was = old.get(spec.name)
    if was is None:
        return _missing_column(spec, batch.num_rows)
    col = batch.column(spec.name)
    if was.kind == spec.kind:
        if spec.kind == "variable":
            return [col, batch.column(SHAPE_COLUMN_PREFIX + spec.name)]
        return [col]
    if was.kind == "tensor" and spec.kind == "variable":
        return _fixed_to_variable(col, was)
    raise ValueError(f"field {spec.name!r} cannot change from {was.kind} to {spec.kind}")


def upgrade_shard(path: Path, old: tuple[FieldSpec, ...], new: tuple[FieldSpec, ...]) -> None:
    """Rewrite ``path`` (written with ``old``) to the schema of ``new``, in place."""
    schema = arrow_schema(new)
    before = {s.name: s for s in old}
    tmp = path.with_name(path.name + ".upgrade")
    with pa.memory_map(str(path), "r") as mm:
        reader = pa.ipc.open_file(mm)
        with pa.ipc.new_file(str(tmp), schema) as w:
            for i in range(reader.num_record_batches):
                batch = reader.get_batch(i)
                arrays = [a for s in new for a in _columns(batch, before, s)]
                w.write_batch(pa.RecordBatch.from_arrays(arrays, schema=schema))
    os.replace(tmp, path)
