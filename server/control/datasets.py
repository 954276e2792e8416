"""``/v1/datasets``: what the store holds."""

from __future__ import annotations

from fastapi import APIRouter

from shardserve.proto.api import DatasetInfo, ErrorBody

from .deps import Authorized, ServiceDep

router = APIRouter(prefix="/v1/datasets", tags=["datasets"], dependencies=Authorized)


@router.get("")
def list_datasets(service: ServiceDep) -> list[DatasetInfo]:
    """Every dataset in the store."""
    return service.datasets()


@router.get("/{name}", responses={404: {"model": ErrorBody}, 422: {"model": ErrorBody}})
def get_dataset(name: str, service: ServiceDep) -> DatasetInfo:
    """One dataset; a name that is not a safe dataset name is refused before touching disk."""
    return service.dataset(name)
