"""The loop's clock: time waiting for data vs. time in the loop body.

``wait`` is measured inside ``next()``; ``compute`` is the gap between handing a batch out
and being asked for the next one. Their ratio answers "is my GPU waiting on data?".
"""

from __future__ import annotations

import time

from shardserve.proto.messages import ClientStats

from .types import LoaderStats

#: How often the client attaches its stats to a Credit message (telemetry, not control).
REPORT_EVERY_S = 0.5


class StatsClock:
    """Accumulates the numbers behind :class:`LoaderStats`."""

    def __init__(self) -> None:
        self.created = time.perf_counter()
        self.batches = 0
        self.bytes = 0
        self.wait_s = 0.0
        self.compute_s = 0.0
        self.first_batch_s: float | None = None
        self.reconnects = 0
        self.copied = 0
        self.messages = 0
        self.detached = 0
        self._handed_out: float | None = None
        self._last_report = 0.0

    def start_wait(self) -> float:
        """Called on entering ``next()``; closes the compute interval that began at the last yield."""
        now = time.perf_counter()
        if self._handed_out is not None:
            self.compute_s += now - self._handed_out
            self._handed_out = None
        return now

    def delivered(self, started: float, nbytes: int) -> None:
        """Called as ``next()`` returns a batch."""
        now = time.perf_counter()
        self.wait_s += now - started
        self.batches += 1
        self.bytes += nbytes
        if self.first_batch_s is None:
            self.first_batch_s = now - self.created
        self._handed_out = now

    def pause(self) -> None:
        """The loop stopped (epoch end or break): time until the next ``next()`` is not compute."""
        self._handed_out = None

    def wire(self) -> ClientStats:
        return ClientStats(batches=self.batches, wait_s=self.wait_s, compute_s=self.compute_s)

    def due_report(self) -> ClientStats | None:
        """Stats to piggyback on the next message, at most every ``REPORT_EVERY_S``."""
        now = time.perf_counter()
        if now - self._last_report < REPORT_EVERY_S:
            return None
        self._last_report = now
        return self.wire()

    def snapshot(self, transport: str) -> LoaderStats:
        return LoaderStats(
            batches=self.batches,
            bytes=self.bytes,
            wait_s=self.wait_s,
            compute_s=self.compute_s,
            transport=transport,
            first_batch_s=self.first_batch_s,
            reconnects=self.reconnects,
            copied=self.copied,
            messages=self.messages,
            detached=self.detached,
        )
