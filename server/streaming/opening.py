"""Opening a stream: which sink delivers it and what its Welcome says.

The one place that chooses a :class:`~.sinks.BatchSink`: shared memory when the client asked
for it from this host and a ring could be had, else the socket (the reason is told through
:meth:`~.notices.StreamNotices.fell_back`). A new way to deliver adds its class in
:mod:`.sinks` and its branch in :meth:`Opener.sink_for`.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import zmq

from shardserve.proto.messages import MAX_CREDIT, Hello, Welcome

from ..registry.jobs import Job
from ..runtime.memory import trim
from ..runtime.rings import ShmUnavailable
from .handshake import batches_per_rank
from .notices import StreamNotices
from .pipeline import Pipeline, choose_group, ring_slots
from .sessions import Prepared, Session
from .sinks import BatchSink, IdlePools, RingBook, Route, SocketSink
from .streamer import StreamerConfig

#: Seconds after streams close (or pools expire) before the heap is trimmed.
TRIM_AFTER_S = 1.0


class Opener:
    """Which sink, and what the Welcome says. Streamer thread only."""

    def __init__(self, sock: zmq.Socket, notices: StreamNotices, config: StreamerConfig) -> None:
        self.sock = sock
        self.notices = notices
        self.config = config
        self.pools = IdlePools()
        #: Streams open at the last :meth:`tidy`, and when to trim the heap next.
        self._open = 0
        self._trim_at: float | None = None
        self.rings = RingBook(
            config.shm_dir or Path("/nonexistent"),
            config.shm_limit_bytes,
            config.shm_unproven_rings,
            ring_bytes=config.shm_ring_bytes,
        )

    def session(self, ident: bytes, stream: int, job: Job, hello: Hello) -> Session:
        """The session a Hello that passed every check opens (not yet prepared)."""
        return Session(
            ident=ident,
            stream=stream,
            job=job,
            rank=hello.rank,
            epoch=hello.epoch,
            seed=job.seed,
            nonce=hello.nonce,
            flow=Pipeline(hello.start_batch, batches_per_rank(job, hello.offset), hello.credit),
            offset=hello.offset,
            want_shm=self.wants_shm(hello),
            keep=hello.keep,
            keep_ring=hello.keep_ring,
            max_group=hello.group,
            client=(hello.boot_id, hello.pid),
        )

    def wants_shm(self, hello: Hello) -> bool:
        """Same kernel boot id: the client shares our host, so it can map our /dev/shm rings."""
        c = self.config
        return (
            hello.transport == "auto"
            and c.shm_dir is not None
            and bool(hello.boot_id)
            and hello.boot_id == c.boot_id
        )

    def sink_for(
        self, s: Session, prep: Prepared, sessions: Iterable[Session], joins: int | None = None
    ) -> BatchSink:
        """The stream's sink: its slot ring if it wants one and can have one, else the socket.
        Also settles how many batches go in one message (``s.group``): ``joins``, the batches
        per message of the share group the stream joins, when its credit allows them (members
        share spans only of one length)."""
        batch_size = s.job.spec.batch_size
        credit = min(s.flow.credit, MAX_CREDIT)
        most = s.max_group if prep.groupable else 1
        ragged = any(shape is None for shape in prep.part_shapes.values())
        group = choose_group(prep.batch_bytes, credit, most, ragged)
        if joins is not None and joins <= min(most, max(credit // 2, 1)):
            group = joins
        s.sends_in(group)
        route = Route(self.sock, s.ident, s.stream, s.epoch, batch_size)
        rows = prep.batch_rows * s.group  # what one message's memory holds
        if s.want_shm:
            slots = ring_slots(credit, s.group)
            try:
                return self.rings.open(
                    route, slots, prep.source, prep.fields, rows, s.keep, s.keep_ring
                )
            except ShmUnavailable as e:
                self.notices.fell_back(s, str(e))
        if s.job.spec.share is not None:
            return SocketSink(route, None)  # sends the share group's buffers (see .shares)
        live = {(x.job_id, x.rank) for x in sessions}
        pool = self.pools.get((s.job_id, s.rank), prep.part_shapes, rows, live)
        return SocketSink(route, pool)

    def welcome(self, s: Session) -> Welcome:
        return Welcome(
            stream=s.stream,
            nonce=s.nonce,
            job=s.job_id,
            rank=s.rank,
            epoch=s.epoch,
            seed=s.seed,
            start_batch=s.flow.start_batch,
            num_batches=s.flow.num_batches,
            heartbeat_s=self.config.heartbeat_s,
            transport=s.transport,
            shm=s.sink.ring if s.sink is not None else None,
            group=s.group,
        )

    def forget_job(self, job_id: str) -> None:
        self.pools.forget_job(job_id)

    def tidy(self, now: float, sessions: Iterable[Session]) -> None:
        """Drop pools and rings nobody came back for, and give freed memory back to the OS a
        second after streams closed (by then libzmq has let go of their frames)."""
        open_now = list(sessions)
        live = {(x.job_id, x.rank) for x in open_now}
        changed = self.pools.expire(now, live) + self.rings.expire(now)
        if changed or len(open_now) < self._open:
            self._trim_at = now + TRIM_AFTER_S
        self._open = len(open_now)
        if self._trim_at is not None and now >= self._trim_at:
            self._trim_at = None
            trim()
