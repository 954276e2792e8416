"""The per-rank scoreboard: what each (job, rank) stream is doing, for HTTP to read.

The streamer thread writes it as things happen; HTTP handlers take a snapshot under the lock
and never wait on the data plane. One record per (job, rank) survives its stream (a rank that
disconnected shows as such, with its last numbers) until the job is deleted.

Rates are over the last :data:`RATE_WINDOW_S` seconds, from the client's own reports (batches
its loop received, seconds it waited and computed; one every ~0.5 s on its Credits): batches
the server sent ahead on credit are not yet delivered, so counting them would overstate the
rate by the prefetch depth. The client's cumulative numbers are turned into counters that never
go down (a new Loader of the same rank starts its numbers from zero) for Prometheus.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from shardserve.proto.api import RankStatus, ShareStatus
from shardserve.proto.endpoints import Delivery as Transport

from ..runtime.metrics import ShareSeries


@dataclass
class RankRecord:
    """Mutable state of one rank; only touched with the board's lock held."""

    connected: bool = False
    stream: int | None = None
    #: Open streams of the rank: one, or a share group's subscribers (``spec.share``).
    streams: set[int] = field(default_factory=set)
    epoch: int | None = None
    transport: Transport | None = None
    batches_delivered: int = 0
    bytes_delivered: int = 0
    next_batch: int = 0
    num_batches: int = 0
    credit: int = 0
    opened_at: float = 0.0
    stream_batches: int = 0
    last_seen: float | None = None
    wait_s: float = 0.0
    compute_s: float = 0.0
    #: Last time anything happened on this rank (opened, heard, closed): for idle detection.
    last_active: float = 0.0
    #: Counters that only grow, from the client's reports (see the module docstring).
    wait_total: float = 0.0
    compute_total: float = 0.0
    client_batches: int | None = None
    client_batches_total: int = 0
    #: Why the current stream fell back from shared memory to the socket, if it did.
    shm_fallback: str | None = None
    #: The last claim of this rank by a second client, and its outcome (kept until deleted).
    conflict: str | None = None
    #: A mixture job's samples sent per source (index in its mixture), since the server
    #: started and in the current stream (which began at batch ``stream_start``).
    sources: list[int] = field(default_factory=list)
    stream_sources: list[int] = field(default_factory=list)
    stream_start: int = 0
    #: ``(t, sent, client batches, wait_total, compute_total)`` over the last window.
    samples: deque[tuple[float, int, int, float, float]] = field(default_factory=deque)

    def note_report(self, now: float, batches: int | None, wait_s: float, compute_s: float) -> None:
        self.wait_total += wait_s - self.wait_s if wait_s >= self.wait_s else wait_s
        self.compute_total += (
            compute_s - self.compute_s if compute_s >= self.compute_s else compute_s
        )
        self.wait_s, self.compute_s = wait_s, compute_s
        if batches is not None:
            last = self.client_batches
            self.client_batches_total += (
                batches - last if last is not None and batches >= last else batches
            )
            self.client_batches = batches
        self.sample(now)

    def sample(self, now: float) -> None:
        """Record the counters at ``now`` for the windowed rates (at most ~5 a second)."""
        point = (
            now,
            self.batches_delivered,
            self.client_batches_total,
            self.wait_total,
            self.compute_total,
        )
        if self.samples and now - self.samples[-1][0] < SAMPLE_EVERY_S and len(self.samples) > 1:
            self.samples[-1] = point
        else:
            self.samples.append(point)
        # Keep one sample at or before the window's start as the baseline.
        while len(self.samples) > 2 and self.samples[1][0] <= now - RATE_WINDOW_S:
            self.samples.popleft()

    def recent(self, now: float) -> tuple[float, float | None]:
        """``(batches per second, stall fraction)`` over the last window."""
        if len(self.samples) < 2:
            return 0.0, None
        t0, sent0, cb0, w0, c0 = self.samples[0]
        t1, sent1, cb1, w1, c1 = self.samples[-1]
        # While reports flow, measure up to the last one; once they stop, the rate decays.
        end = now if now - t1 > STALE_AFTER_S else t1
        span = end - t0
        delivered = cb1 - cb0 if self.client_batches is not None else sent1 - sent0
        rate = delivered / span if span > 0 else 0.0
        busy = (w1 - w0) + (c1 - c0)
        return rate, ((w1 - w0) / busy if busy > 0 else None)

    @property
    def stall_fraction(self) -> float | None:
        total = self.wait_s + self.compute_s
        return self.wait_s / total if total > 0 else None


#: Rates on the status page are over this many seconds.
RATE_WINDOW_S = 10.0
SAMPLE_EVERY_S = 0.2
#: No report for this long: the rank's rate counts down to now instead of its last report.
STALE_AFTER_S = 1.5


@dataclass(frozen=True)
class JobActivity:
    """What the streams of one job are doing, for its lifecycle state."""

    connected: int
    #: Ranks seen, and whether each ended its last stream at the end of its epoch.
    ranks_seen: int
    complete: bool
    last_active: float


