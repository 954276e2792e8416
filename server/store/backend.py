"""What the server asks of a store, whether a folder (:class:`~.catalog.Store`) or an object
store (:class:`~.remote.RemoteStore`): the service and the CLI hold a :class:`StoreBackend`
and never ask which one it is.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import TYPE_CHECKING, Protocol

from shardserve.proto.manifest import Manifest

from .cache import ShardCache
from .read.read_ahead import READ_AHEAD_BYTES
from .remote.object_fs import StoreOptions, is_uri

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from .read.dataset import Dataset


class StoreBackend(Protocol):
    """A store of published datasets, read and served (thread-safe)."""

    @property
    def cache(self) -> ShardCache | None:
        """The local shard cache reads go through; ``None`` where shards are read in place."""
        ...

    def list(self) -> list[Manifest]:
        """Manifests of every published dataset, sorted by name."""
        ...

    def manifest(self, name: str) -> Manifest:
        """Dataset ``name``'s manifest, or ``DatasetNotFound`` listing the datasets."""
        ...

    def version(self, name: str) -> str:
        """The content id of dataset ``name``'s current version (what jobs pin)."""
        ...

    def open(self, name: str, verify: str | None = None, version: str | None = None) -> Dataset:
        """The shared dataset ``name`` (at ``version``, or ``DatasetChanged``)."""
        ...

    def verify_dataset(self, name: str, progress: bool = False) -> Manifest:
        """Check every shard of ``name`` against its manifest; ``DatasetCorruptError`` names
        the first bad one."""
        ...

    def check_shards(self, manifest: Manifest) -> None:
        """``DatasetCorruptError`` naming the first shard file of ``manifest``'s dataset that
        is missing or not the size the manifest says: cheap enough (no read) to run when a
        job is made, so that the job is refused then rather than failing at its first
        batch."""
        ...

    def reads_in_flight(self) -> tuple[str, ...]:
        """The store's reads under way (a shard fetch, a manifest), each named with its
        progress: what a shutdown abandons if the process exits before they end."""
        ...

    def wait_reads(self, timeout_s: float) -> tuple[str, ...]:
        """After :meth:`close` (which tells every read to stop at its next chunk): wait at
        most ``timeout_s`` until no read runs; :meth:`reads_in_flight` then."""
        ...

    def release_unpinned(self, pinned: Iterable[tuple[str, str | None]]) -> None:
        """Let go of old versions no job pins any more."""
        ...

    def mapped_versions(self) -> int:
        """Dataset versions held open: the current ones opened, and older ones jobs pin."""
        ...

    def unready(self) -> str | None:
        """Why the store cannot serve now, or ``None``. A store that may come back (an object
        store away for a while) says ``None``: the streams that need it fail, by name."""
        ...

    def served_bytes(self) -> float:
        """Bytes of the datasets this store serves, for a gauge a scrape reads (never slow:
        an object store counts what this process opened instead of listing a bucket)."""
        ...

    def close(self) -> None:
        """Close every dataset opened (and stop the cache's prefetches)."""
        ...


def open_store(
    store: str | os.PathLike[str],
    *,
    options: StoreOptions | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    cache_limit_bytes: int = 64 << 30,
    registry: CollectorRegistry | None = None,
    verify: str = "lazy",
    read_ahead_bytes: int = READ_AHEAD_BYTES,
) -> StoreBackend:
    """A local ``Store`` for a folder, a ``RemoteStore`` for a URI.

    A remote store gets a :class:`~.cache.ShardCache` in ``cache_dir`` (needed to serve it,
    not to list, inspect, verify or ingest), with its metrics in ``registry`` if given.

    >>> open_store("/data/store").list()                                 # doctest: +SKIP
    """
    # Imported here: the CLI's quick commands load only the kind of store they use.
    if not is_uri(store):
        from .catalog import Store

        return Store(store, verify=verify, read_ahead_bytes=read_ahead_bytes)
    from .remote.stores import RemoteStore

    cache = None
    if cache_dir is not None:
        from .cache_metrics import CacheMetrics

        metrics = CacheMetrics(registry, cache_limit_bytes) if registry is not None else None
        cache = ShardCache(cache_dir, cache_limit_bytes, metrics)
    return RemoteStore(str(store), options, cache=cache, verify=verify)
