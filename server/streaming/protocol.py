"""The server's half of the stream protocol, run on the streamer thread.

:class:`StreamHandler` reacts to three things — a message from a peer, finished assembly work,
a timer tick — and keeps each stream's :class:`~.sessions.Session` moving: submit work within
credit, send what is ready in order, end the epoch. It owns the sessions; the
:class:`~.streamer.Streamer` owns the thread and the socket and calls in here.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import zmq

from shardserve.proto.errors import (
    DatasetCorruptError,
    ErrorCode,
    ProtocolError,
    ShardserveError,
    TransformError,
    VersionMismatch,
    code_for_error,
)
from shardserve.proto.framing import decode, encode, encode_batch, peek_kind
from shardserve.proto.messages import (
    MAX_CREDIT,
    PROTOCOL_VERSION,
    BatchHeader,
    Bye,
    ClientStats,
    ControlMessage,
    Credit,
    EndOfEpoch,
    Error,
    Heartbeat,
    Hello,
    Kind,
    PartHeader,
    Welcome,
)

from ..assembly import Assembler
from ..jobs import JobRegistry
from ..logs import log_event
from ..metrics import Metrics
from ..store.graphs import GraphCollated
from .board import StreamBoard
from .buffers import BufferPool, BufferSet
from .handshake import batches_per_rank, check_hello, version_reject
from .limits import StreamCancelled, check_batch
from .plans import PlanCache
from .sessions import Prepared, Session
from .shm import ShmUnavailable
from .slots import ShmSlots
from .streamer import StreamerConfig, shutdown_error

log = logging.getLogger("shardserve.streaming")

#: Bytes of buffer pools kept for (job, rank)s between their streams (pools of open streams
#: always stay); past it the least recently used idle pools are dropped.
IDLE_POOL_BYTES = 1 << 30
#: A lone stream's batches up to this size are assembled on the streamer thread itself: for
#: a CIFAR batch the pool's two thread hand-offs (submit, wake with the result) cost more
#: CPU than the gather. Bigger batches, or several streams, use the pool.
INLINE_MAX_BYTES = 4 << 20
#: An inline gather slower than this (pages not cached: the disk is being read) blocks the
#: streamer's heartbeats, so that stream's next ``INLINE_BACKOFF`` batches go to the pool.
INLINE_MAX_S = 0.01
INLINE_BACKOFF = 64


@dataclass
class Parts:
    """Collaborators of the handler (all shared with the control plane, all thread-safe)."""

    #: ``open_dataset(name) -> Dataset`` (shared, cached; see ``Service.open_dataset``).
    open_dataset: Callable[[str], Any]
    registry: JobRegistry
    plans: PlanCache
    board: StreamBoard
    metrics: Metrics


class StreamHandler:
    """Sessions by routing id, and what to do with each event. Streamer thread only."""

    def __init__(
        self, sock: zmq.Socket, assembler: Assembler, parts: Parts, config: StreamerConfig
    ) -> None:
        self.sock = sock
        self.assembler = assembler
        self.p = parts
        self.config = config
        self.sessions: dict[bytes, Session] = {}
        self._pools: dict[tuple[str, int], BufferPool] = {}
        #: Jobs whose shm fallback was logged at WARNING already.
        self._fell_back: set[str] = set()
        self._next_stream = 1

    # -- events -------------------------------------------------------------------------

    def on_message(self, ident: bytes, frames: list[bytes]) -> None:
        """One message from peer ``ident``; bad input is answered, never raised."""
        try:
            msg = self._decode(frames)
            if isinstance(msg, Hello):
                self._on_hello(ident, msg)
            elif isinstance(msg, Credit):
                self._on_credit(ident, msg)
            elif isinstance(msg, Heartbeat):
                self._on_heartbeat(ident, msg)
            elif isinstance(msg, Bye):
                if (s := self.sessions.get(ident)) is not None:
                    self._close(s, "bye")
            else:
                kind = msg.kind.name if hasattr(msg, "kind") else "BATCH"
                self._send(
                    ident,
                    Error(
                        code=ErrorCode.UNKNOWN_MESSAGE,
                        fatal=False,
                        message=f"the server does not accept {kind} messages",
                    ),
                )
        except VersionMismatch as e:
            self._send(
                ident, version_reject([int(frames[0][2])] if frames and len(frames[0]) > 2 else [])
            )
            log_event(log, "peer.version_mismatch", level=logging.WARNING, reason=str(e))
        except ProtocolError as e:
            self._send(ident, Error(code=e.code, message=str(e), fatal=False))
            log_event(
                log, "peer.bad_message", level=logging.WARNING, code=e.code.value, reason=str(e)
            )
        except Exception as e:
            log_event(log, "peer.message_failed", level=logging.ERROR, exc_info=True)
            if (s := self.sessions.get(ident)) is not None:
                self._contain(s, e)  # its state may be half-changed: end it, keep the others
                return
            self._try_send(
                ident,
                Error(
                    code=ErrorCode.INTERNAL,
                    fatal=False,
                    message="the server failed to handle this message; see its log",
                ),
            )

    def on_results(self) -> None:
        """Apply finished assembly work (prepared streams, assembled batches)."""
        for done in self.assembler.results():
            what, ident, stream = done.tag[:3]
            s = self.sessions.get(ident)
            live = s is not None and s.stream == stream
            if what == "batch":
                pool, bufs = done.tag[4:]  # pool: BufferPool or ShmSlots; bufs: set or slot
                if live:
                    s.assembling -= 1
                if (not live or done.error is not None) and bufs is not None:
                    with contextlib.suppress(Exception):  # a closed ring: nothing to release
                        pool.release(bufs)  # never to be sent, and the worker is done with it
            if not live:
                continue  # the stream was replaced or closed while this ran
            try:
                self._apply(s, what, done)
            except Exception as e:
                self._contain(s, e)

    def _apply(self, s: Session, what: str, done: Any) -> None:
        if done.error is not None:
            self._stream_failed(s, done.error)
        elif what == "prepare":
            s.prepared = done.value
            s.prepared.pool = self._pool_for(s, s.prepared.part_shapes)
            if s.want_shm:
                s.shm = self._make_slots(s)
            self._welcome(s)
            self._pump(s)
        else:
            index, bufs = done.tag[3], done.tag[5]
            s.ready[index] = (done.value, bufs)
            self._pump(s)

    def _contain(self, s: Session, exc: BaseException) -> None:
        """Whatever went wrong serving ``s`` ends ``s`` alone (never the streamer thread)."""
        try:
            self._stream_failed(s, exc)
        except Exception:
            log_event(log, "stream.fail_failed", level=logging.ERROR, exc_info=True)
            with contextlib.suppress(Exception):
                self._close(s, "failed", level=logging.ERROR)
            if self.sessions.get(s.ident) is s:
                del self.sessions[s.ident]

    def on_tick(self, now: float) -> None:
        """Heartbeats, liveness probes, idle cleanup, retries of sends that hit the HWM."""
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
                self._close(s, "idle after end of epoch")
            return
        if now - s.last_send >= c.heartbeat_s:
            if self._send(s.ident, Heartbeat()) is False:
                return  # peer gone (_send closed the session) or its queue is full
            s.last_send = now
        if s.ready:
            self._pump(s)

    def shutdown(self) -> None:
        """Tell every open stream the server is going (transient), then forget them."""
        for s in list(self.sessions.values()):
            try:
                self._send(s.ident, shutdown_error(s.stream))
            except zmq.ZMQError as e:  # the socket is going away; the session must still close
                log_event(log, "stream.shutdown_send_failed", **s.describe(), reason=str(e))
            if self.sessions.get(s.ident) is s:
                try:
                    self._close(s, "server shutdown")
                except Exception:  # one session's trouble must not keep the others' rings
                    log_event(log, "stream.close_failed", level=logging.ERROR, exc_info=True)
                    self.sessions.pop(s.ident, None)
        self.assembler.close()

    def job_gone(self, job_id: str, code: ErrorCode, message: str) -> None:
        """End every stream of a job with a fatal error (job deleted or failed)."""
        for key in [k for k in self._pools if k[0] == job_id]:
            del self._pools[key]
        self._fell_back.discard(job_id)
        for s in [s for s in self.sessions.values() if s.job_id == job_id]:
            if self.sessions.get(s.ident) is not s:
                continue
            self._try_send(s.ident, Error(code=code, message=message, fatal=True, stream=s.stream))
            if self.sessions.get(s.ident) is s:
                self._close(s, message, level=logging.WARNING)

    # -- messages -----------------------------------------------------------------------

    def _decode(self, frames: list[bytes]) -> ControlMessage | BatchHeader:
        if frames and peek_kind(frames[0]) is Kind.HELLO and frames[0][2] != PROTOCOL_VERSION:
            # A Hello of another protocol version may have another body: explain, do not parse.
            raise VersionMismatch(f"Hello of protocol {frames[0][2]}")
        return decode(frames)

    def _on_hello(self, ident: bytes, hello: Hello) -> None:
        job = self.p.registry.find(hello.job)
        refusal = check_hello(hello, job, self.config.token)
        reuse = None
        if (old := self.sessions.get(ident)) is not None:
            # The same client's next stream (an epoch, a resume) may take over its ring, unless
            # a worker may still be writing into one of its slots.
            if refusal is None and old.shm is not None and old.assembling == 0:
                reuse, old.shm = old.shm, None
            self._close(old, "replaced by a new Hello")
        if refusal is not None:
            self._send(ident, refusal)
            log_event(
                log,
                "stream.refused",
                level=logging.WARNING,
                job=hello.job,
                rank=hello.rank,
                code=refusal.code.value,
                reason=refusal.message,
            )
            return
        assert job is not None  # check_hello refuses a missing job
        s = Session(
            ident,
            self._new_stream_id(),
            job,
            hello.rank,
            hello.epoch,
            job.seed,
            hello.nonce,
            hello.start_batch,
            batches_per_rank(job),
            hello.credit,
        )
        c = self.config
        # Same kernel boot id: the client shares our host, so it can map our /dev/shm rings.
        s.want_shm = (
            hello.transport == "auto"
            and c.shm_dir is not None
            and bool(hello.boot_id)
            and hello.boot_id == c.boot_id
        )
        s.reuse_shm = reuse
        s.keep = hello.keep
        if reuse is not None and not s.want_shm:
            reuse.close()
            s.reuse_shm = None
        self.sessions[ident] = s
        self.p.registry.note_stream(job.id, s.epoch)
        # Welcome waits for the prepared plan (and the slot ring, sized from the dataset).
        # Planning has its own lane, so a flood of Hellos cannot starve other jobs' batches;
        # a Hello replaced (or a peer gone) before its turn costs nothing (see _prepare).
        self.assembler.plan(("prepare", ident, s.stream), self._prepare, s)

    def _welcome(self, s: Session) -> None:
        s.transport = "shm" if s.shm is not None else "socket"
        self._send(
            s.ident,
            Welcome(
                stream=s.stream,
                nonce=s.nonce,
                job=s.job_id,
                rank=s.rank,
                epoch=s.epoch,
                seed=s.seed,
                start_batch=s.start_batch,
                num_batches=s.num_batches,
                heartbeat_s=self.config.heartbeat_s,
                transport=s.transport,
                shm=s.shm.info if s.shm is not None else None,
            ),
        )
        self.p.board.opened(
            s.job_id, s.rank, s.stream, s.epoch, s.start_batch, s.num_batches, s.owed, s.transport
        )
        if s.shm_fallback is not None:
            self.p.board.fell_back(s.job_id, s.rank, s.shm_fallback)
        self.p.metrics.streams.set(len(self.sessions))
        asked: dict[str, Any] = {"asked": "shm"} if s.shm_fallback is not None else {}
        log_event(
            log,
            "stream.opened",
            **s.describe(),
            start=s.start_batch,
            num_batches=s.num_batches,
            credit=s.credit,
            seed=s.seed,
            # The transport this stream really uses (a fallback's reason is logged with it).
            transport=s.transport,
            **asked,
        )

    def _make_slots(self, s: Session) -> ShmSlots | None:
        """The stream's slot ring, holding exactly its credit; ``None`` means use the socket."""
        prep = s.prepared
        assert prep is not None and self.config.shm_dir is not None
        reuse, s.reuse_shm = s.reuse_shm, None
        if reuse is not None:
            key = ShmSlots.key_for(
                min(s.credit, MAX_CREDIT), prep.dataset, prep.fields, s.job.spec.batch_size
            )
            if reuse.key == key:
                reuse.reset(s.keep)
                return reuse
            reuse.close()
        limit = self.config.shm_limit_bytes
        if limit is not None:
            # The limit is for all rings together: many same-host peers cannot fill /dev/shm.
            limit -= sum(x.shm.ring.nbytes for x in self.sessions.values() if x.shm is not None)
        try:
            return ShmSlots.create(
                s.stream,
                min(s.credit, MAX_CREDIT),
                prep.dataset,
                prep.fields,
                s.job.spec.batch_size,
                self.config.shm_dir,
                max(limit, 0) if limit is not None else None,
            )
        except ShmUnavailable as e:
            self.p.metrics.shm_fallbacks.inc()
            s.shm_fallback = str(e)
            # Once per job at WARNING: every rank and epoch of a job falls back for the same
            # reason, and a warning per stream buries everything else in the log.
            first = s.job_id not in self._fell_back
            self._fell_back.add(s.job_id)
            repeat: dict[str, Any] = {} if first else {"repeat": True}
            log_event(
                log,
                "shm.fallback",
                level=logging.WARNING if first else logging.DEBUG,
                **s.describe(),
                reason=f"{e}; serving this stream over the socket instead",
                **repeat,
            )
            return None

    def _prepare(self, s: Session) -> Prepared:
        """On the planning lane: open the dataset and plan this rank's epoch.

        Reads only immutable facts of ``s`` and its ``closed`` flag (a replaced or closed
        stream is skipped: its result would be dropped anyway).
        """
        if s.closed:
            raise StreamCancelled(f"stream {s.stream} was closed before its plan was made")
        job = s.job
        ds = self.p.open_dataset(job.spec.dataset)
        if job.spec.collate == "graph":
            ds = GraphCollated(ds)  # issue 14: graphs collated for message passing
        ds = self.assembler.transformed(ds, job.spec, s.epoch, s.seed, s.rank)  # issue 15
        fields = tuple(job.spec.fields or (f.name for f in ds.manifest.fields))
        m = ds.manifest
        batch_bytes = int(m.total_bytes / max(m.num_samples, 1) * job.spec.batch_size)
        # A job journaled before the limits existed is refused here, before any allocation.
        check_batch(job.spec.batch_size, m.num_samples, batch_bytes, self.config.max_batch_bytes)
        if s.closed:
            raise StreamCancelled(f"stream {s.stream} was closed before its plan was made")
        plan = self.p.plans.rank_plan(job, s.epoch, s.seed, s.rank, shard_rows=ds.shard_rows)
        if (hint := getattr(ds, "plan_hint", None)) is not None:
            hint(plan)  # a remote dataset prefetches the shards this plan reads next
        return Prepared(ds, plan, fields, ds.part_shapes(fields), batch_bytes=batch_bytes)

    def _pool_for(self, s: Session, part_shapes: dict[str, Any]) -> BufferPool:
        """The rank's buffer pool, kept across its streams (epochs): a new stream then writes
        into pages already faulted in instead of fresh ones (~0.1 s per GB)."""
        key = (s.job_id, s.rank)
        pool = self._pools.pop(key, None)
        if pool is None or pool.part_shapes != part_shapes:
            pool = BufferPool(part_shapes, s.job.spec.batch_size)
        self._pools[key] = pool  # (re)inserted last: the dict is in least-recently-used order
        live = {(x.job_id, x.rank) for x in self.sessions.values()}
        total = sum(p.nbytes for p in self._pools.values())
        for k in [k for k in self._pools if k not in live]:
            if total <= IDLE_POOL_BYTES:
                break
            total -= self._pools.pop(k).nbytes
        return pool

    def _on_credit(self, ident: bytes, credit: Credit) -> None:
        s = self._session_or_unknown(ident)
        if s is None:
            return
        if s.shm is not None and credit.slots and (bad := s.shm.give_back(credit.slots)):
            log_event(log, "shm.bad_return", level=logging.WARNING, **s.describe(), slots=bad)
        if s.owed + credit.grant > MAX_CREDIT:
            self._send(
                ident,
                Error(
                    code=ErrorCode.BAD_REQUEST,
                    fatal=True,
                    stream=s.stream,
                    message=f"credit would reach {s.owed + credit.grant}, over the "
                    f"{MAX_CREDIT} a stream may hold",
                ),
            )
            self._close(s, "credit over the limit", level=logging.WARNING)
            return
        s.credit += credit.grant
        self._heard(s, credit.stats)
        self._pump(s)

    def _on_heartbeat(self, ident: bytes, hb: Heartbeat) -> None:
        s = self._session_or_unknown(ident)
        if s is not None:
            self._heard(s, hb.stats)
            if self._send(ident, Heartbeat()):
                s.last_send = time.monotonic()

    def _session_or_unknown(self, ident: bytes) -> Session | None:
        s = self.sessions.get(ident)
        if s is None:
            self._send(
                ident,
                Error(
                    code=ErrorCode.UNKNOWN_STREAM,
                    fatal=False,
                    message="no open stream for this peer (it was closed, or the "
                    "server restarted): say Hello again from your next batch",
                ),
            )
        return s

    def _heard(self, s: Session, stats: ClientStats | None) -> None:
        s.last_recv = time.monotonic()
        if stats is not None:
            self.p.board.heard(
                s.job_id, s.rank, s.owed, stats.wait_s, stats.compute_s, batches=stats.batches
            )
        else:
            self.p.board.heard(s.job_id, s.rank, s.owed)

    # -- moving a stream ----------------------------------------------------------------

    def _pump(self, s: Session) -> None:
        """Submit work within credit, send what is ready in order, end the epoch."""
        if self.sessions.get(s.ident) is not s:
            return  # closed meanwhile (e.g. its peer vanished while being welcomed)
        prep = s.prepared
        inline = self._inline(s)
        while prep is not None and prep.pool is not None and s.wants_work():
            if not self._submit(s, prep, inline):
                break
            if inline and not self._send_ready(s):
                return
        if not self._send_ready(s):
            return
        eoe = EndOfEpoch(stream=s.stream, epoch=s.epoch, num_batches=s.num_batches)
        if s.done_sending and not s.ended and self._send(s.ident, eoe):
            s.ended = True
            log_event(log, "stream.end_of_epoch", **s.describe(), num_batches=s.num_batches)

    def _inline(self, s: Session) -> bool:
        """Whether this stream's next batches are assembled here rather than on the pool."""
        prep = s.prepared
        if prep is None or prep.batch_bytes > INLINE_MAX_BYTES or s.next_submit < s.pool_until:
            return False
        if not self.assembler.inline_ok(prep.dataset):
            return False
        # Another stream with work to do would wait behind this one's gathers.
        return not any(x is not s and not x.ended for x in self.sessions.values())

    def _submit(self, s: Session, prep: Prepared, inline: bool) -> bool:
        """Assemble batch ``s.next_submit`` (now, or on the pool); False when no slot is free
        or the stream failed."""
        index = s.next_submit
        indices = prep.plan.batch(index)
        place = None
        if s.shm is not None:
            slot = s.shm.acquire()
            if slot is None:
                return False  # every slot is being filled or is with the client; a Credit frees one
            pool, bufs, out = s.shm, slot, s.shm.out(slot, len(indices))
            place = partial(s.shm.place, slot)
        else:
            pool, bufs = prep.pool, prep.pool.acquire()
            out = None if bufs is None else bufs.views(len(indices))
        s.next_submit += 1
        s.credit -= 1
        if not inline:
            s.assembling += 1
            self.assembler.gather(
                ("batch", s.ident, s.stream, index, pool, bufs),
                prep.dataset,
                indices,
                prep.fields,
                out,
                place,
                batch=index,
            )
            return True
        t0 = time.perf_counter()
        try:
            parts = self.assembler.assemble_now(
                prep.dataset, indices, prep.fields, out, place, batch=index
            )
        except Exception as e:
            if bufs is not None:
                pool.release(bufs)
            self._stream_failed(s, e)
            return False
        if time.perf_counter() - t0 > INLINE_MAX_S:
            s.pool_until = index + INLINE_BACKOFF
        s.ready[index] = (parts, bufs)
        return True

    def _send_ready(self, s: Session) -> bool:
        """Send assembled batches in index order; False once the stream cannot take more
        (its queue is full, or it was closed)."""
        while s.next_send in s.ready:
            parts, bufs = s.ready.pop(s.next_send)
            if not self._send_batch(s, parts, bufs):
                return False
        return self.sessions.get(s.ident) is s

    def _send_batch(self, s: Session, parts: dict[str, Any], bufs: BufferSet | int | None) -> bool:
        index = s.next_send
        slot = bufs if isinstance(bufs, int) else -1
        in_slot = s.shm.headers(slot, parts) if s.shm is not None and slot >= 0 else None
        if in_slot is not None:
            header = BatchHeader(s.stream, s.epoch, index, in_slot, slot)
            frames: list[Any] = []
        else:
            header = BatchHeader(
                s.stream,
                s.epoch,
                index,
                tuple(PartHeader(n, a.dtype.name, a.shape, a.nbytes) for n, a in parts.items()),
            )
            if slot >= 0:
                # An overflowing shm batch is copied out so its slot can be freed at once.
                frames = [bytes(memoryview(a)) for a in parts.values()]
                s.socket_batches += 1
            else:
                frames = [zmq.Frame(a, track=isinstance(bufs, BufferSet)) for a in parts.values()]
        try:
            self.sock.send_multipart(
                [s.ident, *encode_batch(header, frames)], flags=zmq.NOBLOCK, copy=False
            )
        except zmq.Again:
            s.ready[index] = (parts, bufs)  # the peer's queue is full; retried on the next tick
            return False
        except zmq.ZMQError as e:
            if e.errno == zmq.EHOSTUNREACH:
                self._close(s, "peer gone", level=logging.WARNING)
                return False
            raise
        if s.shm is not None and slot >= 0:
            if in_slot is not None:
                s.shm.lend(slot)  # the client hands it back in a Credit
            else:
                s.shm.release(slot)
        elif isinstance(bufs, BufferSet) and s.prepared is not None and s.prepared.pool is not None:
            s.prepared.pool.release(bufs, zmq.MessageTracker(*frames))
        s.next_send += 1
        s.last_send = time.monotonic()
        self.p.metrics.batches_sent.inc()
        self.p.metrics.bytes_sent.inc(header.nbytes)
        self.p.board.sent(s.job_id, s.rank, header.nbytes, s.next_send, s.owed)
        return True

    def _stream_failed(self, s: Session, exc: BaseException) -> None:
        if isinstance(exc, (DatasetCorruptError, TransformError)):
            # Bad bytes (or a failing transform) are the job's problem, not this stream's:
            # every rank of it must stop.
            self.p.registry.fail(s.job_id, exc.code, str(exc))
            self.job_gone(s.job_id, exc.code, str(exc))
            return
        code = code_for_error(exc)
        known = isinstance(exc, ShardserveError)
        message = (
            str(exc)
            if known
            else f"internal error serving this stream: {type(exc).__name__}: {exc}"
        )
        self._try_send(
            s.ident,
            Error(code=code, message=message, stream=s.stream, fatal=not (known and exc.transient)),
        )
        log_event(
            log,
            "stream.failed",
            level=logging.ERROR,
            exc_info=not known,
            **s.describe(),
            code=code.value,
            reason=str(exc),
        )
        self._close(s, "failed")

    def _send(self, ident: bytes, msg: ControlMessage) -> bool:
        """Send a control message; ``False`` when the peer is gone or its queue is full."""
        try:
            self.sock.send_multipart([ident, *encode(msg)], flags=zmq.NOBLOCK)
            return True
        except zmq.Again:
            return False
        except zmq.ZMQError as e:
            if e.errno != zmq.EHOSTUNREACH:
                raise
            if (s := self.sessions.get(ident)) is not None:
                self._close(s, "peer gone", level=logging.WARNING)
            return False

    def _try_send(self, ident: bytes, msg: ControlMessage) -> bool:
        """:meth:`_send` that also swallows socket errors (best-effort notices)."""
        try:
            return self._send(ident, msg)
        except zmq.ZMQError as e:
            log_event(log, "peer.send_failed", level=logging.WARNING, reason=str(e))
            return False

    def _close(self, s: Session, reason: str, level: int = logging.INFO) -> None:
        s.closed = True
        if self.sessions.get(s.ident) is s:
            del self.sessions[s.ident]
        if s.reuse_shm is not None:  # closed before its Welcome: the ring it was to take over
            s.reuse_shm.close()
            s.reuse_shm = None
        if s.shm is not None:
            s.ready.clear()
            s.shm.close()  # unlinks the ring; a client still mapping it keeps its pages
        elif s.prepared is not None and s.prepared.pool is not None:
            for bufs in s.unsent_buffers():
                if isinstance(bufs, BufferSet):  # not a slot of a ring handed to the next stream
                    s.prepared.pool.release(bufs)
        self.p.board.closed(s.job_id, s.rank, s.stream)
        self.p.metrics.streams.set(len(self.sessions))
        # An shm stream whose batches outgrew their slot sent those over the socket.
        over_socket: dict[str, Any] = (
            {"socket_batches": s.socket_batches} if s.socket_batches else {}
        )
        log_event(
            log,
            "stream.closed",
            level=level,
            **s.describe(),
            reason=reason,
            next_batch=s.next_send,
            num_batches=s.num_batches,
            transport=s.transport,
            **over_socket,
        )

    def _new_stream_id(self) -> int:
        sid = self._next_stream
        self._next_stream = sid % 0xFFFF_FFFF + 1
        return sid
