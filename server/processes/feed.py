"""The board of a streaming process: what its streams tell the board becomes events that the
main process applies to its own :class:`~..streaming.board.StreamBoard`, in order.

Sends to one rank are summed between reports (one event a rank, not one a message), and so
are bare credits, so a
stream at thousands of messages a second costs the link a few events a second.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np

from shardserve.proto.api import ShareStatus
from shardserve.proto.endpoints import Delivery
from shardserve.proto.processes import (
    BoardEvent,
    Closed,
    Conflict,
    FellBack,
    Heard,
    Opened,
    Report,
    Sent,
)

from ..runtime.metrics import ShareSeries


@dataclass
class _Sends:
    nbytes: int = 0
    batches: int = 0
    next_batch: int = 0
    credit: int = 0


class BoardFeed:
    """A :class:`~..streaming.board.BoardWrites` that queues events for the main process.

    >>> f = BoardFeed()
    >>> f.sent("j", 0, 10, 1, 3); f.sent("j", 0, 10, 2, 2)
    >>> [(e.nbytes, e.batches, e.next_batch) for e in f.take().events]
    [(20, 2, 2)]
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._events: list[BoardEvent] = []
        self._sends: dict[tuple[str, int], _Sends] = {}
        self._heard: dict[tuple[str, int], Heard] = {}
        self._shares: tuple[dict[str, list[ShareStatus]], list[ShareSeries]] | None = None
        self._shares_sent: tuple[dict[str, list[ShareStatus]], list[ShareSeries]] = ({}, [])

    def emit(self, event: BoardEvent) -> None:
        """Queue ``event`` after the sends so far (they are flushed first, keeping order)."""
        with self._lock:
            self._flush_sends()
            self._events.append(event)

    def pending(self) -> bool:
        """Whether anything happened since the last :meth:`take`."""
        with self._lock:
            return bool(self._events or self._sends or self._heard or self._shares is not None)

    def take(self) -> Report:
        """Everything queued since the last call, as a report without totals."""
        with self._lock:
            self._flush_sends()
            events, self._events = self._events, []
            shares, self._shares = self._shares, None
        if shares is None:
            return Report(events=events)
        series = [(s.job_id, s.rank, s.subscribers, s.lag, s.handed, s.detaches) for s in shares[1]]
        return Report(events=events, shares=shares[0], share_series=series)

    def _flush_sends(self) -> None:
        for (job, rank), s in self._sends.items():
            self._events.append(
                Sent(
                    job=job,
                    rank=rank,
                    nbytes=s.nbytes,
                    next_batch=s.next_batch,
                    credit=s.credit,
                    batches=s.batches,
                )
            )
        self._sends.clear()
        self._events.extend(self._heard.values())
        self._heard.clear()

    # -- BoardWrites ----------------------------------------------------------------------

    def set_shares(self, shares: dict[str, list[ShareStatus]], series: list[ShareSeries]) -> None:
        # The streamer sets them every tick: only a change is news.
        with self._lock:
            if (shares, series) != self._shares_sent:
                self._shares = self._shares_sent = (shares, series)

    def opened(
        self,
        job: str,
        rank: int,
        stream: int,
        epoch: int,
        start: int,
        num_batches: int,
        credit: int,
        transport: Delivery = "socket",
    ) -> None:
        self.emit(
            Opened(
                job=job,
                rank=rank,
                stream=stream,
                epoch=epoch,
                start=start,
                num_batches=num_batches,
                credit=credit,
                transport=transport,
            )
        )

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
        # A mixture's per-source counts never come here: mixture streams stay in the main
        # process, where the steering they feed lives (see ``placement``).
        with self._lock:
            s = self._sends.setdefault((job, rank), _Sends())
            s.nbytes += nbytes
            s.batches += batches
            s.next_batch, s.credit = next_batch, credit

    def heard(
        self,
        job: str,
        rank: int,
        credit: int | None = None,
        wait_s: float | None = None,
        compute_s: float | None = None,
        batches: int | None = None,
    ) -> None:
        if wait_s is None and compute_s is None:  # a bare credit: the last one a report
            with self._lock:
                self._heard[(job, rank)] = Heard(job=job, rank=rank, credit=credit)
            return
        self.emit(
            Heard(
                job=job,
                rank=rank,
                credit=credit,
                wait_s=wait_s,
                compute_s=compute_s,
                batches=batches,
            )
        )

    def fell_back(self, job: str, rank: int, reason: str) -> None:
        self.emit(FellBack(job=job, rank=rank, reason=reason))

    def conflict(self, job: str, rank: int, what: str) -> None:
        self.emit(Conflict(job=job, rank=rank, what=what))

    def closed(self, job: str, rank: int, stream: int) -> None:
        self.emit(Closed(job=job, rank=rank, stream=stream))
