"""Dependencies of the control plane's routes: the service, and the optional bearer token."""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import Depends, Request

from shardserve.proto.errors import AuthError

from ..service import Service


def get_service(request: Request) -> Service:
    """The :class:`Service` this app was built for (``create_app`` puts it on ``app.state``)."""
    return request.app.state.service  # type: ignore[no-any-return]


ServiceDep = Annotated[Service, Depends(get_service)]


def require_token(request: Request, service: ServiceDep) -> None:
    """Refuse a request without the server's bearer token (when the server has one).

    The comparison is constant-time so the token cannot be guessed byte by byte.
    """
    token = service.settings.token
    if not token:
        return
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(
        given.strip().encode(), token.encode()
    ):
        raise AuthError(
            "missing or wrong token: send 'Authorization: Bearer <token>' "
            "with the server's --token / SHARDSERVE_TOKEN"
        )


Authorized = [Depends(require_token)]
