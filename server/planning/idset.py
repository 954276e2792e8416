"""A set of sample ids that tests millions of candidates at once: what a quarantine skips."""

from __future__ import annotations

import numpy as np


class IdSet:
    """Sorted unique sample ids, with a bitmap over ``0 .. max id`` for membership tests
    (one bit a sample below the largest id: a million quarantined ids of a 40 M source
    test 40 M candidates in a few vectorised passes, not 20 cache misses each).

    >>> IdSet(np.array([5, 1, 5])).allows(np.array([0, 1, 5, 9])).tolist()
    [True, False, False, True]
    """

    def __init__(self, ids: np.ndarray) -> None:
        ids = np.sort(np.asarray(ids, dtype=np.int64))
        if len(ids):
            ids = ids[np.concatenate(([True], ids[1:] != ids[:-1]))]
        self.ids = ids
        self.top = int(ids[-1]) if len(ids) else -1
        bits = np.zeros(self.top + 1, dtype=bool)
        bits[ids] = True
        self._bits = np.packbits(bits, bitorder="little")

    def __len__(self) -> int:
        return len(self.ids)

    def allows(self, cand: np.ndarray) -> np.ndarray:
        """``True`` where a candidate id is not in the set."""
        c = cand.astype(np.int64, copy=False)
        inside = np.minimum(c, max(self.top, 0))
        hit = (self._bits[inside >> 3] >> (inside & 7).astype(np.uint8)) & 1
        return (c > self.top) | (hit == 0)
