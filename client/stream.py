"""One epoch of one rank on the wire: handshake, credit, heartbeats, recovery, deadline.

::

    open() --Hello(nonce)--> awaiting Welcome --Welcome(nonce)--> streaming --EndOfEpoch--> done
                 ^                  |                                 |
                 +-- recover() <----+-- silence > 3 x heartbeat ------+
                     (re-POST job,  +-- Error(JOB_NOT_FOUND | UNKNOWN_STREAM | SERVER_SHUTDOWN)
                      new nonce,    +-- a gap in batch indices
                      start_batch = next undelivered batch, backoff)

Fatal ``Error``/``Reject`` raise the matching typed exception at once. When no batch arrives
within ``timeout``, :class:`DataStallError` says what was waited for and what is known.
Messages of older streams (other nonce or stream id, other epoch, already-seen index) are
dropped, so a reconnect never delivers a batch twice.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable, Sequence

from shardserve.proto.errors import (
    DataStallError,
    ErrorCode,
    MalformedFrame,
    ProtocolError,
    ServerUnavailable,
    ShardserveError,
    error_for_code,
)
from shardserve.proto.framing import Frame, decode, decode_batch, peek_kind
from shardserve.proto.messages import (
    BatchHeader,
    Credit,
    EndOfEpoch,
    Error,
    Heartbeat,
    Hello,
    Kind,
    Reject,
    Welcome,
)

from ._cut import check_message
from ._offthread import Background
from .connection import Connection
from .shm import AttachedRing, RingCache, ShmAttachError
from .stats import StatsClock

log = logging.getLogger(__name__)

#: Heartbeat period until the server's Welcome says otherwise.
DEFAULT_HEARTBEAT_S = 1.0
#: Errors after which the stream is re-established instead of raised.
RECOVERABLE = frozenset(
    {ErrorCode.JOB_NOT_FOUND, ErrorCode.UNKNOWN_STREAM, ErrorCode.SERVER_SHUTDOWN}
)
MAX_BACKOFF_S = 2.0
#: A Hello still without its Welcome after this long is sent again. The server may be alive
#: and heartbeating while that Hello was lost (sent into a dying server, or answered inside
#: the recovery backoff), and silence detection never fires then.
WELCOME_WAIT_S = 10.0


class EpochStream:
    """Batches ``start_batch..`` of one epoch, in order, each exactly once."""

    def __init__(
        self,
        conn: Connection,
        *,
        hello: Hello,
        timeout: float,
        stats: StatsClock,
        recreate_job: Callable[[], None],
        describe: Callable[[], str],
        rings: RingCache | None = None,
        rows: int = 0,
        num_batches: int | None = None,
        graphs: bool = False,
        place: Callable[[Hello, bool], str] | None = None,
    ) -> None:
        """``rows``: the job's batch size, ``num_batches``: its batches per epoch (the plan
        every message and the Welcome are checked against; 0 / ``None``: the server's word);
        ``graphs``: batches are collated graphs (see :func:`._cut.check_message`);
        ``place(hello, again)``: where to say each Hello (:mod:`.placing`)."""
        self._place, self.conn = place, conn
        self.rows, self.num_batches, self.graphs = rows, num_batches, graphs
        self.hello = hello
        self.epoch = hello.epoch
        self.next_index = hello.start_batch
        self.timeout = timeout
        self.stats = stats
        # Off this thread: a name lookup of the restarted server has no timeout (see _offthread).
        self._recreate = Background(recreate_job, f"shardserve-recreate-{hello.job}")
        #: The server said it does not know the job of the Hello now out.
        self._job_missing = False
        self._describe = describe
        self.welcome: Welcome | None = None
        self.done = False
        self.credit_outstanding = 0
        self._pending_grant = 0
        # Credit goes back in halves: a message per batch costs both processes a thread
        # wake-up each, and a client about to wait flushes what it has anyway.
        self._grant_every = max(1, hello.credit // 2)
        self._heartbeat_s = DEFAULT_HEARTBEAT_S
        self._last_heard = time.monotonic()
        self._last_beat = 0.0
        self._backoff = 0.1
        self._next_recover = 0.0
        #: Hellos in a row that got no Welcome within ``WELCOME_WAIT_S``.
        self._unwelcomed = 0
        #: The server's slot ring when the stream runs over shared memory.
        self.ring: AttachedRing | None = None
        self._rings = rings if rings is not None else RingCache()
        self.transport = conn.transport
        self._send_hello(self.next_index)

    # -- the two calls the Loader makes ---------------------------------------------------

    def next(self) -> tuple[BatchHeader, list[Frame]] | None:
        """The next message's header and frames (``header.count`` batches from
        ``header.index``), or None after ``EndOfEpoch``."""
        if self.done:
            return None
        started = time.monotonic()
        deadline = started + self.timeout
        # Time the consumer spent computing is not server silence.
        self._last_heard = max(self._last_heard, started - self._heartbeat_s)
        while True:
            frames = self.conn.recv()
            if frames is None:
                self._flush_grant()
                if self._recreated() and self.welcome is None and self._job_missing:
                    # The last Hello came before the job (a restarted server: place it again).
                    self._send_hello(self.next_index, again=True)
                now = time.monotonic()
                if now >= deadline:
                    raise self._stall(now - started)
                if now - self._last_beat >= self._heartbeat_s:
                    self.conn.send(Heartbeat(stats=self.stats.wire()))
                    self._last_beat = now
                if now - self._last_heard > 3 * self._heartbeat_s:
                    self._recover(f"no message from the server for {now - self._last_heard:.1f} s")
                elif (
                    self.welcome is None
                    and now - self._hello_at > WELCOME_WAIT_S
                    and now >= self._next_recover  # within the backoff _recover does nothing
                ):
                    self._unwelcomed += 1
                    if self._unwelcomed >= 2:
                        # Seen once after a server container restart: Hellos kept going out
                        # and no Welcome came back. A new socket is a new connection.
                        self.conn.reopen()
                    self._recover(f"no Welcome {now - self._hello_at:.1f} s after the Hello")
                wake = min(
                    deadline,
                    self._last_beat + self._heartbeat_s,
                    self._last_heard + 3 * self._heartbeat_s,
                    self._hello_at + WELCOME_WAIT_S if self.welcome is None else deadline,
                )
                self.conn.poll(max(0.001, wake - now))
                continue
            self._last_heard = time.monotonic()
            item = self._handle(frames)
            if item is not None:
                return item
            if self.done:
                return None

    def consumed(self) -> None:
        """The Loader handed a batch out: give its credit back (coalesced, never starving).
        Credit counts batches, however many travel in one message."""
        self._pending_grant += 1
        if self._pending_grant >= self._grant_every:
            self._flush_grant()

    def close(self) -> None:
        """Forget the slot ring; its mapping belongs to the ring cache (the Loader's)."""
        self.ring = None

    # -- message handling ------------------------------------------------------------------

    def _handle(self, frames: Sequence[Frame]) -> tuple[BatchHeader, list[Frame]] | None:
        try:
            if peek_kind(frames[0]) is Kind.BATCH:
                return self._on_batch(*decode_batch(frames))
            msg = decode(frames)
        except ProtocolError as e:
            # A frame we cannot read is the server's bug or a hostile peer: refuse it loudly.
            raise type(e)(
                f"{e} (job {self.hello.job}, rank {self.hello.rank}, endpoint {self.conn.endpoint})"
            ) from None
        match msg:
            case Welcome():
                self._on_welcome(msg)
            case EndOfEpoch():
                if (
                    self.welcome is not None
                    and msg.stream == self.welcome.stream
                    and msg.epoch == self.epoch
                ):
                    if msg.num_batches != self.welcome.num_batches:
                        raise ProtocolError(
                            f"EndOfEpoch field num_batches={msg.num_batches}, the Welcome said "
                            f"{self.welcome.num_batches} (job {self.hello.job}, rank {self.hello.rank})"
                        )
                    if self.next_index >= msg.num_batches:
                        self.done = True
                    else:
                        self._recover(
                            f"EndOfEpoch after batch {self.next_index - 1} of {msg.num_batches}"
                        )
            case Heartbeat():
                pass
            case Error():
                self._on_error(msg.code, msg.message, msg.fatal, msg.stream)
            case Reject():
                if msg.nonce in (0, self.hello.nonce):
                    raise error_for_code(
                        msg.code,
                        f"server rejected the stream: {msg.message} (server speaks protocols "
                        f"{list(msg.server_protocols)}, this client {list(self.hello.protocols)})",
                    )
            case _:
                log.debug("ignoring %s from the server", type(msg).__name__)
        return None

    def _on_welcome(self, msg: Welcome) -> None:
        if msg.nonce != self.hello.nonce:
            return  # the answer to a Hello we have since replaced
        self._unwelcomed = 0
        self.close()
        if msg.transport == "shm":
            if msg.shm is None or self.hello.transport != "auto":
                raise ProtocolError(
                    f"server chose shared memory (ring {msg.shm}) but this client asked for "
                    f"transport {self.hello.transport!r}"
                )
            try:
                self.ring = self._rings.attach(msg.shm)
            except ShmAttachError as e:
                # Same boot id but another IPC namespace (containers): the socket still works.
                log.warning("cannot map the server's shared memory (%s); using the socket", e)
                self.hello = self.hello.model_copy(update={"transport": "socket"})
                self._send_hello(self.next_index)
                return
        self.transport = "shm" if self.ring is not None else self.conn.transport
        if self.num_batches is not None and msg.num_batches != self.num_batches:
            raise ProtocolError(
                f"Welcome field num_batches={msg.num_batches}, but job {self.hello.job} plans "
                f"{self.num_batches} batches per epoch for each rank"
            )
        if msg.start_batch != self.next_index or msg.epoch != self.epoch:
            raise ProtocolError(
                f"Welcome for epoch {msg.epoch} batch {msg.start_batch}, asked for epoch {self.epoch} "
                f"batch {self.next_index}"
            )
        self.welcome = msg
        self.conn.last_stream = msg.stream
        self._heartbeat_s = msg.heartbeat_s if msg.heartbeat_s > 0 else DEFAULT_HEARTBEAT_S
        self._backoff = 0.1

    def _on_batch(
        self, header: BatchHeader, frames: list[Frame]
    ) -> tuple[BatchHeader, list[Frame]] | None:
        if (
            self.welcome is None
            or header.stream != self.welcome.stream
            or header.epoch != self.epoch
        ):
            return None  # an older stream's batch
        if header.slot >= 0 and self.ring is None:
            raise MalformedFrame(
                f"batch {header.index} arrived in shm slot {header.slot} on a socket stream"
            )
        self.credit_outstanding = max(0, self.credit_outstanding - header.count)
        if header.index < self.next_index:
            if header.slot >= 0 and self.ring is not None:
                self.ring.ledger.release(header.slot)
            return None  # already delivered before a reconnect
        if header.index > self.next_index:
            self._recover(f"batch {header.index} arrived while waiting for batch {self.next_index}")
            return None
        if header.count > self.welcome.group:
            raise ProtocolError(
                f"a message of {header.count} batches on a stream of at most {self.welcome.group}"
            )
        try:
            check_message(header, self.rows, self.welcome.num_batches, self.graphs)
        except ProtocolError as e:
            raise ProtocolError(
                f"{e} (job {self.hello.job}, rank {self.hello.rank}, epoch {self.epoch})"
            ) from None
        self.next_index += header.count
        return header, frames

    def _is_mine(self, stream: int | None) -> bool:
        """Whether an Error naming ``stream`` is about this stream.

        Before its Welcome the client does not know its stream id, and the server may fail
        the stream while preparing it (a corrupt shard, a refused rank): such an Error names an
        id the client has not seen. The one id that can be stale then is the last stream
        welcomed on this socket: the server ends it on our Hello, and whatever it sent for it
        before arrives first (one socket, in order).
        """
        if stream is None:
            return True
        if self.welcome is not None:
            return stream == self.welcome.stream
        return stream != self.conn.last_stream

    def _on_error(self, code: ErrorCode, message: str, fatal: bool, stream: int | None) -> None:
        if not self._is_mine(stream):
            return
        where = f"(job {self.hello.job}, rank {self.hello.rank}, epoch {self.epoch}, next batch {self.next_index})"
        if fatal:
            raise error_for_code(code, f"{message} {where}")
        if code is ErrorCode.JOB_NOT_FOUND:
            self._job_missing = True
        if code in RECOVERABLE:
            self._recover(f"server said {code.value}: {message}")
        elif code is ErrorCode.SHARE_DETACHED:
            self.stats.detached += 1
            log.warning("shardserve: %s %s", message, where)
        else:
            log.warning("non-fatal error from the server %s: %s %s", code.value, message, where)

    # -- sending ---------------------------------------------------------------------------

    def _send_hello(self, start: int, again: bool = False) -> None:
        # Slots the consumer still holds must stay lent if the server hands this client's
        # ring to the new stream; the others (those on their way back too) come back free.
        ring = self._rings.ring
        keep = ring.ledger.keep() if ring is not None else ()
        self.hello = self.hello.model_copy(
            update={
                "start_batch": start,
                "nonce": secrets.randbits(62),
                "keep": keep,
                "keep_ring": ring.ring.name if ring is not None and keep else "",
            }
        )
        self.welcome = None
        self._job_missing = False
        self._hello_at = time.monotonic()
        self._pending_grant = 0
        self.credit_outstanding = self.hello.credit
        if self._place is not None:
            endpoint = self._place(self.hello, again)
            if endpoint != self.conn.endpoint:
                self.conn.retarget(endpoint)
        self.conn.send(self.hello)

    def _flush_grant(self) -> None:
        returns = self.ring.ledger.returns() if self.ring is not None else ()
        if not (self._pending_grant or returns) or self.welcome is None:
            return
        credit = Credit(grant=self._pending_grant, slots=returns, stats=self.stats.due_report())
        if self.conn.send(credit):
            self.credit_outstanding += self._pending_grant
            self._pending_grant = 0
            if self.ring is not None:
                self.ring.ledger.returned(returns)

    def _recover(self, reason: str) -> None:
        """Re-create the job (idempotent) and re-open the stream at the next undelivered batch.

        Within the backoff window a second trigger is ignored: errors answering Hellos that
        were queued while the server was down must not set off a Hello storm.
        """
        now = time.monotonic()
        if now < self._next_recover:
            return
        log.info(
            "re-opening stream of job %s rank %s at batch %s: %s",
            self.hello.job,
            self.hello.rank,
            self.next_index,
            reason,
        )
        self.stats.reconnects += 1
        # A server that restarted without the job answers this Hello JOB_NOT_FOUND; the job
        # is posted again meanwhile, and the Hello repeated once it is (see next()). Still
        # down: the Hello waits in libzmq's queue and goes out on reconnect.
        self._recreate.start()
        self._send_hello(self.next_index, again=True)
        self._last_heard = now
        self._next_recover = now + self._backoff
        self._backoff = min(MAX_BACKOFF_S, self._backoff * 2)

    def _recreated(self) -> bool:
        """Whether the job was posted again since the last look; a refusal (the dataset
        changed) is raised here, a server still away is left to the next recovery."""
        try:
            return self._recreate.check()
        except ServerUnavailable as e:
            log.debug("job %s not re-created yet: %s", self.hello.job, e)
            return False

    def _stall(self, waited: float) -> ShardserveError:
        state = (
            "streaming"
            if self.welcome is not None
            else f"waiting for Welcome to Hello nonce {self.hello.nonce}"
        )
        last = self.next_index - 1 if self.next_index > 0 else None
        return DataStallError(
            f"no batch within {waited:.1f} s (timeout={self.timeout}): waited for batch {self.next_index} "
            f"of epoch {self.epoch}, job {self.hello.job}, rank {self.hello.rank} on {self.conn.endpoint}; "
            f"last batch received: {last if last is not None else 'none'}; stream {state}; "
            f"credit outstanding: {self.credit_outstanding}; reconnects: {self.stats.reconnects}; "
            f"{self._describe()}"
        )
