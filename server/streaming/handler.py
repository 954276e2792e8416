"""The server's half of the stream protocol, run on the streamer thread: dispatch and the
life of each session.

:class:`StreamHandler` reacts to three things — a message from a peer, finished assembly work,
a timer tick — opens, welcomes and closes :class:`~.sessions.Session` s, and lets the
:class:`~.pump.Pump` move them (assemble within credit, send in order). The
:class:`~.streamer.Streamer` owns the thread and the socket and calls in here.
"""

from __future__ import annotations

import contextlib
import logging

import zmq

from shardserve.proto.errors import (
    DatasetChanged,
    DatasetCorruptError,
    ErrorCode,
    ProtocolError,
    ShardserveError,
    TransformError,
    VersionMismatch,
)
from shardserve.proto.framing import decode, peek_kind
from shardserve.proto.messages import (
    BatchHeader,
    Bye,
    ControlMessage,
    Credit,
    EndOfEpoch,
    Error,
    Heartbeat,
    Hello,
)
from shardserve.proto.version import foreign_hello, peek_version

from ..reading.assembly import Assembler, Done
from ..registry.jobs import Job
from ..runtime.logs import log_event
from . import replies
from .admission import Admission, HelloRate, Limits
from .handshake import version_reject
from .notices import StreamNotices
from .opening import Opener
from .pipeline import CreditOverflow, Work, WorkKind
from .pump import AssemblyFailed, PeerGone, Pump
from .sessions import Assembled, HandlerDeps, Prepared, Session, prepare
from .shares import ShareBook
from .streamer import StreamerConfig, liveness_s, shutdown_error
from .unread import UnreadBudget

log = logging.getLogger("shardserve.streaming")


