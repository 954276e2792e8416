"""Transform metrics: Prometheus series on the server's own registry, plus plain counts
for the status page and ``GET /v1/transforms``.

``shardserve_transform_seconds{transform}``   histogram  time one transform took on one batch
``shardserve_transform_samples_total``       counter    samples through a chain
``shardserve_transform_errors_total{transform}`` counter failures (raised, bad output, hung,
died), by the installed transform that failed, or ``(chain)`` when the chain failed as a
whole (its deadline, a dead worker): label values are the server's, never a client's chain
``shardserve_transform_replaced_total``      counter    samples replaced (``on_error="replace"``)
``shardserve_transform_worker_restarts_total{reason}`` counter workers replaced (hung, died)
``shardserve_transform_workers``             gauge      worker processes alive
``shardserve_transform_queue``               gauge      batches waiting for a worker
"""

from __future__ import annotations

import threading
from collections import Counter as Tally
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

#: ``transform`` label of a failure of a whole chain (not one installed transform's).
CHAIN_FAILED = "(chain)"


class TransformMetrics:
    def __init__(self, registry: CollectorRegistry | None) -> None:
        r = registry if registry is not None else CollectorRegistry()
        self.seconds = Histogram(
            "shardserve_transform_seconds",
            "time one transform took on one batch",
            ["transform"],
            registry=r,
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10),
        )
        self.samples = Counter(
            "shardserve_transform_samples", "samples through a transform chain", registry=r
        )
        self.errors = Counter(
            "shardserve_transform_errors",
            f"transform failures, by the installed transform that failed ({CHAIN_FAILED!r}: "
            "the chain as a whole, a deadline or a dead worker)",
            ["transform"],
            registry=r,
        )
        self.replaced = Counter(
            "shardserve_transform_replaced",
            "samples replaced after their transform failed",
            registry=r,
        )
        self.restarts = Counter(
            "shardserve_transform_worker_restarts",
            "transform workers replaced",
            ["reason"],
            registry=r,
        )
        self.workers = Gauge("shardserve_transform_workers", "worker processes alive", registry=r)
        self.queue = Gauge("shardserve_transform_queue", "batches waiting for a worker", registry=r)
        self._lock = threading.Lock()
        self._tally: Tally[str] = Tally()
        self._spent: Tally[str] = Tally()

    def count(self, what: str, n: int = 1) -> None:
        with self._lock:
            self._tally[what] += n

    def ran(self, spent: dict[str, float], samples: int) -> None:
        for name, s in spent.items():
            self.seconds.labels(name).observe(s)
        self.samples.inc(samples)
        with self._lock:
            self._tally["samples"] += samples
            self._tally["batches"] += 1
            self._spent.update(spent)

    def snapshot(self) -> dict[str, Any]:
        """Counts since start: samples, batches, errors, replaced, restarts, seconds per transform."""
        with self._lock:
            return {
                **dict(self._tally),
                "seconds": {k: round(v, 6) for k, v in self._spent.items()},
            }
