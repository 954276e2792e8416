"""Read Parquet or Arrow IPC files / folders through ``pyarrow.dataset``, in record batches.

Column mapping: numeric and bool columns -> scalars; ``fixed_size_list`` (nested for more
dimensions) and the ``fixed_shape_tensor`` extension -> fixed tensors; ``list`` /
``large_list`` of numbers -> variable 1-d tensors; ``list`` of ``fixed_size_list`` ->
variable tensors ``[-1, k]``; binary and string -> binary. Nulls become missing values (the
field is nullable, masked on the client). Anything else (structs, lists of lists) is refused,
naming the column.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from shardserve.proto.errors import InvalidDataError
from shardserve.proto.manifest import TextEncoding

from .hf_features import features_of, fixed_arrays, note_labels, prepare
from .source import IngestSource, Piece, Reader, require_files, source_files

PARQUET_SUFFIXES = (".parquet", ".pq")
ARROW_SUFFIXES = (".arrow", ".feather", ".ipc")

BATCH_ROWS = 4096


def _numeric(t: pa.DataType) -> bool:
    return pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t)


def _fixed(arr: pa.Array, where: str, name: str, missing: np.ndarray | None = None) -> np.ndarray:
    """A fixed-size column as one array ``[rows, *dims]``. ``missing``: rows that are null as a
    whole (their elements are filled with zeros: masked); a null element inside a row that has
    a value is refused, never turned into a number (or the column into floats)."""
    dims: list[int] = []
    if isinstance(arr.type, pa.FixedShapeTensorType):
        dims = list(arr.type.shape)
        arr = arr.storage
        values = arr.flatten()
    else:
        values = arr
        while pa.types.is_fixed_size_list(values.type):
            dims.append(values.type.list_size)
            values = values.flatten()
    if not _numeric(values.type):
        raise InvalidDataError(
            f"{where}: column {name!r} has elements of type {values.type}; expected numbers"
        )
    if values.null_count:
        per_row = int(np.prod(dims, dtype=np.int64)) if dims else 1
        rows = np.flatnonzero(values.is_null().to_numpy(zero_copy_only=False)) // per_row
        holes = rows if missing is None else rows[~missing[rows]]
        if holes.size:
            raise InvalidDataError(
                f"{where}: column {name!r} has a missing element inside row {int(holes[0])}, "
                "which has a value; a store holds whole values: fill the missing elements, or "
                "make the whole row null"
            )
        values = pc.fill_null(values, 0)  # only inside rows missing as a whole (masked)
    return values.to_numpy(zero_copy_only=False).reshape(len(arr), *dims)


def _nullable_fixed(arr: pa.Array, where: str, name: str) -> np.ndarray:
    """A fixed column with nulls as a masked array (missing rows hold zeros)."""
    missing = arr.is_null().to_numpy(zero_copy_only=False)
    if _numeric(arr.type):
        values = pc.fill_null(arr, 0).to_numpy(zero_copy_only=False)
        return np.ma.MaskedArray(values, mask=missing)
    k = arr.type.list_size if pa.types.is_fixed_size_list(arr.type) else 0
    inner = arr.values.slice(arr.offset * k, len(arr) * k)
    values = _fixed(pa.FixedSizeListArray.from_arrays(inner, k), where, name, missing)
    mask = np.broadcast_to(missing.reshape(-1, *([1] * (values.ndim - 1))), values.shape)
    return np.ma.MaskedArray(values, mask=mask)


def _ragged(arr: pa.Array, where: str, name: str) -> list[object]:
    """A list column as per-row arrays (``None`` where null)."""
    t = arr.type
    offsets = arr.offsets.to_numpy()
    child = arr.values
    dims: list[int] = []
    while pa.types.is_fixed_size_list(child.type):
        dims.append(child.type.list_size)
        child = child.flatten()
    if not _numeric(child.type):
        raise InvalidDataError(
            f"{where}: column {name!r} has type {t}, which a store cannot hold (lists of "
            "numbers or of fixed-size lists of numbers can be ingested)"
        )
    values = child.to_numpy(zero_copy_only=False)
    k = int(np.prod(dims, dtype=np.int64)) if dims else 1
    rows = np.split(values[offsets[0] * k : offsets[-1] * k], (offsets[1:-1] - offsets[0]) * k)
    out: list[object] = [r.reshape(-1, *dims) if dims else r for r in rows]
    if arr.null_count:
        valid = arr.is_valid().to_numpy(zero_copy_only=False)
        out = [r if ok else None for r, ok in zip(out, valid, strict=True)]
    return out


def _is_list(t: pa.DataType) -> bool:
    return pa.types.is_list(t) or pa.types.is_large_list(t)


def _is_text(t: pa.DataType) -> bool:
    return pa.types.is_string(t) or pa.types.is_large_string(t)


def _struct_of_lists(arr: pa.Array) -> pa.Array:
    """``list<struct{a, b}>`` as ``struct{a: list, b: list}``: a list of dicts as a dict of
    lists (what ``datasets`` gives for ``Sequence(dict)``; a tensor cannot hold dicts)."""
    offsets = arr.offsets
    mask = arr.is_null() if arr.null_count else None
    child = arr.values
    members = [
        pa.ListArray.from_arrays(offsets, pc.struct_field(child, [i]), mask=mask)
        for i in range(child.type.num_fields)
    ]
    return pa.StructArray.from_arrays(members, names=[f.name for f in child.type])


def flatten_structs(batch: pa.RecordBatch) -> pa.RecordBatch:
    """Struct columns as one column per member, named ``parent.member`` (each remembers the
    struct path it came from, so a clash with a column named ``parent.member`` names both);
    lists of structs first become structs of lists."""

    def nested(t: pa.DataType) -> bool:
        return pa.types.is_struct(t) or (_is_list(t) and pa.types.is_struct(t.value_type))

    while any(nested(f.type) for f in batch.schema):
        arrays, fields = [], []
        for f, col in zip(batch.schema, batch.columns, strict=True):
            if _is_list(f.type) and pa.types.is_struct(f.type.value_type):
                col = _struct_of_lists(col)
                f = pa.field(f.name, col.type, metadata=f.metadata)
            if pa.types.is_struct(f.type):
                origin = (f.metadata or {}).get(b"origin", f.name.encode()).decode()
                for i in range(f.type.num_fields):
                    sub = f.type.field(i)
                    meta = {b"origin": f"{origin}[{sub.name!r}]".encode()}
                    fields.append(pa.field(f"{f.name}.{sub.name}", sub.type, metadata=meta))
                    arrays.append(col.field(i) if not col.null_count else pc.struct_field(col, [i]))
            else:
                fields.append(f)
                arrays.append(col)
        batch = pa.RecordBatch.from_arrays(arrays, schema=pa.schema(fields))
    return batch


def _text_lists(arr: pa.Array) -> pa.Array:
    """``list<string>`` rows as binary: each string's UTF-8 ended by ``\\0`` (the
    ``utf-8-list`` encoding the client splits back into ``list[str]``)."""
    out: list[bytes | None] = []
    for row in arr.to_pylist():
        if row is None:
            out.append(None)
            continue
        if any(s is None or "\0" in s for s in row):
            raise ValueError("a list of strings holding None or a NUL character")
        out.append(b"".join(s.encode() + b"\0" for s in row))
    return pa.array(out, type=pa.binary())


def _nested_rows(arr: pa.Array, where: str, name: str) -> list[object]:
    """``list<list<...number>>`` rows as n-d arrays; every row must be rectangular."""
    out: list[object] = []
    for j, row in enumerate(arr.to_pylist()):
        if row is None:
            out.append(None)
            continue
        try:
            a = np.array(row, dtype=_leaf_dtype(arr.type))
        except ValueError:
            raise InvalidDataError(
                f"{where}: column {name!r} row {j} is a ragged list of lists; a tensor needs "
                "every inner list of a row the same length"
            ) from None
        out.append(a)
    return out


def _leaf_dtype(t: pa.DataType) -> np.dtype[np.generic]:
    while _is_list(t) or pa.types.is_fixed_size_list(t):
        t = t.value_type
    if not _numeric(t):
        raise ValueError(f"elements of type {t}")
    return np.dtype(t.to_pandas_dtype())


def convert(
    batch: pa.RecordBatch,
    where: str,
    nulls: bool = True,
    text: dict[str, TextEncoding] | None = None,
) -> dict[str, object]:
    """A record batch as writer columns (see module docstring); ``text`` collects the names
    of the columns that hold text, and their encoding."""
    batch = flatten_structs(batch)
    cols: dict[str, object] = {}
    _refuse_duplicates(batch, where)
    for name, arr in zip(batch.schema.names, batch.columns, strict=True):
        if name.startswith("__index_level_"):
            continue  # pandas' saved index is not a field
        if arr.null_count and not nulls:
            raise InvalidDataError(
                f"{where}: column {name!r} has {arr.null_count} nulls; a store holds no nulls"
            )
        cols[name] = _column(arr, where, name, text)
    return cols


def _refuse_duplicates(batch: pa.RecordBatch, where: str) -> None:
    """Refuse two source columns that flatten to one field name, naming both."""
    names = batch.schema.names
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        origins = [o for o, n in zip(_origins(batch.schema), names, strict=True) if n == dup]
        raise InvalidDataError(
            f"{where}: {' and '.join(repr(o) for o in origins)} both become the field {dup!r}; "
            "rename one of them in the source (or drop one with --map)"
        )


def _column(arr: pa.Array, where: str, name: str, text: dict[str, TextEncoding] | None) -> object:
    """Column ``name`` as the writer takes it (``text``: notes it if it holds text)."""
    t = arr.type
    col: object
    if (_numeric(t) or pa.types.is_fixed_size_list(t)) and arr.null_count:
        col = _nullable_fixed(arr, where, name)
    elif _numeric(t):
        col = arr.to_numpy(zero_copy_only=False)
    elif pa.types.is_fixed_size_list(t) or isinstance(t, pa.FixedShapeTensorType):
        col = _fixed(arr, where, name)
    elif _is_list(t) and _is_text(t.value_type):
        try:
            col = _text_lists(arr)
        except ValueError as e:
            raise InvalidDataError(f"{where}: column {name!r}: {e}") from None
        if text is not None:
            text[name] = "utf-8-list"
    elif _is_list(t) and _is_list(t.value_type):
        try:
            col = _nested_rows(arr, where, name)
        except InvalidDataError:
            raise
        except ValueError as e:
            raise InvalidDataError(
                f"{where}: column {name!r} has type {t}, which a store cannot hold ({e})"
            ) from None
    elif pa.types.is_list(t) or pa.types.is_large_list(t):
        col = _ragged(arr, where, name)
    elif (
        pa.types.is_binary(t)
        or pa.types.is_large_binary(t)
        or pa.types.is_string(t)
        or pa.types.is_large_string(t)
    ):
        # Kept as Arrow (strings as their UTF-8 bytes): no Python object per row.
        col = arr.cast(pa.binary())
        if text is not None and _is_text(t):
            text[name] = "utf-8"
    else:
        raise InvalidDataError(
            f"{where}: column {name!r} has type {t}, which a store cannot hold (numbers, "
            "fixed-size lists, lists of numbers, binary and strings can be ingested)"
        )
    return col


def _origins(schema: pa.Schema) -> list[str]:
    """Where each (flattened) column came from: its metadata note, else its name."""
    out = []
    for f in schema:
        meta = f.metadata or {}
        out.append(meta.get(b"origin", f.name.encode()).decode())
    return out


def variable_columns(fields: pa.Schema | pa.StructType, prefix: str = "") -> set[str]:
    """The fields that lists become once structs are flattened (:func:`flatten_structs`):
    variable-shape, except lists of strings (text)."""
    out: set[str] = set()
    for f in fields:
        t = f.type
        if pa.types.is_struct(t):
            out |= variable_columns(t, f"{prefix}{f.name}.")
        elif _is_list(t) and pa.types.is_struct(t.value_type):
            out |= {
                f"{prefix}{f.name}.{m.name}"
                for m in t.value_type
                if not pa.types.is_struct(m.type) and not _is_text(m.type)
            }
        elif _is_list(t) and not _is_text(t.value_type):
            out.add(prefix + f.name)
    return out


def _open(src: Path, fmt: str, suffixes: tuple[str, ...], only: list[Path] | None) -> IngestSource:
    # Imported here: `import pyarrow.dataset` pulls pandas (~0.3 s), and the registry imports
    # this module to name the formats in `shardserve ingest --help`.
    import pyarrow.dataset as pads

    files = require_files(source_files(src, suffixes, only), src, "/".join(suffixes))
    try:
        dataset = pads.dataset([str(f) for f in files], format=fmt)
    except (pa.ArrowException, OSError) as e:
        raise InvalidDataError(f"source {src}: not readable as {fmt}: {e}") from None
    sizes = {str(f): f.stat().st_size for f in files}
    features = features_of(dataset.schema)
    source = IngestSource(format=fmt, files=files, pieces=iter(()))
    note_labels(features, source)

    def pieces() -> Iterator[Piece]:
        for fragment in dataset.get_fragments():
            path = fragment.path
            rows = 0
            try:
                total = max(1, fragment.count_rows())
                for batch in fragment.to_batches(batch_size=BATCH_ROWS):
                    where = f"{path} rows {rows}..{rows + batch.num_rows - 1}"
                    rows += batch.num_rows
                    if batch.num_rows:
                        share = sizes.get(path, 0) * batch.num_rows // total
                        batch = prepare(batch, features, where)
                        cols = convert(batch, where, text=source.text)
                        yield Piece(where=where, columns=cols, nbytes=share)
            except pa.ArrowException as e:
                raise InvalidDataError(f"{path}: not readable as {fmt}: {e}") from None
            yield Piece(where=path, files=1)

    source.pieces = pieces()
    source.variable = variable_columns(dataset.schema) - fixed_arrays(features)
    return source


def open_parquet(src: Path, threads: int = 1, only: list[Path] | None = None) -> IngestSource:
    """A source over the Parquet file(s) at ``src`` (``only``: these of them)."""
    return _open(src, "parquet", PARQUET_SUFFIXES, only)


def open_arrow(src: Path, threads: int = 1, only: list[Path] | None = None) -> IngestSource:
    """A source over the Arrow IPC (file / Feather v2) file(s) at ``src`` (``only``: these)."""
    return _open(src, "ipc", ARROW_SUFFIXES, only)


PARQUET = Reader("parquet", open_parquet, suffixes=PARQUET_SUFFIXES)
ARROW = Reader("arrow", open_arrow, suffixes=ARROW_SUFFIXES)
