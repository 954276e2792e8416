"""Per-stream state on the server: one :class:`Session` per client DEALER (job, rank).

A session's batch counters live in its :class:`~.pipeline.Pipeline` (credit, in-order
release); where its batches are assembled and how they leave, in its
:class:`~.sinks.BatchSink`, made once the stream is :class:`Prepared`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, TypedDict

import numpy as np

from shardserve.proto.endpoints import Delivery as Transport
from shardserve.proto.errors import ErrorCode
from shardserve.proto.jobs import JobSpec
from shardserve.proto.messages import Error, Hello

from ..reading.sources import OpenSource, Stored
from ..registry.jobs import Job
from ..runtime.metrics import Metrics
from ..source import BatchParts, BatchSource, PartShapes, StreamPlan
from .board import BoardWrites
from .limits import StreamCancelled, check_job_batch
from .pipeline import Pipeline
from .shares import ShareGroup
from .sinks import BatchSink


class StreamFacts(TypedDict):
    """What every log line about a stream names."""

    job: str
    rank: int
    stream: int
    epoch: int


class LogExtras(TypedDict, total=False):
    """Facts some stream log lines add."""

    repeat: bool
    asked: str
    socket_batches: int


@dataclass(frozen=True, slots=True)
class Assembled:
    """A batch ready to send: its parts, and the sink's ticket for the memory they lie in."""

    parts: BatchParts
    ticket: int


@dataclass(frozen=True, eq=False)
class Prepared:
    """What a stream needs before its first batch (built on the planning lane)."""

    source: BatchSource
    #: The rank's batches; with ``envs > 1`` each is one step of every env's batch.
    plan: StreamPlan
    fields: tuple[str, ...]
    part_shapes: PartShapes
    #: The most samples one batch holds: ``batch_size``, or a rank's share of a split smaller
    #: than that (see :func:`~.limits.batch_rows`); buffers are sized by it.
    batch_rows: int
    #: Expected bytes of one full batch (variable fields at the dataset's average).
    batch_bytes: int
    #: Whether several batches may go in one message: each batch is gathered on its own
    #: terms (no batch transforms; graphs are collated per batch), so a span is its batches
    #: one after the other.
    groupable: bool = True
    #: The part whose values name each sample's source, counted by source on the board (a
    #: mixture's, see :attr:`StreamKind.source_part`); ``None``: nothing to count.
    source_part: str | None = None

    def indices(self, index: int, count: int = 1) -> np.ndarray:
        """The samples of batches ``index`` to ``index + count - 1``, in order."""
        return self.plan.span(index, count)


