"""Health, readiness, server info and Prometheus metrics."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

from shardserve.proto.api import ServerInfo
from shardserve.proto.processes import ProcessStatus

from .deps import Authorized, ServiceDep

#: ``/healthz`` is the one route that needs no token: orchestrators probe it blind.
open_router = APIRouter(tags=["health"])
router = APIRouter(tags=["health"], dependencies=Authorized)


@open_router.get("/healthz", responses={503: {"description": "the data plane died"}})
def healthz(service: ServiceDep) -> JSONResponse:
    """200 while the process runs and its data plane lives (liveness); 503 once it died."""
    if service.streamer.failure is not None:
        return JSONResponse({"status": "failed", "reason": service.streamer.failure}, 503)
    return JSONResponse({"status": "ok"})


@router.get("/readyz", responses={503: {"description": "not ready, with the reason"}})
def readyz(service: ServiceDep) -> JSONResponse:
    """200 when the data plane is bound and the store is readable, else 503 with the reason."""
    ok, reason = service.ready()
    return JSONResponse({"ready": ok, "reason": reason}, status_code=200 if ok else 503)


@router.get("/v1/info")
def info(service: ServiceDep) -> ServerInfo:
    """How to reach the data plane, and which protocol versions the server speaks."""
    return service.info()


@router.get("/v1/processes")
def processes(service: ServiceDep) -> list[ProcessStatus]:
    """The streaming processes beside the main one (none with ``--stream-processes 1``)."""
    return service.processes.processes() if service.processes is not None else []


@router.get("/metrics", response_class=Response)
def metrics(service: ServiceDep) -> Response:
    """Prometheus text exposition of this server's metrics."""
    return Response(content=service.metrics_text(), media_type=service.metrics.content_type)
