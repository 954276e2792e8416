"""Counter-based randomness of transforms, a whole batch at a time: Philox4x32-10 in numpy.

A sample's numbers are a pure function of ``(seed, epoch, sample id, chain step)`` and of
how many it has drawn, never of the batch, rank, worker or world size that carries it; a
batch of ``B`` samples is drawn in ~100 numpy operations over ``[B, words]`` arrays, not a
generator per sample (~45 us each).

Why Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011):
its round is two 32 x 32 -> 64-bit multiplies, which numpy does exactly in ``uint64``
(Threefry needs 20 rounds of 64-bit adds and rotations: about twice the numpy calls for the
same words), it passes BigCrush, and it is the generator CUDA's cuRAND, torch and JAX
already run on devices, so a device executor reproduces these words with no new kernel.

Layout: the Philox key is derived once per call from ``(seed, epoch, step, stream)`` by one
Philox block under the key ``seed`` (a bijection of the counter, so distinct ``(epoch,
step, stream)`` give distinct 128-bit blocks; the 64 kept bits collide with probability
2**-64); the counter of block ``j`` of sample ``id`` is ``(j, 0, id_lo, id_hi)``. Words are
a prefix code: a sample's first ``m`` words are the same whether ``m`` or more are drawn.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property

import numpy as np

from .compiled import philox

_M0, _M1 = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
_W0, _W1 = 0x9E3779B9, 0xBB67AE85
_MASK = np.uint64(0xFFFFFFFF)
_SHIFT = np.uint64(32)
_M32 = 0xFFFFFFFF


def philox4x32_10(
    c0: np.ndarray,
    c1: np.ndarray,
    c2: np.ndarray,
    c3: np.ndarray,
    k0: int | np.ndarray,
    k1: int | np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Philox4x32-10 of counters ``(c0, c1, c2, c3)`` (uint32 values, any integer arrays
    of one shape) under key ``(k0, k1)`` (ints, or uint32 values per element): four
    ``uint64`` arrays holding uint32 words.

    >>> z = np.zeros(1, np.uint64)
    >>> [hex(int(w[0])) for w in philox4x32_10(z, z, z, z, 0, 0)]
    ['0x6627e8d5', '0xe169c58d', '0xbc57ac4c', '0x9b00dbd8']
    """
    x0, x1, x2, x3 = (np.asarray(c, dtype=np.uint64) for c in (c0, c1, c2, c3))
    ka, kb = _round_keys(k0, _W0), _round_keys(k1, _W1)
    for r in range(10):
        a, b = ka[r], kb[r]
        p0 = x0 * _M0
        p1 = x2 * _M1
        h0 = p0 >> _SHIFT
        h1 = p1 >> _SHIFT
        h1 ^= x1
        h1 ^= a
        h0 ^= x3
        h0 ^= b
        p1 &= _MASK
        p0 &= _MASK
        x0, x1, x2, x3 = h1, p1, h0, p0
    return x0, x1, x2, x3


def _round_keys(k: int | np.ndarray, weyl: int) -> list[np.uint64] | np.ndarray:
    """The ten rounds' keys ``k + r * weyl`` (mod 2**32): scalars for an int key, else one
    ``uint64[10, ...]`` array made in one operation (not two per round)."""
    if isinstance(k, int):
        return [np.uint64((k + r * weyl) & _M32) for r in range(10)]
    steps = np.arange(10, dtype=np.uint64).reshape(10, *([1] * np.ndim(k))) * np.uint64(weyl)
    return (np.asarray(k, dtype=np.uint64) + steps) & _MASK


def _split64(v: int) -> tuple[int, int]:
    return v & _M32, (v >> 32) & _M32


@functools.lru_cache(maxsize=1024)
def derive_key(seed: int, epoch: int, step: int, stream: int) -> tuple[int, int]:
    """The Philox key of one step's draws: one block of ``(epoch, step, stream)`` under
    the key ``seed`` (the first two words), in Python ints (one block: no arrays)."""
    x0, x1 = _split64(epoch)
    x2, x3 = step & _M32, stream & _M32
    k0, k1 = _split64(seed)
    m0, m1 = int(_M0), int(_M1)
    for r in range(10):
        a, b = (k0 + r * _W0) & _M32, (k1 + r * _W1) & _M32
        p0, p1 = m0 * x0, m1 * x2
        x0, x1, x2, x3 = (p1 >> 32) ^ x1 ^ a, p1 & _M32, (p0 >> 32) ^ x3 ^ b, p0 & _M32
    return x0, x1


