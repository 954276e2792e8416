"""Quarantined samples: ids of a dataset no plan deals from a step on, with the reason.

Kept per dataset, in the order they were posted. Each entry says from which global step each
job that read the dataset at the time skips the ids (its frontier then); a job not named
(created later) skips them from step 0. The entries are journaled by the job registry
(:class:`~.journal.QuarantineRecord`), so a restart plans exactly what the first server did.

>>> q = Quarantines()
>>> _ = q.add("web", [3, 1], "corrupt jpeg", {"ab12": 40})
>>> [(e.ids, e.at) for e in q.entries("web")], q.from_step("web", "ab12", 0)
([((1, 3), {'ab12': 40})], [(40, (1, 3))])
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

from shardserve.proto.api import MAX_QUARANTINED
from shardserve.proto.errors import BadRequest


@dataclass(frozen=True)
class QuarantineEntry:
    ids: tuple[int, ...]  # sorted, unique
    reason: str
    at: dict[str, int]  # job id -> first global step that skips the ids


class Quarantines:
    """Every dataset's quarantine entries; thread-safe, bounded per dataset."""

    def __init__(self, max_ids: int = MAX_QUARANTINED) -> None:
        self.max_ids = max_ids
        self._by_dataset: dict[str, list[QuarantineEntry]] = {}
        self._lock = threading.Lock()

    def add(
        self, dataset: str, ids: Sequence[int], reason: str, at: dict[str, int]
    ) -> QuarantineEntry:
        """Add an entry; refused (nothing added) past ``max_ids`` ids for the dataset."""
        uniq = tuple(sorted(set(ids)))
        if uniq and uniq[0] < 0:
            raise BadRequest(f"quarantine ids must be >= 0, got {uniq[0]}")
        entry = QuarantineEntry(uniq, reason, dict(at))
        with self._lock:
            have = sum(len(e.ids) for e in self._by_dataset.get(dataset, ()))
            if have + len(uniq) > self.max_ids:
                raise BadRequest(
                    f"dataset {dataset!r} already has {have} quarantined ids; {len(uniq)} more "
                    f"would pass the limit of {self.max_ids}: fix the data and ingest it again"
                )
            self._by_dataset.setdefault(dataset, []).append(entry)
        return entry

    def entries(self, dataset: str) -> list[QuarantineEntry]:
        with self._lock:
            return list(self._by_dataset.get(dataset, ()))

    def datasets(self) -> list[str]:
        with self._lock:
            return list(self._by_dataset)

    def from_step(self, dataset: str, job: str, size: int) -> list[tuple[int, tuple[int, ...]]]:
        """``(first step, ids)`` of each entry for ``job`` reading ``dataset``; ids at or past
        ``size`` (not in the job's version) are dropped; ``size`` 0 keeps all."""
        out = []
        for e in self.entries(dataset):
            ids = e.ids if not size else tuple(i for i in e.ids if i < size)
            if ids:
                out.append((e.at.get(job, 0), ids))
        return out

    def records(self) -> list[dict[str, object]]:
        """Journal records of every entry, in order."""
        with self._lock:
            return [
                {
                    "op": "quarantine",
                    "dataset": d,
                    "ids": list(e.ids),
                    "reason": e.reason,
                    "at": e.at,
                }
                for d, entries in self._by_dataset.items()
                for e in entries
            ]
