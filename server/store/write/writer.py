"""``ShardWriter``: stream samples into Arrow IPC shards and publish a dataset atomically.

Layout choices (why: the store benchmarks' measurements):

* One Arrow record batch ("chunk") per shard, unless a shard is larger than
  :data:`CHUNK_MAX_BYTES`; then a shard holds several chunks of that size. A random batch then
  touches few chunks, and the reader's take within a chunk is one ``np.take``.
* Memory is bounded by one chunk (``min(shard_bytes, CHUNK_MAX_BYTES)``) however many samples
  arrive; fixed fields are buffered in preallocated arrays reused from chunk to chunk.
* Files go to ``<root>/.tmp-<name>-<random>/``; each shard is fsynced while its xxh3
  checksum is computed; ``manifest.json`` is written last and the folder is renamed into
  place. An exception (or a kill) publishes nothing.
* Nested samples are flattened by :class:`~.tree.TreeBuilder` (the tree goes in the
  manifest). The schema may still change while samples arrive: a tensor whose shape differs
  from earlier samples' is promoted to a variable field, a place that was ``None`` so far
  becomes a new field (missing in earlier rows), a ``None`` makes a field nullable. The open
  shard is closed at such a change, and shards written before it are rewritten to the final
  schema (:mod:`.migrate`) before anything is published.
"""

from __future__ import annotations

import datetime as _dt
import os
import shutil
import types
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from shardserve.proto.errors import InvalidDataError
from shardserve.proto.manifest import FieldSpec, Manifest, TextEncoding, validate_dataset_name

from .. import layout
from .column_input import checked_column, first_value
from .columns import FixedColumn, VariableColumn, make_column
from .schema import arrow_schema, infer_field, infer_fields
from .shard_files import ShardFiles
from .tree import MISSING, TreeBuilder, is_trivial, tree_of_names

CHUNK_MAX_BYTES = 512 << 20