@dataclass(frozen=True)
class SampleKeys:
    """The keys of one chain step's draws for a batch's samples: ``ids`` are the global
    sample indices (uint64), one row per sample.

    Every draw method is vectorised over the batch and a pure function of each row's
    ``(seed, epoch, id, step, stream)``: a sample draws the same numbers in any batch.
    Two independent draws in one step use two ``stream`` values (:meth:`stream_of`) or
    different words of one draw.

    >>> k = SampleKeys(seed=1, epoch=0, step=0, ids=np.array([7, 3], np.uint64))
    >>> u = k.uniform(2)
    >>> u.shape, bool((u >= 0).all() and (u < 1).all())
    ((2, 2), True)
    >>> bool((k.take(np.array([1])).uniform(2) == u[1:]).all())
    True
    """

    seed: int
    epoch: int
    step: int
    ids: np.ndarray = field(repr=False)
    stream: int = 0
    #: Randomness scheme 1 only (jobs made before scheme 2): the step's per-batch generator.
    #: :mod:`.draws` then gives the numbers the old generators gave (see its docstring).
    legacy: np.random.Generator | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "ids", np.asarray(self.ids, dtype=np.uint64).reshape(-1))

    def __len__(self) -> int:
        return int(self.ids.size)

    @cached_property
    def key(self) -> tuple[int, int]:
        """The Philox key of these draws (see the module docstring)."""
        return derive_key(self.seed, self.epoch, self.step, self.stream)

    def stream_of(self, stream: int) -> SampleKeys:
        """The same samples' independent draw stream number ``stream``."""
        return replace(self, stream=stream)

    def take(self, rows: np.ndarray | slice) -> SampleKeys:
        """The keys of some of the samples (``rows`` of the batch): the same numbers."""
        return replace(self, ids=self.ids[rows])

    def _blocks(self, block: np.ndarray, row: np.ndarray | slice) -> np.ndarray:
        """Words of block ``block[i]`` of sample row ``row[i]``: ``uint64[len, 4]``."""
        return _block_words(block, self.ids[row], *self.key)

    def words(self, n: int) -> np.ndarray:
        """``n`` uint32 words per sample, as ``uint64[B, n]``."""
        b, nb = len(self), -(-n // 4)
        if nb == 1:  # the common draw of a few words: no block and row arrays to build
            return self._blocks(np.zeros(b, np.uint64), slice(None))[:, :n]
        block = np.tile(np.arange(nb, dtype=np.uint64), b)
        row = np.repeat(np.arange(b), nb)
        return self._blocks(block, row).reshape(b, nb * 4)[:, :n]

    def words_ragged(self, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``counts[i]`` words of sample ``i``: ``(uint64 flat words, int64 offsets[B + 1])``,
        sample ``i``'s words at ``flat[offsets[i]:offsets[i + 1]]`` (its first words are
        those :meth:`words` gives)."""
        counts = np.asarray(counts, dtype=np.int64).reshape(-1)
        nb = -(-counts // 4)
        starts = np.zeros(nb.size + 1, np.int64)
        np.cumsum(nb, out=starts[1:])
        rows = np.arange(nb.size)
        row = np.repeat(rows, nb)
        block = (np.arange(int(starts[-1]), dtype=np.int64) - starts[row]).astype(np.uint64)
        flat4 = self._blocks(block, row).reshape(-1)
        # Keep the first counts[i] of each sample's 4 * nb[i] words.
        row4 = np.repeat(rows, 4 * nb)
        keep = np.arange(flat4.size) - 4 * starts[row4] < counts[row4]
        offsets = np.zeros(counts.size + 1, np.int64)
        np.cumsum(counts, out=offsets[1:])
        return flat4[keep], offsets

    def uniform(self, n: int) -> np.ndarray:
        """``float64[B, n]`` uniform on [0, 1), 53 random bits each (two words)."""
        return to_unit(self.words(2 * n))

    def integers(self, high: np.ndarray | int, n: int) -> np.ndarray:
        """``int64[B, n]`` uniform on ``[0, high[i])`` for sample ``i`` (``1 <= high <=
        2**32``), from 64 random bits each: bias at most ``high / 2**64`` per value."""
        hi = np.broadcast_to(np.asarray(high, dtype=np.int64).reshape(-1, 1), (len(self), 1))
        return below(self.words(2 * n), hi)


def words_together(keys: Sequence[SampleKeys], n: int) -> list[np.ndarray]:
    """``[k.words(n) for k in keys]`` (the same words) in one Philox pass over all their
    samples, each under its own key: a fused chain's steps draw at the cost of one step
    (a pass over 256 samples is ~100 numpy calls whatever the batch, most of a draw's time).

    >>> a, b = SampleKeys(1, 0, 0, np.arange(3)), SampleKeys(1, 0, 1, np.arange(2))
    >>> [bool((w == k.words(4)).all()) for w, k in zip(words_together([a, b], 4), [a, b])]
    [True, True]
    """
    if len(keys) == 1 or -(-n // 4) != 1:
        return [k.words(n) for k in keys]
    sizes = [len(k) for k in keys]
    ids = np.concatenate([k.ids for k in keys])
    k0, k1 = (np.repeat(np.array([k.key[i] for k in keys], np.uint64), sizes) for i in (0, 1))
    words = _block_words(np.zeros(ids.shape, np.uint64), ids, k0, k1)
    return np.split(words[:, :n], np.cumsum(sizes)[:-1])


def _block_words(
    block: np.ndarray, ids: np.ndarray, k0: int | np.ndarray, k1: int | np.ndarray
) -> np.ndarray:
    """Words of block ``block[i]`` of sample ``ids[i]`` under key ``(k0, k1)`` (one, or one
    per sample): ``uint64[len, 4]``. The counter is ``(block, 0, id low, id high)``.

    Compiled where the extension was built (:mod:`.compiled`: the same words in one loop, a
    batch of 256 in 10 us against 67 us of numpy calls), else :func:`philox4x32_10`."""
    if philox is not None:
        out = np.empty((ids.size, 4), np.uint64)
        philox.blocks(_u64(block), _u64(ids), _u64(k0), _u64(k1), out)
        return out.reshape(*ids.shape, 4)
    zero = np.zeros(ids.shape, np.uint64)
    return np.stack(philox4x32_10(block, zero, ids & _MASK, ids >> _SHIFT, k0, k1), axis=-1)


def _u64(a: int | np.ndarray) -> np.ndarray:
    """``a`` as a flat contiguous ``uint64`` array (no copy when it is one already)."""
    return np.ascontiguousarray(a, dtype=np.uint64).reshape(-1)


def to_unit(words: np.ndarray) -> np.ndarray:
    """Pairs of words ``[..., 2n]`` -> floats on [0, 1) ``[..., n]`` (53 bits each)."""
    a, b = words[..., 0::2] >> np.uint64(5), words[..., 1::2] >> np.uint64(6)
    return ((a << np.uint64(26)) | b).astype(np.float64) * (1.0 / (1 << 53))


def below(words: np.ndarray, high: np.ndarray) -> np.ndarray:
    """Pairs of words ``[..., 2n]`` -> ints on ``[0, high)`` ``[..., n]``: the top 64 bits
    of the 64-bit draw times ``high`` (exact in uint64: ``high <= 2**32``)."""
    h = np.asarray(high).astype(np.uint64)
    if np.any(h < 1) or np.any(h > (1 << 32)):
        raise ValueError(f"high must be 1 to 2**32, got {np.asarray(high).ravel()[:8]}")
    a, b = words[..., 0::2], words[..., 1::2]
    return ((a * h + ((b * h) >> _SHIFT)) >> _SHIFT).astype(np.int64)
