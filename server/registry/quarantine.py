"""Quarantined samples: a set of ids per dataset that no plan deals from a step on, each with
the latest reason given for it.

Each id keeps the steps it was first quarantined at: from which global step each job that read
the dataset at the time skips it (its frontier then); a job not named (created later) skips it
from step 0. Posting an id again changes only its reason (the latest is kept), never the step:
a plan already made with it stays right. A post that changes nothing costs a lookup and is not
journaled, so a flood of duplicates holds no more memory than one post. The changes are
journaled by the job registry (:class:`~.journal.QuarantineRecord`), so a restart plans exactly
what the first server did.

Held per dataset, bounded before anything is added: ``max_ids`` distinct ids (8 + 4 + 4 bytes
each in numpy arrays), ``max_groups`` distinct sets of steps (one per post that added ids
while jobs read the dataset) and ``max_reasons`` distinct reasons of at most
:data:`~shardserve.proto.api.MAX_QUARANTINE_REASON` characters.

>>> q = Quarantines()
>>> _ = q.add("web", [3, 1], "corrupt jpeg", {"ab12": 40})
>>> _ = q.add("web", [3], "truncated", {"ab12": 90})
>>> [(e.ids, e.reason, e.at) for e in q.entries("web")]
[((1,), 'corrupt jpeg', {'ab12': 40}), ((3,), 'truncated', {'ab12': 40})]
>>> [(s, ids.tolist()) for s, ids in q.from_step("web", "ab12", 0)]
[(40, [1, 3])]
"""

from __future__ import annotations

import threading
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np

from shardserve.proto.api import MAX_QUARANTINE_REASON, MAX_QUARANTINED
from shardserve.proto.errors import BadRequest

#: Most distinct sets of steps (posts that added ids while jobs read) one dataset may hold.
MAX_QUARANTINE_GROUPS = 1 << 16
#: Most distinct reasons one dataset may hold (reasons no id has any more are dropped first).
MAX_QUARANTINE_REASONS = 1 << 16

_Steps = tuple[tuple[str, int], ...]
_K = TypeVar("_K", bound=Hashable)


@dataclass(frozen=True)
class QuarantineEntry:
    """The ids quarantined from the same steps for the same reason."""

    ids: tuple[int, ...]  # sorted, unique
    reason: str
    at: dict[str, int]  # job id -> first global step that skips the ids


@dataclass(frozen=True)
class QuarantineChange:
    """What one :meth:`Quarantines.add` changed: ``ids`` new or with a new reason."""

    ids: tuple[int, ...]
    reason: str
    at: dict[str, int]
    added: int  # how many of ``ids`` were not quarantined before (a plan changes)


@dataclass
class _DatasetSet:
    """One dataset's quarantine: parallel arrays sorted by id."""

    ids: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))
    group: np.ndarray = field(default_factory=lambda: np.empty(0, np.int32))  # into groups
    reason: np.ndarray = field(default_factory=lambda: np.empty(0, np.int32))  # into reasons
    groups: list[_Steps] = field(default_factory=list)
    group_index: dict[_Steps, int] = field(default_factory=dict)
    reasons: list[str] = field(default_factory=list)
    reason_index: dict[str, int] = field(default_factory=dict)

    def held_bytes(self) -> int:
        """Bytes of the arrays and strings held (the dicts' own overhead left out)."""
        arrays = self.ids.nbytes + self.group.nbytes + self.reason.nbytes
        steps = sum(sum(len(j) + 8 for j, _ in g) for g in self.groups)
        return arrays + steps + sum(len(r) for r in self.reasons)


