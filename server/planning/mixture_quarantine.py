"""Quarantined ids of a mixture: each source's ids skipped from a position on.

>>> sets = QuarantineSets([Quarantine(0, 10, np.array([3, 5]))], n_sources=2)
>>> sets.at(0, 9) is None, sets.at(0, 10).allows(np.array([3, 4])).tolist(), sets.at(1, 10)
(True, [False, True], None)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from .idset import IdSet


@dataclass(frozen=True)
class Quarantine:
    """Ids of source ``source`` skipped by every position from ``at`` on."""

    source: int
    at: int
    ids: np.ndarray = field(repr=False)  # sorted, unique, int64


class QuarantineSets:
    """Each source's quarantined ids in force at a position: one :class:`IdSet` a source
    over every id, with the first position each is skipped from. Its size does not depend
    on how many quarantine positions there are (one bitmap a source, not one a position)."""

    def __init__(self, quarantine: Sequence[Quarantine], n_sources: int) -> None:
        self._sets: list[IdSet | None] = [None] * n_sources
        self._since: list[np.ndarray] = [np.empty(0, np.int64)] * n_sources
        for k in range(n_sources):
            mine = [q for q in quarantine if q.source == k]
            if not mine:
                continue
            ids = np.concatenate([np.asarray(q.ids, dtype=np.int64) for q in mine])
            at = np.concatenate([np.full(len(q.ids), q.at, dtype=np.int64) for q in mine])
            by = np.lexsort((at, ids))  # by id, then position: an id's earliest first
            ids, at = ids[by], at[by]
            first = np.concatenate(([True], ids[1:] != ids[:-1])) if len(ids) else ids
            self._sets[k], self._since[k] = IdSet(ids[first]), at[first]

    def at(self, source: int, position: int) -> SkippedAt | None:
        """The ids of ``source`` quarantined at ``position``, or ``None``."""
        ids = self._sets[source]
        if ids is None:
            return None
        count = int(np.count_nonzero(self._since[source] <= position))
        return SkippedAt(ids, self._since[source], position, count) if count else None


@dataclass(frozen=True)
class SkippedAt:
    """The ids of an :class:`IdSet` skipped at ``position`` (``since[i] <= position``)."""

    ids: IdSet
    since: np.ndarray
    position: int
    count: int

    def __len__(self) -> int:
        return self.count

    def allows(self, cand: np.ndarray) -> np.ndarray:
        """``True`` where a candidate id is not skipped at the position."""
        ok = self.ids.allows(cand)
        hit = np.flatnonzero(~ok)
        if len(hit) and self.count < len(self.ids):
            where = np.searchsorted(self.ids.ids, cand[hit].astype(np.int64))
            ok[hit] = self.since[where] > self.position
        return ok
