"""Read an LMDB environment (``lmdb``, extra ``shardserve[formats]``): one sample per key.

Keys are read in LMDB's order (sorted bytes) from a read-only transaction; each value is a
sample: ``.pt`` bytes (a dict, tuple... as in ``.pt`` files) or ``.npy`` bytes (field
``data``) recognised by their magic, anything else kept raw (field ``value``).
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

from shardserve.proto.errors import InvalidDataError

from .decode import by_magic
from .extras import require
from .source import Piece, Reader, Source

#: How many bytes of values the progress bar is told about at a time.
REPORT_BYTES = 4 << 20


def _pieces(env_dir: Path, total: int) -> Iterator[Piece]:
    lmdb = require("lmdb", "LMDB")
    try:
        env = lmdb.open(str(env_dir), readonly=True, lock=False, readahead=False,
                        subdir=True, max_readers=4)  # fmt: skip
    except lmdb.Error as e:
        raise InvalidDataError(f"{env_dir}: not a readable LMDB environment ({e})") from None
    try:
        with env.begin(buffers=False) as txn, _standins():
            for key, value in txn.cursor():
                where = f"{env_dir} key {bytes(key)[:64]!r}"
                yield Piece(where=where, sample=by_magic(bytes(value), where))
    finally:
        env.close()
    yield Piece(where=str(env_dir), files=1, nbytes=total)


def open_lmdb(src: Path, threads: int = 1) -> Source:
    """A source over the LMDB environment at ``src`` (its folder, or its ``data.mdb``)."""
    require("lmdb", "LMDB")
    env_dir = src.parent if src.is_file() else src
    data = env_dir / "data.mdb"
    if not data.is_file():
        raise InvalidDataError(f"source {src} is not an LMDB environment (no data.mdb)")
    return Source(format="lmdb", files=[data], pieces=_pieces(env_dir, data.stat().st_size))


def _standins() -> AbstractContextManager[None]:
    """PyG stand-ins held for the whole read when torch is there (values may be ``.pt``)."""
    # torch is imported here and in pt_files only (".pt" values need it); serving never does.
    try:
        torch = importlib.import_module("torch")
    except ImportError:
        return nullcontext()
    from .pyg import standins

    return standins(torch)


def is_lmdb(src: Path) -> bool:
    """An LMDB environment: its ``data.mdb`` file, or a folder holding one."""
    return src.name == "data.mdb" if src.is_file() else (src / "data.mdb").is_file()


READER = Reader("lmdb", open_lmdb, claims=is_lmdb)
