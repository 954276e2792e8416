"""Shards of a remote store, leased from the local :class:`~..cache.ShardCache`: a shard is
fetched whole, checksummed and mapped when a batch first needs it, leased while read, and
unmapped least recently used past the cache limit; the shards a stream's plan reads next are
fetched ahead (:class:`CachedShards`, a :class:`~.shard_set.ShardSet`).
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from shardserve.proto.errors import DatasetCorruptError
from shardserve.proto.manifest import Manifest, ShardInfo

from ...source import Planned
from ..cache import Lease, ShardCache
from .shard_set import VERIFY_MODES, Chunks, shard_starts
from .shards import MappedShard

if TYPE_CHECKING:
    pass


class _Open:
    """A leased, mapped shard and how many reads hold it right now."""

    def __init__(self, lease: Lease, shard: MappedShard) -> None:
        self.lease = lease
        self.shard = shard
        self.users = 0

    def close(self) -> None:
        self.shard.close()
        self.lease.release()


#: ``fetch(info, dest)``: copy shard ``info`` whole into the new file ``dest``; its checksum.
#: Shards fetched ahead of the reader at most (and never more than half the cache limit).
PREFETCH_SHARDS = 8
#: Stream plans remembered for prefetching (one per open stream is enough).
HINTS = 16

Fetch = Callable[[ShardInfo, Path], str]


class CachedShards:
    """A remote dataset's shards, fetched into a local cache as batches need them; see the
    module docstring. ``where`` names the store in errors."""

    waits = True

    def __init__(
        self, manifest: Manifest, cache: ShardCache, fetch: Fetch, where: str, verify: str = "lazy"
    ) -> None:
        if verify not in VERIFY_MODES:
            raise ValueError(f"verify must be one of {VERIFY_MODES}, got {verify!r}")
        self.manifest = manifest
        self.cache = cache
        self._fetch = fetch
        self._where = where
        self._starts = shard_starts(manifest)
        self._verify_mode = verify
        self._checked: set[int] = set()
        self._failed: dict[int, DatasetCorruptError] = {}
        self._mapped: OrderedDict[int, _Open] = OrderedDict()
        self._mapped_bytes = 0
        self._lock = threading.Lock()
        self._shard_locks = [threading.Lock() for _ in manifest.shards]
        #: ``(shards in reading order, position of each shard in it or -1)`` per plan.
        self._hints: deque[tuple[np.ndarray, np.ndarray]] = deque(maxlen=HINTS)
        if verify == "full":
            self.verify()

    def acquire(self, shards: Iterable[int]) -> Chunks:
        """The chunks of ``shards`` (in that order), each leased and mapped; then the shards
        the plans read next start fetching."""
        shards = list(shards)
        held: list[int] = []
        try:
            mapped = []
            for s in shards:
                mapped.append(self._map(s))
                held.append(s)
        except BaseException:
            self.release(held)
            raise
        self._prefetch_after(shards)
        first = [int(self._starts[s]) for s in shards]
        return Chunks.of(mapped, first, self.manifest.fields, None, None)

    def _map(self, s: int) -> MappedShard:
        """Map shard ``s`` (leasing it from the cache) and count one more user of it."""
        with self._lock:
            if s in self._failed:
                raise self._failed[s]
            entry = self._mapped.get(s)
            if entry is not None:
                entry.users += 1
                self._mapped.move_to_end(s)
                return entry.shard
        with self._shard_locks[s]:  # one thread fetches and maps a shard; others wait for it
            with self._lock:
                entry = self._mapped.get(s)
                if entry is not None:
                    entry.users += 1
                    self._mapped.move_to_end(s)
                    return entry.shard
            try:
                lease, shard = self._lease_checked(s)
            except DatasetCorruptError as e:
                e = DatasetCorruptError(f"{e} (dataset {self.manifest.name!r} in {self._where})")
                with self._lock:
                    self._failed[s] = e
                raise e from None
            entry = _Open(lease, shard)
            entry.users = 1
            with self._lock:
                self._mapped[s] = entry
                self._mapped_bytes += shard.info.bytes
        return shard

    def _fetcher(self, s: int) -> partial[str]:
        return partial(self._fetch, self.manifest.shards[s])

    def _lease_checked(self, s: int, refetch: bool = True) -> tuple[Lease, MappedShard]:
        """Shard ``s`` leased from the cache and mapped, checked unless ``--verify off``. A
        cached copy that fails its checksum (tampered, a bad disk) is removed and fetched again,
        once: then the object store's bytes decide."""
        info = self.manifest.shards[s]
        lease = self.cache.acquire(info.checksum, info.bytes, self._fetcher(s))
        try:
            shard = MappedShard(lease.path, info, self.manifest.fields)
        except BaseException:
            lease.release()
            raise
        # A shard this process fetched was checksummed on the way in.
        if lease.fetched:
            self._checked.add(s)
        if s not in self._checked and self._verify_mode != "off":
            try:
                shard.verify()
            except DatasetCorruptError:
                shard.close()
                lease.release()
                if not refetch:
                    raise
                self.cache.discard(info.checksum)
                return self._lease_checked(s, refetch=False)
            except BaseException:
                shard.close()
                lease.release()
                raise
            self._checked.add(s)
        return lease, shard

    def check_reads(self, ids: np.ndarray, fields: Sequence[str]) -> None:
        """Nothing: a shard is checksummed whole when it is fetched, before any read."""

    def release(self, shards: Sequence[int]) -> None:
        """One user fewer for each of ``shards``; unmap idle ones past the cache limit."""
        with self._lock:
            for s in shards:
                self._mapped[s].users -= 1
            if self._mapped_bytes <= self.cache.limit_bytes:
                return
            for s in list(self._mapped):
                if self._mapped_bytes <= self.cache.limit_bytes:
                    break
                entry = self._mapped[s]
                if entry.users == 0:
                    del self._mapped[s]
                    self._mapped_bytes -= entry.shard.info.bytes
                    entry.close()

    def plan_hint(self, plan: Planned) -> None:
        """Remember the order of shards ``plan`` (a stream's) will read."""
        ids = np.asarray(plan.sample_ids(), np.int64)
        shards = np.searchsorted(self._starts, ids, "right") - 1
        if shards.size == 0:
            return
        _, first = np.unique(shards, return_index=True)
        seq = shards[np.sort(first)]
        pos = np.full(len(self.manifest.shards), -1, dtype=np.int64)
        pos[seq] = np.arange(seq.size)
        with self._lock:
            self._hints.append((seq, pos))

    def _prefetch_after(self, touched: Sequence[int]) -> None:
        with self._lock:
            hints = list(self._hints)
        budget = self.cache.limit_bytes // 2
        for seq, pos in hints:
            at = max((int(pos[s]) for s in touched), default=-1)
            if at < 0:
                continue
            ahead = 0
            for s in seq[at + 1 : at + 1 + PREFETCH_SHARDS].tolist():
                info = self.manifest.shards[s]
                ahead += info.bytes
                if ahead > budget:
                    break
                if s not in self._mapped:
                    self.cache.prefetch(info.checksum, info.bytes, self._fetcher(s))

    def verify(self, progress: bool = False) -> None:
        """Fetch (through the cache) and check every shard."""
        for s in range(len(self.manifest.shards)):
            with self._lock:
                self._checked.discard(s)
            self._map(s)
            self.release([s])

    def close(self) -> None:
        """Unmap every shard and give back its lease."""
        with self._lock:
            entries, self._mapped = list(self._mapped.values()), OrderedDict()
            self._mapped_bytes = 0
        for e in entries:
            e.close()
