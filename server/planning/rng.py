"""The epoch's random generator and the dtype of an epoch order.

Every random draw of a plan comes from one ``numpy.random.Generator`` seeded by
``SeedSequence([seed, epoch])``: no ``hash()``, no global state, so the same
(seed, epoch) gives the same plan in any process on any machine. Environment ``env > 0`` of
a job (several batches per step, each from its own plan) mixes its number in:
``SeedSequence([seed, epoch, env])``; env 0 is the job's own plan.
"""

from __future__ import annotations

import operator

import numpy as np

# Below this many samples an order fits uint32 (4 bytes a sample); at or above it, int64.
UINT32_LIMIT = 2**32


def epoch_rng(seed: int, epoch: int, env: int = 0) -> np.random.Generator:
    """Return the generator for one (seed, epoch[, env]).

    >>> epoch_rng(0, 1).integers(0, 10, 3).tolist() == epoch_rng(0, 1).integers(0, 10, 3).tolist()
    True
    """
    seed = operator.index(seed)
    epoch = operator.index(epoch)
    env = operator.index(env)
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    if epoch < 0:
        raise ValueError(f"epoch must be >= 0, got {epoch}")
    if env < 0:
        raise ValueError(f"env must be >= 0, got {env}")
    # env 0 keeps the two-word entropy so that a job's own plan never changes.
    entropy = [seed, epoch] if env == 0 else [seed, epoch, env]
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence(entropy)))


def order_dtype(n_samples: int) -> np.dtype:
    """Return the dtype of an order over ``n_samples`` ids: uint32 while they fit, else int64.

    >>> order_dtype(10), order_dtype(2**32)
    (dtype('uint32'), dtype('int64'))
    """
    return np.dtype(np.uint32) if n_samples < UINT32_LIMIT else np.dtype(np.int64)