class Quarantines:
    """Every dataset's quarantined ids; thread-safe, bounded per dataset (see the module)."""

    def __init__(
        self,
        max_ids: int = MAX_QUARANTINED,
        max_groups: int = MAX_QUARANTINE_GROUPS,
        max_reasons: int = MAX_QUARANTINE_REASONS,
    ) -> None:
        self.max_ids, self.max_groups, self.max_reasons = max_ids, max_groups, max_reasons
        self._by_dataset: dict[str, _DatasetSet] = {}
        self._lock = threading.Lock()

    def add(
        self, dataset: str, ids: Sequence[int], reason: str, at: Mapping[str, int]
    ) -> QuarantineChange | None:
        """Quarantine ``ids`` from the steps ``at``; an id already quarantined keeps its steps
        and takes ``reason``. Returns what changed (``None``: nothing, so nothing to journal).
        Refused (nothing added) past a bound, naming it."""
        uniq = np.unique(np.asarray(ids, dtype=np.int64))
        if len(uniq) and uniq[0] < 0:
            raise BadRequest(f"quarantine ids must be >= 0, got {int(uniq[0])}")
        if len(reason) > MAX_QUARANTINE_REASON:
            raise BadRequest(
                f"a quarantine reason is at most {MAX_QUARANTINE_REASON} characters, got "
                f"{len(reason)}: shorten it"
            )
        with self._lock:
            s = self._by_dataset.get(dataset) or _DatasetSet()
            pos = np.searchsorted(s.ids, uniq)
            known = pos < len(s.ids)
            known[known] = s.ids[pos[known]] == uniq[known]
            new = uniq[~known]
            r = s.reason_index.get(reason)
            renamed = uniq[known][s.reason[pos[known]] != r] if r is not None else uniq[known]
            if not len(new) and not len(renamed):
                return None
            self._check_room(dataset, s, len(new), reason, at)
            r = _index(s.reasons, s.reason_index, reason)
            if len(renamed):
                s.reason[pos[known]] = r
            if len(new):
                g = _index(s.groups, s.group_index, tuple(sorted(at.items())))
                where = pos[~known]
                s.ids = np.insert(s.ids, where, new)
                s.group = np.insert(s.group, where, np.int32(g))
                s.reason = np.insert(s.reason, where, np.int32(r))
            self._by_dataset[dataset] = s
        changed = np.union1d(new, renamed)
        return QuarantineChange(tuple(changed.tolist()), reason, dict(at), len(new))

    def _check_room(
        self, dataset: str, s: _DatasetSet, new: int, reason: str, at: Mapping[str, int]
    ) -> None:
        """Refuse a change past a bound; reasons no id has any more are dropped first."""
        if len(s.ids) + new > self.max_ids:
            raise BadRequest(
                f"dataset {dataset!r} already has {len(s.ids)} quarantined ids; {new} more "
                f"would pass the limit of {self.max_ids}: fix the data and ingest it again"
            )
        steps = tuple(sorted(at.items()))
        if new and steps not in s.group_index and len(s.groups) >= self.max_groups:
            raise BadRequest(
                f"dataset {dataset!r} already has {len(s.groups)} quarantine posts that took "
                f"effect at different steps, the limit: post ids in fewer, larger requests, "
                "or fix the data and ingest it again"
            )
        if reason not in s.reason_index and len(s.reasons) >= self.max_reasons:
            _drop_unused_reasons(s)
            if len(s.reasons) >= self.max_reasons:
                raise BadRequest(
                    f"dataset {dataset!r} already has {len(s.reasons)} distinct quarantine "
                    "reasons, the limit: reuse one of them"
                )

    def count(self, dataset: str) -> int:
        """Distinct ids of ``dataset`` quarantined."""
        with self._lock:
            s = self._by_dataset.get(dataset)
            return 0 if s is None else len(s.ids)

    def held_bytes(self, dataset: str) -> int:
        """Bytes the dataset's quarantine holds (ids, steps and reasons)."""
        with self._lock:
            s = self._by_dataset.get(dataset)
            return 0 if s is None else s.held_bytes()

    def unknown(self, dataset: str, ids: np.ndarray) -> np.ndarray:
        """The ones of sorted unique ``ids`` not quarantined (a lookup each, not a scan)."""
        with self._lock:
            s = self._by_dataset.get(dataset)
            have = np.empty(0, np.int64) if s is None else s.ids
            pos = np.searchsorted(have, ids)
            hit = pos < len(have)
            hit[hit] = have[pos[hit]] == ids[hit]
        return ids[~hit]

    def entries(self, dataset: str) -> list[QuarantineEntry]:
        """The ids grouped by the steps they were first quarantined at and their reason."""
        with self._lock:
            s = self._by_dataset.get(dataset)
            if s is None:
                return []
            ids, group, reason = s.ids, s.group, s.reason
            groups, reasons = list(s.groups), list(s.reasons)
        key = group.astype(np.int64) * (len(reasons) + 1) + reason
        out = []
        for k in np.unique(key).tolist():
            g, r = divmod(k, len(reasons) + 1)
            mine = ids[key == k]
            out.append(QuarantineEntry(tuple(mine.tolist()), reasons[r], dict(groups[g])))
        return out

    def datasets(self) -> list[str]:
        with self._lock:
            return list(self._by_dataset)

    def from_step(self, dataset: str, job: str, size: int) -> list[tuple[int, np.ndarray]]:
        """``(first step, ids)`` for ``job`` reading ``dataset``, one pair per step, by step;
        ids at or past ``size`` (not in the job's version) are dropped; ``size`` 0 keeps all."""
        with self._lock:
            s = self._by_dataset.get(dataset)
            if s is None:
                return []
            ids, group = s.ids, s.group
            starts = np.array([dict(g).get(job, 0) for g in s.groups], dtype=np.int64)
        if size:
            keep = ids < size
            ids, group = ids[keep], group[keep]
        step = starts[group] if len(ids) else np.empty(0, np.int64)
        return [(int(t), ids[step == t]) for t in np.unique(step).tolist()]

    def records(self) -> list[dict[str, object]]:
        """Journal records that rebuild every dataset's quarantine as it is."""
        return [
            {
                "op": "quarantine",
                "dataset": d,
                "ids": list(e.ids),
                "reason": e.reason,
                "at": e.at,
            }
            for d in self.datasets()
            for e in self.entries(d)
        ]


def _index(values: list[_K], index: dict[_K, int], value: _K) -> int:
    """``value``'s place in ``values``, appended if new (``index``: the reverse map)."""
    i = index.get(value)
    if i is None:
        i = index[value] = len(values)
        values.append(value)
    return i


def _drop_unused_reasons(s: _DatasetSet) -> None:
    """Forget the reasons no id has any more (each id keeps only its latest)."""
    used = np.unique(s.reason)
    remap = np.full(len(s.reasons), -1, dtype=np.int32)
    remap[used] = np.arange(len(used), dtype=np.int32)
    s.reason = remap[s.reason]
    s.reasons = [s.reasons[i] for i in used.tolist()]
    s.reason_index = {r: i for i, r in enumerate(s.reasons)}
