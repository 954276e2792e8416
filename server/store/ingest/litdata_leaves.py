"""One LitData leaf (one entry of ``config.data_format``) from its bytes, without LitData.

LitData writes each leaf of a sample with the serializer named in ``index.json``'s
``data_format`` (``"int"``, ``"numpy"``, ``"no_header_numpy:9"``...). This module knows the
byte layout of the common ones, learnt from ``litdata/streaming/serializers.py``, and turns
each into a sample value as the other readers give them:

==========================  =========================================================
serializer                  value
==========================  =========================================================
``int`` / ``float``         Python ``int`` (int64) / ``float`` (float64)
``bool``                    Python ``bool``
``str`` / ``text``          Python ``str`` (a text field)
``bytes``                   ``bytes``
``jpeg``, ``image:EXT``,    the encoded file's ``bytes``, as stored: the server's
``file:EXT``                ``decode_image`` transform decodes images where they are used
``numpy``                   ``ndarray`` of the stored shape and dtype
``no_header_numpy:N``       1-D ``ndarray`` of numpy dtype number ``N``
``tensor``                  ``ndarray`` of the stored shape and dtype (torch dtype number)
``no_header_tensor:N``      1-D ``ndarray`` of torch dtype number ``N``
``pil``                     ``uint8`` (etc.) ``ndarray`` ``H x W [x C]``, as ``np.asarray(image)``
``json``                    dicts as nested fields, lists of numbers as arrays
                            (:func:`.decode.plain`)
==========================  =========================================================

``pickle`` (and ``graph:pickle``) are refused: a pickle is never loaded. Any other serializer
(video, audio, ...) is refused by name, before a byte of the chunks is read.
"""

from __future__ import annotations

import struct
from collections.abc import Callable

import numpy as np

from shardserve.proto.errors import InvalidDataError

from .decode import plain
from .litdata_json import loads
from .raw import Buffer, array, header, pil_pixels, utf8

#: LitData's numpy dtype numbers (``constants._NUMPY_DTYPES_MAPPING``: the order of numpy's
#: scalar types). ``None`` where the store has no such dtype; the name says what it was.
NUMPY_DTYPES: tuple[tuple[str, bool], ...] = (
    ("int8", True),
    ("int16", True),
    ("int32", True),
    ("int64", True),
    ("uint8", True),
    ("uint16", True),
    ("uint32", True),
    ("uint64", True),
    ("float16", True),
    ("float32", True),
    ("float64", True),
    ("complex64", False),
    ("complex128", False),
    ("bool", True),
    ("object", False),
    ("bytes", False),
    ("str", False),
    ("void", False),
)
#: LitData's torch dtype numbers (``constants._TORCH_DTYPES_MAPPING``: aliases repeat).
TORCH_DTYPES: tuple[tuple[str, bool], ...] = (
    ("float32", True),
    ("float32", True),
    ("float64", True),
    ("float64", True),
    ("complex64", False),
    ("complex64", False),
    ("complex128", False),
    ("complex128", False),
    ("float16", True),
    ("float16", True),
    ("bfloat16", False),
    ("uint8", True),
    ("int8", True),
    ("int16", True),
    ("int16", True),
    ("int32", True),
    ("int32", True),
    ("int64", True),
    ("int64", True),
    ("bool", True),
    ("uint16", True),
)

#: A leaf decoder: (its bytes, the suffix after ``:`` in its serializer name, where) -> value.
Decode = Callable[[Buffer, str, str], object]


def _sized(data: Buffer, size: int, what: str, where: str) -> Buffer:
    if len(data) != size:
        raise InvalidDataError(f"{where}: {what} should be {size} bytes, found {len(data)}")
    return data


def _int(data: Buffer, _arg: str, where: str) -> object:
    return int(struct.unpack("<q", _sized(data, 8, "an int", where))[0])


def _float(data: Buffer, _arg: str, where: str) -> object:
    return float(struct.unpack("<d", _sized(data, 8, "a float", where))[0])


def _bool(data: Buffer, _arg: str, where: str) -> object:
    return _sized(data, 1, "a bool", where)[0] != 0


