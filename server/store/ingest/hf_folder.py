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

from shardserve.proto.errors import InvalidDataError

from .arrow_files import convert, variable_columns
from .hf_features import features_of, fixed_arrays, note_labels, prepare
from .source import IngestSource, Piece, Reader, listed_file


def _files(src: Path) -> list[Path]:
    try:
        state = json.loads((src / "state.json").read_text())
        names = [str(d["filename"]) for d in state["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise InvalidDataError(
            f"{src}/state.json: not a datasets save_to_disk state ({type(e).__name__}: {e})"
        ) from None
    files = [listed_file(src, n, src / "state.json") for n in names]
    if not files:
        raise InvalidDataError(f"source {src} lists no data files; nothing to ingest")
    return files


def _pieces(files: list[Path], source: IngestSource) -> Iterator[Piece]:
    for path in files:
        rows = 0
        size = path.stat().st_size
        try:
            with pa.memory_map(str(path), "r") as mm:
                reader = pa.ipc.open_stream(mm)
                features = features_of(reader.schema)
                for batch in reader:
                    if not batch.num_rows:
                        continue
                    where = f"{path} rows {rows}..{rows + batch.num_rows - 1}"
                    rows += batch.num_rows
                    batch = prepare(batch, features, where)
                    cols = convert(batch, where, nulls=True, text=source.text)
                    yield Piece(where=where, columns=cols)
        except pa.ArrowException as e:
            raise InvalidDataError(f"{path}: not readable as an Arrow stream: {e}") from None
        yield Piece(where=str(path), files=1, nbytes=size)


def open_hf(src: Path, threads: int = 1) -> IngestSource:
    """A source over a ``save_to_disk`` folder (see module docstring)."""
    if src.is_file():
        raise InvalidDataError(f"source {src}: a datasets save_to_disk source is its folder")
    files = _files(src)
    try:
        with pa.memory_map(str(files[0]), "r") as mm:
            schema = pa.ipc.open_stream(mm).schema
    except pa.ArrowException as e:
        raise InvalidDataError(f"{files[0]}: not readable as an Arrow stream: {e}") from None
    variable = variable_columns(schema) - fixed_arrays(features_of(schema))
    source = IngestSource(format="hf", files=files, pieces=iter(()), variable=variable)
    note_labels(features_of(schema), source)
    source.pieces = _pieces(files, source)
    return source


def is_hf_folder(src: Path) -> bool:
    """A ``save_to_disk`` folder: ``state.json`` beside ``dataset_info.json``."""
    return src.is_dir() and (src / "state.json").is_file() and (src / "dataset_info.json").is_file()


READER = Reader("hf", open_hf, claims=is_hf_folder)
