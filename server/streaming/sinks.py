"""Where a stream's batches are assembled and how they leave: one :class:`BatchSink` per stream.

A sink hands out *tickets* — an ``int`` naming the memory one batch is assembled into — and
sends an assembled batch by its ticket. Every ticket ends exactly once: :meth:`~BatchSink.send`
or :meth:`~BatchSink.release` (never sent: failed, or its stream closed)::

    acquire -> ticket --out()/placer() on the worker--> send (ok) -> done
                  |                                      | zmq.Again: kept, sent again later
                  +--------------- release --------------+  (assembly failed, stream closed)

* :class:`SocketSink` gathers into the rank's reusable :class:`~.buffers.BufferPool` and sends
  the arrays zero-copy; :class:`IdlePools` keeps pools of (job, rank)s between their streams
  (epochs), least recently used dropped past a byte budget.
* :class:`SlotSink` gathers straight into a shared-memory slot (:class:`~.shm.ShmSlots`) and
  sends only the slot number; the client reads the slot in place and returns it in a Credit.
  :class:`RingBook` holds the server-wide ring limit and hands a peer's ring to its next
  stream.

A third way to deliver (say, GPU memory) is one more subclass; the handler picks a sink when a
stream is welcomed (``StreamHandler._open_sink``). Streamer thread only, except ``out`` arrays
and the ``placer`` callable, which the assembly worker holding the ticket uses.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import numpy as np
import zmq

from shardserve.proto.endpoints import Delivery
from shardserve.proto.framing import encode_batch
from shardserve.proto.messages import BatchHeader, PartHeader, ShmRing

from ..runtime.rings import ShmUnavailable
from ..source import BatchParts, BatchSource, PartShapes, Placer
from .buffers import BufferPool, BufferSet
from .shm import ShmSlots

#: Bytes of buffer pools kept for (job, rank)s between their streams (pools of open streams
#: always stay); past it the least recently used idle pools are dropped.
IDLE_POOL_BYTES = 1 << 30
#: Seconds a pool (or a slot ring) waits for its (job, rank)'s (peer's) next stream: the next
#: epoch's Hello comes at once; memory of a stream nobody resumes goes back after this.
IDLE_KEEP_S = 10.0


@dataclass(frozen=True, slots=True)
class Route:
    """Where one stream's batches go: the server's ROUTER socket and the peer's routing id;
    ``rows`` is the batch size the headers tell the client to cut messages by."""

    sock: zmq.Socket
    ident: bytes
    stream: int
    epoch: int
    rows: int = 0

    def header(
        self, index: int, count: int, parts: tuple[PartHeader, ...], slot: int = -1
    ) -> BatchHeader:
        return BatchHeader(self.stream, self.epoch, index, parts, slot, count, self.rows)

    def send(self, header: BatchHeader, payload: list[zmq.Frame] | list[bytes]) -> None:
        """Send without blocking; raises ``zmq.Again`` (peer's queue full: nothing was sent)
        or ``zmq.ZMQError`` (``EHOSTUNREACH``: the peer is gone)."""
        frames = [self.ident, *encode_batch(header, payload)]
        self.sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)


def part_headers(parts: BatchParts) -> tuple[PartHeader, ...]:
    return tuple(PartHeader(n, a.dtype.name, a.shape, a.nbytes) for n, a in parts.items())


class BatchSink(ABC):
    """One stream's way of delivering batches (see the module docstring)."""

    transport: ClassVar[Delivery]
    #: Whether :meth:`fill` copies the batch (into memory of the sink's own).
    copies_on_fill: ClassVar[bool] = False

    def __init__(self, route: Route) -> None:
        self.route = route
        #: Batches that did not fit the sink's memory and went over the socket as a copy.
        self.overflowed = 0

    @abstractmethod
    def acquire(self) -> int | None:
        """A ticket for one batch's memory, or ``None`` when none is free (the client holds
        it; a Credit returns some)."""

    @abstractmethod
    def out(self, ticket: int, rows: int) -> Mapping[str, np.ndarray] | None:
        """Arrays the store's ``take`` writes the fixed-size parts into, if the sink has any."""

    def placer(self, ticket: int) -> Placer | None:
        """What moves a gathered batch where it is sent from (on the worker), if anything."""
        return None

    @abstractmethod
    def fill(self, ticket: int, parts: BatchParts) -> BatchParts:
        """A batch assembled elsewhere (a share group's, read-only and kept by the group)
        made this ticket's: the parts to send."""

    @abstractmethod
    def send(self, ticket: int, index: int, parts: BatchParts, count: int = 1) -> int:
        """Send batches ``index`` to ``index + count - 1`` (one message) and end its ticket;
        returns the payload bytes. On ``zmq.Again`` the ticket stays held, to be sent again."""

    @abstractmethod
    def release(self, ticket: int) -> None:
        """End a ticket whose batch will never be sent."""

    @abstractmethod
    def forfeit(self, ticket: int) -> None:
        """End a ticket whose assembly failed without reusing its memory: a transform thread
        that missed its deadline cannot be stopped and may still write into it."""

    def returned(self, slots: Iterable[int]) -> list[int]:
        """Slots a Credit gives back; returns those the client did not hold (ignored)."""
        return list(slots)

    @property
    def ring(self) -> ShmRing | None:
        """What the client maps to read batches in place (the Welcome carries it)."""
        return None

    def mapped(self) -> None:  # noqa: B027 - only sinks with client-mapped memory care
        """The client proved it reads this sink's memory (its first Credit on the stream)."""

    def close(self, handover: bool = False) -> None:  # noqa: B027 - most sinks hold nothing
        """The stream ended; ``handover``: the same client's next stream may take over what
        it held (no assembly still writes into it)."""


class SocketSink(BatchSink):
    """Batches gathered into reusable buffer sets and sent as zero-copy frames.

    An array sent with ``copy=False`` belongs to libzmq until its I/O thread has written it,
    so a set goes back to the pool only when the ``MessageTracker`` of its send says so.
    Without a pool (a shared stream) every batch is a share group's, never written again:
    sent zero-copy from the group's buffer, which libzmq's reference keeps alive.
    """

    transport: ClassVar[Delivery] = "socket"

    def __init__(self, route: Route, pool: BufferPool | None) -> None:
        super().__init__(route)
        self.pool = pool
        self._sets: dict[int, BufferSet] = {}
        self._next_ticket = 0

    def acquire(self) -> int:
        ticket = self._next_ticket
        self._next_ticket += 1
        bufs = self.pool.acquire() if self.pool is not None else None
        if bufs is not None:  # None: every part is variable-size, take allocates them
            self._sets[ticket] = bufs
        return ticket

    def out(self, ticket: int, rows: int) -> Mapping[str, np.ndarray] | None:
        bufs = self._sets.get(ticket)
        return None if bufs is None else bufs.views(rows)

    def fill(self, ticket: int, parts: BatchParts) -> BatchParts:
        self.release(ticket)  # sent from the group's buffer: the ticket's own is not needed
        return parts

    def send(self, ticket: int, index: int, parts: BatchParts, count: int = 1) -> int:
        r = self.route
        header = r.header(index, count, part_headers(parts))
        bufs = self._sets.get(ticket)
        frames = [zmq.Frame(a, track=bufs is not None) for a in parts.values()]
        r.send(header, frames)
        if bufs is not None and self.pool is not None:
            del self._sets[ticket]
            self.pool.release(bufs, zmq.MessageTracker(*frames))
        return header.nbytes

    def release(self, ticket: int) -> None:
        bufs = self._sets.pop(ticket, None)
        if bufs is not None and self.pool is not None:
            self.pool.release(bufs)

    def forfeit(self, ticket: int) -> None:
        bufs = self._sets.pop(ticket, None)
        if bufs is not None and self.pool is not None:
            self.pool.forfeit(bufs)


class SlotSink(BatchSink):
    """Batches gathered into shared-memory slots; the socket carries only slot numbers.

    A batch whose variable-size parts outgrow the slot is copied out and sent on the socket,
    its slot freed at once (counted in :attr:`overflowed`).
    """

    transport: ClassVar[Delivery] = "shm"
    copies_on_fill: ClassVar[bool] = True

    def __init__(self, route: Route, slots: ShmSlots, book: RingBook) -> None:
        super().__init__(route)
        self.slots = slots
        self._book = book

    def acquire(self) -> int | None:
        return self.slots.acquire()

    def out(self, ticket: int, rows: int) -> Mapping[str, np.ndarray]:
        return self.slots.out(ticket, rows)

    def placer(self, ticket: int) -> Placer:
        return self.slots.tail(ticket)

    def fill(self, ticket: int, parts: BatchParts) -> BatchParts:
        return self.slots.copy_in(ticket, parts)

    def send(self, ticket: int, index: int, parts: BatchParts, count: int = 1) -> int:
        r = self.route
        in_slot = self.slots.headers(ticket, parts)
        if in_slot is not None:
            header = r.header(index, count, in_slot, ticket)
            r.send(header, [])
            self.slots.lend(ticket)  # the client hands it back in a Credit
            return header.nbytes
        header = r.header(index, count, part_headers(parts))
        r.send(header, [a.tobytes() for a in parts.values()])
        self.slots.release(ticket)
        self.overflowed += 1
        return header.nbytes

    def release(self, ticket: int) -> None:
        with contextlib.suppress(Exception):  # a closed ring: nothing to release
            self.slots.release(ticket)

    def forfeit(self, ticket: int) -> None:
        # The slot is neither freed nor lent. A failed batch fails its stream, whose ring is
        # then unlinked: a ring goes to the peer's next stream only when nothing was being
        # assembled, so no later batch is written into this slot.
        return

    def returned(self, slots: Iterable[int]) -> list[int]:
        return self.slots.give_back(slots)

    @property
    def ring(self) -> ShmRing:
        return self.slots.info

    def mapped(self) -> None:
        self._book.prove(self.slots)

    def close(self, handover: bool = False) -> None:
        self._book.retire(self.route.ident, self.slots, handover)


class IdlePools:
    """Buffer pools by (job, rank), kept across that rank's streams: a new stream then writes
    into pages already faulted in instead of fresh ones (~0.1 s per GB). Idle pools past
    ``max_idle_bytes`` go, least recently used first."""

    def __init__(self, max_idle_bytes: int = IDLE_POOL_BYTES, keep_s: float = IDLE_KEEP_S) -> None:
        self.max_idle_bytes = max_idle_bytes
        self.keep_s = keep_s
        self._pools: dict[tuple[str, int], BufferPool] = {}  # in least-recently-used order
        #: When each pool was first seen without a live stream.
        self._idle_since: dict[tuple[str, int], float] = {}

    def get(
        self,
        key: tuple[str, int],
        part_shapes: PartShapes,
        batch_size: int,
        live: set[tuple[str, int]],
    ) -> BufferPool:
        """The pool for ``key`` (made, or remade if its layout changed); ``live`` keys are
        never dropped."""
        pool = self._pools.pop(key, None)
        self._idle_since.pop(key, None)
        # Remade when the shapes changed, or the rows (batches per message).
        if pool is None or pool.part_shapes != dict(part_shapes) or pool.batch_size != batch_size:
            pool = BufferPool(part_shapes, batch_size)
        self._pools[key] = pool
        total = sum(p.nbytes for p in self._pools.values())
        for k in [k for k in self._pools if k not in live and k != key]:
            if total <= self.max_idle_bytes:
                break
            total -= self._pools.pop(k).nbytes
            self._idle_since.pop(k, None)
        return pool

    def expire(self, now: float, live: set[tuple[str, int]]) -> int:
        """Drop pools that have had no live stream for ``keep_s``; how many were dropped."""
        dropped = 0
        for k in list(self._pools):
            if k in live:
                self._idle_since.pop(k, None)
                continue
            since = self._idle_since.setdefault(k, now)
            if now - since >= self.keep_s:
                del self._pools[k], self._idle_since[k]
                dropped += 1
        return dropped

    def forget_job(self, job_id: str) -> None:
        for key in [k for k in self._pools if k[0] == job_id]:
            del self._pools[key]
            self._idle_since.pop(key, None)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self._pools.values())


