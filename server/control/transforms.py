"""``GET /v1/transforms``: the transforms jobs may name here, their parameters (JSON Schema)
and output fields, and how the pool that runs them is doing."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from .deps import Authorized, ServiceDep

router = APIRouter(prefix="/v1/transforms", tags=["transforms"], dependencies=Authorized)


@router.get("")
def list_transforms(service: ServiceDep) -> dict[str, Any]:
    """Installed transforms (``transforms``), the pool (``pool``) and counts since start."""
    return service.transforms.describe()
