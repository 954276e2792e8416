"""Read ``.npy`` / ``.npz`` files whose arrays share a leading sample dimension.

* one ``.npz`` file, or a folder of them: each file is a block of samples, one array per
  field (the same keys in every file);
* one ``.npy`` file: a single field named after the file;
* a folder of ``.npy`` files: one field per file (named after it), all with the same length.

A **structured** array (records such as ``[("board", "u1", (32,)), ("eval", "i2")]``)
becomes one field per record field, sub-arrays as fixed-shape tensors and nested records as
dotted names (``game.board``); a lone structured ``.npy`` file gives its fields their own
names (``board``, ``eval``...).

Arrays are loaded with ``allow_pickle=False``; ``.npy`` files are memory-mapped and copied
out in blocks, so memory stays bounded whatever their size.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path

import numpy as np

from shardserve.proto.errors import InvalidDataError

from .registry import SUFFIXES
from .source import Piece, Source, list_files, require_files

BLOCK_BYTES = 16 << 20


def _load(path: Path, mmap: bool) -> np.ndarray | Mapping[str, np.ndarray]:
    try:
        return np.load(path, mmap_mode="r" if mmap else None, allow_pickle=False)
    except ValueError as e:  # object arrays need pickle, which is refused
        raise InvalidDataError(
            f"{path}: cannot be read without unpickling ({e}); store plain numeric arrays"
        ) from None
    except (OSError, EOFError) as e:
        raise InvalidDataError(f"{path}: not a readable numpy file ({e})") from None


def _unpack(arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Structured arrays split into one array (a strided view) per record field."""
    out: dict[str, np.ndarray] = {}
    lone = len(arrays) == 1
    for key, a in arrays.items():
        if a.dtype.names is None:
            out[key] = a
            continue
        for sub, v in _unpack({f: a[f] for f in a.dtype.names}).items():
            out[sub if lone else f"{key}.{sub}"] = v
    return out


def _blocks(arrays: dict[str, np.ndarray], where: str, nbytes: int) -> Iterator[Piece]:
    arrays = _unpack(arrays)
    lengths = {k: (a.shape[0] if a.ndim else None) for k, a in arrays.items()}
    if None in lengths.values() or len(set(lengths.values())) != 1:
        raise InvalidDataError(
            f"{where}: arrays must share a leading sample dimension; lengths are {lengths}"
        )
    n = next(iter(lengths.values())) or 0
    row_bytes = max(1, sum(a[:1].nbytes for a in arrays.values()))
    step = max(1, BLOCK_BYTES // row_bytes)
    for start in range(0, n, step):
        stop = min(n, start + step)
        cols = {k: np.ascontiguousarray(a[start:stop]) for k, a in arrays.items()}
        last = stop == n
        yield Piece(
            where=f"{where} rows {start}..{stop - 1}",
            columns=cols,
            nbytes=nbytes * (stop - start) // n,
            files=1 if last else 0,
        )


def _npz_pieces(files: list[Path]) -> Iterator[Piece]:
    for path in files:
        z = _load(path, mmap=False)
        if isinstance(z, np.ndarray):
            raise InvalidDataError(f"{path}: a .npz file must hold named arrays")
        with z:  # type: ignore[attr-defined]
            try:
                arrays = {k: z[k] for k in z.files}
            except ValueError as e:
                raise InvalidDataError(f"{path}: cannot be read without unpickling ({e})") from None
        yield from _blocks(arrays, str(path), path.stat().st_size)


def _npy_pieces(files: list[Path], src: Path) -> Iterator[Piece]:
    arrays = {}
    for path in files:
        arr = _load(path, mmap=True)
        if not isinstance(arr, np.ndarray):
            raise InvalidDataError(f"{path}: expected one array in a .npy file")
        if path.stem in arrays:
            raise InvalidDataError(f"{path}: two .npy files are named {path.stem!r}")
        arrays[path.stem] = arr
    yield from _blocks(arrays, str(src), sum(p.stat().st_size for p in files))


def open_numpy(src: Path, threads: int = 1) -> Source:
    """A source over the ``.npz`` / ``.npy`` files at ``src`` (see module docstring)."""
    files = require_files(list_files(src, SUFFIXES["npz"]), src, ".npz/.npy")
    kinds = {p.suffix.lower() for p in files}
    if len(kinds) > 1:
        raise InvalidDataError(f"source {src} mixes .npy and .npz files; keep one kind per source")
    if kinds == {".npz"}:
        return Source(format="npz", files=files, pieces=_npz_pieces(files))
    return Source(format="npz", files=files, pieces=_npy_pieces(files, src))
