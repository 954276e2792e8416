"""Values stored as bytes in containers (WebDataset members, LMDB values), made samples.

``.npy`` bytes are loaded with ``allow_pickle=False``; ``.pt`` bytes with
``torch.load(weights_only=True)`` (:mod:`.pt_files`); class labels (``.cls``, ``.id``,
``.index``) become integers; everything else (encoded images, text, JSON) stays bytes, to be
decoded where it is used.
"""

from __future__ import annotations

import io

import numpy as np

from shardserve.proto.errors import InvalidDataError

NPY_MAGIC = b"\x93NUMPY"
ZIP_MAGIC = b"PK\x03\x04"
INT_EXTS = ("cls", "cls2", "id", "index")


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
    if last in INT_EXTS:
        try:
            return int(data.strip())
        except ValueError:
            raise InvalidDataError(
                f"{where}: .{last} should hold an integer, got {data[:20]!r}"
            ) from None
    return data


def by_magic(data: bytes, where: str) -> object:
    """An LMDB value: ``.pt`` (zip) or ``.npy`` bytes by their magic, else raw bytes."""
    if data.startswith(NPY_MAGIC):
        return {"data": load_npy(data, where)}
    if data.startswith(ZIP_MAGIC):
        from .pt_files import load_file

        return load_file(where, data)
    return {"value": data}