class RingBook:
    """Every slot ring of this server: the shared limit, and rings handed to a peer's next
    stream (its epochs reuse one ring: pages faulted in on both sides, no file to zero-fill).

    A new ring is *unproven* until its client's first Credit on the stream: a client sends
    Credits only for batches it read out of the ring, and one that cannot map it says Hello
    again on the socket (which unlinks the ring at once). Only proven rings count against
    ``limit_bytes``, so a peer that claims this host's boot id and never maps its ring cannot
    crowd real same-host clients out of shared memory; unproven rings are capped in number
    (``max_unproven``) instead, each within the limit. Shared memory in use is therefore at
    most ``limit_bytes + max_unproven x limit_bytes`` (a ring past either is refused and its
    stream uses the socket). A ring handed to the peer's next stream stays proven.
    """

    def __init__(
        self,
        shm_dir: Path,
        limit_bytes: int | None,
        max_unproven: int = 16,
        keep_s: float = IDLE_KEEP_S,
        ring_bytes: int | None = None,
    ) -> None:
        self.shm_dir = shm_dir
        self.limit_bytes = limit_bytes
        #: Most bytes of one ring (see :meth:`~.shm.ShmSlots.create`).
        self.ring_bytes = ring_bytes
        self.max_unproven = max_unproven
        self.keep_s = keep_s
        self._live: dict[int, ShmSlots] = {}
        self._unproven: set[int] = set()
        self._handed: dict[bytes, ShmSlots] = {}
        #: When each handed ring was handed (unlinked when its peer is not back in ``keep_s``).
        self._handed_at: dict[bytes, float] = {}

    @property
    def live_bytes(self) -> int:
        """Bytes of proven live rings (what the limit counts)."""
        return sum(x.ring.nbytes for k, x in self._live.items() if k not in self._unproven)

    @property
    def unproven(self) -> int:
        return len(self._unproven)

    def prove(self, slots: ShmSlots) -> None:
        self._unproven.discard(id(slots))

    def open(
        self,
        route: Route,
        nslots: int,
        source: BatchSource,
        fields: tuple[str, ...],
        batch_size: int,
        keep: tuple[int, ...],
        keep_ring: str,
    ) -> SlotSink:
        """A ring of ``nslots`` slots of ``batch_size`` rows each: the peer's previous ring if
        its layout fits, else a new one within the limit (raises :class:`~.shm.ShmUnavailable`).
        ``keep``: slots of the ring named ``keep_ring`` the client still reads; they stay lent
        only if that is the ring handed back."""
        slots = self._handed.pop(route.ident, None)
        self._handed_at.pop(route.ident, None)
        if slots is not None:
            # A ring whose file was removed (a cleanup of /dev/shm) cannot be mapped by name:
            # its client may need to, so the stream gets a new one.
            fits = slots.key == ShmSlots.key_for(nslots, source, fields, batch_size)
            if fits and slots.ring.on_disk():
                slots.reset(keep if keep_ring == slots.ring.name else ())
                self._live[id(slots)] = slots
                return SlotSink(route, slots, self)
            slots.close()
        if len(self._unproven) >= self.max_unproven:
            raise ShmUnavailable(
                f"{len(self._unproven)} rings already wait for their clients' first Credit "
                "(the proof they mapped them; --shm-unproven-rings)"
            )
        limit = self.limit_bytes
        if limit is not None:
            # The limit is for all proven rings together: same-host peers cannot fill /dev/shm.
            limit = max(limit - self.live_bytes, 0)
        slots = ShmSlots.create(
            route.stream,
            nslots,
            source,
            fields,
            batch_size,
            self.shm_dir,
            limit,
            ring_bytes=self.ring_bytes,
        )
        self._live[id(slots)] = slots
        self._unproven.add(id(slots))
        return SlotSink(route, slots, self)

    def retire(self, ident: bytes, slots: ShmSlots, handover: bool) -> None:
        """A stream ended: keep its ring for the peer's next stream, or unlink it."""
        self._live.pop(id(slots), None)
        self._unproven.discard(id(slots))
        if handover:
            self.discard(ident)
            self._handed[ident] = slots
            self._handed_at[ident] = -1.0  # stamped by the next expire()
        else:
            slots.close()  # unlinks the ring; a client still mapping it keeps its pages

    def discard(self, ident: bytes) -> None:
        """Unlink a ring left for ``ident``'s next stream that will not take it."""
        slots = self._handed.pop(ident, None)
        self._handed_at.pop(ident, None)
        if slots is not None:
            slots.close()

    def expire(self, now: float) -> int:
        """Unlink rings whose peer has not opened its next stream within ``keep_s``."""
        gone = 0
        for ident, at in list(self._handed_at.items()):
            if at < 0:
                self._handed_at[ident] = now
            elif now - at >= self.keep_s:
                self.discard(ident)
                gone += 1
        return gone

    def close(self) -> None:
        for ident in list(self._handed):
            self.discard(ident)
