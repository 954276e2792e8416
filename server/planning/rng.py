"""The epoch's random generator and the dtype of an epoch order.

Every random draw of a plan comes from one ``numpy.random.Generator`` seeded by
``SeedSequence([seed, epoch])``: no ``hash()``, no global state, so the same
(seed, epoch) gives the same plan in any process on any machine.
"""

from __future__ import annotations

import operator

import numpy as np

# Below this many samples an order fits uint32 (4 bytes a sample); at or above it, int64.
UINT32_LIMIT = 2**32


def epoch_rng(seed: int, epoch: int) -> np.random.Generator:
    """Return the generator for one (seed, epoch).

    >>> epoch_rng(0, 1).integers(0, 10, 3).tolist() == epoch_rng(0, 1).integers(0, 10, 3).tolist()
    True
    """
    seed = operator.index(seed)
    epoch = operator.index(epoch)
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    if epoch < 0:
        raise ValueError(f"epoch must be >= 0, got {epoch}")
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, epoch])))


def order_dtype(n_samples: int) -> np.dtype:
    """Return the dtype of an order over ``n_samples`` ids: uint32 while they fit, else int64.

    >>> order_dtype(10), order_dtype(2**32)
    (dtype('uint32'), dtype('int64'))
    """
    return np.dtype(np.uint32) if n_samples < UINT32_LIMIT else np.dtype(np.int64)
