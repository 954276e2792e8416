"""The image built-ins on ``uint8`` batches in one pass of compiled code: a crop's window (with
its padding), a flip and a per-channel table of results (the normalize's, see
:func:`~.kernels.norm_table`) in a single loop that writes the final dtype straight into the
stream's slot, without the GIL (``_windows.c``).

The numpy kernels make a padded copy, the crops, then three float passes; this reads each
input byte once and writes each output element once (CIFAR, batch 256, one core: 0.3 ms
against 1.3 ms). The values are numpy's: the table is numpy's normalize of every ``uint8``
value, and the window and the flip only move bytes, so the bytes are the same either way
(``tests/transforms/test_onepass.py`` checks that on random inputs).

The extension is optional (:mod:`.compiled`): where it was not built, :func:`gather` declines
and the built-ins run their numpy kernels.

>>> x = np.arange(4, dtype=np.uint8).reshape(1, 2, 2)
>>> y = np.empty((1, 2, 2), np.uint8)
>>> gather(x, y, identity(1), chw_in=True, chw_out=True, flip=np.array([True])) or not windows
True
>>> bool((y == x[:, :, ::-1]).all()) or not windows
True
"""

from __future__ import annotations

import functools

import numpy as np

from .compiled import windows

#: Images of more channels than this run on numpy: a job's image shape must not decide how
#: much the table cache holds (a table is 256 entries a channel of up to 8 bytes, and
#: ``kernels.norm_table`` keeps 16: at most 2 MiB in all).
MAX_CHANNELS = 64


def channels(x: np.ndarray, chw: bool) -> int:
    """Channels of a batch ``x`` of images: ``[B, H, W]`` has one, ``[B, C, H, W]`` (``chw``)
    or ``[B, H, W, C]`` the size of that axis."""
    if x.ndim == 3:
        return 1
    return int(x.shape[1] if chw else x.shape[3])


def table_channels(x: np.ndarray, chw: bool) -> int | None:
    """:func:`channels` of a ``uint8`` batch the compiled pass takes; ``None`` (numpy runs, no
    table is made) for another dtype or past :data:`MAX_CHANNELS`."""
    c = channels(x, chw)
    return c if x.dtype == np.uint8 and c <= MAX_CHANNELS else None


@functools.lru_cache(maxsize=8)
def identity(channels: int) -> np.ndarray:
    """The table that leaves ``uint8`` values as they are (a crop or flip alone)."""
    t = np.tile(np.arange(256, dtype=np.uint8), (channels, 1))
    t.flags.writeable = False
    return t


def gather(
    x: np.ndarray,
    y: np.ndarray,
    table: np.ndarray,
    *,
    chw_in: bool,
    chw_out: bool,
    oy: np.ndarray | None = None,
    ox: np.ndarray | None = None,
    flip: np.ndarray | None = None,
    pad: int = 0,
    fill: int = 0,
) -> bool:
    """Write into ``y`` each sample of ``x``'s window at ``(oy, ox)`` of the image padded by
    ``pad`` with ``fill`` (the whole image if no offsets), mirrored where ``flip``, each value
    ``v`` of channel ``c`` written as ``table[c, v]``. ``x``: ``uint8`` ``[B, H, W]`` or
    ``[B, C, H, W]`` (``chw_in``) or ``[B, H, W, C]``; ``y`` the same in its own layout
    (``chw_out``) and the table's dtype. ``False``, with nothing written, where the kernel does
    not apply (not built, not ``uint8``, ``y`` not contiguous): the caller runs numpy."""
    if (
        windows is None
        or x.dtype != np.uint8
        or x.ndim not in (3, 4)
        or y.ndim != x.ndim
        or y.shape[0] != x.shape[0]
        or not y.flags.c_contiguous
        or not y.flags.writeable
        or table.dtype != y.dtype
        or table.shape != (channels(x, chw_in), 256)
        or channels(y, chw_out) != table.shape[0]
    ):
        return False
    n = x.shape[0]
    c, h_in, w_in, sc, sh, sw = _geometry(x, chw_in)
    _, h, w, dc, dh, dw = _geometry(y, chw_out)
    if oy is None or ox is None:
        oy = ox = np.zeros(n, np.int64)
    flips = np.ascontiguousarray(flip, np.bool_).view(np.uint8) if flip is not None else b""
    geometry = (n, c, h_in, w_in, sc, sh, sw, h, w, dc, dh, dw, pad, fill, y.itemsize)
    windows.gather(
        np.ascontiguousarray(x),
        y,
        np.ascontiguousarray(oy, np.int64),
        np.ascontiguousarray(ox, np.int64),
        flips,
        np.ascontiguousarray(table),
        geometry,
    )
    return True


def _geometry(x: np.ndarray, chw: bool) -> tuple[int, int, int, int, int, int]:
    """``(channels, height, width)`` of ``x``'s samples and their element strides in a
    C-contiguous sample."""
    if x.ndim == 3:
        h, w = x.shape[1:]
        return 1, h, w, h * w, w, 1
    if chw:
        c, h, w = x.shape[1:]
        return c, h, w, h * w, w, 1
    h, w, c = x.shape[1:]
    return c, h, w, 1, w * c, c
