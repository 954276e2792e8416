"""Random generators of transforms: pure functions of where a sample or batch is.

Every generator is ``numpy.random.Generator(PCG64(SeedSequence(key)))`` over integer keys
only, so the same job gives the same numbers in any process, after a restart and after a
resume; no ``hash()``, no global state. The chain step is part of the key so that two
random steps of one chain draw independent numbers. The leading tag keeps sample, batch
and replacement keys apart even when their integers coincide.
"""

from __future__ import annotations

import functools
from typing import Any, cast

import numpy as np

from shardserve.proto.jobs import JobSpec

_SAMPLE, _BATCH, _REPLACE = 1, 2, 3

#: Randomness schemes of the built-in transforms' draws, recorded in a job's spec
#: (``JobSpec.transform_rng``; a spec without it is of scheme 1, made before schemes were
#: recorded). 1: a generator per batch for crop and flip, one per sample for the others
#: (this module). 2: counter-based per-sample keys (:mod:`.keys`) for all of them, so a
#: sample is augmented the same in any batch. User transforms draw from this module's
#: generators under both.
LEGACY_SCHEME, CURRENT_SCHEME = 1, 2
SCHEMES = (LEGACY_SCHEME, CURRENT_SCHEME)


def job_scheme(spec: JobSpec) -> int:
    """The randomness scheme a job's transforms draw by (``None`` in its spec: scheme 1)."""
    return spec.transform_rng or LEGACY_SCHEME


def pin_scheme(spec: JobSpec) -> JobSpec:
    """A new job's spec with the current scheme recorded, when it has transforms and says
    none. A spec already pinned to a dataset version is a job that exists (a rank re-posting
    its run's job, a Loader after a restart): it keeps the scheme it has, ``None`` included.

    >>> pin_scheme(JobSpec(dataset="d", batch_size=2, transforms=[{"name": "hflip"}])).transform_rng
    2
    >>> pin_scheme(JobSpec(dataset="d", batch_size=2)).transform_rng is None
    True
    """
    if not spec.transforms or spec.transform_rng is not None or spec.unpinned() != spec:
        return spec
    return spec.model_copy(update={"transform_rng": CURRENT_SCHEME})


def _gen(key: list[int]) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence(key)))


def sample_rng(seed: int, epoch: int, index: int, step: int) -> np.random.Generator:
    """The generator of chain step ``step`` for global sample ``index`` in ``epoch``."""
    return _gen([_SAMPLE, seed, epoch, index, step])


def sample_rngs(seed: int, epoch: int, indices: np.ndarray, step: int) -> list[np.random.Generator]:
    """:func:`sample_rng` of each of ``indices``, the same generators made a batch at a time:
    ``SeedSequence``'s hashing and ``PCG64``'s seeding from it (~40 us a sample, as much as
    many transforms' own work) become ~200 numpy operations over the whole batch, then a
    ``PCG64`` seeded from each row's words (~3 us). Below ``VECTOR_MIN`` samples those
    operations cost more than they save, and each generator is made on its own.

    >>> ids = np.arange(40) << 27  # past 2**32 from the 33rd on
    >>> [g.integers(1 << 30) for g in sample_rngs(1, 2, ids, 0)] == [
    ...     sample_rng(1, 2, i, 0).integers(1 << 30) for i in ids.tolist()]
    True
    """
    idx = np.asarray(indices, dtype=np.uint64).reshape(-1)
    if idx.size < VECTOR_MIN:
        return [sample_rng(seed, epoch, i, step) for i in idx.tolist()]
    _register_seeded()
    out: list[np.random.Generator | None] = [None] * idx.size
    head, tail = _words([_SAMPLE, seed, epoch]), _words([step])
    # An index of 2**32 or more is two words: each length is hashed as its own matrix.
    wide = idx >= (1 << 32)
    for sel in (np.flatnonzero(~wide), np.flatnonzero(wide)):
        if not sel.size:
            continue
        cols = [(idx[sel] & 0xFFFFFFFF).astype(np.uint32)]
        if wide[sel[0]]:
            cols.append((idx[sel] >> np.uint64(32)).astype(np.uint32))
        entropy = [np.full(sel.size, w, np.uint32) for w in head] + cols
        entropy += [np.full(sel.size, w, np.uint32) for w in tail]
        for k, words in zip(sel.tolist(), _state_words(entropy), strict=True):
            key = [_SAMPLE, seed, epoch, int(idx[k]), step]
            # numpy takes any ISeedSequence here; its stubs name only SeedSequence.
            seeded = cast(np.random.SeedSequence, _Seeded(words, key))
            out[k] = np.random.Generator(np.random.PCG64(seeded))
    return [g for g in out if g is not None]


