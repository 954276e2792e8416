"""Values laid out raw in other libraries' files, read from a buffer: UTF-8 text, a C-order
array of a known shape, and PIL's raw pixels (the ``pil`` encoding MosaicML MDS and LitData
share: ``uint32 width, height, len(mode)``, the mode's name, then ``Image.tobytes()``).

Each size is checked before a value is made, and each value owns its bytes (it outlives the
mapping or buffer it was read from).
"""

from __future__ import annotations

import math
import struct

import numpy as np

from shardserve.proto.errors import InvalidDataError

#: A value's bytes: a view into a file or a decompressed buffer, or bytes.
Buffer = bytes | memoryview

#: PIL modes: (element dtype, channels) as ``np.asarray(image)`` gives them. Mode ``1``
#: (one bit per pixel, rows padded to a byte) is unpacked on its own.
PIL_MODES: dict[str, tuple[str, int]] = {
    "L": ("u1", 1),
    "P": ("u1", 1),
    "LA": ("u1", 2),
    "La": ("u1", 2),
    "PA": ("u1", 2),
    "RGB": ("u1", 3),
    "YCbCr": ("u1", 3),
    "LAB": ("u1", 3),
    "HSV": ("u1", 3),
    "RGBA": ("u1", 4),
    "RGBa": ("u1", 4),
    "RGBX": ("u1", 4),
    "CMYK": ("u1", 4),
    "I": ("<i4", 1),
    "F": ("<f4", 1),
    "I;16": ("<u2", 1),
    "I;16L": ("<u2", 1),
    "I;16B": (">u2", 1),
}


def utf8(data: Buffer, where: str) -> str:
    try:
        return bytes(data).decode("utf-8")
    except UnicodeDecodeError as e:
        raise InvalidDataError(f"{where}: text is not UTF-8 ({e})") from None


def header(data: Buffer, fmt: str, where: str) -> tuple[int, ...]:
    """``struct.unpack_from(fmt, data)``, refused when ``data`` is too short for it."""
    if len(data) < struct.calcsize(fmt):
        raise InvalidDataError(f"{where}: the header is cut short ({len(data)} bytes)")
    return struct.unpack_from(fmt, data)


def array(data: Buffer, dtype: np.dtype, shape: tuple[int, ...], where: str) -> np.ndarray:
    """``data`` as an array of ``shape``, its size checked against the shape first."""
    want = math.prod(shape) * dtype.itemsize
    if len(data) != want:
        raise InvalidDataError(
            f"{where}: shape {shape} of {dtype.name} needs {want} bytes, found {len(data)}"
        )
    # A copy in native order: the value outlives the buffer it was read from.
    return (
        np.frombuffer(data, dtype=dtype).astype(dtype.newbyteorder("="), copy=True).reshape(shape)
    )


def pil_pixels(data: Buffer, where: str) -> np.ndarray:
    """A raw PIL image as ``np.asarray(image)`` gives it: ``[H, W]`` or ``[H, W, C]``."""
    width, height, mode_len = header(data, "<III", where)
    mode = utf8(data[12 : 12 + mode_len], where)
    raw = data[12 + mode_len :]
    if mode == "1":
        row = (width + 7) // 8
        bits = array(raw, np.dtype("u1"), (height, row), where)
        return np.unpackbits(bits, axis=1)[:, :width].astype(np.bool_)
    if mode not in PIL_MODES:
        raise InvalidDataError(
            f"{where}: PIL mode {mode!r} is not one ingest reads ({', '.join(PIL_MODES)}); "
            "convert the image (e.g. image.convert('RGB')) before it is written"
        )
    dtype, channels = PIL_MODES[mode]
    shape = (height, width) if channels == 1 else (height, width, channels)
    return array(raw, np.dtype(dtype), shape, where)
