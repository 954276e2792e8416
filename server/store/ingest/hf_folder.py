"""Read a Hugging Face ``datasets`` folder written by ``save_to_disk``, without ``datasets``.

Such a folder is Arrow already: ``state.json`` lists its ``data-*.arrow`` files (Arrow IPC
*stream* format) in order, beside ``dataset_info.json``. They are read with pyarrow, a
record batch at a time, and converted as Arrow sources are (:mod:`.arrow_files`), plus:
struct columns (``Image()`` is ``{bytes, path}``) become dotted fields (``image.bytes``),
nulls become missing values (masked), and lists of fixed-size lists (``Array2D`` with a
variable first dimension) become variable tensors.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from shardserve.proto.errors import InvalidDataError

from .arrow_files import convert
from .source import Piece, Reader, Source


def _files(src: Path) -> list[Path]:
    try:
        state = json.loads((src / "state.json").read_text())
        names = [str(d["filename"]) for d in state["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise InvalidDataError(
            f"{src}/state.json: not a datasets save_to_disk state ({type(e).__name__}: {e})"
        ) from None
    files = [src / n for n in names]
    for f in files:
        if not f.is_file() or f.resolve().parent != src.resolve():
            raise InvalidDataError(f"{src}/state.json lists {f.name}, which is not in the folder")
    if not files:
        raise InvalidDataError(f"source {src} lists no data files; nothing to ingest")
    return files


def _flatten(batch: pa.RecordBatch) -> pa.RecordBatch:
    """Struct columns as one column per member, named ``parent.member`` (each remembers the
    struct path it came from, so a clash with a column named ``parent.member`` names both)."""
    while any(pa.types.is_struct(f.type) for f in batch.schema):
        arrays, fields = [], []
        for f, col in zip(batch.schema, batch.columns, strict=True):
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


def _pieces(files: list[Path]) -> Iterator[Piece]:
    for path in files:
        rows = 0
        size = path.stat().st_size
        try:
            with pa.memory_map(str(path), "r") as mm:
                reader = pa.ipc.open_stream(mm)
                for batch in reader:
                    if not batch.num_rows:
                        continue
                    where = f"{path} rows {rows}..{rows + batch.num_rows - 1}"
                    rows += batch.num_rows
                    yield Piece(where=where, columns=convert(_flatten(batch), where, nulls=True))
        except pa.ArrowException as e:
            raise InvalidDataError(f"{path}: not readable as an Arrow stream: {e}") from None
        yield Piece(where=str(path), files=1, nbytes=size)


def open_hf(src: Path, threads: int = 1) -> Source:
    """A source over a ``save_to_disk`` folder (see module docstring)."""
    if src.is_file():
        raise InvalidDataError(f"source {src}: a datasets save_to_disk source is its folder")
    files = _files(src)
    try:
        with pa.memory_map(str(files[0]), "r") as mm:
            schema = pa.ipc.open_stream(mm).schema
    except pa.ArrowException as e:
        raise InvalidDataError(f"{files[0]}: not readable as an Arrow stream: {e}") from None
    return Source(format="hf", files=files, pieces=_pieces(files), variable=_lists(schema))


def _lists(fields: pa.Schema | pa.StructType, prefix: str = "") -> set[str]:
    out: set[str] = set()
    for f in fields:
        if pa.types.is_struct(f.type):
            out |= _lists(f.type, f"{prefix}{f.name}.")
        elif pa.types.is_list(f.type) or pa.types.is_large_list(f.type):
            out.add(prefix + f.name)
    return out


def is_hf_folder(src: Path) -> bool:
    """A ``save_to_disk`` folder: ``state.json`` beside ``dataset_info.json``."""
    return src.is_dir() and (src / "state.json").is_file() and (src / "dataset_info.json").is_file()


READER = Reader("hf", open_hf, claims=is_hf_folder)
