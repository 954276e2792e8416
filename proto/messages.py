"""Wire messages of the data plane. Pure data: no sockets, no clocks.

One DEALER per stream (a job's rank) talks to the server's ROUTER::

    client (DEALER)                          server (ROUTER)
      Hello(job, rank, epoch, start, credit, group) ->
                                             <- Welcome(stream, num_batches, group, ...) | Reject
      [Credit(grant, slots, stats)]          ->     (any time; adds to the credit)
                                             <- Batch(stream, epoch, index, count, parts)
                                                    (count batches per message, at most
                                                     credit batches in flight)
                                             <- EndOfEpoch(stream, epoch)
      Heartbeat(stats)                       ->     (while waiting)
                                             <- Heartbeat                  (while the stream is
                                                                            owed batches)
                                             <- Error(code, message)       (any time)
      Bye                                    ->

A new ``Hello`` on the same socket replaces the stream (next epoch, resume point); the
client tells old from new by ``Welcome.nonce`` and ``Batch.stream``. The server never sends
a batch the client has not granted credit for, so a slow consumer bounds the memory that
its stream may hold on both sides.

Small batches travel several to a message: a ``Batch`` carries ``count``
consecutive batches of the plan, ``rows`` samples each (the last of an epoch may be short),
one after the other in every part, and the client cuts them apart. Credit still counts
batches. The server picks how many per message (``Welcome.group``), at most what the Hello
allows, so a message stays around ``GROUP_BYTES``.

Control messages are pydantic models encoded as JSON; the hot ``Batch`` header is a packed
struct (see :mod:`shardserve.proto.framing`).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from .endpoints import Delivery
from .errors import ErrorCode

#: The data-plane protocol version this code speaks (3: ``Hello.offset`` and ``Hello.origin``,
#: elastic resume).
PROTOCOL_VERSION = 3
SUPPORTED_PROTOCOLS = (3,)

#: Upper bound on credit one stream may hold; more is refused, not clamped silently.
MAX_CREDIT = 1024
#: Upper bound on batches one message may carry (``Hello.group``).
MAX_GROUP = 256
#: Small batches go several to a message until it holds about this many bytes: a message
#: costs both processes a fixed ~0.1-0.5 ms however small it is.
GROUP_BYTES = 4 << 20
#: Upper bounds a decoder enforces before allocating anything.
MAX_PARTS = 256
MAX_NDIM = 8
MAX_PART_BYTES = 1 << 34  # 16 GiB


class Kind(IntEnum):
    HELLO = 1
    WELCOME = 2
    REJECT = 3
    CREDIT = 4
    BATCH = 5
    END_OF_EPOCH = 6
    HEARTBEAT = 7
    ERROR = 8
    BYE = 9


class _Msg(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


#: Bounds of what a peer may report: counts fit a float exactly, seconds are finite and under
#: ~30 years (``Infinity`` passed ``ge=0`` and reached the status page and metrics).
MAX_REPORTED_COUNT = 1 << 53
MAX_REPORTED_S = 1e9


class ClientStats(_Msg):
    """What a client reports about its own loop (telemetry for the status page)."""

    batches: int = Field(default=0, ge=0, le=MAX_REPORTED_COUNT)
    wait_s: float = Field(default=0.0, ge=0, le=MAX_REPORTED_S, allow_inf_nan=False)
    compute_s: float = Field(default=0.0, ge=0, le=MAX_REPORTED_S, allow_inf_nan=False)


class Hello(_Msg):
    kind: Literal[Kind.HELLO] = Kind.HELLO
    protocols: tuple[Annotated[int, Field(ge=0, lt=256)], ...] = Field(
        default=SUPPORTED_PROTOCOLS, max_length=16
    )
    job: str = Field(min_length=1, max_length=64)
    rank: int = Field(ge=0, lt=1 << 16)
    epoch: int = Field(ge=0, lt=1 << 31)
    start_batch: int = Field(default=0, ge=0, le=MAX_REPORTED_COUNT)
    credit: int = Field(ge=1, le=MAX_CREDIT)
    #: Echoed in Welcome so the client can tell this stream's reply from an older one's.
    nonce: int = Field(default=0, ge=0, lt=1 << 63)
    token: str = Field(default="", max_length=4096)
    #: "auto" asks for shared memory when the server shares this host; "socket" never does.
    transport: Literal["auto", "socket"] = "auto"
    host: str = Field(default="", max_length=255)
    #: Boot id of the client's kernel; equal boot ids mean one host and one /dev/shm.
    boot_id: str = Field(default="", max_length=64)
    pid: int = Field(default=0, ge=0, lt=1 << 32)
    #: Slots of this client's current ring that it still reads from (batches of an earlier
    #: stream the consumer holds): a server reusing the ring keeps them out of the free list.
    keep: tuple[Annotated[int, Field(ge=0, lt=MAX_CREDIT)], ...] = Field(
        default=(), max_length=MAX_CREDIT
    )
    #: The ring ``keep`` names slots of: a server honours ``keep`` only when the ring it hands
    #: this stream is that one. After a server restart, or a Hello sent again before the
    #: Welcome, the server's ring for this peer is not the one the client still reads.
    keep_ring: str = Field(default="", max_length=255)
    #: Most batches this client takes in one message (1: one batch per message).
    group: int = Field(default=1, ge=1, le=MAX_GROUP)
    #: Elastic resume (:mod:`.resume`): positions of the epoch's order dealt before this
    #: stream's plan (``< batch size * world size``); ``start_batch`` counts in that deal.
    offset: int = Field(default=0, ge=0, le=MAX_REPORTED_COUNT)
    #: The job whose state this epoch resumes when that job had another world size (its
    #: id), shown on this job's status as the link between the two; ``""`` otherwise.
    origin: str = Field(default="", max_length=64)


class ShmRing(_Msg):
    """A shared-memory slot ring the server made for this stream."""

    name: str
    slots: int = Field(ge=1, le=MAX_CREDIT)
    slot_bytes: int = Field(ge=1)


class Welcome(_Msg):
    kind: Literal[Kind.WELCOME] = Kind.WELCOME
    protocol: int = PROTOCOL_VERSION
    stream: int = Field(ge=0, lt=1 << 32)
    nonce: int
    job: str
    rank: int
    epoch: int
    seed: int
    start_batch: int
    num_batches: int
    heartbeat_s: float
    transport: Delivery = "socket"
    shm: ShmRing | None = None
    #: Most batches the server sends in one message on this stream.
    group: int = Field(default=1, ge=1, le=MAX_GROUP)


class Reject(_Msg):
    kind: Literal[Kind.REJECT] = Kind.REJECT
    code: ErrorCode
    message: str
    nonce: int = 0
    server_protocols: tuple[int, ...] = SUPPORTED_PROTOCOLS


class Credit(_Msg):
    kind: Literal[Kind.CREDIT] = Kind.CREDIT
    grant: int = Field(ge=0, le=MAX_CREDIT)
    #: Shared-memory slots the client is done with.
    slots: tuple[int, ...] = Field(default=(), max_length=MAX_CREDIT)
    stats: ClientStats | None = None


class EndOfEpoch(_Msg):
    kind: Literal[Kind.END_OF_EPOCH] = Kind.END_OF_EPOCH
    stream: int
    epoch: int
    num_batches: int


class Heartbeat(_Msg):
    kind: Literal[Kind.HEARTBEAT] = Kind.HEARTBEAT
    stats: ClientStats | None = None


class Error(_Msg):
    kind: Literal[Kind.ERROR] = Kind.ERROR
    code: ErrorCode
    message: str
    #: Fatal errors end the stream; a client should not retry them.
    fatal: bool = True
    stream: int | None = None


class Bye(_Msg):
    kind: Literal[Kind.BYE] = Kind.BYE


ControlMessage = Hello | Welcome | Reject | Credit | EndOfEpoch | Heartbeat | Error | Bye

CONTROL_MODELS: dict[Kind, type[_Msg]] = {
    Kind.HELLO: Hello,
    Kind.WELCOME: Welcome,
    Kind.REJECT: Reject,
    Kind.CREDIT: Credit,
    Kind.END_OF_EPOCH: EndOfEpoch,
    Kind.HEARTBEAT: Heartbeat,
    Kind.ERROR: Error,
    Kind.BYE: Bye,
}


@dataclass(frozen=True, slots=True)
class PartHeader:
    """One array of a batch: a field, or a field's offsets/shapes companion.

    ``offset`` is the byte offset inside the shared-memory slot (0 on the socket path).
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    offset: int = 0


@dataclass(frozen=True, slots=True)
class BatchHeader:
    """The small header in front of a batch's raw frames.

    ``slot`` is -1 when the payload follows as frames, else the shared-memory slot holding it.
    The message holds ``count`` batches, ``index`` to ``index + count - 1``, of ``rows``
    samples each (the last may be short), one after the other in every part.
    """

    stream: int
    epoch: int
    index: int
    parts: tuple[PartHeader, ...]
    slot: int = -1
    count: int = 1
    rows: int = 0

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)


Message = ControlMessage | BatchHeader