#: Samples from which :func:`sample_rngs` hashes a batch with numpy (at ~2 us a numpy call on
#: small arrays, the batch's ~200 calls cost what 16 separate SeedSequences do).
VECTOR_MIN = 32

# numpy's SeedSequence (its documented algorithm, stable across versions), over columns.
_INIT_A, _MULT_A = 0x43B0D7E5, 0x931E8875
_INIT_B, _MULT_B = 0x8B51F9DD, 0x58F38DED
_MIX_L, _MIX_R = np.uint32(0xCA01F9DD), np.uint32(0x4973F715)
_POOL = 4
_M32 = 0xFFFFFFFF


def _words(key: list[int]) -> list[int]:
    """A key's entropy as SeedSequence reads it: each int as little-endian uint32 words."""
    out: list[int] = []
    for n in key:
        out.append(n & _M32)
        n >>= 32
        while n:
            out.append(n & _M32)
            n >>= 32
    return out


class _Hash:
    """SeedSequence's ``hashmix``: its constant steps the same for every row of a column."""

    def __init__(self, init: int, mult: int) -> None:
        self.const, self.mult = init, mult

    def __call__(self, v: np.ndarray) -> np.ndarray:
        v = v ^ np.uint32(self.const)
        self.const = (self.const * self.mult) & _M32
        v = v * np.uint32(self.const)
        return v ^ (v >> np.uint32(16))


def _mix(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    r = _MIX_L * x - _MIX_R * y
    return r ^ (r >> np.uint32(16))


def _state_words(entropy: list[np.ndarray]) -> np.ndarray:
    """``SeedSequence(key).generate_state(4, uint64)`` of each row: ``[n, 4]`` uint64."""
    n = entropy[0].size
    h = _Hash(_INIT_A, _MULT_A)
    zero = np.zeros(n, np.uint32)
    pool = [h(entropy[i] if i < len(entropy) else zero) for i in range(_POOL)]
    for src in range(_POOL):
        for dst in range(_POOL):
            if src != dst:
                pool[dst] = _mix(pool[dst], h(pool[src]))
    for src in range(_POOL, len(entropy)):
        for dst in range(_POOL):
            pool[dst] = _mix(pool[dst], h(entropy[src]))
    g = _Hash(_INIT_B, _MULT_B)
    words = [g(pool[i % _POOL]).astype(np.uint64) for i in range(2 * _POOL)]
    return np.stack([words[2 * k] | (words[2 * k + 1] << np.uint64(32)) for k in range(_POOL)], 1)


class _Seeded:
    """``SeedSequence(key)`` whose state words for ``PCG64`` are already known; anything else
    asked of it (``spawn``, other words) goes to the real one, made then: a transform that
    spawns child generators gets the same children from either path."""

    def __init__(self, words: np.ndarray, key: list[int]) -> None:
        self.words = words
        self.key = key
        self._seq: np.random.SeedSequence | None = None

    @property
    def seq(self) -> np.random.SeedSequence:
        if self._seq is None:
            self._seq = np.random.SeedSequence(self.key)
        return self._seq

    def generate_state(self, n_words: int, dtype: Any = np.uint32) -> np.ndarray:
        if n_words == _POOL and np.dtype(dtype) == np.uint64:  # what PCG64 asks
            return self.words
        return self.seq.generate_state(n_words, dtype)

    def spawn(self, n_children: int) -> Any:
        return self.seq.spawn(n_children)


@functools.cache
def _register_seeded() -> None:
    """Make :class:`_Seeded` an ``ISpawnableSeedSequence`` (an ABC), as ``PCG64`` asks, when
    the first batch of generators is made: importing ``numpy.random`` at module level would
    load it (~3.5 MiB) into every idle server, as the transforms are imported at start."""
    from numpy.random.bit_generator import ISpawnableSeedSequence

    ISpawnableSeedSequence.register(_Seeded)


def batch_rng(seed: int, epoch: int, rank: int, batch: int, step: int) -> np.random.Generator:
    """The generator of chain step ``step`` for batch ``batch`` of ``rank`` in ``epoch``."""
    return _gen([_BATCH, seed, epoch, rank, batch, step])


def replacement(seed: int, epoch: int, index: int, attempt: int, num_samples: int) -> int:
    """The sample served instead of ``index`` after its ``attempt``-th failure (never itself
    unless the dataset has one sample)."""
    if num_samples <= 1:
        return index
    j = int(_gen([_REPLACE, seed, epoch, index, attempt]).integers(0, num_samples - 1))
    return j + 1 if j >= index else j
