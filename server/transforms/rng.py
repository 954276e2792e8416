"""Random generators of transforms: pure functions of where a sample or batch is.

Every generator is ``numpy.random.Generator(PCG64(SeedSequence(key)))`` over integer keys
only, so the same job gives the same numbers in any process, after a restart and after a
resume; no ``hash()``, no global state. The chain step is part of the key so that two
random steps of one chain draw independent numbers. The leading tag keeps sample, batch
and replacement keys apart even when their integers coincide.
"""

from __future__ import annotations

import numpy as np

_SAMPLE, _BATCH, _REPLACE = 1, 2, 3


def _gen(key: list[int]) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence(key)))


def sample_rng(seed: int, epoch: int, index: int, step: int) -> np.random.Generator:
    """The generator of chain step ``step`` for global sample ``index`` in ``epoch``."""
    return _gen([_SAMPLE, seed, epoch, index, step])


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
