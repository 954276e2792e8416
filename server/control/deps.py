"""Dependencies of the control plane's routes: the service, and the optional bearer token."""

from __future__ import annotations

import base64
import binascii
import hmac
from typing import Annotated

from fastapi import Depends, Request

from shardserve.proto.errors import AuthError

from ..service import Service


def get_service(request: Request) -> Service:
    """The :class:`Service` this app was built for (``create_app`` puts it on ``app.state``)."""
    return request.app.state.service  # type: ignore[no-any-return]


ServiceDep = Annotated[Service, Depends(get_service)]


def _presented_token(header: str) -> str:
    """The token in an ``Authorization`` header: a bearer token, or the password of HTTP Basic
    (so a person can open the status page in a browser, which prompts for Basic credentials)."""
    scheme, _, value = header.partition(" ")
    if scheme.lower() == "bearer":
        return value.strip()
    if scheme.lower() == "basic":
        try:
            return base64.b64decode(value.strip(), validate=True).decode().partition(":")[2]
        except (binascii.Error, UnicodeDecodeError):
            return ""
    return ""


def require_token(request: Request, service: ServiceDep) -> None:
    """Refuse a request without the server's token (when the server has one).

    The comparison is constant-time so the token cannot be guessed byte by byte.
    """
    token = service.settings.token
    if not token:
        return
    given = _presented_token(request.headers.get("authorization", ""))
    if not hmac.compare_digest(given.encode(), token.encode()):
        raise AuthError(
            "missing or wrong token: send 'Authorization: Bearer <token>' "
            "with the server's --token / SHARDSERVE_TOKEN (in a browser: any user name, "
            "the token as password)"
        )


Authorized = [Depends(require_token)]
