"""Contracts between a server's main process and its streaming processes, and of placement.

A sidecar started with ``--stream-processes N`` (N > 1) runs its streams in N worker processes
beside the main one (see ``docs/concepts/streaming-processes.md``). A client asks the control
plane where to open its rank's streams (``POST /v1/jobs/{id}/place``: :class:`PlaceRequest`
in, :class:`Placement` out) and says its Hellos there; the main process has told that
streaming process, over its link, to serve that rank (:class:`AdmitStream`), and tells it
when the job changes (:class:`UpdateJob`). The data protocol itself is unchanged: a client
that never asks is served by the main process, as before.

Every message on a link is one JSON frame of :data:`LinkMessage` (never pickled): typed here,
validated on receipt, the same version on both ends (one server's processes).

>>> Placement(process=2, data_endpoints=["tcp://127.0.0.1:7072"]).process
2
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from .api import ShareStatus
from .endpoints import Delivery

#: How long the main process waits for a streaming process to confirm a placed rank or a
#: changed job (then the rank is served by the main process instead).
ADMIT_TIMEOUT_S = 10.0

#: Stream ids of streaming process ``k`` start at ``k << STREAM_ID_BITS`` (ids stay < 2**32
#: and never collide between processes, so the board keys them as one server's).
STREAM_ID_BITS = 26


class _Link(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class PlaceRequest(_Link):
    """Where should this client open the streams of ``rank``? (``POST .../place``)"""

    rank: int = Field(ge=0, lt=1 << 16)


class Placement(_Link):
    """The process that serves the stream (0: the main process) and its data endpoints."""

    process: int = Field(ge=0, lt=1 << (32 - STREAM_ID_BITS))
    data_endpoints: list[str]


class ProcessStatus(_Link):
    """One streaming process (``GET /v1/processes``, the status page)."""

    index: int
    pid: int
    up: bool
    #: Streams open in it, as its last report said.
    streams: int
    #: Ranks of jobs placed on it (each rank's streams open there).
    ranks: int
    #: How many times it was replaced after it died.
    restarts: int
    data_endpoints: list[str]


class JobWire(_Link):
    """What a streaming process knows of a job: the fields its streams read."""

    id: str
    spec: dict[str, object]
    num_samples: int
    epoch: int = 0
    seed: int = 0
    resumed_from: str | None = None


# -- main process to a streaming process ------------------------------------------------


class AdmitStream(_Link):
    """Serve the Hellos of ``job``'s ``rank`` (placed here); answered by :class:`Ack`."""

    kind: Literal["admit"] = "admit"
    request: int
    job: JobWire
    rank: int


class UpdateJob(_Link):
    """The job changed (a new seed set with its epoch); answered by :class:`Ack`."""

    kind: Literal["update"] = "update"
    request: int
    job: JobWire


class EndJob(_Link):
    """End every stream of ``job`` (deleted, or failed in another process)."""

    kind: Literal["end_job"] = "end_job"
    job: str
    code: str
    message: str


class Stop(_Link):
    """Close every stream (``SERVER_SHUTDOWN``) and exit."""

    kind: Literal["stop"] = "stop"


# -- a streaming process to the main process --------------------------------------------


class Ready(_Link):
    """The process is up and its data endpoints are bound."""

    kind: Literal["ready"] = "ready"
    pid: int
    data_endpoints: list[str]


class Ack(_Link):
    """A streaming process took an :class:`AdmitStream` or :class:`UpdateJob` (its ``request``)."""

    kind: Literal["ack"] = "ack"
    request: int


class Opened(_Link):
    """A stream of a rank was welcomed in the reporting process."""

    kind: Literal["opened"] = "opened"
    job: str
    rank: int
    stream: int
    epoch: int
    start: int
    num_batches: int
    credit: int
    transport: Delivery = "socket"


class Sent(_Link):
    """Messages sent to one rank since the last report, summed."""

    kind: Literal["sent"] = "sent"
    job: str
    rank: int
    nbytes: int
    next_batch: int
    credit: int
    batches: int


class Heard(_Link):
    """A rank's client reported its credit and timings."""

    kind: Literal["heard"] = "heard"
    job: str
    rank: int
    credit: int | None = None
    wait_s: float | None = None
    compute_s: float | None = None
    batches: int | None = None


class FellBack(_Link):
    """A rank's stream asked for shared memory and got the socket."""

    kind: Literal["fell_back"] = "fell_back"
    job: str
    rank: int
    reason: str


class Conflict(_Link):
    """A second client claimed a rank."""

    kind: Literal["conflict"] = "conflict"
    job: str
    rank: int
    what: str


class Closed(_Link):
    """A stream of a rank ended."""

    kind: Literal["closed"] = "closed"
    job: str
    rank: int
    stream: int


class StreamNoted(_Link):
    """A rank opened a stream of ``epoch`` (the registry's ``note_stream``)."""

    kind: Literal["noted"] = "noted"
    job: str
    epoch: int
    origin: str = ""


class JobFailed(_Link):
    """The job's bytes or its chain failed here: every process ends its streams."""

    kind: Literal["failed"] = "failed"
    job: str
    code: str
    message: str


BoardEvent = Annotated[
    Opened | Sent | Heard | FellBack | Conflict | Closed | StreamNoted | JobFailed,
    Field(discriminator="kind"),
]


class Sample(_Link):
    """One sample of a metric family: its name, labels and value."""

    name: str
    labels: dict[str, str]
    value: float


class Family(_Link):
    """One metric family of a process, as ``prometheus_client`` collected it."""

    name: str
    type: str
    documentation: str
    samples: list[Sample]


class Report(_Link):
    """What happened since the last report, in order (the streams open follow from its
    ``Opened`` and ``Closed`` events), with the process's totals now."""

    kind: Literal["report"] = "report"
    events: list[BoardEvent] = []
    #: Cumulative counters and current gauges of the process (``None``: unchanged).
    families: list[Family] | None = None
    #: The process's share groups by job, and their metric series as
    #: ``(job, rank, subscribers, lag, handed, detaches)`` (``None``: unchanged).
    shares: dict[str, list[ShareStatus]] | None = None
    share_series: list[tuple[str, int | None, int, int, int, int]] | None = None


LinkMessage = Annotated[
    AdmitStream | UpdateJob | EndJob | Stop | Ready | Ack | Report, Field(discriminator="kind")
]


class Envelope(_Link):
    """One frame on a link."""

    message: LinkMessage


def stream_id_base(process: int) -> int:
    """The first stream id of streaming process ``process`` (0: the main process).

    >>> stream_id_base(0), stream_id_base(2)
    (0, 134217728)
    """
    return process << STREAM_ID_BITS


def stream_ids_of(process: int) -> tuple[int, int]:
    """The first and last stream id process ``process`` hands out (0: the main process;
    id 0 is never one).

    >>> stream_ids_of(0), stream_ids_of(1)
    ((1, 67108863), (67108865, 134217727))
    """
    base = stream_id_base(process)
    return base + 1, base + (1 << STREAM_ID_BITS) - 1