class ShardWriter:
    """Write one dataset; use as a context manager (a clean exit publishes, an error aborts).

    ``fields`` fixes the schema up front (a ``-1`` dimension makes a field variable);
    without it the first sample decides, and names in ``variable`` become variable fields
    whose never-changing dimensions are narrowed to their value in the manifest.
    """

    def __init__(
        self,
        store_root: str | os.PathLike[str],
        name: str,
        fields: Sequence[FieldSpec] | None = None,
        shard_bytes: int = 256 << 20,
        overwrite: bool = False,
        source: Mapping[str, object] | None = None,
        *,
        variable: Collection[str] = (),
        max_sample_bytes: int | None = None,
    ) -> None:
        self.root = Path(store_root)
        self.name = validate_dataset_name(name)
        if shard_bytes < 1:
            raise InvalidDataError(f"shard size must be positive, got {shard_bytes} bytes")
        if (self.root / name).exists() and not overwrite:
            raise InvalidDataError(
                f"dataset {name!r} already exists in {self.root}; pass --overwrite to replace it"
            )
        self.shard_bytes = shard_bytes
        self.overwrite = overwrite
        self.source = {str(k): str(v) for k, v in (source or {}).items()}
        self._variable = frozenset(variable)
        self.max_sample_bytes = max_sample_bytes
        self._chunk_bytes = min(shard_bytes, CHUNK_MAX_BYTES)
        self.manifest: Manifest | None = None
        self.num_samples = 0
        self._specs: tuple[FieldSpec, ...] | None = None
        # A columns.Column each; kept open because each checks and takes its own value type,
        # which the union's methods cannot pair with the values checked for it.
        self._columns: list[Any] = []
        self._buffered = 0
        self._done = False
        self._tree = TreeBuilder()
        #: Set by a columnar source whose column names are already flattened paths.
        self.structure: object = None
        #: Set by a columnar source: its binary fields that hold text (Arrow strings).
        self.encodings: dict[str, TextEncoding] = {}
        #: Fields found to vary in shape (name -> first shape seen), and found to be missing
        #: in some samples; for the ingest summary.
        self.promoted: dict[str, tuple[int, ...]] = {}
        layout.clean_stale(self.root)
        self._owned = layout.new_temp_dir(self.root, name)
        self._temp = self._owned.path
        self._files = ShardFiles(self._temp)
        if fields is not None:
            self._init_fields(tuple(fields))

    # -- context manager ---------------------------------------------------------------------
    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(
        self,
        et: type[BaseException] | None,
        ev: BaseException | None,
        tb: types.TracebackType | None,
    ) -> None:
        if et is None:
            self.finish()
        else:
            self.abort()

    # -- adding data -------------------------------------------------------------------------
    def add(self, sample: object, where: str | None = None) -> None:
        """Append one sample (a dict, nested to any depth, a tuple or list, of arrays / numbers /
        bytes / ``None``); ``where`` names it in errors."""
        where = where or f"sample {self.num_samples}"
        flat = self._tree.flatten(sample, where)
        if self._specs is None:
            present = {k: v for k, v in flat.items() if v is not MISSING}
            declared = self._variable & set(present)  # the rest may appear later
            self._init_fields(infer_fields(present, variable=declared, where=where))
        for name, value in flat.items():
            if name not in self._index and value is not MISSING:
                self._add_field(name, value, where)
        values: list[Any] = []
        for i, c in enumerate(self._columns):
            v = flat.get(c.spec.name, MISSING)
            if v is MISSING:
                self._set_nullable(i)
                values.append(None)
                continue
            if isinstance(c, FixedColumn) and self._varies(c, v):
                c = self._promote(i)
            values.append(c.check(v, where))
        nbytes = 0
        for c, v in zip(self._columns, values, strict=True):
            c.push(v)
            if isinstance(c, FixedColumn):
                nbytes += c.row_bytes
            else:
                nbytes += int(c.row_sizes([v])[0]) if v is not None else 4
        self._check_size(nbytes, where)
        self.num_samples += 1
        self._buffered += nbytes
        self._maybe_flush()

    def _check_size(self, nbytes: int, where: str) -> None:
        limit = self.max_sample_bytes
        if limit is not None and nbytes > limit:
            raise InvalidDataError(
                f"{where}: the sample is {nbytes} bytes, more than --max-sample-bytes {limit}; "
                "raise the limit if this sample is real"
            )

    # -- the schema changing under way ----------------------------------------------------
    def _add_field(self, name: str, value: object, where: str) -> None:
        """A field first seen now: every earlier row is missing it."""
        assert self._specs is not None
        try:
            spec = infer_field(name, value, variable=name in self._variable, where=where)
        except ValueError as e:
            if isinstance(e, InvalidDataError):
                raise
            raise InvalidDataError(f"{where}: field {name!r} cannot be stored: {e}") from None
        if self.num_samples:
            spec = spec.model_copy(update={"nullable": True})
        col = make_column(spec, self._chunk_rows)
        buffered = self._columns[0].n if self._columns else 0
        for _ in range(buffered):
            col.push(None)
        self._specs = (*self._specs, spec)
        self._columns.append(col)
        self._index[name] = len(self._columns) - 1
        self._schema_changed()

    def _set_nullable(self, i: int) -> None:
        assert self._specs is not None
        spec = self._specs[i]
        if spec.nullable:
            return
        spec = spec.model_copy(update={"nullable": True})
        self._columns[i].spec = spec
        self._specs = (*self._specs[:i], spec, *self._specs[i + 1 :])
        self._schema_changed()

    @staticmethod
    def _varies(c: FixedColumn, v: object) -> bool:
        """Whether ``v`` is the field's kind of array but of another shape (so: promote)."""
        return (
            isinstance(v, np.ndarray)
            and v.dtype == c.dtype
            and v.ndim == len(c.shape)
            and v.ndim > 0
            and v.shape != c.shape
        )

    def _promote(self, i: int) -> VariableColumn:
        assert self._specs is not None
        old = self._columns[i]
        spec = old.spec.model_copy(update={"shape": (-1,) * len(old.shape)})
        col = VariableColumn.promoted(spec, old)
        self.promoted[spec.name] = old.shape
        self._columns[i] = col
        self._specs = (*self._specs[:i], spec, *self._specs[i + 1 :])
        self._schema_changed()
        return col

    def _schema_changed(self) -> None:
        assert self._specs is not None
        # One shard, one schema: chunks written so far stay in a shard of the old one
        # (rewritten at finish); the rows still buffered go to a new shard.
        self._files.close_shard()
        self._schema = arrow_schema(self._specs)

    def add_batch(self, columns: Mapping[str, object], where: str | None = None) -> None:
        """Append whole columns: arrays ``[B, *shape]`` for fixed fields, sequences of
        per-sample arrays / bytes for variable and binary fields."""
        where = where or f"batch at sample {self.num_samples}"
        rows = {k: len(v) for k, v in columns.items()}  # type: ignore[arg-type]
        if len(set(rows.values())) > 1:
            raise InvalidDataError(f"{where}: columns have different lengths {rows}")
        b = next(iter(rows.values()), 0)
        if b == 0:
            return
        if self._specs is None:
            first = {k: first_value(v) for k, v in columns.items()}
            self._init_fields(infer_fields(first, variable=self._variable, where=where))
        self._check_keys(columns, where)
        cols: list[Any] = []
        sizes = np.zeros(b, dtype=np.int64)
        masks: list[np.ndarray | None] = []
        for i, c in enumerate(self._columns):
            col, missing = checked_column(c, columns[c.spec.name], b, where)
            if missing is not None and missing.any():
                self._set_nullable(i)
                c = self._columns[i]
            else:
                missing = None
            masks.append(missing)
            sizes += c.row_sizes(col)
            cols.append(col)
        if self.max_sample_bytes is not None and b:
            top = int(sizes.argmax())
            self._check_size(int(sizes[top]), f"{where} row {top}")
        start = 0
        while start < b:
            room = self._room()
            before = np.cumsum(sizes[start:]) - sizes[start:]
            k = max(1, int(np.searchsorted(before, room, side="left")))
            stop = min(b, start + k)
            for c, col, miss in zip(self._columns, cols, masks, strict=True):
                if miss is not None:
                    for r in np.flatnonzero(miss[start:stop]).tolist():
                        c.valid.missing(c.n + r)
                c.push_rows(col, start, stop)
            self.num_samples += stop - start
            self._buffered += int(sizes[start:stop].sum())
            start = stop
            self._maybe_flush()

    # -- finishing ---------------------------------------------------------------------------
    def finish(self) -> Manifest:
        """Flush, write the manifest and publish; returns the manifest (also ``self.manifest``)."""
        if self._done:
            raise InvalidDataError(f"writer for {self.name!r} is already finished or aborted")
        try:
            if self.num_samples == 0 or self._specs is None:
                raise InvalidDataError(
                    f"no samples were written to {self.name!r}; nothing published"
                )
            self._flush_chunk()
            self._files.close_shard()
            unknown = sorted(self._variable - set(self._index))
            if unknown:
                raise InvalidDataError(
                    f"--variable names {unknown}, but the samples have fields {list(self._index)}"
                )
            self._files.upgrade(self._specs)
            structure = self.structure if self.structure is not None else self._tree.final()
            if structure is None:  # columns only: dotted names (game.board) spell a tree
                structure = tree_of_names([s.name for s in self._specs])
            manifest = Manifest(
                name=self.name,
                num_samples=self.num_samples,
                fields=self._final_specs(),
                shards=tuple(self._files.shards),
                created_at=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                source=self.source,
                structure=None if structure is None or is_trivial(structure) else structure,
            )
            layout.write_manifest(self._temp, manifest)
            layout.publish(self._temp, self.root, self.name, overwrite=self.overwrite)
        except BaseException:
            self.abort()
            raise
        # Published: the lock held through the rename can go now.
        layout.drop_owner_files(layout.dataset_dir(self.root, self.name))
        self._owned.release()
        self._done = True
        self.manifest = manifest
        return manifest

    def abort(self) -> None:
        """Drop everything written so far; nothing is published."""
        self._done = True
        self._files.abort()
        shutil.rmtree(self._temp, ignore_errors=True)
        self._owned.release()

    # -- internals ---------------------------------------------------------------------------
    def _init_fields(self, specs: tuple[FieldSpec, ...]) -> None:
        if not specs:
            raise InvalidDataError("a dataset needs at least one field")
        self._specs = specs
        fixed_row = sum(
            s.numel * np.dtype(s.dtype).itemsize for s in specs if s.kind in ("scalar", "tensor")
        )
        self._chunk_rows = self._chunk_bytes // max(1, fixed_row) + 1
        self._columns = [make_column(s, self._chunk_rows) for s in specs]
        self._index = {s.name: i for i, s in enumerate(specs)}
        self._schema = arrow_schema(specs)

    def _check_keys(self, sample: Mapping[str, object], where: str) -> None:
        want = [c.spec.name for c in self._columns]
        if len(sample) != len(want) or any(k not in sample for k in want):
            missing = [k for k in want if k not in sample]
            extra = [k for k in sample if k not in want]
            raise InvalidDataError(
                f"{where}: fields differ from the first sample's {want}: "
                f"missing {missing}, unexpected {extra}"
            )

    def _room(self) -> int:
        """Payload bytes the current chunk may still take."""
        target = min(self._chunk_bytes, self.shard_bytes - self._files.committed)
        return max(1, target - self._buffered)

    def _maybe_flush(self) -> None:
        if self._buffered >= min(self._chunk_bytes, self.shard_bytes - self._files.committed):
            self._flush_chunk()
            if self._files.committed >= self.shard_bytes:
                self._files.close_shard()

    def _flush_chunk(self) -> None:
        n = self._columns[0].n if self._columns else 0
        if n == 0:
            return
        assert self._specs is not None
        arrays: list[pa.Array] = []
        for c in self._columns:
            arrays.extend(c.to_arrow())
        batch = pa.RecordBatch.from_arrays(arrays, schema=self._schema)
        self._files.write(batch, self._specs, self._buffered)
        for c in self._columns:
            c.reset()
        self._buffered = 0

    def _final_specs(self) -> tuple[FieldSpec, ...]:
        assert self._specs is not None
        out = []
        narrow = self._variable | set(self.promoted)
        for spec, col in zip(self._specs, self._columns, strict=True):
            if spec.name in narrow and isinstance(col, VariableColumn) and col.first_shape:
                shape = tuple(
                    -1 if v else d for v, d in zip(col.varied, col.first_shape, strict=True)
                )
                if -1 not in shape:
                    shape = (-1, *shape[1:])  # declared variable: keep it variable
                spec = FieldSpec(
                    name=spec.name, dtype=spec.dtype, shape=shape, nullable=spec.nullable
                )
            enc = self.encodings.get(spec.name)
            if enc is not None and spec.kind == "binary":
                spec = spec.model_copy(update={"encoding": enc})
            out.append(spec)
        return tuple(out)
