"""Read HDF5 files (``h5py``, extra ``shardserve[formats]``): one dataset per field.

Every dataset in a file (groups searched, ``group/name`` becoming the field ``group.name``)
must share the leading sample dimension; files are read in sorted order, each in blocks of
rows (HDF5's own chunked reads), so memory stays bounded whatever the file size. Structured
(compound) datasets split into one field per member, as numpy structured arrays do.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from shardserve.proto.errors import InvalidDataError

from .extras import require
from .numpy_files import BLOCK_BYTES, _unpack
from .source import Piece, Reader, Source, list_files, require_files

SUFFIXES = (".h5", ".hdf5")


def _datasets(h5: Any, f: Any) -> dict[str, Any]:
    found: dict[str, Any] = {}

    def visit(name: str, obj: Any) -> None:
        if isinstance(obj, h5.Dataset):
            found[name.replace("/", ".")] = obj

    f.visititems(visit)
    return dict(sorted(found.items()))


def _pieces(files: list[Path]) -> Iterator[Piece]:
    h5 = require("h5py", "HDF5")
    for path in files:
        try:
            f = h5.File(path, "r")
        except OSError as e:
            raise InvalidDataError(f"{path}: not a readable HDF5 file ({e})") from None
        with f:
            sets = _datasets(h5, f)
            if not sets:
                raise InvalidDataError(f"{path}: holds no datasets")
            lengths = {k: (d.shape[0] if d.shape else None) for k, d in sets.items()}
            if None in lengths.values() or len(set(lengths.values())) != 1:
                raise InvalidDataError(
                    f"{path}: datasets must share a leading sample dimension; lengths are {lengths}"
                )
            n = next(iter(lengths.values())) or 0
            row = max(1, sum(int(np.prod(d.shape[1:], dtype=np.int64)) * d.dtype.itemsize
                             for d in sets.values()))  # fmt: skip
            step = max(1, BLOCK_BYTES // row)
            size = path.stat().st_size
            for start in range(0, n, step):
                stop = min(n, start + step)
                where = f"{path} rows {start}..{stop - 1}"
                try:
                    cols = _unpack({k: d[start:stop] for k, d in sets.items()})
                except (OSError, ValueError) as e:
                    raise InvalidDataError(f"{where}: unreadable ({e})") from None
                yield Piece(where=where, columns=cols, nbytes=size * (stop - start) // max(n, 1),
                            files=1 if stop == n else 0)  # fmt: skip
            if n == 0:
                yield Piece(where=str(path), files=1, nbytes=size)


def open_hdf5(src: Path, threads: int = 1) -> Source:
    """A source over the HDF5 file(s) at ``src`` (see module docstring)."""
    require("h5py", "HDF5")  # fail before anything is read
    files = require_files(list_files(src, SUFFIXES), src, ".h5/.hdf5")
    return Source(format="hdf5", files=files, pieces=_pieces(files))


READER = Reader("hdf5", open_hdf5, suffixes=SUFFIXES)