def _text(data: Buffer, _arg: str, where: str) -> object:
    return utf8(data, where)


def _bytes(data: Buffer, _arg: str, _where: str) -> object:
    return bytes(data)


def _dtype(table: tuple[tuple[str, bool], ...], number: int, where: str) -> np.dtype:
    """The little-endian numpy dtype of LitData dtype ``number`` (LitData writes native order
    on the little-endian machines it runs on)."""
    if not 0 <= number < len(table):
        raise InvalidDataError(f"{where}: dtype number {number} is not one LitData writes")
    name, held = table[number]
    if not held:
        raise InvalidDataError(
            f"{where}: the field is {name}, which the store cannot hold; convert it (e.g. to "
            "float32) in the optimize() function and write the dataset again"
        )
    return np.dtype(name).newbyteorder("<")


def _numpy(data: Buffer, _arg: str, where: str) -> object:
    # uint32 dtype number, uint32 rank, uint32 per dimension, then the C-order values.
    number, rank = header(data, "<II", where)
    start = 8 + 4 * rank
    shape = header(data, f"<{2 + rank}I", where)[2:]
    return array(data[start:], _dtype(NUMPY_DTYPES, number, where), shape, where)


def _tensor(data: Buffer, _arg: str, where: str) -> object:
    # As numpy's, but the header is big-endian (struct ">II", ">{rank}I").
    number, rank = header(data, ">II", where)
    start = 8 + 4 * rank
    shape = header(data, f">{2 + rank}I", where)[2:]
    return array(data[start:], _dtype(TORCH_DTYPES, number, where), shape, where)


def _flat(table: tuple[tuple[str, bool], ...]) -> Decode:
    """A no-header array: 1-D, its dtype number in the serializer's name (``:N``)."""

    def decode(data: Buffer, arg: str, where: str) -> object:
        if not arg.isdigit():
            raise InvalidDataError(f"{where}: the serializer names no dtype number ({arg!r})")
        dtype = _dtype(table, int(arg), where)
        if len(data) % dtype.itemsize:
            raise InvalidDataError(
                f"{where}: {len(data)} bytes is not a whole number of {dtype.name} values"
            )
        return array(data, dtype, (len(data) // dtype.itemsize,), where)

    return decode


def _pil(data: Buffer, _arg: str, where: str) -> object:
    return pil_pixels(data, where)


def _json(data: Buffer, _arg: str, where: str) -> object:
    return plain(loads(bytes(data), where), where)


#: Serializer name (before ``:``) -> decoder.
DECODERS: dict[str, Decode] = {
    "int": _int,
    "float": _float,
    "bool": _bool,
    "str": _text,
    "text": _text,
    "bytes": _bytes,
    "jpeg": _bytes,
    "image": _bytes,
    "file": _bytes,
    "numpy": _numpy,
    "no_header_numpy": _flat(NUMPY_DTYPES),
    "tensor": _tensor,
    "no_header_tensor": _flat(TORCH_DTYPES),
    "pil": _pil,
    "json": _json,
}
#: What the leaf of each fixed-size serializer occupies (checked before it is decoded).
FIXED: dict[str, int] = {"int": 8, "float": 8, "bool": 1}


def decoder(serializer: str, field: str, index: str) -> tuple[Decode, str]:
    """The decoder of a ``data_format`` entry and its argument; refuses what is not read.

    ``index`` (the ``index.json`` path) and ``field`` name where the serializer was found."""
    key, _, arg = serializer.partition(":")
    if key == "pickle" or arg == "pickle":
        raise InvalidDataError(
            f"{index}: field {field!r} was written with LitData's {serializer!r} serializer; "
            "ingest never loads pickles (unpickling runs arbitrary code). Re-write that field "
            "with another serializer: return a number, str, bytes, numpy array or tensor for "
            "it from the optimize() function"
        )
    found = DECODERS.get(key)
    if found is None:
        raise InvalidDataError(
            f"{index}: field {field!r} uses LitData's {serializer!r} serializer, which ingest "
            f"does not read ({', '.join(DECODERS)} are read); re-write that field as bytes, a "
            "numpy array or a tensor in the optimize() function"
        )
    return found, arg
