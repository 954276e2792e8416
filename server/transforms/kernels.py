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

import functools
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
    with ``fill``: a read-only view of this thread's scratch array (reused: read it before
    the next call), whose border is filled only when it does not hold ``fill`` already, and
    one copy of the interior.

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
    value = np.asarray(fill).astype(x.dtype)
    # Only the interior is written below: a border this thread filled last time, in this
    # very buffer and geometry, still holds ``fill`` (a third of the padding's time saved).
    border = (buf.__array_interface__["data"][0], buf.shape, buf.dtype.str, ah, aw, padding)
    kept = buf.nbytes <= SCRATCH_MAX  # a fresh array (past the bound) is never assumed filled
    if not kept or _local.__dict__.get("border") != (*border, value.tobytes()):
        buf[...] = value
        _local.border = (*border, value.tobytes())
    inner: list[slice] = [slice(None)] * x.ndim
    inner[ah] = slice(padding, padding + x.shape[ah])
    inner[aw] = slice(padding, padding + x.shape[aw])
    buf[tuple(inner)] = x
    view = buf.view()
    view.flags.writeable = False  # the border is kept for the next call: never written over
    return view


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

    The batch goes through in blocks of :data:`NORM_BLOCK_BYTES` of ``y`` (the three passes of
    a block then stay in cache), and per-channel ``mean``/``std`` are subtracted and divided
    as arrays of one sample's shape (a broadcast of a ``[C, 1, 1]`` array costs a third more
    per pass); neither changes a value, only the order elements are visited in.

    On a ``uint8`` batch the built-ins look the results up instead, in compiled code
    (:func:`norm_table`, :mod:`.onepass`); this is the fallback and the table's maker.
    Measured and kept out here (one core, CIFAR batch 256: 0.55 ms): that table looked up
    through numpy costs 0.85-1.2 ms with ``np.take`` (about 1.1 ns an element for the index
    cast and the gather, in blocks of 4 to 64 samples; a table of pairs over a ``uint16``
    view is no better) and 1.8 ms by fancy indexing; a multiply by ``1 / std`` changes
    39-48 of a channel's 256 results (CIFAR's mean and std), so the divide stays.

    >>> y = np.empty((1, 2), np.float32)
    >>> normalize_into(np.array([[0, 255]], np.uint8), y, False, 1 / 255, [0.5], [0.5])
    array([[-1.,  1.]], dtype=float32)
    """
    dt = y.dtype
    m = _per_sample(mean, y.shape[1:], chw, dt)
    s = _per_sample(std, y.shape[1:], chw, dt)
    rows = max(1, NORM_BLOCK_BYTES // max(1, y[:1].nbytes))
    for lo in range(0, max(1, y.shape[0]), rows):
        xb, yb = x[lo : lo + rows], y[lo : lo + rows]
        if scale != 1.0:
            np.multiply(xb, dt.type(scale), out=yb, dtype=dt, casting="unsafe")
        else:
            np.copyto(yb, xb, casting="unsafe")
        if m is not None:
            np.subtract(yb, m, out=yb)
        if s is not None:
            np.divide(yb, s, out=yb)
    return y


@functools.lru_cache(maxsize=16)
def norm_table(
    scale: float,
    mean: tuple[float, ...] | None,
    std: tuple[float, ...] | None,
    channels: int,
    dtype: str,
) -> np.ndarray:
    """``[channels, 256]``: what :func:`normalize_into` makes of each ``uint8`` value on each
    channel, by that very function, so a lookup in it gives a batch the same bytes.

    >>> norm_table(1 / 255, (0.5,), (0.5,), 1, "float32")[0, [0, 255]]
    array([-1.,  1.], dtype=float32)
    """
    x = np.ascontiguousarray(np.broadcast_to(np.arange(256, dtype=np.uint8), (1, channels, 1, 256)))
    y = np.empty(x.shape, np.dtype(dtype))
    normalize_into(x, y, True, scale, mean, std)
    table = y.reshape(channels, 256)
    table.flags.writeable = False
    return table


#: Bytes of ``y`` normalized at a time: its three passes stay in a core's L2 cache.
NORM_BLOCK_BYTES = 1 << 19


def _per_sample(
    v: Sequence[float] | None, sample: tuple[int, ...], chw: bool, dt: np.dtype
) -> np.ndarray | None:
    """``v`` (one value or one per channel) as ``dt``, shaped to broadcast over a batch of
    samples shaped ``sample``: one sample's full array when there are several channels."""
    if v is None:
        return None
    if len(v) == 1:
        return np.asarray(v, dtype=dt).reshape([1])
    return _channel_array(tuple(float(a) for a in v), sample, chw, dt.str)


@functools.lru_cache(maxsize=16)
def _channel_array(v: tuple[float, ...], sample: tuple[int, ...], chw: bool, dt: str) -> np.ndarray:
    """One sample's array (``sample`` shaped, read-only) holding channel ``c``'s ``v[c]``
    everywhere on that channel: cached, a batch's normalize then makes no array of it."""
    view = [1] * (len(sample) + 1)
    if len(sample) == 3:
        view[1 if chw else 3] = -1
    per = np.asarray(v, dtype=np.dtype(dt)).reshape(view)
    full = np.ascontiguousarray(np.broadcast_to(per, (1, *sample)))
    full.flags.writeable = False
    return full
