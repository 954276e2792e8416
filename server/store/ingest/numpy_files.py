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
out in blocks, and the members of a ``.npz`` are decompressed as streams, a block of rows at a
time, so memory stays bounded whatever their size (a 1.4 MB ``.npz`` can declare gigabytes).
"""

from __future__ import annotations

import zipfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import numpy as np

from shardserve.proto.errors import InvalidDataError

from .source import (
    MAX_SAMPLE_BYTES,
    IngestSource,
    Piece,
    Reader,
    put_field,
    require_files,
    source_files,
)

SUFFIXES = (".npz", ".npy")

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


def _unpack(arrays: dict[str, np.ndarray], where: str = "source") -> dict[str, np.ndarray]:
    """Structured arrays split into one array (a strided view) per record field; two inputs
    that become one name (array ``a.b`` beside record ``a`` with field ``b``) are refused."""
    out: dict[str, object] = {}
    seen: dict[str, str] = {}
    lone = len(arrays) == 1
    for key, a in arrays.items():
        if a.dtype.names is None:
            put_field(out, key, a, key, seen, where)
            continue
        for sub, v in _unpack({f: a[f] for f in a.dtype.names}, where).items():
            name = sub if lone else f"{key}.{sub}"
            put_field(out, name, v, f"{key}[{sub!r}]", seen, where)
    return out  # type: ignore[return-value]


def _blocks(arrays: dict[str, np.ndarray], where: str, nbytes: int) -> Iterator[Piece]:
    arrays = _unpack(arrays, where)
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


@dataclass
class _Member:
    """One array of a ``.npz``: its header, and its decompressing stream after the header."""

    stream: IO[bytes]
    dtype: np.dtype[np.generic]
    shape: tuple[int, ...]

    @property
    def row_bytes(self) -> int:
        return int(np.prod(self.shape[1:], dtype=np.int64)) * self.dtype.itemsize

    def read_rows(self, k: int, where: str) -> np.ndarray:
        want = k * self.row_bytes
        data = self.stream.read(want)
        if len(data) != want:
            raise InvalidDataError(f"{where}: member ends early ({len(data)} of {want} bytes)")
        return np.frombuffer(data, dtype=self.dtype).reshape(k, *self.shape[1:])


def _open_member(z: zipfile.ZipFile, info: zipfile.ZipInfo, path: Path) -> _Member:
    where = f"{path}[{info.filename}]"
    f = z.open(info)
    try:
        version = np.lib.format.read_magic(f)
        read = (
            np.lib.format.read_array_header_1_0
            if version == (1, 0)
            else np.lib.format.read_array_header_2_0
        )
        shape, fortran, dtype = read(f)
    except (ValueError, OSError, EOFError) as e:
        f.close()
        raise InvalidDataError(f"{where}: not a readable .npy member ({e})") from None
    if dtype.hasobject:
        f.close()
        raise InvalidDataError(
            f"{where}: cannot be read without unpickling (object array); store plain numeric arrays"
        )
    if fortran and len(shape) > 1:
        f.close()
        raise InvalidDataError(
            f"{where}: a Fortran-ordered array cannot be read a block of rows at a time; save it "
            "with np.ascontiguousarray(...) first"
        )
    return _Member(f, dtype, tuple(shape))


def _check_rows(row_bytes: dict[str, int], where: str, limit: int) -> None:
    """A sample's bytes, known from the headers, against ``--max-sample-bytes`` before any
    row is read (one row of a declared ``(1, 10**10)`` array would be read whole)."""
    total = sum(row_bytes.values())
    if total > limit:
        big = max(row_bytes, key=lambda k: row_bytes[k])
        raise InvalidDataError(
            f"{where}: one sample is {total} bytes ({big!r}: {row_bytes[big]}), more than "
            f"--max-sample-bytes {limit}; raise the limit if this sample is real"
        )


def _npz_pieces(files: list[Path], limit: int) -> Iterator[Piece]:
    for path in files:
        try:
            z = zipfile.ZipFile(path)
        except (zipfile.BadZipFile, OSError) as e:
            raise InvalidDataError(f"{path}: not a readable numpy file ({e})") from None
        with z:
            infos = [i for i in z.infolist() if i.filename.endswith(".npy")]
            if not infos:
                raise InvalidDataError(f"{path}: a .npz file must hold named arrays")
            members: dict[str, _Member] = {}
            try:
                for info in infos:
                    members[info.filename[: -len(".npy")]] = _open_member(z, info, path)
                _check_rows({k: m.row_bytes for k, m in members.items()}, str(path), limit)
                yield from _member_blocks(members, str(path), path.stat().st_size)
            finally:
                for m in members.values():
                    m.stream.close()


def _member_blocks(members: dict[str, _Member], where: str, nbytes: int) -> Iterator[Piece]:
    lengths = {k: (m.shape[0] if m.shape else None) for k, m in members.items()}
    if None in lengths.values() or len(set(lengths.values())) != 1:
        raise InvalidDataError(
            f"{where}: arrays must share a leading sample dimension; lengths are {lengths}"
        )
    n = next(iter(lengths.values())) or 0
    row_bytes = max(1, sum(m.row_bytes for m in members.values()))
    step = max(1, BLOCK_BYTES // row_bytes)
    for start in range(0, n, step):
        stop = min(n, start + step)
        rows = f"{where} rows {start}..{stop - 1}"
        cols = {k: m.read_rows(stop - start, rows) for k, m in members.items()}
        yield Piece(
            where=rows,
            columns=cols,
            nbytes=nbytes * (stop - start) // n,
            files=1 if stop == n else 0,
        )


def _npy_pieces(files: list[Path], src: Path, limit: int) -> Iterator[Piece]:
    arrays = {}
    for path in files:
        arr = _load(path, mmap=True)
        if not isinstance(arr, np.ndarray):
            raise InvalidDataError(f"{path}: expected one array in a .npy file")
        if path.stem in arrays:
            raise InvalidDataError(f"{path}: two .npy files are named {path.stem!r}")
        arrays[path.stem] = arr
    row_bytes = {
        k: int(np.prod(a.shape[1:], dtype=np.int64)) * a.dtype.itemsize for k, a in arrays.items()
    }
    _check_rows(row_bytes, str(src), limit)
    yield from _blocks(arrays, str(src), sum(p.stat().st_size for p in files))


def open_numpy(
    src: Path,
    threads: int = 1,
    only: list[Path] | None = None,
    max_sample_bytes: int = MAX_SAMPLE_BYTES,
) -> IngestSource:
    """A source over the ``.npz`` / ``.npy`` files at ``src`` (see module docstring)."""
    files = require_files(source_files(src, SUFFIXES, only), src, ".npz/.npy")
    kinds = {p.suffix.lower() for p in files}
    if len(kinds) > 1:
        raise InvalidDataError(f"source {src} mixes .npy and .npz files; keep one kind per source")
    if kinds == {".npz"}:
        return IngestSource(format="npz", files=files, pieces=_npz_pieces(files, max_sample_bytes))
    return IngestSource(format="npz", files=files, pieces=_npy_pieces(files, src, max_sample_bytes))


READER = Reader("npz", open_numpy, suffixes=SUFFIXES, bounded=True)
