"""``RemoteDataset``: a dataset of a remote store, read shard by shard through the local cache.

It answers what a local :class:`~.dataset.Dataset` answers (``take``, ``part_shapes``,
``shard_rows``, ...), but maps only the shards batches touch. A ``take`` leases and maps the
shards of its batch (fetching on a miss), gathers with the same vectorised code as the local
dataset, and keeps recently used shards mapped while they fit the cache limit; a shard being
read (or mapped) holds a lease, so the cache never evicts the current window of a stream.

Prefetch: :meth:`plan_hint` tells the dataset the order a stream will read (its epoch plan);
after each ``take`` the shards that come next in that order are fetched in the background, up
to half the cache limit ahead, so a ``block`` shuffle over a remote store reads from a warm
cache. Every shard is checksummed before its first use (at fetch; a shard found already in the
cache is checked once per process, as a local store's lazy verify does).
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from collections.abc import Mapping, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np

from shardserve.proto.errors import DatasetCorruptError
from shardserve.proto.manifest import Manifest

from .cache import Lease, ShardCache
from .dataset import Dataset
from .gather import ALL, Positions, groups
from .index import as_indices, check_bounds, chunk_starts, locate
from .shards import MappedShard

if TYPE_CHECKING:
    from .remote import RemoteStore

#: Shards fetched ahead of the reader at most (and never more than half the cache limit).
PREFETCH_SHARDS = 8
#: Stream plans remembered for prefetching (one per open stream is enough).
HINTS = 16


class _Open:
    """A leased, mapped shard and how many ``take`` calls read it right now."""

    def __init__(self, lease: Lease, shard: MappedShard) -> None:
        self.lease = lease
        self.shard = shard
        self.users = 0

    def close(self) -> None:
        self.shard.close()
        self.lease.release()


class RemoteDataset(Dataset):
    """A remote dataset served from a local shard cache; see the module docstring."""

    def __init__(
        self, store: RemoteStore, manifest: Manifest, cache: ShardCache, verify: str = "lazy"
    ) -> None:
        # Not Dataset.__init__: that maps every shard, which is what this class avoids.
        self.store = store
        self.cache = cache
        self.manifest = manifest
        self.fields = manifest.fields
        self._specs = {f.name: f for f in self.fields}
        self.num_samples = manifest.num_samples
        self.shard_rows = np.array([s.rows for s in manifest.shards], dtype=np.int64)
        self._shard_starts = chunk_starts(self.shard_rows)
        self._verify_mode = verify
        self._checked: set[int] = set()
        self._failed: dict[int, DatasetCorruptError] = {}
        self._mapped: OrderedDict[int, _Open] = OrderedDict()
        self._mapped_bytes = 0
        self._lock = threading.Lock()
        self._shard_locks = [threading.Lock() for _ in manifest.shards]
        #: ``(shards in reading order, position of each shard in it or -1)`` per plan.
        self._hints: deque[tuple[np.ndarray, np.ndarray]] = deque(maxlen=HINTS)
        self._closed = False
        if verify == "full":
            self.verify()

    def _fetcher(self, s: int) -> partial[str]:
        return partial(self.store.fetch, self.manifest.name, self.manifest.shards[s])

    # -- shards ---------------------------------------------------------------------------
    def _acquire(self, s: int) -> MappedShard:
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
            info = self.manifest.shards[s]
            try:
                lease, shard = self._lease_checked(s)
            except DatasetCorruptError as e:
                e = DatasetCorruptError(
                    f"{e} (dataset {self.manifest.name!r} in {self.store.root})"
                )
                with self._lock:
                    self._failed[s] = e
                raise e from None
            entry = _Open(lease, shard)
            entry.users = 1
            with self._lock:
                self._mapped[s] = entry
                self._mapped_bytes += info.bytes
        return shard

    def _lease_checked(self, s: int, refetch: bool = True) -> tuple[Lease, MappedShard]:
        """Shard ``s`` leased from the cache and mapped, checked unless ``--verify off``. A
        cached copy that fails its checksum (tampered, a bad disk) is removed and fetched again,
        once: then the object store's bytes decide."""
        info = self.manifest.shards[s]
        lease = self.cache.acquire(info.checksum, info.bytes, self._fetcher(s))
        try:
            shard = MappedShard(lease.path, info, self.fields)
        except BaseException:
            lease.release()
            raise
        # A shard this process fetched was checksummed on the way in.
        if lease.fetched:
            self._checked.add(s)
        if s not in self._checked and self._verify_mode != "off":
            try:
                shard.verify()
            except BaseException as e:
                shard.close()
                lease.release()
                if not (refetch and isinstance(e, DatasetCorruptError)):
                    raise
                self.cache.discard(info.checksum)
                return self._lease_checked(s, refetch=False)
            self._checked.add(s)
        return lease, shard

    def _release(self, shards: Sequence[int]) -> None:
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

    # -- prefetch -------------------------------------------------------------------------
    def plan_hint(self, plan: Any) -> None:
        """Remember the order of shards ``plan`` (a rank's epoch plan) will read."""
        ids = getattr(plan, "_ids", None)
        if ids is None:
            ids = np.concatenate([np.asarray(b) for b in plan]) if len(plan) else np.empty(0)
        shards = np.searchsorted(self._shard_starts, np.asarray(ids, np.int64), "right") - 1
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

    # -- reading --------------------------------------------------------------------------
    def take(
        self,
        indices: np.ndarray | Sequence[int],
        fields: Sequence[str] | None = None,
        out: Mapping[str, np.ndarray] | None = None,
    ) -> dict[str, np.ndarray]:
        """Gather samples ``indices``; the same parts as :meth:`Dataset.take`."""
        if self._closed:
            raise ValueError(f"dataset {self.manifest.name!r} is closed")
        idx = as_indices(indices)
        names = self._names(fields)
        lo, hi = check_bounds(idx, self.num_samples)
        b = idx.size
        # Ids map to shards monotonically: a batch inside one shard (the common case with a
        # block shuffle) is found from its min and max alone.
        first, last = (np.searchsorted(self._shard_starts, [lo, hi], "right") - 1).tolist()
        if not b:
            touched: list[int] = []
        elif first == last:
            touched = [first]
        else:
            touched = np.unique(np.searchsorted(self._shard_starts, idx, "right") - 1).tolist()
        held: list[int] = []
        try:
            chunks = []
            starts: list[int] = []
            for s in touched:
                shard = self._acquire(s)
                held.append(s)
                base = int(self._shard_starts[s])
                for c in shard.chunks:
                    starts.append(base)
                    chunks.append(c)
                    base += c.rows
            starts.append(int(self._shard_starts[touched[-1] + 1]) if touched else 0)
            self._prefetch_after(touched)
            return self._gather(idx, names, chunks, np.asarray(starts, np.int64), b, out)
        finally:
            self._release(held)

    def _gather(
        self,
        idx: np.ndarray,
        names: list[str],
        chunks: list[Any],
        starts: np.ndarray,
        b: int,
        out: Mapping[str, np.ndarray] | None,
    ) -> dict[str, np.ndarray]:
        if len(chunks) == 1:  # one chunk holds the batch: no per-id search
            base = int(starts[0])
            rows = idx - base if base else idx
            g: list[tuple[int, Positions]] = [(0, ALL)]
        else:
            chunk, rows = locate(idx, starts) if b else (idx, idx)
            g = groups(chunk)
        kinds = {
            "fixed": lambda c: c.fixed,
            "valid": lambda c: c.valid,
            "shapes": lambda c: c.shapes,
        }
        # The local store's field loop (masks included), over this batch's leased chunks.
        return self._read(
            names, idx, g, rows, lambda kind, n: [kinds[kind](c)[n] for c in chunks],
            lambda n: [c.arrays[n] for c in chunks], out, None,
        )  # fmt: skip

    # -- integrity and life ---------------------------------------------------------------
    def verify(self, progress: bool = False) -> None:
        """Fetch (through the cache) and check every shard; ``DatasetCorruptError`` on the
        first bad one."""
        for s in range(len(self.manifest.shards)):
            with self._lock:
                self._checked.discard(s)
            self._acquire(s)
            self._release([s])

    def close(self) -> None:
        """Unmap every shard and give back its lease."""
        self._closed = True
        with self._lock:
            entries, self._mapped = list(self._mapped.values()), OrderedDict()
            self._mapped_bytes = 0
        for e in entries:
            e.close()
