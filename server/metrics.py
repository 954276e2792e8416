"""Prometheus metrics of one server, registered in an injected ``CollectorRegistry``.

Never the global registry: tests (and benchmarks) build several servers in one process, and
each must count only its own work. ``GET /metrics`` renders :meth:`Metrics.render`.

=====================================  ==========  =========================================
name                                   type        meaning
=====================================  ==========  =========================================
shardserve_batches_sent_total          counter     batches sent on the data plane
shardserve_bytes_sent_total            counter     payload bytes of those batches
shardserve_assembly_seconds            histogram   time to gather one batch from the store
shardserve_streams                     gauge       open data-plane streams
shardserve_client_stall_ratio          gauge       per job and rank: client wait / (wait+compute)
shardserve_store_bytes                 gauge       bytes of every dataset in the store
shardserve_jobs                        gauge       jobs known, by state
=====================================  ==========  =========================================
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

_ASSEMBLY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class Metrics:
    """The server's instruments; one instance per server."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        r = self.registry
        self.batches_sent = Counter(
            "shardserve_batches_sent", "Batches sent on the data plane.", registry=r
        )
        self.bytes_sent = Counter(
            "shardserve_bytes_sent", "Payload bytes of the batches sent.", registry=r
        )
        self.assembly_seconds = Histogram(
            "shardserve_assembly_seconds",
            "Seconds to gather one batch from the store into its buffers.",
            buckets=_ASSEMBLY_BUCKETS,
            registry=r,
        )
        self.streams = Gauge("shardserve_streams", "Open data-plane streams.", registry=r)
        self.stall_ratio = Gauge(
            "shardserve_client_stall_ratio",
            "Fraction of its loop time a client reported waiting for data.",
            ["job", "rank"],
            registry=r,
        )
        self.store_bytes = Gauge(
            "shardserve_store_bytes", "Bytes of every dataset in the store.", registry=r
        )
        self.jobs = Gauge(
            "shardserve_jobs", "Jobs known to the server, by state.", ["state"], registry=r
        )

    def watch_store_bytes(self, fn: Callable[[], float]) -> None:
        """Compute ``shardserve_store_bytes`` with ``fn`` at every scrape."""
        self.store_bytes.set_function(fn)

    def set_stall(self, job: str, rank: int, ratio: float) -> None:
        self.stall_ratio.labels(job=job, rank=str(rank)).set(ratio)

    def forget_job(self, job: str, world_size: int) -> None:
        """Drop a deleted job's per-rank series so /metrics does not grow with dead jobs."""
        for rank in range(world_size):
            with contextlib.suppress(KeyError):
                self.stall_ratio.remove(job, str(rank))

    def render(self) -> bytes:
        """The registry in Prometheus text exposition format."""
        return generate_latest(self.registry)