@dataclass(eq=False, kw_only=True)
class Session:
    """One open stream: who it is for, where it is, how its batches leave.

    The fields below ``flow`` change only through the transition methods (``prepared``,
    ``sink_made``, ``joined``, ``credit_seen``, ``end_sent``, ``mark_closed``, ...), on the
    streamer thread; everyone else reads them.
    """

    ident: bytes
    stream: int
    job: Job
    rank: int
    epoch: int
    seed: int
    nonce: int
    flow: Pipeline[Assembled]
    #: Positions of the epoch's order dealt before this stream's plan (elastic resume).
    offset: int = 0
    #: Asked for shared memory from this host (same kernel boot id, transport "auto").
    want_shm: bool = False
    #: Slots of the previous stream's ring the client still reads (it may take that ring over).
    keep: tuple[int, ...] = ()
    #: The ring those slots are of (``Hello.keep_ring``); another ring keeps none.
    keep_ring: str = ""
    #: Most batches per message the client takes (its Hello), and what this stream sends
    #: (chosen with its sink, see ``Opener.sink_for``).
    max_group: int = 1
    group: int = 1
    prepared: Prepared | None = None
    sink: BatchSink | None = None
    #: Why the ring was refused (the stream then uses the socket).
    shm_fallback: str | None = None
    ended: bool = False
    #: Set when the session is closed; read by its pending planning work (any thread).
    closed: bool = False
    last_recv: float = field(default_factory=time.monotonic)
    last_send: float = field(default_factory=time.monotonic)
    #: When the Hello that opened it arrived (monotonic).
    opened: float = field(default_factory=time.monotonic)
    #: The client sent a Credit on this stream (so it reads what the sink hands out).
    credited: bool = False
    #: Who the client says it is: (kernel boot id, pid); ``("", 0)`` when it did not say.
    client: tuple[str, int] = ("", 0)
    #: The share group of a shared job's stream (``spec.share``), joined at its Welcome.
    share: ShareGroup | None = None

    @property
    def job_id(self) -> str:
        return self.job.id

    @property
    def transport(self) -> Transport:
        """How this stream's batches leave (``socket`` until its sink is made)."""
        return self.sink.transport if self.sink is not None else "socket"

    @property
    def assembling(self) -> int:
        return self.flow.assembling

    def describe(self) -> StreamFacts:
        """Facts for log lines."""
        return {"job": self.job_id, "rank": self.rank, "stream": self.stream, "epoch": self.epoch}

    # -- transitions ----------------------------------------------------------------------

    def ready(self, prepared: Prepared) -> None:
        """Its plan and source are built: the epoch ends at the plan's end when that comes
        before the nominal count (a mixture whose source ran out, ``"stop"``)."""
        self.prepared = prepared
        self.flow.num_batches = min(self.flow.num_batches, len(prepared.plan))

    def sends_in(self, group: int) -> None:
        """``group`` batches go in one message of this stream (chosen with its sink)."""
        self.group = group

    def sink_made(self, sink: BatchSink) -> None:
        """Its batches leave through ``sink`` from now on."""
        self.sink = sink

    def joined(self, share: ShareGroup) -> None:
        """It reads a share group's batches: every subscriber takes the same spans."""
        self.share = share
        self.flow.grid = self.group

    def fell_back(self, reason: str) -> None:
        """It asked for shared memory and uses the socket, for ``reason``."""
        self.shm_fallback = reason

    def credit_seen(self) -> bool:
        """The client sent a Credit: whether it is the first since the sink was made (the
        client then reads what the sink hands out)."""
        if self.sink is None or self.credited:
            return False
        self.credited = True
        return True

    def heard_from(self) -> None:
        """A message from its client arrived now."""
        self.last_recv = time.monotonic()

    def sent(self, at: float | None = None) -> None:
        """A message to its client left at ``at`` (now by default)."""
        self.last_send = time.monotonic() if at is None else at

    def end_sent(self) -> None:
        """Its EndOfEpoch left: it waits for the client's goodbye or the idle timeout."""
        self.ended = True

    def mark_closed(self) -> None:
        """Closed (the handler ends the rest): its pending planning work (any thread) drops what it made."""
        self.closed = True


class StreamKind(Protocol):
    """What streaming asks of a job's kind (one dataset, a mixture: see ``server.kinds``).

    The handler holds the object ``HandlerDeps.kind_of`` gives for the job and never asks
    the spec which kind it is: a kind that streams differently changes its object, not
    streaming.
    """

    @property
    def source_part(self) -> str | None:
        """The part whose values name each sample's source, which the board counts by
        source; ``None`` when the kind has none. Read by :func:`prepare` (planning lane)."""
        ...

    def open_stored(self, spec: JobSpec) -> Stored:
        """What a job of ``spec`` reads as stored, the first link of its stream's chain
        (:func:`~..sources.open_source` adds the rest). Called by :func:`prepare` on the
        planning lane: opening a version may map shards or wait for a remote store."""
        ...

    def stream_plan(
        self,
        job: Job,
        epoch: int,
        seed: int,
        rank: int,
        shard_rows: np.ndarray,
        offset: int,
        start: int,
    ) -> StreamPlan:
        """The rank's batches of ``epoch``, dealt from position ``offset`` of its order,
        ready to read from batch ``start`` on. Called by :func:`prepare` on the planning
        lane, so a plan that takes seconds never holds the streamer thread."""
        ...


