"""One stream's batch flow as pure bookkeeping: credit, what to assemble next, in-order release.

No sockets, no threads, no clocks: the handler feeds events in (a Credit, an assembled batch,
a send) and asks what to do next. Counters, in batch indices of the rank's epoch plan::

    start_batch <= next_send <= next_submit <= num_batches
                   |<- in flight ->|            in flight = assembling or assembled, unsent
    credit    = batches granted that are not yet submitted for assembly
    owed      = credit + in flight        (what the client may still receive: its credit)

Work is taken only while ``credit > 0``, so ``owed`` never exceeds what the client granted:
a consumer that stops reading holds at most its credit in memory on both sides. Batches are
released strictly in index order; results that finish out of order wait in ``ready``.

Small batches go several to a message: :meth:`Pipeline.take` hands out a *span*
of up to ``most`` consecutive batches, assembled, sent and released as one; every counter
still counts batches.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Generic, Protocol, TypeVar

from shardserve.proto.messages import GROUP_BYTES, MAX_CREDIT

from .shares import ShareGroup

#: Assemblies one stream may have queued at once: enough to keep the pool busy, few enough
#: that one greedy stream does not starve the others of assembly threads.
MAX_INFLIGHT_PER_STREAM = 4
#: A lone stream's batches up to this size are assembled on the streamer thread itself: for
#: a CIFAR batch the pool's two thread hand-offs (submit, wake with the result) cost more
#: CPU than the gather. Bigger batches, or several streams, use the pool.
INLINE_MAX_BYTES = 4 << 20
#: An inline gather slower than this (pages not cached: the disk is being read) blocks the
#: streamer's heartbeats, so that stream's next ``INLINE_BACKOFF`` batches go to the pool.
INLINE_MAX_S = 0.01
INLINE_BACKOFF = 64

T = TypeVar("T")


#: The bytes a message of variable-size batches (graphs, token lists) is kept within: their
#: gather and collation pass over a message's data several times, and past about this much
#: (the caches of this class of machine) a 64-graph batch cost more per batch in a bigger
#: message, not less (bench_small: 2 batches a message 670 us each, 5 batches 1,080 us).
RAGGED_GROUP_BYTES = 2 << 20


def choose_group(batch_bytes: int, credit: int, most: int, ragged: bool = False) -> int:
    """Batches per message for a stream: as many as fit ``GROUP_BYTES`` (or
    ``RAGGED_GROUP_BYTES`` when some parts vary in size), at most ``most`` (the client's cap)
    and half the credit, so that one message is in flight while the client reads the other.

    A batch of variable parts that fits ``RAGGED_GROUP_BYTES`` alone still goes two to a
    message: one per message pays the message's fixed costs (its send, header and credit,
    the pump's wake) per batch, and those outweigh the cache (64 CHGNet-sized graphs, 1.65 MB,
    epochs of each interleaved on 2 busy cores: server CPU 1,262 us a batch one to a message,
    1,118 us two to a message, medians of 4).

    >>> choose_group(100_000, credit=32, most=64), choose_group(8 << 20, 32, 64)
    (16, 1)
    >>> choose_group(700_000, 32, 64, ragged=True), choose_group(1_700_000, 4, 64, ragged=True)
    (2, 2)
    """
    limit = RAGGED_GROUP_BYTES if ragged else GROUP_BYTES
    fit = limit // max(batch_bytes, 1)
    if ragged and fit == 1:
        fit = 2
    return max(1, min(most, credit // 2, fit))


def ring_slots(credit: int, group: int) -> int:
    """Shared-memory slots for a stream of ``group`` batches per slot: one per batch of
    credit when a slot is one batch; else enough for the messages credit allows in flight,
    plus one the client's loop still holds and one being refilled.

    >>> ring_slots(32, 1), ring_slots(32, 16), ring_slots(4, 2)
    (32, 4, 4)
    """
    if group == 1:
        return credit
    return min(credit, -(-credit // group) + 2)


class WorkKind(Enum):
    PREPARE = "prepare"
    BATCH = "batch"
    #: A span assembled for a share group (``Work.share``), whoever of its members asked.
    SHARED = "shared"


class TicketOwner(Protocol):
    """Who lent a batch's memory (a :class:`~.sinks.BatchSink`): told when it is not needed."""

    def release(self, ticket: int) -> None: ...

    def forfeit(self, ticket: int) -> None: ...


@dataclass(frozen=True, slots=True)
class Work:
    """What a job on the assembler is for; it comes back with the result, so a result of a
    stream that was replaced or closed meanwhile is recognised (``stream`` differs) and dropped.

    Batches carry their ``index`` (the first of the span) and the ``ticket`` of the memory
    they are assembled into, with its ``owner``, so a batch that will never be sent still
    gives its memory back.
    """

    kind: WorkKind
    ident: bytes
    stream: int
    index: int = -1
    ticket: int = -1
    owner: TicketOwner | None = None
    #: The share group a ``SHARED`` span is for (the group itself: a later group of the same
    #: key, made after this one was dropped, is not the one that asked).
    share: ShareGroup | None = None

    def abandon(self) -> None:
        """The batch will not be sent (its stream is gone): free its memory."""
        if self.owner is not None:
            self.owner.release(self.ticket)

    def forfeit(self) -> None:
        """The batch failed: end its ticket without reusing its memory (a transform thread
        past its deadline may still write into it)."""
        if self.owner is not None:
            self.owner.forfeit(self.ticket)


