"""Read HDF5 files (``h5py``, extra ``shardserve[formats]``): one dataset per field.

Every dataset in a file (groups searched, ``group/name`` becoming the field ``group.name``)
that has the leading sample dimension (the length most datasets share) is a field; an array
without it (``class_names``) and the file's attributes are metadata, kept in the manifest's
``source`` as JSON when small (``meta.class_names``) and listed in the summary, never
samples. A dataset ``a.b`` beside group ``a`` / dataset ``b`` is refused (one field name); files are read in sorted order, each in blocks of
rows (HDF5's own chunked reads), so memory stays bounded whatever the file size. Structured
(compound) datasets split into one field per member, as numpy structured arrays do.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

import numpy as np

from shardserve.proto.errors import InvalidDataError

from .extras import require
from .numpy_files import BLOCK_BYTES, _unpack
from .source import (
    MAX_SAMPLE_BYTES,
    IngestSource,
    Piece,
    Reader,
    put_field,
    require_files,
    source_files,
)

if TYPE_CHECKING:
    import h5py

SUFFIXES = (".h5", ".hdf5")


#: Metadata arrays (no sample dimension) up to this size are kept in the manifest as JSON.
METADATA_MAX_BYTES = 64 << 10


def _datasets(h5: ModuleType, f: h5py.File, path: Path) -> dict[str, h5py.Dataset]:
    found: dict[str, h5py.Dataset] = {}
    seen: dict[str, str] = {}

    def visit(name: str, obj: object) -> None:
        if isinstance(obj, h5.Dataset):
            put_field(found, name.replace("/", "."), obj, name, seen, str(path))

    f.visititems(visit)
    return dict(sorted(found.items()))


def _sample_length(sets: dict[str, h5py.Dataset]) -> int:
    """The leading length most datasets share (ties: the longer): the sample count."""
    counts: dict[int, int] = {}
    for d in sets.values():
        if d.shape:
            counts[d.shape[0]] = counts.get(d.shape[0], 0) + 1
    if not counts:
        return 0
    return max(counts, key=lambda n: (counts[n], n))


def _as_json(value: object) -> str | None:
    """A small array or attribute as JSON (strings decoded), ``None`` if it is not small."""
    arr = np.asarray(value)
    if arr.nbytes > METADATA_MAX_BYTES:
        return None
    if arr.dtype.kind in ("S", "O", "U"):
        items = [
            v.decode(errors="replace") if isinstance(v, bytes) else str(v)
            for v in arr.reshape(-1).tolist()
        ]
        return json.dumps(items if arr.ndim else items[0])
    if arr.dtype.kind in "biuf":
        return json.dumps(arr.tolist())
    return None


def _metadata(
    f: h5py.File, sets: dict[str, h5py.Dataset], n: int, path: Path, source: IngestSource
) -> None:
    """Arrays without the sample dimension and file attributes into the source's metadata."""
    for key in [k for k, d in sets.items() if not d.shape or d.shape[0] != n]:
        d = sets.pop(key)
        text = _as_json(d[()])
        if text is None:
            source.metadata[key] = f"{path.name}: shape {list(d.shape)} {d.dtype}, skipped"
        else:
            source.info[f"meta.{key}"] = text
            source.metadata[key] = f"{path.name}: shape {list(d.shape)}, kept as source.meta.{key}"
    for key, value in f.attrs.items():
        text = _as_json(value)
        if text is not None:
            source.info[f"meta.@{key}"] = text
            source.metadata[f"@{key}"] = f"{path.name}: attribute, kept as source.meta.@{key}"
        else:
            source.metadata[f"@{key}"] = f"{path.name}: attribute, skipped"


def _pieces(files: list[Path], source: IngestSource, limit: int) -> Iterator[Piece]:
    h5 = require("h5py", "HDF5")
    for path in files:
        try:
            f = h5.File(path, "r")
        except OSError as e:
            raise InvalidDataError(f"{path}: not a readable HDF5 file ({e})") from None
        with f:
            sets = _datasets(h5, f, path)
            if not sets:
                raise InvalidDataError(f"{path}: holds no datasets")
            n = _sample_length(sets)
            _metadata(f, sets, n, path, source)
            if not sets:
                raise InvalidDataError(f"{path}: holds no per-sample datasets")
            row = max(
                1,
                sum(
                    int(np.prod(d.shape[1:], dtype=np.int64)) * d.dtype.itemsize
                    for d in sets.values()
                ),
            )
            if row > limit:
                raise InvalidDataError(
                    f"{path}: one sample is {row} bytes, more than --max-sample-bytes {limit}; "
                    "raise the limit if this sample is real"
                )
            step = max(1, BLOCK_BYTES // row)
            size = path.stat().st_size
            for start in range(0, n, step):
                stop = min(n, start + step)
                where = f"{path} rows {start}..{stop - 1}"
                try:
                    cols = _unpack({k: d[start:stop] for k, d in sets.items()}, where)
                except (OSError, ValueError) as e:
                    if isinstance(e, InvalidDataError):
                        raise
                    raise InvalidDataError(f"{where}: unreadable ({e})") from None
                yield Piece(
                    where=where,
                    columns=cols,
                    nbytes=size * (stop - start) // max(n, 1),
                    files=1 if stop == n else 0,
                )
            if n == 0:
                yield Piece(where=str(path), files=1, nbytes=size)


def open_hdf5(
    src: Path,
    threads: int = 1,
    only: list[Path] | None = None,
    max_sample_bytes: int = MAX_SAMPLE_BYTES,
) -> IngestSource:
    """A source over the HDF5 file(s) at ``src`` (see module docstring)."""
    require("h5py", "HDF5")  # fail before anything is read
    files = require_files(source_files(src, SUFFIXES, only), src, ".h5/.hdf5")
    source = IngestSource(format="hdf5", files=files, pieces=iter(()))
    source.pieces = _pieces(files, source, max_sample_bytes)
    return source


READER = Reader("hdf5", open_hdf5, suffixes=SUFFIXES, bounded=True)
