"""Dependencies of the control plane's routes: the service, and the optional token.

The token may come as ``Authorization: Bearer <token>`` (programs) or as the password of HTTP
Basic with any user name (a person opening the status page in a browser, which only prompts
for Basic). Both are declared with :mod:`fastapi.security`, so ``/openapi.json`` lists the
two schemes; a refusal carries one ``WWW-Authenticate`` header per scheme
(:data:`CHALLENGES`): browsers do not parse two schemes folded into one header.
"""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import Depends, HTTPException, Request
from fastapi.security import (
    HTTPAuthorizationCredentials,
    HTTPBasic,
    HTTPBasicCredentials,
    HTTPBearer,
)
from starlette.requests import HTTPConnection

from shardserve.proto.errors import AuthError

from ..service import Service

REALM = "shardserve"
#: Sent as separate ``WWW-Authenticate`` headers with every 401.
CHALLENGES = (f'Bearer realm="{REALM}"', f'Basic realm="{REALM}", charset="UTF-8"')


def get_service(request: Request) -> Service:
    """The :class:`Service` this app was built for (``create_app`` puts it on ``app.state``)."""
    return request.app.state.service


ServiceDep = Annotated[Service, Depends(get_service)]


class _LenientBasic(HTTPBasic):
    """HTTP Basic that reads an undecodable header as no credentials (answered by our own
    401 with both challenges) instead of FastAPI's Basic-only one."""

    async def __call__(self, request: HTTPConnection) -> HTTPBasicCredentials | None:  # type: ignore[override]
        try:
            return await super().__call__(request)
        except HTTPException:
            return None


bearer_scheme = HTTPBearer(
    auto_error=False,
    description="The server's token (--token / SHARDSERVE_TOKEN); only when it has one.",
)
basic_scheme = _LenientBasic(
    auto_error=False,
    realm=REALM,
    description="For browsers: any user name, the server's token as the password.",
)


def require_token(
    service: ServiceDep,
    bearer: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer_scheme)],
    basic: Annotated[HTTPBasicCredentials | None, Depends(basic_scheme)],
) -> None:
    """Refuse a request without the server's token (when the server has one).

    The comparison is constant-time so the token cannot be guessed byte by byte.
    """
    token = service.settings.token
    if not token:
        return
    given = bearer.credentials if bearer is not None else basic.password if basic else ""
    if not hmac.compare_digest(given.encode(), token.encode()):
        raise AuthError(
            "missing or wrong token: send 'Authorization: Bearer <token>' "
            "with the server's --token / SHARDSERVE_TOKEN (in a browser: any user name, "
            "the token as password)"
        )


Authorized = [Depends(require_token)]
