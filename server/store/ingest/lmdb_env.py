"""Read an LMDB environment (``lmdb``, extra ``shardserve[formats]``): one sample per key.

Keys are read in LMDB's order (sorted bytes) from a read-only transaction. Keys such as
``__len__`` and ``__keys__`` (``__NAME__``) are metadata, never samples: listed in the summary
and, when short text, kept in the manifest's ``source`` (``meta.__len__``). Every other value
is a sample, read as ``--value-format`` says (``raw``, ``pt``, ``npy``, ``msgpack``,
``json``), or by default (``auto``): ``.pt`` bytes (a dict, tuple... as in ``.pt`` files) or ``.npy`` bytes (field
``data``) recognised by their magic, msgpack maps (what ``msgpack.packb(dict)`` writes)
recognised by parsing the first value whole, anything else kept raw (field ``value``, and
the summary names ``--value-format``).
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

from shardserve.proto.errors import InvalidDataError

from .decode import NPY_MAGIC, VALUE_FORMATS, ZIP_MAGIC, as_value, is_msgpack_map
from .extras import require
from .source import IngestSource, Piece, Reader

#: How many bytes of values the progress bar is told about at a time.
REPORT_BYTES = 4 << 20


def is_metadata_key(key: bytes) -> bool:
    """``__len__``, ``__keys__``...: keys the usual LMDB writing scripts add beside the
    samples to describe them; never a sample."""
    return len(key) > 4 and key.startswith(b"__") and key.endswith(b"__")


def _note(value: bytes) -> tuple[str, str | None]:
    """What the summary says of a metadata value, and the value as text for the manifest
    when it is short UTF-8 (a pickled value is never loaded: its size is all that is said)."""
    if len(value) <= 4096:
        try:
            text = value.decode()
        except UnicodeDecodeError:
            pass
        else:
            if text.isprintable():
                return "kept in source.meta", text
    return f"{len(value)} bytes, skipped", None


def _pieces(env_dir: Path, total: int, source: IngestSource, fmt: str) -> Iterator[Piece]:
    lmdb = require("lmdb", "LMDB")
    try:
        env = lmdb.open(
            str(env_dir), readonly=True, lock=False, readahead=False, subdir=True, max_readers=4
        )
    except lmdb.Error as e:
        raise InvalidDataError(f"{env_dir}: not a readable LMDB environment ({e})") from None
    try:
        with env.begin(buffers=False) as txn, _standins():
            for key, value in txn.cursor():
                k = bytes(key)
                if is_metadata_key(k):
                    name = k.decode(errors="replace")
                    note, text = _note(bytes(value))
                    source.metadata[name] = note
                    if text is not None:
                        source.info[f"meta.{name}"] = text
                    continue
                where = f"{env_dir} key {k[:64]!r}"
                data = bytes(value)
                if fmt == "auto":  # the first sample's value decides for the environment
                    fmt = _detected(data, source)
                yield Piece(where=where, sample=_read(data, where, fmt))
    finally:
        env.close()
    yield Piece(where=str(env_dir), files=1, nbytes=total)


#: ``fmt`` of an environment whose values were found to be msgpack (``auto``).
DETECTED_MSGPACK = "msgpack-detected"


def _detected(first: bytes, source: IngestSource) -> str:
    """How ``auto`` reads an environment, from its first sample value; said in the manifest's
    ``source.value_format`` and in the ingest summary. msgpack maps are the environment's
    format (every value must be one); else each value by its magic (.pt, .npy) or raw."""
    if not first.startswith((NPY_MAGIC, ZIP_MAGIC)) and is_msgpack_map(first):
        source.info["value_format"] = "msgpack (detected)"
        return DETECTED_MSGPACK
    source.info["value_format"] = "auto"
    return "magic"


def _read(data: bytes, where: str, fmt: str) -> object:
    if fmt == DETECTED_MSGPACK:
        if not is_msgpack_map(data):
            raise InvalidDataError(
                f"{where}: not a msgpack map, though the first value was one (values were "
                "detected as msgpack): give --value-format (raw keeps every value as bytes)"
            )
        return as_value(data, where, "msgpack")
    return as_value(data, where, "auto" if fmt == "magic" else fmt)


def open_lmdb(src: Path, threads: int = 1, value_format: str = "auto") -> IngestSource:
    """A source over the LMDB environment at ``src`` (its folder, or its ``data.mdb``); each
    value read as ``value_format`` (:data:`.decode.VALUE_FORMATS`)."""
    require("lmdb", "LMDB")
    if value_format not in VALUE_FORMATS:
        raise InvalidDataError(
            f"--value-format {value_format!r}: choose one of {', '.join(VALUE_FORMATS)}"
        )
    env_dir = src.parent if src.is_file() else src
    data = env_dir / "data.mdb"
    if not data.is_file():
        raise InvalidDataError(f"source {src} is not an LMDB environment (no data.mdb)")
    source = IngestSource(format="lmdb", files=[data], pieces=iter(()))
    source.pieces = _pieces(env_dir, data.stat().st_size, source, value_format)
    return source


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


READER = Reader("lmdb", open_lmdb, claims=is_lmdb, valued=True)
