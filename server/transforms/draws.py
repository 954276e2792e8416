"""The random parameters of the built-in transforms, drawn for a whole batch from
:class:`~.keys.SampleKeys`: pure functions, so an executor elsewhere (a device, a worker
process, a fused kernel) given the same keys draws the same boxes, flips and rows.

Each row of every result depends only on that sample's keys and its own sizes, never on the
batch around it. Keys of randomness scheme 1 (``keys.legacy`` set: jobs made before scheme 2)
give the numbers the old per-batch and per-sample generators gave, so such a job goes on
with the augmentation it started with.
"""

from __future__ import annotations

import math

import numpy as np

from .keys import SampleKeys, below, to_unit, words_together
from .rng import sample_rngs

#: Tries of torchvision's RandomResizedCrop before its centre-crop fallback.
TRIES = 10


def crop_offsets(keys: SampleKeys, room_y: int, room_x: int) -> tuple[np.ndarray, np.ndarray]:
    """Per sample, the top-left corner ``(oy, ox)`` of a crop: ``oy`` uniform on
    ``0..room_y`` and ``ox`` on ``0..room_x`` (``room = padded side - crop side``).

    >>> k = SampleKeys(seed=0, epoch=0, step=0, ids=np.arange(3))
    >>> oy, ox = crop_offsets(k, 8, 8)
    >>> oy.shape, bool(((0 <= oy) & (oy <= 8)).all())
    ((3,), True)
    """
    b = len(keys)
    if keys.legacy is not None:
        return (
            keys.legacy.integers(0, room_y + 1, size=b),
            keys.legacy.integers(0, room_x + 1, size=b),
        )
    return _offsets(keys.words(4), room_y, room_x)


def _offsets(w: np.ndarray, room_y: int, room_x: int) -> tuple[np.ndarray, np.ndarray]:
    """:func:`crop_offsets` from a sample's first four words."""
    oy = below(w[:, 0:2], np.int64(room_y + 1))[:, 0]
    return oy, below(w[:, 2:4], np.int64(room_x + 1))[:, 0]


def flips(keys: SampleKeys, p: float) -> np.ndarray:
    """``bool[B]``: whether each sample is flipped (probability ``p``).

    >>> bool(flips(SampleKeys(seed=0, epoch=0, step=1, ids=np.arange(4)), 1.0).all())
    True
    """
    if keys.legacy is not None:
        return keys.legacy.random(len(keys)) < p
    return to_unit(keys.words(2))[:, 0] < p


