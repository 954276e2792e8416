"""Moving one stream: assemble within credit (inline or on the pool), send in index order.

The decisions are the :class:`~.pipeline.Pipeline`'s; the memory and the sending are the
session's :class:`~.sinks.BatchSink`'s; this module only joins them to the assembler, the
metrics and the board. Streamer thread only.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import zmq

from ..reading.assembly import Assembler
from ..runtime.metrics import Metrics
from ..source import BatchParts
from .board import BoardWrites
from .pipeline import INLINE_MAX_BYTES, Work, WorkKind
from .sessions import Assembled, Prepared, Session
from .shares import ShareGroup, Take, Waiter
from .sinks import BatchSink

#: ``detached(session, first batch of its own pass)``: tell a subscriber it left its group.
Detached = Callable[[Session, int], None]


class PeerGone(Exception):
    """The peer's connection is gone (``EHOSTUNREACH``): its stream must close."""


class AssemblyFailed(Exception):
    """An inline assembly raised (its cause); the stream fails, others go on."""


class Pump:
    """Submits and sends batches of sessions; see the module docstring."""

    def __init__(
        self, assembler: Assembler[Work], metrics: Metrics, board: BoardWrites, detached: Detached
    ) -> None:
        self.assembler = assembler
        self.metrics = metrics
        self.board = board
        self.detached = detached

    def run(self, s: Session, others_busy: bool) -> bool:
        """Submit work within credit, send what is ready in order. ``False`` when the peer's
        queue is full (retried on the next tick); raises :class:`PeerGone` or
        :class:`AssemblyFailed`."""
        prep, sink, flow = s.prepared, s.sink, s.flow
        if prep is None or sink is None:
            return False  # not welcomed yet: nothing may be sent
        # A source that may wait (a fetch, a transform) is never assembled on the streamer.
        inline = prep.source.inline_ok and flow.inline(prep.batch_bytes * s.group, others_busy)
        while flow.wants_work():
            if not self._plan_ready(prep, flow.next_submit, s.group):
                break  # re-planned on the planning lane, which wakes the streamer when done
            ticket = sink.acquire()
            if ticket is None:
                break  # every slot is being filled or is with the client; a Credit frees one
            index, count = flow.take(s.group)
            self._assemble(s, prep, sink, index, count, ticket, inline)
            if inline and not self._send_ready(s, prep, sink):
                return False
        return self._send_ready(s, prep, sink)

    @staticmethod
    def _plan_ready(prep: Prepared, index: int, most: int) -> bool:
        """Whether the stream's plan serves its next span now (a mixture re-planned after a
        steering change is not until its order lands); a wait too long fails the stream."""
        try:
            return prep.plan.ready(index, most)
        except TimeoutError as e:
            raise AssemblyFailed(str(e)) from e

    def _assemble(
        self,
        s: Session,
        prep: Prepared,
        sink: BatchSink,
        index: int,
        count: int,
        ticket: int,
        inline: bool,
    ) -> None:
        if s.share is not None and self._shared(
            s, s.share, prep, sink, index, count, ticket, inline
        ):
            return
        self.metrics.batches_assembled.inc(count)
        indices = prep.indices(index, count)
        out = sink.out(ticket, len(indices))
        place = sink.placer(ticket)
        if not inline:
            s.flow.offloaded()
            work = Work(WorkKind.BATCH, s.ident, s.stream, index, ticket, sink)
            self.assembler.gather(work, prep.source, indices, prep.fields, out, place, index)
            return
        t0 = time.perf_counter()
        try:
            parts = self.assembler.assemble_now(
                prep.source, indices, prep.fields, out, place, index
            )
        except Exception as e:
            sink.release(ticket)
            raise AssemblyFailed(str(e)) from e
        s.flow.timed_inline(index, time.perf_counter() - t0)
        s.flow.assembled(index, Assembled(parts, ticket))

    def _shared(
        self,
        s: Session,
        g: ShareGroup,
        prep: Prepared,
        sink: BatchSink,
        index: int,
        count: int,
        ticket: int,
        inline: bool,
    ) -> bool:
        """A shared stream's span from its group (see :mod:`.shares`); ``False``: the stream
        assembles it on its own (below the window)."""
        take, entry, newly_detached = g.take(s.ident, index, count)
        if take is Take.OWN:
            if newly_detached:
                self.detached(s, index)
            return False
        assert entry is not None  # READY, WAIT and PRODUCE name their entry
        if take is Take.READY:
            assert entry.parts is not None
            self.fill(s, sink, index, ticket, entry.parts)
            self.handed(g, count)
            return True
        entry.waiters.append(Waiter(s.ident, s.stream, ticket, sink))
        s.flow.offloaded()
        if take is Take.WAIT:
            return True
        self.metrics.batches_assembled.inc(count)
        indices = prep.indices(index, count)
        if not inline:
            # Assembled for the group, into memory of its own that no member writes again.
            work = Work(WorkKind.SHARED, s.ident, s.stream, index, share=g)
            self.assembler.gather(work, prep.source, indices, prep.fields, None, None, index)
            return True
        try:
            parts = self.assembler.assemble_now(
                prep.source, indices, prep.fields, None, None, index
            )
        except Exception as e:
            g.failed(index)
            s.flow.returned()
            sink.release(ticket)
            raise AssemblyFailed(str(e)) from e
        g.produced(index, parts)  # its only waiter is this stream: nobody ran meanwhile
        s.flow.returned()
        self.fill(s, sink, index, ticket, parts)
        return True

    def handed(self, g: ShareGroup, count: int) -> None:
        """A member was handed ``count`` batches of ``g``'s pass, not assembled for it."""
        g.hand(count)
        self.metrics.share_handed.inc(count)

    def fill(self, s: Session, sink: BatchSink, index: int, ticket: int, parts: BatchParts) -> None:
        """Make a share group's span ``s``'s: filled into its ticket's memory, then ready to
        send. A copy of a big one runs on the pool, as a gather would: the streamer thread
        serves every stream."""
        if sink.copies_on_fill and sum(a.nbytes for a in parts.values()) > INLINE_MAX_BYTES:
            s.flow.offloaded()
            work = Work(WorkKind.BATCH, s.ident, s.stream, index, ticket, sink)
            self.assembler.submit(work, sink.fill, ticket, parts)
            return
        s.flow.assembled(index, Assembled(sink.fill(ticket, parts), ticket))

    def _send_ready(self, s: Session, prep: Prepared, sink: BatchSink) -> bool:
        """Send assembled batches in index order; ``False`` once the peer's queue is full."""
        flow = s.flow
        while (batch := flow.next_ready()) is not None:
            count = flow.span(flow.next_send)
            try:
                nbytes = sink.send(batch.ticket, flow.next_send, batch.parts, count)
            except zmq.Again:
                return False  # kept in order; the next tick sends it again
            except zmq.ZMQError as e:
                if e.errno == zmq.EHOSTUNREACH:
                    raise PeerGone(str(e)) from e
                raise
            flow.released()
            s.sent()
            self.metrics.batches_sent.inc(count)
            self.metrics.messages_sent.inc()
            self.metrics.bytes_sent.inc(nbytes)
            self.board.sent(
                s.job_id,
                s.rank,
                nbytes,
                flow.next_send,
                flow.owed,
                count,
                # Counted by source where the job's kind names the part (another job's field
                # may bear the same name).
                batch.parts.get(prep.source_part) if prep.source_part is not None else None,
            )
        return True
