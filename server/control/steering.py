"""Steering routes: a mixture job's weights (``/v1/jobs/{id}/mixture``) and quarantined
samples of a dataset (``/v1/datasets/{name}/quarantine``)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Path

from shardserve.proto.api import (
    ErrorBody,
    MixtureStatus,
    MixtureUpdate,
    QuarantineList,
    QuarantineRequest,
)

from .deps import Authorized, ServiceDep
from .strict import StrictJson

jobs_router = APIRouter(prefix="/v1/jobs", tags=["mixtures"], dependencies=Authorized)
datasets_router = APIRouter(prefix="/v1/datasets", tags=["quarantine"], dependencies=Authorized)

JobId = Annotated[str, Path(min_length=1, max_length=64, description="id from POST /v1/jobs")]
_ERRORS: dict[int | str, dict[str, Any]] = {
    404: {"model": ErrorBody},
    409: {"model": ErrorBody, "description": "the step is before the job's frontier"},
    422: {"model": ErrorBody},
}


@jobs_router.get("/{job_id}/mixture", responses=_ERRORS)
def get_mixture(job_id: JobId, service: ServiceDep) -> MixtureStatus:
    """The mixture's sources, its whole schedule, the weights in force and the frontier."""
    return service.mixture_admin.status(job_id)


@jobs_router.put(
    "/{job_id}/mixture", responses=_ERRORS, dependencies=[Depends(StrictJson(MixtureUpdate))]
)
def set_mixture(job_id: JobId, update: MixtureUpdate, service: ServiceDep) -> MixtureStatus:
    """New weights from ``at_step`` on (default: the frontier, the first step no rank has
    been sent); journaled, so restarts and resumes replay it; a step in the past is a 409."""
    return service.mixture_admin.set_mixture(job_id, update)


@datasets_router.post(
    "/{name}/quarantine",
    responses=_ERRORS,
    dependencies=[Depends(StrictJson(QuarantineRequest))],
)
def quarantine(name: str, req: QuarantineRequest, service: ServiceDep) -> QuarantineList:
    """Skip these sample ids in every mixture plan reading the dataset, from each job's
    frontier on (jobs created later: from step 0); journaled with those steps."""
    return service.mixture_admin.quarantine(name, req)


@datasets_router.get("/{name}/quarantine", responses=_ERRORS)
def quarantine_list(name: str, service: ServiceDep) -> QuarantineList:
    """The dataset's quarantined ids, each entry with its reason and steps per job."""
    return service.mixture_admin.quarantine_list(name)
