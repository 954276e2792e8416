"""The control plane's HTTP bodies: what ``/v1/...`` accepts and answers, apart from the job
spec itself (:mod:`.jobs`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from .endpoints import Delivery
from .jobs import JobSpec

#: ``pending``: created, no stream yet; ``running``: a rank streams (or did moments ago);
#: ``idle``: no stream for a while, an epoch left unfinished; ``finished``: every rank ended
#: its last epoch and left; ``failed``: stopped with a reason; ``deleted``: gone (a DELETE's reply).
JobState = Literal["pending", "running", "idle", "finished", "failed", "deleted"]


class EpochUpdate(BaseModel):
    """``PUT /v1/jobs/{id}/epoch``: what every rank streams next when its client does not
    set the epoch itself."""

    model_config = ConfigDict(extra="forbid")

    epoch: int = Field(ge=0, lt=1 << 31)
    seed: int | None = Field(default=None, ge=0, lt=1 << 63)


class RankStatus(BaseModel):
    rank: int
    connected: bool
    epoch: int | None = None
    transport: Delivery | None = None
    batches_delivered: int = 0
    bytes_delivered: int = 0
    next_batch: int = 0
    num_batches: int = 0
    credit: int = 0
    #: Batches the client handed to its loop per second over the last few seconds (its own
    #: reports; the server's sends when a client reports none).
    batches_per_s: float = 0.0
    #: Reported by the client: seconds waiting for data / (waiting + computing), since it began.
    stall_fraction: float | None = None
    #: The same over the last few seconds (``None`` until two reports span that window).
    stall_now: float | None = None
    #: Why this rank's stream uses the socket although it asked for shared memory.
    shm_fallback: str | None = None
    #: The last time two clients claimed this rank, and what the server did about it.
    conflict: str | None = None
    wait_s: float = 0.0
    compute_s: float = 0.0
    last_seen_s: float | None = None


class ShareStatus(BaseModel):
    """One share group of a job: the subscribers of one rank's pass (``Loader(share=...)``)."""

    share: str
    rank: int
    epoch: int
    subscribers: int
    #: Batches kept below the front for members behind it, at most, and kept now.
    window: int
    kept: int
    #: The furthest batch any subscriber took.
    front: int
    #: Batches assembled for the group (once each), and handed to subscribers from it.
    assembled: int
    handed: int
    #: Batches subscribers assembled on their own passes (behind the window).
    own: int
    #: Times a subscriber fell behind the window.
    detaches: int
    #: Each subscriber's batches behind the front, ascending.
    lags: list[int] = Field(default_factory=list)


class JobStatus(BaseModel):
    id: str
    spec: JobSpec
    state: JobState
    #: The epoch set with ``PUT /v1/jobs/{id}/epoch`` (0 until then). Streams never move it:
    #: each rank's own epoch is in ``ranks``.
    epoch: int
    seed: int
    num_samples: int
    batches_per_epoch: int
    #: Ranks that have opened a stream (a rank never seen is absent), by rank.
    ranks: list[RankStatus]
    #: Share groups of the job (``spec.share``), one per rank and epoch being streamed.
    shares: list[ShareStatus] = Field(default_factory=list)
    error: str | None = None
    #: Elastic resume: the id of the job, of another world size, whose ``state_dict`` a rank
    #: of this job resumed (that job's metrics and status end where this one's begin).
    resumed_from: str | None = None


class CreatedJob(BaseModel):
    id: str
    created: bool
    status: JobStatus
    #: Bytes of one sample as the job serves it (after its transforms; variable-size fields at
    #: the dataset's average): what a client sizes its default prefetch by. ``None``: unknown
    #: (a mixture), the stored size stands in.
    sample_bytes: float | None = None


class DatasetInfo(BaseModel):
    name: str
    num_samples: int
    num_shards: int
    bytes: int
    fields: list[dict[str, object]]
    created_at: str = ""
    #: The tree nested samples were saved as (:data:`~.manifest.Tree`); absent when flat.
    structure: Any = None
    #: Class names by label: an image folder's, or a dataset's one ClassLabel field's.
    classes: list[str] | None = None
    #: Each ClassLabel field's names by label (Hugging Face datasets); absent when none.
    label_names: dict[str, list[str]] | None = None


class ErrorBody(BaseModel):
    """The body of every 4xx/5xx the control plane sends."""

    code: str
    detail: str


class ServerInfo(BaseModel):
    """``GET /v1/info``: how to reach the data plane and what the server speaks."""

    version: str
    protocols: list[int]
    #: Data-plane endpoints the server is bound to, e.g. ``tcp://127.0.0.1:7071``, ``ipc:///run/ss.sock``.
    data_endpoints: list[str]
    host: str
    #: The kernel boot id: a client with the same one shares this host (and its /dev/shm).
    boot_id: str
    auth_required: bool
    #: Processes serving streams: above 1, a client asks ``POST /v1/jobs/{id}/place`` where
    #: to open each stream (an older server says nothing: one process).
    stream_processes: int = 1


#: Most sample ids one quarantine request may name, and one dataset may have in all.
MAX_QUARANTINE_IDS = 1 << 16
MAX_QUARANTINED = 1 << 20
#: Most characters of a quarantine's reason.
MAX_QUARANTINE_REASON = 512


class MixtureUpdate(BaseModel):
    """``PUT /v1/jobs/{id}/mixture``: new weights from global step ``at_step`` on
    (``None``: the job's frontier, the first step no rank has been sent yet).

    ``weights`` maps every source's name to its weight, or lists them in the order of
    ``JobSpec.mixture``.
    """

    model_config = ConfigDict(extra="forbid")

    weights: dict[str, float] | list[float]
    at_step: int | None = Field(default=None, ge=0, lt=1 << 62)


class MixtureStatus(BaseModel):
    """``GET /v1/jobs/{id}/mixture``: the sources, the whole schedule (the spec's weights at
    step 0, then every change), the weights in force at the frontier, and the frontier."""

    job: str
    sources: list[str]
    schedule: list[dict[str, Any]]
    weights_now: list[float]
    #: The first global step no rank has been sent yet: changes must be at or after it.
    frontier: int
    batches_per_epoch: int
    #: Samples sent per source (all ranks, since this server started).
    sent: list[int] = Field(default_factory=list)
    #: Over every rank's current stream: the share of each source sent, the share the
    #: schedule asked for over the same steps, and the largest gap in standard deviations
    #: of a binomial draw (``None`` before any sample): above ~4, the mixture is not what
    #: was asked for.
    window_samples: int = 0
    window_shares: list[float] = Field(default_factory=list)
    target_shares: list[float] = Field(default_factory=list)
    deviation_sigmas: float | None = None


class QuarantineRequest(BaseModel):
    """``POST /v1/datasets/{name}/quarantine``: sample ids (of the dataset's current
    version) no plan may deal from each job's frontier on, and why."""

    model_config = ConfigDict(extra="forbid")

    ids: list[int] = Field(min_length=1, max_length=MAX_QUARANTINE_IDS)
    reason: str = Field(min_length=1, max_length=MAX_QUARANTINE_REASON)


class QuarantineEntry(BaseModel):
    ids: list[int]
    reason: str
    #: The global step from which each job reading the dataset skips these ids.
    at: dict[str, int]


class QuarantineList(BaseModel):
    dataset: str
    entries: list[QuarantineEntry]
    #: Distinct ids quarantined (an id posted again counts once).
    total_ids: int
    #: Bytes the server holds for this dataset's quarantine (ids, steps, reasons).
    held_bytes: int = 0