class CreditOverflow(ValueError):
    """A Credit would let a stream hold more than ``MAX_CREDIT`` batches."""


@dataclass
class Pipeline(Generic[T]):
    """The counters of one stream (see the module docstring); ``T`` is an assembled batch."""

    start_batch: int
    num_batches: int
    credit: int
    next_submit: int = field(init=False)
    next_send: int = field(init=False)
    #: Batches handed to the assembly pool whose result has not come back.
    assembling: int = 0
    #: Batch index before which assembly stays on the pool (set after a slow inline take).
    pool_until: int = 0
    #: Assembled batches waiting for their turn, by index.
    ready: dict[int, T] = field(default_factory=dict)
    #: Batches in each span taken and not yet released, by its first index.
    spans: dict[int, int] = field(default_factory=dict)
    #: A shared stream's spans end on multiples of this many batches, each taken only with the
    #: credit for all of it, so every subscriber of the group takes the same spans; 0: any.
    grid: int = 0
    #: Before the client has read: no batch at or past this index is taken, whatever the
    #: credit (its allotment, see ``.unread``); ``None``: credit alone bounds the stream.
    until: int | None = None

    def __post_init__(self) -> None:
        self.next_submit = self.next_send = self.start_batch

    @property
    def in_flight(self) -> int:
        return self.next_submit - self.next_send

    @property
    def owed(self) -> int:
        """Batches the client has granted and not yet received."""
        return self.credit + self.in_flight

    def allot(self, batches: int | None) -> None:
        """Take at most ``batches`` from the first (``None``: as credit allows)."""
        self.until = None if batches is None else self.start_batch + batches

    @property
    def done_sending(self) -> bool:
        return self.next_send >= self.num_batches

    def grant(self, n: int) -> None:
        """Add a Credit's grant; raises :class:`CreditOverflow` (nothing changed) past the cap."""
        if self.owed + n > MAX_CREDIT:
            raise CreditOverflow(
                f"credit would reach {self.owed + n}, over the {MAX_CREDIT} a stream may hold"
            )
        self.credit += n

    def _end(self) -> int:
        """The index no batch is taken at or past now: the epoch's end or the allotment's."""
        return self.num_batches if self.until is None else min(self.until, self.num_batches)

    def _aligned(self) -> int:
        """The length of the next span on the grid (to the next multiple, or the epoch's end)."""
        i = self.next_submit
        return min(self.grid - i % self.grid, self.num_batches - i)

    def wants_work(self) -> bool:
        """Whether one more batch (one more span, on a grid) may be taken for assembly now."""
        return (
            self.credit >= (self._aligned() if self.grid else 1)
            and self.credit > 0
            and self.next_submit < self._end()
            and self.assembling < MAX_INFLIGHT_PER_STREAM
        )

    def take(self, most: int = 1) -> tuple[int, int]:
        """The first index and the count of the next span to assemble as one message: up to
        ``most`` batches, as many as the credit and the epoch allow, each spending one credit
        (check :meth:`wants_work` first)."""
        if not self.wants_work():
            raise RuntimeError(
                f"no work to take: credit {self.credit}, next {self.next_submit} of "
                f"{self.num_batches}, {self.assembling} assembling"
            )
        index = self.next_submit
        if self.grid:
            count = self._aligned()
        else:
            count = max(1, min(most, self.credit, self._end() - index))
        self.next_submit += count
        self.credit -= count
        self.spans[index] = count
        return index, count

    def span(self, index: int) -> int:
        """How many batches the span starting at ``index`` holds."""
        return self.spans[index]

    def offloaded(self) -> None:
        """The batch just taken went to the assembly pool."""
        self.assembling += 1

    def returned(self) -> None:
        """A batch came back from the pool (assembled, failed, or for a closed stream)."""
        self.assembling -= 1

    def assembled(self, index: int, batch: T) -> None:
        self.ready[index] = batch

    def next_ready(self) -> T | None:
        """The batch to send now (the next in order), if it is assembled."""
        return self.ready.get(self.next_send)

    def released(self) -> int:
        """The span from :meth:`next_ready` was sent; returns its first index."""
        index = self.next_send
        del self.ready[index]
        self.next_send += self.spans.pop(index)
        return index

    def drain(self) -> list[T]:
        """Assembled batches that will now never be sent (the stream is closing)."""
        batches = list(self.ready.values())
        self.ready.clear()
        self.spans.clear()
        return batches

    # -- where the next batch is assembled -----------------------------------------------

    def inline(self, batch_bytes: int, others_busy: bool) -> bool:
        """Whether the next batch is assembled on the streamer thread rather than the pool:
        only small batches of a lone stream, and not during a backoff after a slow one."""
        if batch_bytes > INLINE_MAX_BYTES or self.next_submit < self.pool_until:
            return False
        return not others_busy  # another stream's work would wait behind this one's gathers

    def timed_inline(self, index: int, seconds: float) -> None:
        """An inline gather of ``index`` took ``seconds``; a slow one (a disk read) sends the
        next ``INLINE_BACKOFF`` batches to the pool, so heartbeats keep flowing."""
        if seconds > INLINE_MAX_S:
            self.pool_until = index + INLINE_BACKOFF
