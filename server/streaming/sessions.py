"""Per-stream state on the server: one :class:`Session` per client DEALER (job, rank).

Counters, all in batch indices of the epoch's plan for that rank::

    start_batch <= next_send <= next_submit <= num_batches
                   |<- in flight ->|            in flight = assembling or assembled, unsent
    credit    = batches granted that are not yet submitted for assembly
    owed      = credit + in flight        (what the client may still receive; its credit)

The streamer submits work only while ``credit > 0``, so ``owed`` never exceeds what the client
granted: a consumer that stops reading holds at most its credit in memory on both sides.
Batches are sent strictly in index order; results that finish out of order wait in ``ready``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from shardserve.proto.endpoints import Delivery as Transport

from ..jobs import Job
from .buffers import BufferPool, BufferSet

#: Assemblies one stream may have queued at once: enough to keep the pool busy, few enough
#: that one greedy stream does not starve the others of assembly threads.
MAX_INFLIGHT_PER_STREAM = 4


@dataclass(eq=False)
class Prepared:
    """What a stream needs before its first batch (built on the assembly pool; the buffer
    pool is attached on the streamer thread, which alone touches pools)."""

    dataset: Any
    plan: Any
    fields: tuple[str, ...]
    part_shapes: dict[str, Any]
    pool: BufferPool | None = None
    #: Expected bytes of one full batch (variable fields at the dataset's average).
    batch_bytes: int = 0


@dataclass(eq=False)
class Session:
    """One open stream: who it is for, where it is, what it may send."""

    ident: bytes
    stream: int
    job: Job
    rank: int
    epoch: int
    seed: int
    nonce: int
    start_batch: int
    num_batches: int
    credit: int
    transport: Transport = "socket"
    prepared: Prepared | None = None
    #: Asked for shared memory from this host; ``shm`` is its ring once made.
    want_shm: bool = False
    shm: Any = None
    #: Why the ring was refused (the stream then uses the socket).
    shm_fallback: str | None = None
    #: Batches of an shm stream too big for their slot, sent over the socket instead.
    socket_batches: int = 0
    #: The previous stream's ring, handed over by a new Hello from the same client, and the
    #: slots of it the client still reads from.
    reuse_shm: Any = None
    keep: tuple[int, ...] = ()
    next_submit: int = 0
    next_send: int = 0
    #: Assembled batches waiting for their turn: index -> (parts, buffer set or None).
    ready: dict[int, tuple[dict[str, np.ndarray], BufferSet | None]] = field(default_factory=dict)
    #: Batches handed to the assembly pool whose result has not come back.
    assembling: int = 0
    #: Batch index before which assembly stays on the pool (set after a slow inline take).
    pool_until: int = 0
    ended: bool = False
    #: Set when the session is closed; read by its pending planning work (any thread).
    closed: bool = False
    last_recv: float = field(default_factory=time.monotonic)
    last_send: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        self.next_submit = self.next_send = self.start_batch

    @property
    def job_id(self) -> str:
        return self.job.id

    @property
    def in_flight(self) -> int:
        return self.next_submit - self.next_send

    @property
    def owed(self) -> int:
        """Batches the client has granted and not yet received."""
        return self.credit + self.in_flight

    @property
    def done_sending(self) -> bool:
        return self.next_send >= self.num_batches

    def wants_work(self) -> bool:
        """Whether one more batch may be submitted for assembly now."""
        return (
            self.prepared is not None
            and self.credit > 0
            and self.next_submit < self.num_batches
            and self.assembling < MAX_INFLIGHT_PER_STREAM
        )

    def unsent_buffers(self) -> list[BufferSet]:
        """Buffer sets of assembled batches that will now never be sent (stream closing)."""
        sets = [bufs for _, bufs in self.ready.values() if bufs is not None]
        self.ready.clear()
        return sets

    def describe(self) -> dict[str, Any]:
        """Facts for log lines."""
        return {"job": self.job_id, "rank": self.rank, "stream": self.stream, "epoch": self.epoch}