@dataclass(frozen=True)
class RankCounters:
    """The per-rank counters ``/metrics`` exports."""

    job: str
    rank: int
    batches: int
    bytes: int
    wait_s: float
    compute_s: float
    connected: bool


class BoardWrites(Protocol):
    """What the streams tell the board: the :class:`StreamBoard` itself in the main process,
    a feed that reports to it from a streaming process (``server.processes.feed``)."""

    def set_shares(self, shares: dict[str, list[ShareStatus]], series: list[ShareSeries]) -> None:
        """Every job's share groups now, and their metric series (replaced whole)."""

    def opened(
        self,
        job: str,
        rank: int,
        stream: int,
        epoch: int,
        start: int,
        num_batches: int,
        credit: int,
        transport: Transport = "socket",
    ) -> None:
        """A stream of the rank was welcomed."""

    def sent(
        self,
        job: str,
        rank: int,
        nbytes: int,
        next_batch: int,
        credit: int,
        batches: int = 1,
        sources: np.ndarray | None = None,
    ) -> None:
        """A message of ``batches`` batches left."""

    def heard(
        self,
        job: str,
        rank: int,
        credit: int | None = None,
        wait_s: float | None = None,
        compute_s: float | None = None,
        batches: int | None = None,
    ) -> None:
        """The client said something."""

    def fell_back(self, job: str, rank: int, reason: str) -> None:
        """The rank's stream asked for shared memory and got the socket."""

    def conflict(self, job: str, rank: int, what: str) -> None:
        """A second client claimed the rank."""

    def closed(self, job: str, rank: int, stream: int) -> None:
        """Stream ``stream`` of the rank ended."""


