"""Read WebDataset ``.tar`` shards with the standard library's ``tarfile`` (no extra needed).

A sample is the run of consecutive members sharing a key (the member path up to the first
``.`` of its file name); each member is a field named by the rest (``jpg``, ``cls``,
``seg.png``), decoded by :mod:`.decode` (encoded images stay bytes). The key itself is kept
as the bytes field ``__key__``. Shards are read in sorted order, members in tar order.
"""

from __future__ import annotations

import tarfile
from collections.abc import Iterator
from pathlib import Path

from shardserve.proto.errors import InvalidDataError

from .decode import by_extension
from .source import Piece, Reader, Source, require_files, source_files

SUFFIXES = (".tar",)


def _split(name: str) -> tuple[str, str]:
    folder, _, base = name.rpartition("/")
    key, dot, ext = base.partition(".")
    if not dot:
        return "", ""
    return (f"{folder}/{key}" if folder else key), ext


def _pieces(files: list[Path]) -> Iterator[Piece]:
    for path in files:
        size = path.stat().st_size
        key: str | None = None
        sample: dict[str, object] = {}
        try:
            with tarfile.open(path, "r:*") as tar:
                for m in tar:
                    if not m.isfile():
                        continue
                    k, ext = _split(m.name)
                    if not k or ext.startswith("__"):
                        continue  # not a sample member (no extension)
                    if k != key and sample:
                        yield Piece(where=f"{path} key {key}", sample=sample)
                        sample = {}
                    key = k
                    where = f"{path} member {m.name}"
                    f = tar.extractfile(m)
                    if f is None:
                        continue
                    if ext in sample:
                        raise InvalidDataError(f"{where}: key {k!r} has two .{ext} members")
                    if not sample:
                        sample["__key__"] = k.encode()
                    sample[ext] = by_extension(ext, f.read(), where)
        except (tarfile.TarError, OSError) as e:
            raise InvalidDataError(f"{path}: not a readable tar file ({e})") from None
        if sample:
            yield Piece(where=f"{path} key {key}", sample=sample, files=1, nbytes=size)
        else:
            yield Piece(where=str(path), files=1, nbytes=size)


def open_webdataset(src: Path, threads: int = 1, only: list[Path] | None = None) -> Source:
    """A source over the WebDataset ``.tar`` shard(s) at ``src`` (see module docstring)."""
    files = require_files(source_files(src, SUFFIXES, only), src, ".tar")
    return Source(format="webdataset", files=files, pieces=_pieces(files))


READER = Reader("webdataset", open_webdataset, suffixes=SUFFIXES)
