"""Prometheus instruments of the remote-store shard cache, in the server's injected registry.

=====================================  ==========  =========================================
name                                   type        meaning
=====================================  ==========  =========================================
shardserve_cache_hits_total            counter     shard reads served from the local cache
shardserve_cache_misses_total          counter     shard reads that had to fetch first
shardserve_cache_fetches_total         counter     whole shards fetched (misses + prefetches)
shardserve_cache_prefetches_total      counter     shards fetched ahead of the readers
shardserve_cache_fetched_bytes_total   counter     bytes fetched from the object store
shardserve_cache_fetch_seconds         histogram   time to fetch and verify one shard
shardserve_cache_evictions_total       counter     shards evicted to stay under the limit
shardserve_cache_bytes                 gauge       bytes of shards in the cache folder
shardserve_cache_limit_bytes           gauge       the configured limit
=====================================  ==========  =========================================
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_FETCH_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class CacheMetrics:
    """The cache's instruments, registered in ``registry`` (never the global one)."""

    def __init__(self, registry: CollectorRegistry, limit_bytes: int) -> None:
        r = self._registry = registry
        self.hits = Counter(
            "shardserve_cache_hits", "Shard reads served from the cache.", registry=r
        )
        self.misses = Counter(
            "shardserve_cache_misses", "Shard reads that fetched the shard first.", registry=r
        )
        self.fetches = Counter(
            "shardserve_cache_fetches", "Whole shards fetched from the store.", registry=r
        )
        self.prefetched = Counter(
            "shardserve_cache_prefetches", "Shards fetched ahead of the readers.", registry=r
        )
        self.fetched_bytes = Counter(
            "shardserve_cache_fetched_bytes", "Bytes fetched from the object store.", registry=r
        )
        self.fetch_seconds = Histogram(
            "shardserve_cache_fetch_seconds",
            "Seconds to fetch and verify one whole shard.",
            buckets=_FETCH_BUCKETS,
            registry=r,
        )
        self.evictions = Counter(
            "shardserve_cache_evictions", "Shards evicted to stay under the limit.", registry=r
        )
        self.used_bytes = Gauge(
            "shardserve_cache_bytes", "Bytes of shards in the cache folder.", registry=r
        )
        self.limit = Gauge("shardserve_cache_limit_bytes", "The cache's size limit.", registry=r)
        self.limit.set(limit_bytes)

    def summary(self) -> dict[str, float]:
        """Current values for the status page."""
        get = self._registry.get_sample_value
        names = {
            "hits": "shardserve_cache_hits_total",
            "misses": "shardserve_cache_misses_total",
            "fetches": "shardserve_cache_fetches_total",
            "fetched_bytes": "shardserve_cache_fetched_bytes_total",
            "fetch_seconds": "shardserve_cache_fetch_seconds_sum",
            "evictions": "shardserve_cache_evictions_total",
            "used_bytes": "shardserve_cache_bytes",
            "limit_bytes": "shardserve_cache_limit_bytes",
        }
        return {k: get(v) or 0.0 for k, v in names.items()}