class StreamBoard:
    """Lock-protected ``{(job, rank): RankRecord}``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ranks: dict[tuple[str, int], RankRecord] = {}
        #: By process (0: the main one), each a streamer's snapshot replaced whole.
        self._shares: dict[int, tuple[dict[str, list[ShareStatus]], list[ShareSeries]]] = {}

    def set_shares(
        self,
        shares: dict[str, list[ShareStatus]],
        series: list[ShareSeries],
        origin: int = 0,
    ) -> None:
        """Every job's share groups now in process ``origin``, and their metric series."""
        with self._lock:
            self._shares[origin] = (shares, series)

    def shares(self, job: str) -> list[ShareStatus]:
        with self._lock:
            return [g for by_job, _ in self._shares.values() for g in by_job.get(job, ())]

    def share_series(self) -> list[ShareSeries]:
        with self._lock:
            return [s for _, series in self._shares.values() for s in series]

    def opened(
        self,
        job: str,
        rank: int,
        stream: int,
        epoch: int,
        start: int,
        num_batches: int,
        credit: int,
        transport: Transport = "socket",
    ) -> None:
        now = time.monotonic()
        with self._lock:
            rec = self._ranks.setdefault((job, rank), RankRecord())
            rec.streams.add(stream)
            rec.connected, rec.stream, rec.epoch, rec.transport = True, stream, epoch, transport
            rec.next_batch, rec.num_batches, rec.credit = start, num_batches, credit
            rec.opened_at, rec.stream_batches, rec.last_seen = now, 0, now
            rec.stream_start, rec.stream_sources = start, []
            rec.last_active, rec.shm_fallback = now, None
            rec.sample(now)

    def sent(
        self,
        job: str,
        rank: int,
        nbytes: int,
        next_batch: int,
        credit: int,
        batches: int = 1,
        sources: np.ndarray | None = None,
    ) -> None:
        """A message of ``batches`` batches (small ones travel several to a message) left;
        ``sources``: a mixture's, the source of each of its samples."""
        counts = np.bincount(sources).tolist() if sources is not None and sources.size else []
        with self._lock:
            rec = self._ranks.get((job, rank))
            if rec is not None:
                rec.batches_delivered += batches
                rec.stream_batches += batches
                rec.bytes_delivered += nbytes
                rec.next_batch, rec.credit = next_batch, credit
                if counts:
                    _add(rec.sources, counts)
                    _add(rec.stream_sources, counts)

    def mixture_windows(self, job: str) -> list[SourceWindow]:
        """Per rank of mixture job ``job``: samples sent per source in all and in its current
        stream, with the steps that stream covered."""
        with self._lock:
            return [
                SourceWindow(
                    rank,
                    rec.epoch,
                    rec.stream_start,
                    rec.next_batch,
                    list(rec.sources),
                    list(rec.stream_sources),
                )
                for (j, rank), rec in sorted(self._ranks.items())
                if j == job and rec.sources
            ]

    def heard(
        self,
        job: str,
        rank: int,
        credit: int | None = None,
        wait_s: float | None = None,
        compute_s: float | None = None,
        batches: int | None = None,
    ) -> None:
        """The client said something (credit, heartbeat with telemetry)."""
        now = time.monotonic()
        with self._lock:
            rec = self._ranks.get((job, rank))
            if rec is not None:
                rec.last_seen = rec.last_active = now
                if credit is not None:
                    rec.credit = credit
                if wait_s is not None and compute_s is not None:
                    rec.note_report(now, batches, wait_s, compute_s)

    def fell_back(self, job: str, rank: int, reason: str) -> None:
        """The rank's current stream asked for shared memory and got the socket."""
        with self._lock:
            rec = self._ranks.get((job, rank))
            if rec is not None:
                rec.shm_fallback = reason

    def conflict(self, job: str, rank: int, what: str) -> None:
        """A second client claimed the rank (refused, or it fenced the silent holder)."""
        with self._lock:
            self._ranks.setdefault((job, rank), RankRecord()).conflict = what

    def closed(self, job: str, rank: int, stream: int) -> None:
        """Stream ``stream`` of that rank ended; the rank stays connected while another of its
        streams is open (a newer one, or another subscriber of its share group)."""
        with self._lock:
            rec = self._ranks.get((job, rank))
            if rec is not None and stream in rec.streams:
                rec.streams.discard(stream)
                if not rec.streams:
                    rec.connected, rec.credit = False, 0
                rec.last_active = time.monotonic()

    def drop_job(self, job: str) -> None:
        with self._lock:
            for key in [k for k in self._ranks if k[0] == job]:
                del self._ranks[key]

    def ranks(self, job: str) -> list[RankStatus]:
        """A :class:`RankStatus` for every rank of ``job`` that has opened a stream.

        Ranks never seen are left out rather than listed as zeros: a job of world size 65,536
        must not turn a status request into megabytes.
        """
        now = time.monotonic()
        with self._lock:
            recs = sorted((r, rec) for (j, r), rec in self._ranks.items() if j == job)
            return [_status(r, rec, now) for r, rec in recs]

    def open_streams(self) -> int:
        with self._lock:
            return sum(rec.connected for rec in self._ranks.values())

    def activity(self) -> dict[str, JobActivity]:
        """Per job with a stream ever: connected ranks, completion, last activity."""
        out: dict[str, list[RankRecord]] = {}
        with self._lock:
            for (job, _), rec in self._ranks.items():
                out.setdefault(job, []).append(rec)
            return {
                job: JobActivity(
                    connected=sum(r.connected for r in recs),
                    ranks_seen=len(recs),
                    complete=all(r.num_batches > 0 and r.next_batch >= r.num_batches for r in recs),
                    last_active=max(r.last_active for r in recs),
                )
                for job, recs in out.items()
            }

    def counters(self) -> list[RankCounters]:
        """Every rank's counters, for one scrape."""
        with self._lock:
            return [
                RankCounters(
                    job,
                    rank,
                    rec.batches_delivered,
                    rec.bytes_delivered,
                    rec.wait_total,
                    rec.compute_total,
                    rec.connected,
                )
                for (job, rank), rec in self._ranks.items()
            ]

    def stall_now(self) -> float | None:
        """Waiting / (waiting + computing) over the last window, over every connected rank."""
        wait = busy = 0.0
        with self._lock:
            for rec in self._ranks.values():
                if rec.connected and len(rec.samples) >= 2:
                    _, _, _, w0, c0 = rec.samples[0]
                    _, _, _, w1, c1 = rec.samples[-1]
                    wait += w1 - w0
                    busy += (w1 - w0) + (c1 - c0)
        return wait / busy if busy > 0 else None


@dataclass(frozen=True)
class SourceWindow:
    """One rank's samples of a mixture job by source: ``sent`` since the server started,
    ``stream`` over batches ``start..next_batch`` of ``epoch`` (its current stream)."""

    rank: int
    epoch: int | None
    start: int
    next_batch: int
    sent: list[int]
    stream: list[int]


def _add(into: list[int], counts: list[int]) -> None:
    into.extend([0] * (len(counts) - len(into)))
    for k, c in enumerate(counts):
        into[k] += c


def _status(rank: int, rec: RankRecord, now: float) -> RankStatus:
    rate, stall_now = rec.recent(now)
    return RankStatus(
        rank=rank,
        connected=rec.connected,
        epoch=rec.epoch,
        transport=rec.transport,
        batches_delivered=rec.batches_delivered,
        bytes_delivered=rec.bytes_delivered,
        next_batch=rec.next_batch,
        num_batches=rec.num_batches,
        credit=rec.credit,
        batches_per_s=rate if rec.connected else 0.0,
        stall_fraction=rec.stall_fraction,
        stall_now=stall_now if rec.connected else None,
        shm_fallback=rec.shm_fallback,
        conflict=rec.conflict,
        wait_s=rec.wait_s,
        compute_s=rec.compute_s,
        last_seen_s=None if rec.last_seen is None else now - rec.last_seen,
    )