class StreamHandler:
    """Sessions by routing id, and what to do with each event. Streamer thread only.

    The host of its :class:`~.admission.Admission` (see :class:`~.admission.AdmissionHost`):
    admission decides each Hello, the handler opens, probes and closes the streams.
    """

    def __init__(
        self,
        sock: zmq.Socket,
        assembler: Assembler[Work],
        deps: HandlerDeps,
        config: StreamerConfig,
    ) -> None:
        self.sock = sock
        self.assembler = assembler
        self.deps = deps
        self.config = config
        self.sessions: dict[bytes, Session] = {}
        self.out = replies.Outbox(sock, self._peer_gone)
        self.pump = Pump(assembler, deps.metrics, deps.board, self._detached)
        self.shares = ShareBook(
            config.share_window, config.share_window_bytes, total_bytes=config.share_bytes
        )
        self.notices = StreamNotices(deps.board, deps.metrics)
        self.opener = Opener(sock, self.notices, config)
        limits = Limits(
            config.max_streams,
            config.max_streams_per_job,
            liveness_s(config.heartbeat_s, config.stream_timeout_s),
            config.share_subscribers,
        )
        rate = HelloRate(config.max_hellos_per_s)
        self.admission = Admission(
            self, deps.registry, deps.gate, config.token, self.notices, limits, rate
        )
        self.unread = UnreadBudget(config.unread_stream_bytes, config.unread_bytes)
        self._next_stream = deps.stream_ids[0]

    # -- events -------------------------------------------------------------------------

    def on_message(self, ident: bytes, frames: list[bytes]) -> None:
        """One message from peer ``ident``; bad input is answered, never raised."""
        try:
            match self._decode(frames):
                case Hello() as hello:
                    self.admission.hello(ident, hello)
                case Credit() as credit:
                    self._on_credit(ident, credit)
                case Heartbeat() as hb:
                    self._on_heartbeat(ident, hb)
                case Bye():
                    self.admission.forget(ident)
                    if (s := self.sessions.get(ident)) is not None:
                        self.close(s, "bye")
                case BatchHeader():
                    self.out.send(ident, replies.not_accepted("BATCH"))
                case other:
                    self.out.send(ident, replies.not_accepted(other.kind.name))
        except VersionMismatch as e:
            v = peek_version(frames)
            self.out.send(ident, version_reject([v] if v is not None else []))
            log_event(log, "peer.version_mismatch", level=logging.WARNING, reason=str(e))
        except ProtocolError as e:
            self.out.send(ident, Error(code=e.code, message=str(e), fatal=False))
            log_event(
                log, "peer.bad_message", level=logging.WARNING, code=e.code.value, reason=str(e)
            )
        except Exception as e:
            log_event(log, "peer.message_failed", level=logging.ERROR, exc_info=True)
            if (s := self.sessions.get(ident)) is not None:
                self._contain(s, e)  # its state may be half-changed: end it, keep the others
                return
            self.out.try_send(ident, replies.handling_failed())

    def _decode(self, frames: list[bytes]) -> ControlMessage | BatchHeader:
        if frames and (v := foreign_hello(frames, peek_kind(frames[0]))) is not None:
            # A Hello of another protocol version may have another body: explain, do not parse.
            raise VersionMismatch(f"Hello of protocol {v}")
        return decode(frames)

    def on_results(self) -> None:
        """Apply finished assembly work (prepared streams, assembled batches)."""
        for done in self.assembler.results():
            work: Work = done.tag
            if work.kind is WorkKind.SHARED:
                self._shared_done(work, done)
                continue
            s = self.sessions.get(work.ident)
            live = s is not None and s.stream == work.stream
            if work.kind is WorkKind.BATCH:
                if s is not None and live:
                    s.flow.returned()
                if done.error is not None:
                    work.forfeit()  # never to be sent, and maybe still written
                elif not live:
                    work.abandon()  # never to be sent, and the worker is done with its memory
            if s is None or not live:
                continue  # the stream was replaced or closed while this ran
            try:
                self._apply(s, work, done)
            except Exception as e:
                self._contain(s, e)

    def _apply(self, s: Session, work: Work, done: Done[Work]) -> None:
        if done.error is not None:
            self._stream_failed(s, done.error)
        elif work.kind is WorkKind.PREPARE:
            prepared: Prepared = done.value
            s.ready(prepared)
            share = s.job.spec.share
            plan = (s.job_id, s.rank, s.epoch, s.seed, s.offset)
            joins = self.shares.spans_of(plan) if share is not None else None
            s.sink_made(self.opener.sink_for(s, prepared, self.sessions.values(), joins))
            if share is not None:
                key = (*plan, s.group)
                s.joined(
                    self.shares.join(
                        key, share, s.ident, s.stream, s.flow.start_batch, prepared.batch_bytes
                    )
                )
            else:  # a share group's batches are bounded by its window (see .shares)
                self._allot(s, prepared.batch_bytes)
            self._welcome(s)
            self._pump(s)
        else:
            s.flow.assembled(work.index, Assembled(done.value, work.ticket))
            self._pump(s)

    def _shared_done(self, work: Work, done: Done[Work]) -> None:
        """A share group's span is assembled (or failed): hand it to every member waiting."""
        g = work.share
        if g is None or self.shares.get(g.key) is not g:
            return  # the group was dropped while it ran (its members left, its job ended)
        waiters = (
            g.failed(work.index) if done.error is not None else g.produced(work.index, done.value)
        )
        for w in waiters:
            s = self.sessions.get(w.ident)
            if s is None or s.stream != w.stream:
                w.sink.release(w.ticket)  # its stream closed while it waited
                continue
            s.flow.returned()
            try:
                if done.error is not None:
                    w.sink.release(w.ticket)
                    self._stream_failed(s, done.error)
                    continue
                count = s.flow.span(work.index)
                self.pump.fill(s, w.sink, work.index, w.ticket, done.value)
                if (w.ident, w.stream) != (work.ident, work.stream):
                    self.pump.handed(g, count)
                self._pump(s)
            except Exception as e:
                self._contain(s, e)

    def _detached(self, s: Session, index: int) -> None:
        """Tell a subscriber it fell behind its group's window (not fatal: same bytes)."""
        g = s.share
        if g is None:
            return
        notice = Error(
            code=ErrorCode.SHARE_DETACHED,
            fatal=False,
            stream=s.stream,
            message=f"this Loader fell more than {g.window} batches behind the fastest of share "
            f"group {g.share!r} (rank {s.rank}, epoch {s.epoch}): from batch {index} it is "
            "served on its own pass of the same plan (the same batches, no longer shared); "
            "it rejoins if it catches up (--share-window sets how far behind it may be)",
        )
        self.out.try_send(s.ident, notice)
        log_event(log, "share.detached", **s.describe(), share=g.share, at=index, front=g.front)

    def on_tick(self, now: float) -> None:
        """Heartbeats, liveness probes, idle cleanup, retries of sends that hit the HWM, held
        claims of a rank."""
        try:
            self.admission.tick(now)
        except Exception:  # a bug here must not stop the streams' timers below
            log_event(log, "stream.admission_failed", level=logging.ERROR, exc_info=True)
        self.shares.expire(now)
        self.deps.board.set_shares(self.shares.statuses(), self.shares.series())
        self.deps.metrics.share_bytes.set(self.shares.budget.used)
        try:
            self.opener.tidy(now, self.sessions.values())
        except Exception:  # memory housekeeping must not stop the streams' timers below
            log_event(log, "stream.tidy_failed", level=logging.ERROR, exc_info=True)
        for s in list(self.sessions.values()):
            if self.sessions.get(s.ident) is not s:
                continue  # closed by an earlier one's tick
            try:
                self._tick(s, now)
            except Exception as e:
                self._contain(s, e)

    def _tick(self, s: Session, now: float) -> None:
        c = self.config
        if s.ended:
            if now - s.last_recv > c.stream_timeout_s:
                self.close(s, "idle after end of epoch")
            return
        if now - s.last_send >= c.heartbeat_s:
            if self.out.send(s.ident, Heartbeat()) is False:
                return  # peer gone (_send closed the session) or its queue is full
            s.sent(now)
        if s.flow.ready:
            self._pump(s)

    def shutdown(self) -> None:
        """Tell every open stream the server is going (transient), then forget them."""
        for s in list(self.sessions.values()):
            try:
                self.out.send(s.ident, shutdown_error(s.stream))
            except zmq.ZMQError as e:  # the socket is going away; the session must still close
                log_event(log, "stream.shutdown_send_failed", **s.describe(), reason=str(e))
            if self.sessions.get(s.ident) is s:
                try:
                    self.close(s, "server shutdown")
                except Exception:  # one session's trouble must not keep the others' rings
                    log_event(log, "stream.close_failed", level=logging.ERROR, exc_info=True)
                    self.sessions.pop(s.ident, None)
        self.opener.rings.close()
        self.assembler.close()

    def job_gone(self, job_id: str, code: ErrorCode, message: str) -> None:
        """End every stream of a job with a fatal error (job deleted or failed)."""
        self.opener.forget_job(job_id)
        self.notices.forget_job(job_id)
        self.shares.forget_job(job_id)
        for s in [s for s in self.sessions.values() if s.job_id == job_id]:
            if self.sessions.get(s.ident) is not s:
                continue
            self.out.try_send(
                s.ident, Error(code=code, message=message, fatal=True, stream=s.stream)
            )
            if self.sessions.get(s.ident) is s:
                self.close(s, message, level=logging.WARNING)

    # -- admission's host (see .admission.AdmissionHost) -----------------------------------

    def send(self, ident: bytes, msg: ControlMessage) -> bool:
        """Answer peer ``ident``; ``False`` when it is gone (its stream is closed) or its
        queue is full."""
        return self.out.send(ident, msg)

    def probe(self, s: Session, now: float) -> None:
        """A Heartbeat to ``s``'s peer: the send fails (and closes ``s``) once libzmq has
        dropped the connection of a dead, frozen or partitioned process."""
        if self.out.send(s.ident, Heartbeat()):
            s.sent(now)

    def drop_ring(self, ident: bytes) -> None:
        """No stream opens for ``ident`` now: the ring its last stream left goes."""
        self.opener.rings.discard(ident)

    def open(self, ident: bytes, job: Job, hello: Hello) -> None:
        """Open the stream an admitted Hello asks for; its Welcome waits for its plan."""
        s = self.opener.session(ident, self._new_stream_id(), job, hello)
        if not s.want_shm:
            self.opener.rings.discard(ident)
        self.sessions[ident] = s
        self.deps.registry.note_stream(job.id, s.epoch, hello.origin)
        # Welcome waits for the prepared plan (and the slot ring, sized from the dataset).
        # Planning has its own lane, so a flood of Hellos cannot starve other jobs' batches;
        # a Hello replaced (or a peer gone) before its turn costs nothing (see prepare).
        work = Work(WorkKind.PREPARE, ident, s.stream)
        d = self.deps
        self.assembler.plan(work, prepare, s, d.open_source, d.kind_of, self.config.max_batch_bytes)

    def _welcome(self, s: Session) -> None:
        self.out.send(s.ident, self.opener.welcome(s))
        self.notices.opened(s, len(self.sessions))

    # -- messages of an open stream -----------------------------------------------------

    def _on_credit(self, ident: bytes, credit: Credit) -> None:
        s = self._session_or_unknown(ident)
        if s is None:
            return
        if s.credit_seen() and s.sink is not None:
            s.sink.mapped()  # the client reads what the sink hands out (see RingBook)
        if s.sink is not None and credit.slots and (bad := s.sink.returned(credit.slots)):
            log_event(log, "shm.bad_return", level=logging.WARNING, **s.describe(), slots=bad)
        if s.flow.until is not None and s.flow.next_send > s.flow.start_batch:
            self._has_read(s)  # a Credit after a batch: the client reads
        try:
            s.flow.grant(credit.grant)
        except CreditOverflow as e:
            self.out.send(ident, replies.credit_refused(str(e), s.stream))
            self.close(s, "credit over the limit", level=logging.WARNING)
            return
        self.notices.heard(s, credit.stats)
        self._pump(s)

    def _on_heartbeat(self, ident: bytes, hb: Heartbeat) -> None:
        if self.admission.holds(ident):  # held: "slow, not dead", not "unknown stream"
            self.out.send(ident, Heartbeat())
            return
        s = self._session_or_unknown(ident)
        if s is not None:
            self.notices.heard(s, hb.stats)
            if self.out.send(ident, Heartbeat()):
                s.sent()

    def _session_or_unknown(self, ident: bytes) -> Session | None:
        s = self.sessions.get(ident)
        if s is None:
            self.out.send(ident, replies.unknown_stream())
        return s

    # -- moving and ending a stream -----------------------------------------------------

    def replanned(self) -> None:
        """An order planned on the planning lane landed: pump the streams that were skipped
        while it was made (a stream with nothing to do returns at once)."""
        for s in list(self.sessions.values()):
            if not s.ended:  # ``pump.run`` returns at once for a stream not yet welcomed
                try:
                    self._pump(s)
                except Exception as e:
                    self._contain(s, e)

    def _pump(self, s: Session) -> None:
        """Submit work within credit, send what is ready in order, end the epoch."""
        if self.sessions.get(s.ident) is not s:
            return  # closed meanwhile (e.g. its peer vanished while being welcomed)
        others_busy = any(x is not s and not x.ended for x in self.sessions.values())
        try:
            unblocked = self.pump.run(s, others_busy)
        except PeerGone:
            self.close(s, "peer gone", level=logging.WARNING)
            return
        except AssemblyFailed as e:
            self._stream_failed(s, e.__cause__ or e)
            return
        eoe = EndOfEpoch(stream=s.stream, epoch=s.epoch, num_batches=s.flow.num_batches)
        if unblocked and s.flow.done_sending and not s.ended and self.out.send(s.ident, eoe):
            s.end_sent()
            log_event(log, "stream.end_of_epoch", **s.describe(), num_batches=eoe.num_batches)

    def _stream_failed(self, s: Session, exc: BaseException) -> None:
        if isinstance(exc, (DatasetCorruptError, DatasetChanged, TransformError)):
            # Bad bytes (or a failing transform) are the job's problem, not this stream's:
            # every rank of it must stop.
            self.deps.registry.fail(s.job_id, exc.code, str(exc))
            self.job_gone(s.job_id, exc.code, str(exc))
            self.deps.spread_failure(s.job_id, exc.code, str(exc))
            return
        reply = replies.stream_failure(exc, s.stream)
        self.out.try_send(s.ident, reply)
        self.notices.failed(s, reply, exc, bug=not isinstance(exc, ShardserveError))
        self.close(s, "failed")

    def _contain(self, s: Session, exc: BaseException) -> None:
        """Whatever went wrong serving ``s`` ends ``s`` alone (never the streamer thread)."""
        try:
            self._stream_failed(s, exc)
        except Exception:
            log_event(log, "stream.fail_failed", level=logging.ERROR, exc_info=True)
            with contextlib.suppress(Exception):
                self.close(s, "failed", level=logging.ERROR)
            if self.sessions.get(s.ident) is s:
                del self.sessions[s.ident]

    def close(
        self, s: Session, reason: str, level: int = logging.INFO, handover: bool = False
    ) -> None:
        """End ``s`` for ``reason``; ``handover``: its client's next stream may take over its
        slot ring (unless a worker may still be writing into one of its slots)."""
        s.mark_closed()
        if self.sessions.get(s.ident) is s:
            del self.sessions[s.ident]
        self._has_read(s)  # whatever it was allotted before reading goes back
        if s.share is not None:
            self.shares.leave(s.ident, s.stream)
        sink = s.sink
        if sink is None:  # closed before its Welcome: the ring it was to take over goes
            self.opener.rings.discard(s.ident)
        else:
            for batch in s.flow.drain():
                sink.release(batch.ticket)
            sink.close(handover=handover and s.flow.assembling == 0)
        overflowed = sink.overflowed if sink is not None else 0
        self.notices.closed(s, reason, level, len(self.sessions), overflowed)

    def _allot(self, s: Session, batch_bytes: int) -> None:
        """Bound what ``s`` is sent before its client reads (see :mod:`.unread`)."""
        ask = self.unread.ask(batch_bytes * s.group, s.flow.credit, s.group)
        s.flow.allot(self.unread.admit((s.ident, s.stream), ask) * s.group)
        self._unread_gauges()

    def _has_read(self, s: Session) -> None:
        """``s`` read (or closed): its allotment goes back, its credit alone bounds it, and
        the streams waiting for room take theirs, first come first served."""
        if not self.unread.read((s.ident, s.stream)):
            return
        s.flow.allot(None)
        while due := self.unread.due():
            for (ident, stream), n in due:
                w = self.sessions.get(ident)
                if w is None or w.stream != stream:
                    self.unread.read((ident, stream))  # gone without a close: free it
                    continue
                w.flow.allot(n * w.group)
                self._pump(w)
        self._unread_gauges()

    def _unread_gauges(self) -> None:
        self.deps.metrics.unread_bytes.set(self.unread.used)
        self.deps.metrics.unread_waiting.set(self.unread.waiting)

    def _peer_gone(self, ident: bytes) -> None:
        if (s := self.sessions.get(ident)) is not None:
            self.close(s, "peer gone", level=logging.WARNING)

    def _new_stream_id(self) -> int:
        sid = self._next_stream
        first, last = self.deps.stream_ids
        self._next_stream = sid + 1 if sid < last else first
        return sid
