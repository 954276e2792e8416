"""Values stored as bytes in containers (WebDataset members, LMDB values), made samples.

As webdataset's default decoders do (``webdataset.autodecode``), by extension: ``.npy``
bytes are loaded with ``allow_pickle=False``; ``.pt`` / ``.pth`` bytes with
``torch.load(weights_only=True)`` (:mod:`.pt_files`); class labels (``.cls``, ``.cls2``,
``.id``, ``.index``, ``.inx``) become integers; text (``.txt``, ``.text``,
``.transcript``) becomes ``str``; ``.json`` / ``.jsn`` and msgpack (``.mp``, ``.msg``)
become their value, a dict as nested fields and a list of numbers as an array. Everything
else (encoded images, audio) stays bytes, decoded where it is used. Pickles are never loaded.
"""

from __future__ import annotations

import io
import json

import numpy as np

from shardserve.proto.errors import InvalidDataError

from .raw import utf8

NPY_MAGIC = b"\x93NUMPY"
ZIP_MAGIC = b"PK\x03\x04"
INT_EXTS = ("cls", "cls2", "id", "index", "inx")
TEXT_EXTS = ("txt", "text", "transcript")
JSON_EXTS = ("json", "jsn")
MSGPACK_EXTS = ("mp", "msg", "msgpack")
#: LMDB ``--value-format`` choices; ``auto`` tells .pt and .npy by their magic, msgpack maps
#: by parsing (:func:`is_msgpack_map`), else raw.
VALUE_FORMATS = ("auto", "raw", "pt", "npy", "msgpack", "json")
#: First bytes of a msgpack map: fixmap (up to 15 entries), map 16, map 32.
MSGPACK_MAP_FIRST = frozenset(range(0x80, 0x90)) | {0xDE, 0xDF}


def plain(value: object, where: str) -> object:
    """A JSON / msgpack value as a sample value: dicts nested, lists of numbers as arrays."""
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return value
    if isinstance(value, dict):
        return {str(k): plain(v, f"{where}.{k}") for k, v in value.items()}
    if isinstance(value, list):
        if all(isinstance(v, bool) for v in value) and value:
            return np.array(value, dtype=np.bool_)
        if all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            return np.array(value, dtype=np.int64)
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
            return np.array(value, dtype=np.float64)
        try:
            arr = np.array(value, dtype=np.float64)
        except (ValueError, TypeError):
            arr = None
        if arr is not None and arr.ndim > 1:
            return arr  # a rectangular list of lists of numbers
    raise InvalidDataError(
        f"{where}: holds a {type(value).__name__} that is not a number, text, a dict or a list "
        "of numbers; convert it with --map"
    )


def _json(data: bytes, where: str) -> object:
    try:
        value = json.loads(data)
    except ValueError as e:
        raise InvalidDataError(f"{where}: not valid JSON ({e})") from None
    return plain(value, where)


def _msgpack(data: bytes, where: str) -> object:
    from .extras import require

    msgpack = require("msgpack", "msgpack values")
    try:
        value = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except (ValueError, msgpack.UnpackException) as e:
        raise InvalidDataError(f"{where}: not valid msgpack ({e})") from None
    return plain(value, where)


def load_npy(data: bytes, where: str) -> np.ndarray:
    try:
        arr = np.load(io.BytesIO(data), allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        raise InvalidDataError(f"{where}: not a plain .npy array ({e})") from None
    if not isinstance(arr, np.ndarray):
        raise InvalidDataError(f"{where}: expected one .npy array")
    return arr


def by_extension(ext: str, data: bytes, where: str) -> object:
    """A WebDataset member's value from its extension (the part after the key)."""
    last = ext.rsplit(".", 1)[-1].lower()
    if last == "npy":
        return load_npy(data, where)
    if last in ("pt", "pth"):
        from .pt_files import load_file

        return load_file(where, data)
    if last in TEXT_EXTS:
        return utf8(data, where)
    if last in JSON_EXTS:
        return _json(data, where)
    if last in MSGPACK_EXTS:
        return _msgpack(data, where)
    if last in INT_EXTS:
        try:
            return int(data.strip())
        except ValueError:
            raise InvalidDataError(
                f"{where}: .{last} should hold an integer, got {data[:20]!r}"
            ) from None
    return data


def as_value(data: bytes, where: str, fmt: str) -> object:
    """An LMDB value as a sample, read as ``fmt`` (:data:`VALUE_FORMATS`); a value that is
    not a dict becomes the field ``value`` (``data`` for an array)."""
    if fmt == "auto":
        return by_magic(data, where)
    if fmt == "raw":
        return {"value": data}
    if fmt == "npy":
        return {"data": load_npy(data, where)}
    if fmt == "pt":
        from .pt_files import load_file

        return load_file(where, data)
    value = _json(data, where) if fmt == "json" else _msgpack(data, where)
    return value if isinstance(value, dict) else {"value": value}


def by_magic(data: bytes, where: str) -> object:
    """An LMDB value: ``.pt`` (zip) or ``.npy`` bytes by their magic, else raw bytes."""
    if data.startswith(NPY_MAGIC):
        return {"data": load_npy(data, where)}
    if data.startswith(ZIP_MAGIC):
        from .pt_files import load_file

        return load_file(where, data)
    return {"value": data}


def is_msgpack_map(data: bytes) -> bool:
    """Whether ``data`` is, whole, one msgpack map with text keys and at least one entry: what
    ``msgpack.packb(dict)`` writes. Parsing the whole value (no byte left over, every key a
    string) is what makes this unambiguous where a first byte alone is not (a PNG starts with
    0x89, a fixmap's byte). Without msgpack installed nothing is detected."""
    if not data or data[0] not in MSGPACK_MAP_FIRST:
        return False
    try:
        import msgpack
    except ImportError:
        return False
    try:
        value = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except (ValueError, msgpack.UnpackException):
        return False
    return isinstance(value, dict) and bool(value) and all(isinstance(k, str) for k in value)
