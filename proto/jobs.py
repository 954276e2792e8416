"""The control plane's contract: job specs and the status the server reports.

A job is a pure function of its spec: the same spec always has the same id
(:func:`job_id`), on any server, before and after a restart. That is what lets every DDP
rank post the same spec and get the same job, and a restarted server pick up where the old
one stopped without a coordinator.
"""

from __future__ import annotations

import hashlib
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from .manifest import validate_dataset_name

ShuffleMode = Literal["global", "block", "none"]
#: How a batch's samples are put together: ``None`` stacks each field (the default);
#: ``"graph"`` collates graphs for message passing (node fields concatenated, ``edge_index``
#: offset, a ``batch`` vector), as ``torch_geometric`` does.
Collate = Literal["graph"]
#: ``pending``: created, no stream yet; ``running``: a rank streams (or did moments ago);
#: ``idle``: no stream for a while, an epoch left unfinished; ``finished``: every rank ended
#: its last epoch and left; ``failed``: stopped with a reason; ``deleted``: gone (a DELETE's reply).
JobState = Literal["pending", "running", "idle", "finished", "failed", "deleted"]
Transport = Literal["shm", "socket"]

MAX_BATCH_SIZE = 1 << 20
MAX_WORLD_SIZE = 1 << 16
#: Most environments one step of a job may carry (``JobSpec.envs``).
MAX_ENVS = 1024


class JobSpec(BaseModel):
    """What to serve: which dataset, in which order, cut how. Everything that decides the
    batches is here and nothing else is."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    dataset: str = Field(min_length=1, max_length=128)
    batch_size: int = Field(ge=1, le=MAX_BATCH_SIZE)
    seed: int = Field(default=0, ge=0, lt=1 << 63)
    shuffle: ShuffleMode = "global"
    drop_last: bool = False
    world_size: int = Field(default=1, ge=1, le=MAX_WORLD_SIZE)
    #: Fields to serve, in this order; ``None`` serves every field of the dataset.
    fields: tuple[str, ...] | None = None
    #: For ``shuffle="block"``: how many shards are mixed together at a time.
    block_window: int = Field(default=4, ge=1, le=1 << 16)
    #: See :data:`Collate`; left out of the job id when ``None``, so ids of specs without it
    #: stay what they were.
    collate: Collate | None = None
    #: Environments per step (issue 22): each batch carries ``envs`` environment batches of
    #: ``batch_size // envs`` samples, environment ``e`` from the plan of
    #: ``SeedSequence([seed, epoch, e])`` (environment 0: the job's own plan); env ``e``'s rows
    #: are the ``e``-th of ``envs`` equal parts. Left out of the job id when 1.
    envs: int = Field(default=1, ge=1, le=MAX_ENVS)

    @model_validator(mode="after")
    def _check_envs(self) -> JobSpec:
        if self.envs > 1:
            if self.batch_size % self.envs:
                raise ValueError(
                    f"batch_size {self.batch_size} must be a multiple of envs {self.envs} "
                    "(a step holds envs batches of equal size)"
                )
            if self.collate is not None:
                raise ValueError(
                    f"collate={self.collate!r} needs envs=1: each env batch would be cut out of one collated batch"
                )
        return self

    @field_validator("dataset")
    @classmethod
    def _check_dataset(cls, v: str) -> str:
        try:
            return validate_dataset_name(v)
        except ValueError as e:
            raise ValueError(str(e)) from None

    @field_validator("fields")
    @classmethod
    def _check_fields(cls, v: tuple[str, ...] | None) -> tuple[str, ...] | None:
        if v is not None:
            if len(v) == 0:
                raise ValueError("fields must name at least one field, or be left out for all")
            if len(set(v)) != len(v):
                raise ValueError(f"fields lists a name twice: {list(v)}")
        return v


def job_id(spec: JobSpec) -> str:
    """A stable id for a spec: 16 hex digits of SHA-256 over its canonical JSON.

    >>> job_id(JobSpec(dataset="d", batch_size=2)) == job_id(JobSpec(batch_size=2, dataset="d"))
    True
    """
    # Fields added later are left out at their defaults: ids of older specs stay what they were.
    exclude = {
        k for k, unset in (("collate", spec.collate is None), ("envs", spec.envs == 1)) if unset
    }
    canonical = spec.model_dump_json(exclude_none=False, exclude=exclude or None).encode()
    return hashlib.sha256(canonical).hexdigest()[:16]


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
    transport: Transport | None = None
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
    wait_s: float = 0.0
    compute_s: float = 0.0
    last_seen_s: float | None = None


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
    error: str | None = None


class CreatedJob(BaseModel):
    id: str
    created: bool
    status: JobStatus


class DatasetInfo(BaseModel):
    name: str
    num_samples: int
    num_shards: int
    bytes: int
    fields: list[dict[str, object]]
    created_at: str = ""
    #: The tree nested samples were saved as (:data:`~.manifest.Tree`); absent when flat.
    structure: Any = None


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