#: ``kind_of(job)``: the job's kind, from the server's table (``server.kinds``).
KindOf = Callable[[Job], StreamKind]


def prepare(s: Session, open_source: OpenSource, kind_of: KindOf, max_batch_bytes: int) -> Prepared:
    """On the planning lane: open the dataset and plan this rank's epoch.

    Reads only immutable facts of ``s`` and its ``closed`` flag (a replaced or closed stream
    is skipped: its result would be dropped anyway).
    """
    if s.closed:
        raise StreamCancelled(f"stream {s.stream} was closed before its plan was made")
    job = s.job
    kind = kind_of(job)
    source = open_source(kind.open_stored(job.spec), job.spec, s.epoch, s.seed, s.rank)
    m = source.manifest
    fields = tuple(job.spec.fields or (f.name for f in m.fields))
    # A job journaled before the limits existed is refused here, before any allocation.
    rows = check_job_batch(job.spec, job.num_samples, source.sample_bytes, max_batch_bytes)
    batch_bytes = int(source.sample_bytes * rows)  # as served (after a chain)
    if s.closed:
        raise StreamCancelled(f"stream {s.stream} was closed before its plan was made")
    plan = kind.stream_plan(
        job, s.epoch, s.seed, s.rank, source.shard_rows, s.offset, s.flow.start_batch
    )
    source.plan_hint(plan)  # a remote dataset fetches what comes next
    return Prepared(
        source,
        plan,
        fields,
        source.part_shapes(fields),
        rows,
        batch_bytes,
        source.groupable,
        kind.source_part,
    )


class StreamJobs(Protocol):
    """What the streams ask of the jobs: the :class:`JobRegistry` in the main process, its
    replica in a streaming process (``server.processes.replica``)."""

    def find(self, jid: str) -> Job | None:
        """The job ``jid``, or ``None`` when this process does not know it."""
        ...

    def note_stream(self, jid: str, epoch: int, origin: str = "") -> None:
        """A rank opened a stream of ``epoch``."""

    def fail(self, jid: str, code: ErrorCode, message: str) -> Job | None:
        """The job's bytes or chain failed: every rank of it must stop."""
        ...


#: ``gate(hello)``: why this process does not serve ``hello`` (a transient refusal the client
#: answers by asking where to go), or ``None``.
Gate = Callable[[Hello], Error | None]


def open_gate(hello: Hello) -> Error | None:
    """The gate of a server with one streaming process: every Hello may open here."""
    return None


#: Stream ids of a server with one process: every id that fits the wire.
ALL_STREAM_IDS = (1, 0xFFFF_FFFF)

#: ``spread_failure(job, code, message)``: see :attr:`HandlerDeps.spread_failure`.
SpreadFailure = Callable[[str, ErrorCode, str], None]


def no_spread(job: str, code: ErrorCode, message: str) -> None:
    """A server of one process: nobody else serves the job."""


@dataclass(frozen=True)
class HandlerDeps:
    """What the handler uses and shares with the control plane (all thread-safe)."""

    #: A stream's source chain (see :func:`~..sources.open_source`).
    open_source: OpenSource
    registry: StreamJobs
    #: A job's kind, which plans its streams (see :class:`StreamKind`).
    kind_of: KindOf
    board: BoardWrites
    metrics: Metrics
    #: Hellos this process refuses before admission (see :data:`Gate`).
    gate: Gate = open_gate
    #: The first and last stream id this process hands out (processes never share one).
    stream_ids: tuple[int, int] = ALL_STREAM_IDS
    #: How a job that failed here stops in the server's other processes: the main process
    #: tells its streaming processes; a streaming process's ``registry`` reports the failure
    #: to the main process already, which tells the rest.
    spread_failure: SpreadFailure = no_spread
