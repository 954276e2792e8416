"""What the rest of the server learns about streams: log lines, the board, the metrics.

One method per event of a stream's life (opened, fell back to the socket, refused, failed,
closed), so the handler says *what* happened and this module says it to everyone who listens.
"""

from __future__ import annotations

import logging
import time

from shardserve.proto.messages import ClientStats, Error, Hello, Reject

from ..runtime.logs import log_event
from ..runtime.metrics import Metrics
from .board import BoardWrites
from .sessions import LogExtras, Session

log = logging.getLogger("shardserve.streaming")


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


class StreamNotices:
    """Tells the log, the status board and the metrics about streams. Streamer thread only."""

    def __init__(self, board: BoardWrites, metrics: Metrics) -> None:
        self.board = board
        self.metrics = metrics
        #: Jobs whose shm fallback was logged at WARNING already.
        self._fell_back: set[str] = set()

    def opened(self, s: Session, open_streams: int) -> None:
        """A stream was welcomed."""
        flow = s.flow
        self.board.opened(
            s.job_id,
            s.rank,
            s.stream,
            s.epoch,
            flow.start_batch,
            flow.num_batches,
            flow.owed,
            s.transport,
        )
        if s.shm_fallback is not None:
            self.board.fell_back(s.job_id, s.rank, s.shm_fallback)
        self.metrics.streams.set(open_streams)
        asked: LogExtras = {"asked": "shm"} if s.shm_fallback is not None else {}
        log_event(
            log,
            "stream.opened",
            **s.describe(),
            start=flow.start_batch,
            num_batches=flow.num_batches,
            credit=flow.credit,
            seed=s.seed,
            # The transport this stream really uses (a fallback's reason is logged with it).
            transport=s.transport,
            **asked,
        )

    def heard(self, s: Session, stats: ClientStats | None) -> None:
        """A message from the stream's client (with its loop's telemetry, if it sent any)."""
        s.heard_from()
        board, owed = self.board, s.flow.owed
        if stats is not None:
            board.heard(s.job_id, s.rank, owed, stats.wait_s, stats.compute_s, stats.batches)
        else:
            board.heard(s.job_id, s.rank, owed)

    def fell_back(self, s: Session, reason: str) -> None:
        """A stream asked for shared memory and will use the socket."""
        self.metrics.shm_fallbacks.inc()
        s.fell_back(reason)
        # Once per job at WARNING: every rank and epoch of a job falls back for the same
        # reason, and a warning per stream buries everything else in the log.
        first = s.job_id not in self._fell_back
        self._fell_back.add(s.job_id)
        repeat: LogExtras = {} if first else {"repeat": True}
        log_event(
            log,
            "shm.fallback",
            level=logging.WARNING if first else logging.DEBUG,
            **s.describe(),
            reason=f"{reason}; serving this stream over the socket instead",
            **repeat,
        )

    def refused(self, hello: Hello, refusal: Reject | Error) -> None:
        log_event(
            log,
            "stream.refused",
            level=logging.WARNING,
            job=hello.job,
            rank=hello.rank,
            code=refusal.code.value,
            reason=refusal.message,
        )

    def rank_conflict(self, holder: Session, claimant: bytes, refusal: Error) -> None:
        """A second client claimed a live rank and was refused (not an ordinary open)."""
        self._conflict(holder, claimant, "refused", "refused a second client", refusal)

    def fenced(self, holder: Session, claimant: bytes, notice: Error) -> None:
        """A claimant took a rank whose holder had gone silent."""
        self._conflict(holder, claimant, "fenced", "a new client took the rank", notice)

    def _conflict(
        self, holder: Session, claimant: bytes, outcome: str, what: str, msg: Error
    ) -> None:
        self.board.conflict(holder.job_id, holder.rank, f"{_now()}: {what}: {msg.message}")
        log_event(
            log,
            "stream.rank_conflict",
            level=logging.WARNING,
            **holder.describe(),
            claimant=claimant.hex(),
            outcome=outcome,
            reason=msg.message,
        )

    def hello_limited(self, ident: bytes, refusal: Error) -> None:
        log_event(
            log,
            "peer.hello_limited",
            level=logging.WARNING,
            peer=ident.hex(),
            reason=refusal.message,
        )

    def failed(self, s: Session, reply: Error, exc: BaseException, bug: bool) -> None:
        log_event(
            log,
            "stream.failed",
            level=logging.ERROR,
            exc_info=bug,
            **s.describe(),
            code=reply.code.value,
            reason=str(exc),
        )

    def closed(
        self, s: Session, reason: str, level: int, open_streams: int, overflowed: int
    ) -> None:
        self.board.closed(s.job_id, s.rank, s.stream)
        self.metrics.streams.set(open_streams)
        # An shm stream whose batches outgrew their slot sent those over the socket.
        extra: LogExtras = {"socket_batches": overflowed} if overflowed else {}
        log_event(
            log,
            "stream.closed",
            level=level,
            **s.describe(),
            reason=reason,
            next_batch=s.flow.next_send,
            num_batches=s.flow.num_batches,
            transport=s.transport,
            **extra,
        )

    def forget_job(self, job_id: str) -> None:
        self._fell_back.discard(job_id)