def crop_flips(
    crop: SampleKeys, flip: SampleKeys, room_y: int, room_x: int, p: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(*crop_offsets(crop, room_y, room_x), flips(flip, p))``, the same numbers, drawn
    in one pass for both steps' keys (a fused crop and flip).

    >>> c, f = (SampleKeys(seed=0, epoch=0, step=s, ids=np.arange(4)) for s in (0, 1))
    >>> oy, ox, fl = crop_flips(c, f, 8, 8, 0.5)
    >>> bool((fl == flips(f, 0.5)).all() and (oy == crop_offsets(c, 8, 8)[0]).all())
    True
    """
    if crop.legacy is not None or flip.legacy is not None:
        return (*crop_offsets(crop, room_y, room_x), flips(flip, p))
    wc, wf = words_together([crop, flip], 4)
    return (*_offsets(wc, room_y, room_x), to_unit(wf[:, :2])[:, 0] < p)


def resized_crop_boxes(
    keys: SampleKeys,
    heights: np.ndarray,
    widths: np.ndarray,
    scale: tuple[float, float] | list[float],
    ratio: tuple[float, float] | list[float],
) -> np.ndarray:
    """``float64[B, 4]`` boxes ``(y0, x0, h, w)`` of torchvision's RandomResizedCrop on
    images ``heights[i] x widths[i]``: up to 10 tries of an area share in ``scale`` and a
    log-uniform aspect in ``ratio``, the first that fits, else the centre crop clamped to
    ``ratio``. Every try's numbers are drawn (a fixed 80 words a sample), then the first
    fitting one is kept: the same box as trying one at a time.

    >>> k = SampleKeys(seed=3, epoch=0, step=0, ids=np.arange(2))
    >>> resized_crop_boxes(k, np.array([32, 40]), np.array([32, 50]), (0.08, 1), (0.75, 1.33)).shape
    (2, 4)
    """
    H = np.asarray(heights, dtype=np.int64).reshape(-1)
    W = np.asarray(widths, dtype=np.int64).reshape(-1)
    if keys.legacy is not None or len(keys) == 0:
        return _legacy_boxes(keys, H, W, scale, ratio)
    words = keys.words(8 * TRIES).reshape(len(keys), TRIES, 8)
    u = to_unit(words[..., :4])  # [B, TRIES, 2]: area share, log aspect
    area = (H * W).astype(np.float64)[:, None]
    target = area * (scale[0] + (scale[1] - scale[0]) * u[..., 0])
    lo, hi = math.log(ratio[0]), math.log(ratio[1])
    aspect = np.exp(lo + (hi - lo) * u[..., 1])
    w = np.rint(np.sqrt(target * aspect)).astype(np.int64)
    h = np.rint(np.sqrt(target / aspect)).astype(np.int64)
    fits = (w > 0) & (w <= W[:, None]) & (h > 0) & (h <= H[:, None])
    y0 = below(words[..., 4:6], np.where(fits, H[:, None] - h + 1, 1)[..., None])[..., 0]
    x0 = below(words[..., 6:8], np.where(fits, W[:, None] - w + 1, 1)[..., None])[..., 0]
    t = np.argmax(fits, axis=1)
    rows = np.arange(len(keys))
    out = np.stack([y0[rows, t], x0[rows, t], h[rows, t], w[rows, t]], axis=1).astype(np.float64)
    none = ~fits.any(axis=1)
    if none.any():
        out[none] = _centre(H[none], W[none], ratio)
    return out


def _centre(H: np.ndarray, W: np.ndarray, ratio: tuple[float, float] | list[float]) -> np.ndarray:
    """torchvision's fallback: the whole image, clamped to the ratio range, centred."""
    r = W / H
    h, w = H.copy(), W.copy()
    narrow, wide = r < ratio[0], r > ratio[1]
    h[narrow] = np.rint(W[narrow] / ratio[0]).astype(np.int64)
    w[wide] = np.rint(H[wide] * ratio[1]).astype(np.int64)
    return np.stack([(H - h) // 2, (W - w) // 2, h, w], axis=1).astype(np.float64)


def _legacy_box(
    H: int,
    W: int,
    scale: tuple[float, float] | list[float],
    ratio: tuple[float, float] | list[float],
    rng: np.random.Generator,
) -> tuple[int, int, int, int]:
    """Scheme 1: one sample's box from its own generator, one try at a time."""
    area = H * W
    log_r = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(TRIES):
        target = area * rng.uniform(scale[0], scale[1])
        aspect = math.exp(rng.uniform(*log_r))
        w = round(math.sqrt(target * aspect))
        h = round(math.sqrt(target / aspect))
        if 0 < w <= W and 0 < h <= H:
            return int(rng.integers(0, H - h + 1)), int(rng.integers(0, W - w + 1)), h, w
    r = W / H
    if r < ratio[0]:
        w, h = W, round(W / ratio[0])
    elif r > ratio[1]:
        h, w = H, round(H * ratio[1])
    else:
        h, w = H, W
    return (H - h) // 2, (W - w) // 2, h, w


def _legacy_boxes(
    keys: SampleKeys,
    H: np.ndarray,
    W: np.ndarray,
    scale: tuple[float, float] | list[float],
    ratio: tuple[float, float] | list[float],
) -> np.ndarray:
    rngs = sample_rngs(keys.seed, keys.epoch, keys.ids, keys.step)
    boxes = [
        _legacy_box(int(h), int(w), scale, ratio, g)
        for h, w, g in zip(H.tolist(), W.tolist(), rngs, strict=True)
    ]
    return np.array(boxes, dtype=np.float64).reshape(len(keys), 4)


def subset_indices(
    keys: SampleKeys, sizes: np.ndarray, k: int, replace: bool = False
) -> np.ndarray:
    """``int64[B, k]``: ``k`` rows of each sample's ``sizes[i]`` rows, uniformly: without
    ``replace`` a uniform ``k``-subset in ascending order (``sizes >= k``), with it ``k``
    independent rows in draw order.

    Without replacement a sample takes the first ``k`` distinct values of its uniform stream
    (exactly unbiased: Lemire's multiply-shift with rejection, on 16-bit pieces of its words
    up to 2**16 rows, on whole words past that) when
    ``2k <= size`` (at most ~1.4k draws), else the ``k`` smallest of ``size`` 64-bit sort
    keys. Which way depends only on the sample's own size.

    >>> k = SampleKeys(seed=0, epoch=0, step=0, ids=np.arange(2))
    >>> rows = subset_indices(k, np.array([10, 4000]), 3)
    >>> rows.shape, bool((np.diff(rows, axis=1) > 0).all())
    ((2, 3), True)
    """
    n = np.asarray(sizes, dtype=np.int64).reshape(-1)
    if n.size != len(keys):
        raise ValueError(f"{n.size} sizes for {len(keys)} samples")
    if keys.legacy is not None:
        return _legacy_subset(keys, n, k, replace)
    if replace:
        return keys.integers(n, k)
    if (n < k).any():
        raise ValueError(f"a sample has {int(n.min())} rows, fewer than k={k}")
    few = 2 * k <= n
    if few.all():  # the common batch: no copy of its rows into place
        return _first_distinct(keys, n, k)
    out = np.empty((n.size, k), np.int64)
    for sel, fn in ((np.flatnonzero(few), _first_distinct), (np.flatnonzero(~few), _smallest)):
        if sel.size:
            out[sel] = fn(_rows_of(keys, sel), n[sel], k)
    return out


def _rows_of(keys: SampleKeys, rows: np.ndarray) -> SampleKeys:
    """``keys.take(rows)``, or ``keys`` itself when ``rows`` are all of them in order (the
    common batch): no new keys, whose Philox key would be derived again."""
    return keys if rows.size == len(keys) else keys.take(rows)


def _legacy_subset(keys: SampleKeys, n: np.ndarray, k: int, replace: bool) -> np.ndarray:
    """Scheme 1: each sample's rows from its own generator (the old per-sample transform)."""
    out = np.empty((n.size, k), np.int64)
    for i, g in enumerate(sample_rngs(keys.seed, keys.epoch, keys.ids, keys.step)):
        if replace:
            out[i] = g.choice(int(n[i]), size=k, replace=True)
        else:
            rows = g.choice(int(n[i]), size=k, replace=False, shuffle=False)
            rows.sort()
            out[i] = rows
    return out


def _first_distinct(keys: SampleKeys, n: np.ndarray, k: int) -> np.ndarray:
    """The first ``k`` distinct values of each sample's stream of uniform ints below
    ``n[i]``, ascending. The batch draws ~10% more than its largest sample expects to need
    (every sample looks at all of them: its answer is the same however many it draws); a
    sample still short draws again with twice as many. A sample of at most 2**16 rows draws
    16-bit values, two a word: half the words to make."""
    expect = n * (np.log(n) - np.log(n - k))  # expected draws for k distinct of n
    m = (expect * 1.1 + 16).astype(np.int64)
    narrow = n <= 1 << 16
    out = np.empty((n.size, k), np.int64)
    plan: list[tuple[np.ndarray, int]]
    if narrow.all():  # the common batch: all of it at once, then the short ones again
        got, short = _distinct_once(keys, n, int(m.max()), k, 16)
        if not short.any():  # every sample found k in its first draws: no copy into place
            return got
        out[~short] = got
        plan = [(np.flatnonzero(short), 16)]
        m[short] *= 2
    else:
        plan = [(np.flatnonzero(narrow), 16), (np.flatnonzero(~narrow), 32)]
    for todo, bits in plan:
        while todo.size:
            width = int(m[todo].max())
            got, short = _distinct_once(_rows_of(keys, todo), n[todo], width, k, bits)
            out[todo[~short]] = got
            todo = todo[short]
            m[todo] = 2 * width
    return out


def _bounded(
    keys: SampleKeys, n: np.ndarray, width: int, bits: int
) -> tuple[np.ndarray, np.ndarray]:
    """``width`` draws per sample below ``n[i]`` from ``bits``-bit pieces of its words
    (Lemire's multiply-shift): ``(values, rejected)``, both ``[B, width]``. A draw whose low
    bits fall below ``2**bits mod n`` is rejected: what is left is exactly uniform."""
    if bits == 16:
        # A word's low then high half is its little-endian uint16 view; piece * n < 2**32
        # (n <= 2**16), so uint32 holds the product exactly, at half uint64's memory traffic.
        pieces = keys.words(-(-width // 2)).astype("<u4").view("<u2")[:, :width]
        nn = n.astype(np.uint32)[:, None]
        prod = pieces * nn
        # The high half as a contiguous uint32 (what the caller sorts in): a shift costs less
        # than a strided uint16 view and its cast, as does the low half by a mask.
        return prod >> np.uint32(16), (prod & np.uint32(0xFFFF)) < ((1 << 16) - nn) % nn
    n64 = n.astype(np.uint64)[:, None]
    prod64 = keys.words(width) * n64
    bad = (prod64 & np.uint64((1 << bits) - 1)) < (np.uint64(1 << bits) - n64) % n64
    return prod64 >> np.uint64(bits), bad


def _distinct_once(
    keys: SampleKeys, n: np.ndarray, width: int, k: int, bits: int
) -> tuple[np.ndarray, np.ndarray]:
    """``(rows of the samples that found k distinct in width draws, bool short[B])``: the
    batch as one ``[B, width]`` array.

    One sort per row of ``value << shift | draw`` puts each value's first draw first; the
    ``k`` values whose first draws come earliest are kept, already in ascending order."""
    drawn, bad = _bounded(keys, n, width, bits)
    big = int(n.max())  # sorts after every value drawn
    shift = max(width - 1, 1).bit_length()  # draw < 2**shift: a shift and a mask, no divmod
    # uint32 sorts 2-3x faster than 64-bit words
    dt = np.uint32 if (big + 1) << shift < (1 << 32) else np.uint64
    value = drawn.astype(dt, copy=False)  # drawn is fresh: shifted in place
    value <<= dt(shift)
    value |= np.arange(width, dtype=dt)
    np.copyto(value, dt(big << shift), where=bad)
    value.sort(axis=1)
    first = value & dt((1 << shift) - 1)
    value >>= dt(shift)
    new = np.empty(value.shape, bool)
    new[:, 0] = True
    np.not_equal(value[:, 1:], value[:, :-1], out=new[:, 1:])
    new &= value < big
    # The k-th earliest first draw of each row: values first drawn by then are the subset
    # (``when`` is ``width`` for a repeat, past every first draw of a row not short).
    when = np.where(new, first, dt(width))
    kth = np.partition(when, k - 1, axis=1)[:, k - 1 : k]
    short = kth[:, 0] >= width
    keep = when <= kth
    if short.any():
        keep &= ~short[:, None]
    # compress of the flat rows: the same values in the same order as value[keep], ~3x
    # faster (numpy's 2-D boolean index takes a slow path: ~40 us of a 16 x 800 batch)
    kept = np.compress(keep.reshape(-1), value.reshape(-1))
    return kept.astype(np.int64).reshape(-1, k), short


def _smallest(keys: SampleKeys, n: np.ndarray, k: int) -> np.ndarray:
    """Rows of the ``k`` smallest of ``n[i]`` 64-bit sort keys (ties, ~2**-64 a pair, go
    to the lower row), ascending."""
    words, offsets = keys.words_ragged(2 * n)
    key64 = (words[0::2] << np.uint64(32)) | words[1::2]
    width = int(n.max())
    pad = np.full((n.size, width), np.iinfo(np.uint64).max, np.uint64)
    row = np.repeat(np.arange(n.size), n)
    col = np.arange(key64.size) - np.repeat(offsets[:-1] // 2, n)
    pad[row, col] = key64
    order = np.argsort(pad, axis=1, kind="stable")[:, :k]
    return np.sort(order, axis=1)
