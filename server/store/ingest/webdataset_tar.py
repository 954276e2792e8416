"""Read WebDataset ``.tar`` shards with the standard library's ``tarfile`` (no extra needed).

A sample is the run of consecutive members sharing a key (the member path up to the first
``.`` of its file name); each member is a field named by the rest (``jpg``, ``cls``,
``seg.png``), decoded by :mod:`.decode` (encoded images stay bytes). The key itself is kept
as the bytes field ``__key__``. Shards are read in sorted order, members in tar order.

A tar is untrusted input, read as a stream and never extracted: a member larger than
``max_sample_bytes`` (its header's size, checked before a byte of it is read, so a sparse
member or a compressed bomb costs nothing), a sample whose members add up to more, a link,
a device file, a member path with ``..`` or an absolute one, and a pickled member (``.pyd``,
``.pickle``: webdataset would unpickle it) are refused, naming the member.
"""

from __future__ import annotations

import tarfile
from collections.abc import Iterator
from pathlib import Path

from shardserve.proto.errors import InvalidDataError

from .decode import by_extension
from .source import MAX_SAMPLE_BYTES, IngestSource, Piece, Reader, require_files, source_files

SUFFIXES = (".tar", ".tgz")
#: Members webdataset's default decoders unpickle; never loaded here.
PICKLE_EXTS = ("pyd", "pickle", "pkl")


def _check_member(m: tarfile.TarInfo, where: str, limit: int) -> None:
    if m.issym() or m.islnk():
        raise InvalidDataError(f"{where}: a link in a tar is refused (to {m.linkname!r})")
    if m.isdev():
        raise InvalidDataError(f"{where}: a device or fifo member in a tar is refused")
    parts = m.name.split("/")
    if m.name.startswith("/") or ".." in parts:
        raise InvalidDataError(f"{where}: a member path outside the tar's own tree is refused")
    if m.isfile() and m.size > limit:
        raise InvalidDataError(
            f"{where}: member is {m.size} bytes, more than --max-sample-bytes {limit}; raise "
            "the limit if this sample is real"
        )


def _split(name: str) -> tuple[str, str]:
    folder, _, base = name.rpartition("/")
    key, dot, ext = base.partition(".")
    if not dot:
        return "", ""
    return (f"{folder}/{key}" if folder else key), ext


def _pieces(files: list[Path], limit: int) -> Iterator[Piece]:
    for path in files:
        size = path.stat().st_size
        key: str | None = None
        sample: dict[str, object] = {}
        sample_bytes = 0
        try:
            with tarfile.open(path, "r:*") as tar:
                for m in tar:
                    _check_member(m, f"{path} member {m.name}", limit)
                    if not m.isfile():
                        continue
                    k, ext = _split(m.name)
                    if not k or ext.startswith("__"):
                        continue  # not a sample member (no extension)
                    if k != key and sample:
                        yield Piece(where=f"{path} key {key}", sample=sample)
                        sample, sample_bytes = {}, 0
                    key = k
                    where = f"{path} member {m.name}"
                    if ext.rsplit(".", 1)[-1].lower() in PICKLE_EXTS:
                        raise InvalidDataError(
                            f"{where}: a pickled member is never loaded (unpickling runs code); "
                            "store it as .json, .npy or .pt instead"
                        )
                    sample_bytes += m.size
                    if sample_bytes > limit:
                        raise InvalidDataError(
                            f"{path} key {k}: members add up to {sample_bytes} bytes, more than "
                            f"--max-sample-bytes {limit}"
                        )
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


def open_webdataset(
    src: Path,
    threads: int = 1,
    only: list[Path] | None = None,
    max_sample_bytes: int = MAX_SAMPLE_BYTES,
) -> IngestSource:
    """A source over the WebDataset ``.tar`` shard(s) at ``src`` (see module docstring)."""
    files = require_files(source_files(src, SUFFIXES, only), src, ".tar")
    return IngestSource(format="webdataset", files=files, pieces=_pieces(files, max_sample_bytes))


READER = Reader("webdataset", open_webdataset, suffixes=SUFFIXES, bounded=True)
