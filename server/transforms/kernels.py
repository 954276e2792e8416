"""Array kernels of the image built-ins: pad, crop and flip in one gather, normalize into a
given array. Pure numpy on whole batches; the random parameters come in as arrays (drawn by
each transform's own draw function), so the unfused transforms and the fused chain run the
very same code and give the same bytes.

Where the time goes (CIFAR, batch 256, ``uint8[3, 32, 32]``, one core): ``np.pad`` 0.38 ms
(its border writes have 4-element inner loops), the padded copy's windows gathered 0.15 ms,
the flip as a copy and a masked write 0.18 ms, normalize 0.65 ms (a cast pass, then three
float passes). Here: a filled buffer and one interior copy (0.14 ms), flipped samples gathered
through a mirrored view of the same buffer (no flipped copy), the cast fused into the scale.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import as_strided

#: Scratch arrays up to this size are kept per thread and reused: a fresh one of a megabyte
#: or more comes from mmap and costs a page fault per 4 KiB on first write (a padded CIFAR
#: batch, 1.2 MB: 0.35 ms of faults against 0.14 ms of copying). Bounded so that a thread
#: keeps at most two of them (the padded copy, the crops) whatever batches it ran.
SCRATCH_MAX = 8 << 20
_local = threading.local()


def scratch(role: str, shape: Sequence[int], dtype: np.dtype) -> np.ndarray:
    """This thread's reusable array for ``role`` (its contents are left over: write it all
    before reading); a fresh one past :data:`SCRATCH_MAX`. Never returned to a caller."""
    nbytes = int(np.prod(shape)) * dtype.itemsize
    if nbytes > SCRATCH_MAX:
        return np.empty(shape, dtype)
    kept: dict[str, np.ndarray] = _local.__dict__.setdefault("arrays", {})
    a = kept.get(role)
    if a is None or a.nbytes < nbytes:
        a = kept[role] = np.empty(nbytes, np.uint8)
    return a[:nbytes].view(dtype).reshape(shape)


def pad_batch(x: np.ndarray, ah: int, aw: int, padding: int, fill: float) -> np.ndarray:
    """``x`` ``[B, ...]`` padded by ``padding`` on both sides of batch axes ``ah`` and ``aw``
    with ``fill``: a filled scratch array (this thread's, reused: read it before the next
    call) and one copy of the interior.

    >>> pad_batch(np.ones((1, 2, 2), np.uint8), 1, 2, 1, 0)[0]
    array([[0, 0, 0, 0],
           [0, 1, 1, 0],
           [0, 1, 1, 0],
           [0, 0, 0, 0]], dtype=uint8)
    """
    shape = list(x.shape)
    shape[ah] += 2 * padding
    shape[aw] += 2 * padding
    buf = scratch("pad", shape, x.dtype)
    buf[...] = np.asarray(fill).astype(x.dtype)
    inner: list[slice] = [slice(None)] * x.ndim
    inner[ah] = slice(padding, padding + x.shape[ah])
    inner[aw] = slice(padding, padding + x.shape[aw])
    buf[tuple(inner)] = x
    return buf


def _windows(buf: np.ndarray, ah: int, aw: int, h: int, w: int) -> np.ndarray:
    """Read-only view ``[B, Y, X, *sample]``: the ``h`` x ``w`` window of each sample at
    every offset ``(y, x)``, its axes in the sample's own order (so a gather of one window per
    sample is already laid out as the output)."""
    shape = list(buf.shape[1:])
    shape[ah - 1], shape[aw - 1] = h, w
    room_y, room_x = buf.shape[ah] - h + 1, buf.shape[aw] - w + 1
    strides = (buf.strides[0], buf.strides[ah], buf.strides[aw], *buf.strides[1:])
    return as_strided(buf, (buf.shape[0], room_y, room_x, *shape), strides, writeable=False)


def crop_flip(
    x: np.ndarray,
    ah: int,
    aw: int,
    size: tuple[int, int],
    oy: np.ndarray,
    ox: np.ndarray,
    flip: np.ndarray | None = None,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """Per sample ``b``: the ``size`` window of ``x[b]`` at ``(oy[b], ox[b])`` (batch axes
    ``ah``, ``aw``), mirrored along ``aw`` where ``flip[b]``; written into ``out`` if given.

    A mirrored crop is a crop of the mirrored image at ``X - w - ox``: flipped samples are
    gathered from a reversed view of ``x``, so no flipped copy is ever made.

    >>> x = np.arange(8, dtype=np.uint8).reshape(1, 2, 4)
    >>> crop_flip(x, 1, 2, (2, 2), np.array([0]), np.array([1]), np.array([True]))[0]
    array([[2, 1],
           [6, 5]], dtype=uint8)
    """
    h, w = size
    b = x.shape[0]
    shape = list(x.shape)
    shape[ah], shape[aw] = h, w
    if flip is None or not flip.any():
        got = _windows(x, ah, aw, h, w)[np.arange(b), oy, ox]
        if out is None:
            return got
        out[...] = got
        return out
    dest = np.empty(shape, x.dtype) if out is None else out
    flipped = np.flatnonzero(flip)
    kept = np.flatnonzero(~flip)
    if len(kept):
        dest[kept] = _windows(x, ah, aw, h, w)[kept, oy[kept], ox[kept]]
    mirror: list[slice] = [slice(None)] * x.ndim
    mirror[aw] = slice(None, None, -1)
    room_x = x.shape[aw] - w
    dest[flipped] = _windows(x[tuple(mirror)], ah, aw, h, w)[
        flipped, oy[flipped], room_x - ox[flipped]
    ]
    return dest


def normalize_into(
    x: np.ndarray,
    y: np.ndarray,
    chw: bool,
    scale: float,
    mean: Sequence[float] | None,
    std: Sequence[float] | None,
) -> np.ndarray:
    """``y = (x * scale - mean) / std`` per channel in ``y``'s dtype (``x`` already in ``y``'s
    layout; channels on axis 1 if ``chw`` else the last of a 4-d batch). Each operation rounds
    to ``y``'s dtype in this order, so the bytes are those of cast, multiply, subtract, divide
    done one by one; the cast is fused into the multiply (one pass less).

    >>> y = np.empty((1, 2), np.float32)
    >>> normalize_into(np.array([[0, 255]], np.uint8), y, False, 1 / 255, [0.5], [0.5])
    array([[-1.,  1.]], dtype=float32)
    """
    dt = y.dtype
    if scale != 1.0:
        np.multiply(x, dt.type(scale), out=y, dtype=dt, casting="unsafe")
    else:
        np.copyto(y, x, casting="unsafe")
    view = [1] * y.ndim
    if y.ndim == 4:
        view[1 if chw else 3] = -1
    if mean is not None:
        y -= np.asarray(mean, dtype=dt).reshape(view if len(mean) > 1 else [1])
    if std is not None:
        y /= np.asarray(std, dtype=dt).reshape(view if len(std) > 1 else [1])
    return y
