"""The per-rank scoreboard: what each (job, rank) stream is doing, for HTTP to read.

The streamer thread writes it as things happen; HTTP handlers take a snapshot under the lock
and never wait on the data plane. One record per (job, rank) survives its stream (a rank that
disconnected shows as such, with its last numbers) until the job is deleted.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from shardserve.proto.jobs import RankStatus, Transport


@dataclass
class RankRecord:
    """Mutable state of one rank; only touched with the board's lock held."""

    connected: bool = False
    stream: int | None = None
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

    @property
    def stall_fraction(self) -> float | None:
        total = self.wait_s + self.compute_s
        return self.wait_s / total if total > 0 else None


class StreamBoard:
    """Lock-protected ``{(job, rank): RankRecord}``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ranks: dict[tuple[str, int], RankRecord] = {}

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
            rec.connected, rec.stream, rec.epoch, rec.transport = True, stream, epoch, transport
            rec.next_batch, rec.num_batches, rec.credit = start, num_batches, credit
            rec.opened_at, rec.stream_batches, rec.last_seen = now, 0, now

    def sent(self, job: str, rank: int, nbytes: int, next_batch: int, credit: int) -> None:
        with self._lock:
            rec = self._ranks.get((job, rank))
            if rec is not None:
                rec.batches_delivered += 1
                rec.stream_batches += 1
                rec.bytes_delivered += nbytes
                rec.next_batch, rec.credit = next_batch, credit

    def heard(
        self,
        job: str,
        rank: int,
        credit: int | None = None,
        wait_s: float | None = None,
        compute_s: float | None = None,
    ) -> None:
        """The client said something (credit, heartbeat with telemetry)."""
        with self._lock:
            rec = self._ranks.get((job, rank))
            if rec is not None:
                rec.last_seen = time.monotonic()
                if credit is not None:
                    rec.credit = credit
                if wait_s is not None and compute_s is not None:
                    rec.wait_s, rec.compute_s = wait_s, compute_s

    def closed(self, job: str, rank: int, stream: int) -> None:
        """Stream ``stream`` of that rank ended; a newer stream of the rank stays connected."""
        with self._lock:
            rec = self._ranks.get((job, rank))
            if rec is not None and rec.stream == stream:
                rec.connected, rec.credit = False, 0

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


def _status(rank: int, rec: RankRecord, now: float) -> RankStatus:
    elapsed = now - rec.opened_at
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
        batches_per_s=rec.stream_batches / elapsed if rec.connected and elapsed > 0 else 0.0,
        stall_fraction=rec.stall_fraction,
        wait_s=rec.wait_s,
        compute_s=rec.compute_s,
        last_seen_s=None if rec.last_seen is None else now - rec.last_seen,
    )
