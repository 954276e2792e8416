"""``/v1/jobs``: create (idempotently), inspect, set the epoch of, and delete jobs."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Path, Query, Response, status

from shardserve.proto.api import CreatedJob, EpochUpdate, ErrorBody, JobStatus
from shardserve.proto.jobs import JobSpec
from shardserve.proto.processes import Placement, PlaceRequest

from .deps import Authorized, ServiceDep
from .strict import StrictJson

router = APIRouter(prefix="/v1/jobs", tags=["jobs"], dependencies=Authorized)

JobId = Annotated[str, Path(min_length=1, max_length=64, description="id from POST /v1/jobs")]
_NOT_FOUND: dict[int | str, dict[str, Any]] = {404: {"model": ErrorBody}}


@router.post(
    "",
    status_code=status.HTTP_201_CREATED,
    responses={
        200: {"model": CreatedJob, "description": "the job already existed"},
        404: {"model": ErrorBody},
        422: {"model": ErrorBody},
    },
    dependencies=[Depends(StrictJson(JobSpec))],
)
def create_job(spec: JobSpec, service: ServiceDep, response: Response) -> CreatedJob:
    """Create the job for ``spec``, or return the existing one: every DDP rank may post the
    same spec and gets the same id (201 when created, 200 when it existed)."""
    created = service.create_job(spec)
    if not created.created:
        response.status_code = status.HTTP_200_OK
    return created


@router.get("")
def list_jobs(service: ServiceDep) -> list[JobStatus]:
    """Every job with its ranks."""
    return service.job_admin.all_jobs()


@router.get("/{job_id}", responses=_NOT_FOUND)
def get_job(job_id: JobId, service: ServiceDep) -> JobStatus:
    """State, epoch, seed and each rank's progress (delivered, credit, stall fraction)."""
    return service.job_admin.job(job_id)


@router.put(
    "/{job_id}/epoch",
    responses={**_NOT_FOUND, 422: {"model": ErrorBody}},
    dependencies=[Depends(StrictJson(EpochUpdate))],
)
def set_epoch(job_id: JobId, update: EpochUpdate, service: ServiceDep) -> JobStatus:
    """Set the epoch (and optionally a new seed) ranks stream next; survives a restart."""
    return service.job_admin.set_epoch(job_id, update)


#: Header of ``GET .../plan`` responses: how many batches the ids are cut into.
NUM_BATCHES_HEADER = "X-Shardserve-Num-Batches"
#: Header of ``GET .../plan`` responses: the ``offset`` the plan was dealt from (a client
#: asking for one checks it came back: a server without elastic resume ignores the query).
OFFSET_HEADER = "X-Shardserve-Offset"


@router.get(
    "/{job_id}/plan",
    responses={
        200: {
            "content": {"application/octet-stream": {}},
            "description": "little-endian int64 sample ids, batch after batch",
        },
        **_NOT_FOUND,
        422: {"model": ErrorBody},
    },
    response_class=Response,
)
def get_plan(
    job_id: JobId,
    service: ServiceDep,
    epoch: Annotated[int, Query(ge=0, lt=1 << 31)],
    rank: Annotated[int, Query(ge=0, lt=1 << 16)] = 0,
    env: Annotated[int | None, Query(ge=0, lt=1 << 16)] = None,
    offset: Annotated[int, Query(ge=0, lt=1 << 53)] = 0,
    take: bool = False,
    origin: Annotated[str | None, Query(min_length=1, max_length=64)] = None,
) -> Response:
    """One rank's sample ids of one epoch, in batch order: exactly what the data plane streams.
    With ``env``: that environment's own plan (of a job with ``envs`` > 1, the ``env``-th
    part of every step, batches of ``batch_size // envs``; 422 past its environments).
    Batches are ``batch_size`` ids each, the last one possibly short; the header
    ``X-Shardserve-Num-Batches`` gives their number. ``offset`` (elastic resume): the plan
    dealt from that position of the epoch's order, as a ``Hello`` with that offset streams
    it; echoed in ``X-Shardserve-Offset``. ``origin``: the job that saved the state resumed
    (linked as a ``Hello.origin`` links it). ``take=true``: the client gathers the epoch from
    this plan itself (resident mode): a mixture takes no weight change inside it from now on.
    """
    ids, batches = service.plan(job_id, epoch, rank, env, offset, take, origin or "")
    return Response(
        content=ids.tobytes(),
        media_type="application/octet-stream",
        headers={NUM_BATCHES_HEADER: str(batches), OFFSET_HEADER: str(offset)},
    )


@router.delete("/{job_id}", responses=_NOT_FOUND)
def delete_job(job_id: JobId, service: ServiceDep) -> JobStatus:
    """Delete the job; its open streams end with a fatal ``JOB_FAILED`` error."""
    return service.job_admin.delete_job(job_id)


@router.post(
    "/{job_id}/place",
    responses={**_NOT_FOUND, 400: {"model": ErrorBody}, 422: {"model": ErrorBody}},
    dependencies=[Depends(StrictJson(PlaceRequest))],
)
def place_stream(job_id: JobId, req: PlaceRequest, service: ServiceDep) -> Placement:
    """Where to open a stream of ``job_id``'s rank: the process that will serve it and its
    data endpoints (the rank stays there until it closes or that process dies). A failed
    job is answered the main process, whose Hello reply names its error; a server of one
    process answers its own endpoints (``--stream-processes``)."""
    return service.place(job_id, req)
