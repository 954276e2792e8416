"""``create_app(service)``: the FastAPI control plane of one server.

Routers per resource (:mod:`.health`, :mod:`.datasets`, :mod:`.jobs`, :mod:`.status_page`);
one exception handler maps the :mod:`shardserve.proto.errors` tree to HTTP codes with an
:class:`~shardserve.proto.jobs.ErrorBody`; request bodies over ``max_body_bytes`` get 413.
Handlers are plain ``def``: they read files (manifests, the journal's fsync) and so run on
the thread pool, never blocking the event loop, and never wait on the data plane.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from shardserve.proto.api import ErrorBody
from shardserve.proto.errors import (
    AuthError,
    BadRequest,
    DatasetChanged,
    DatasetCorruptError,
    DatasetNotFound,
    InvalidDataError,
    JobFailed,
    JobNotFound,
    ProtocolError,
    ShardserveError,
    StepInThePast,
)

from ..service import Service
from ..store.remote.object_fs import StoreUnavailable
from . import datasets, health, job_routes, status_page, steering, transforms
from .deps import CHALLENGES, Authorized
from .hosts import HostAllowList, allowed_hosts
from .limits import BodyLimit

#: Most specific first: the first class an error is an instance of decides its status.
STATUS_FOR_ERROR: list[tuple[type[ShardserveError], int]] = [
    (DatasetNotFound, 404),
    (JobNotFound, 404),
    (AuthError, 401),
    (StepInThePast, 409),
    (BadRequest, 422),
    (InvalidDataError, 422),
    (DatasetCorruptError, 409),
    (DatasetChanged, 409),
    (JobFailed, 409),
    (ProtocolError, 409),
    (StoreUnavailable, 503),
]


def status_for(exc: ShardserveError) -> int:
    for cls, code in STATUS_FOR_ERROR:
        if isinstance(exc, cls):
            return code
    return 500


def _body(
    code: str, detail: str, status: int, headers: dict[str, str] | None = None
) -> JSONResponse:
    return JSONResponse(
        ErrorBody(code=code, detail=detail).model_dump(), status_code=status, headers=headers
    )


async def _on_shardserve_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ShardserveError)
    status = status_for(exc)
    response = _body(exc.code.value, str(exc), status)
    if status == 401:
        # One header per scheme (Basic too, so a browser prompts for the token): a browser
        # ignores a challenge that folds both schemes into one header.
        for challenge in CHALLENGES:
            response.headers.append("WWW-Authenticate", challenge)
    return response


def _where(loc: tuple[Any, ...]) -> str:
    return ".".join(str(p) for p in loc if p != "body") or "body"


async def _on_validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    problems = [
        f"{_where(tuple(e.get('loc', ())))}: {e.get('msg', 'invalid')}"
        + (f" (got {e['input']!r})" if "input" in e and not isinstance(e["input"], dict) else "")
        for e in exc.errors()
    ]
    return _body("bad_request", "invalid request, change: " + "; ".join(problems), 422)


async def _on_http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    code = {404: "not_found", 405: "method_not_allowed", 413: "too_large"}.get(
        exc.status_code, "http_error"
    )
    return _body(code, str(exc.detail), exc.status_code, getattr(exc, "headers", None))


def create_app(service: Service) -> FastAPI:
    """The control plane for ``service``; tests build their own with their own service."""
    # FastAPI's own schema and docs routes would skip the token check; the schema is served
    # below behind it instead. No /docs: Swagger UI loads its scripts from a CDN.
    app = FastAPI(
        title="shardserve",
        version=service.version,
        summary="Control plane of a shardserve data-serving sidecar.",
        openapi_url=None,
        docs_url=None,
        redoc_url=None,
    )
    app.state.service = service
    app.add_middleware(BodyLimit, max_bytes=service.settings.max_body_bytes)
    settings = service.settings
    # Added last, so it runs first: a foreign Host is refused before anything else.
    app.add_middleware(
        HostAllowList,
        allowed=allowed_hosts(settings.allowed_hosts, settings.http_host_port[0]),
    )
    app.add_exception_handler(ShardserveError, _on_shardserve_error)
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(StarletteHTTPException, _on_http_error)
    for router in (
        health.open_router,
        health.router,
        datasets.router,
        job_routes.router,
        steering.jobs_router,
        steering.datasets_router,
        status_page.router,
        transforms.router,
    ):
        app.include_router(router)

    @app.get("/openapi.json", include_in_schema=False, dependencies=Authorized)
    def openapi() -> JSONResponse:
        return JSONResponse(app.openapi())

    return app
