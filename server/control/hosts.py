"""Answer only requests whose ``Host`` header names this server (DNS-rebinding guard).

A web page the trainer's user opens can make their browser send requests to
``http://attacker.example:7070`` after pointing that name at 127.0.0.1; the browser then
treats a loopback server as the attacker's own origin. The request still carries
``Host: attacker.example:7070``, which no legitimate client sends, so it is refused (403).

Allowed by default: ``localhost`` and the loopback addresses, plus the address the control
plane is bound to. A wildcard bind (``0.0.0.0``, ``::``) allows any host: remote clients then
use whatever name reaches the machine, and a non-loopback bind needs a token anyway.
``--allowed-host NAME`` adds to that list (a wildcard bind then allows only the listed names
and the loopback ones); ``*`` allows any host.
"""

from __future__ import annotations

import json

from starlette.types import ASGIApp, Receive, Scope, Send

from shardserve.proto.endpoints import LOOPBACK_NAMES, is_loopback_host, is_wildcard_host

LOOPBACK_HOSTS = (*LOOPBACK_NAMES, "127.0.0.1", "::1")


def host_of(header: str) -> str:
    """``"[::1]:7070"`` -> ``"::1"``, ``"LocalHost:80"`` -> ``"localhost"``."""
    h = header.strip().lower()
    if h.startswith("["):
        return h[1 : h.find("]")] if "]" in h else h
    if h.count(":") == 1:
        h = h.split(":", 1)[0]
    return h.rstrip(".")


def default_allowed(bind_host: str) -> frozenset[str] | None:
    """The default allow-list for a control plane bound to ``bind_host``; ``None``: any."""
    if is_wildcard_host(bind_host):
        return None
    return frozenset({*LOOPBACK_HOSTS, host_of(bind_host)})


def allowed_hosts(configured: list[str], bind_host: str) -> frozenset[str] | None:
    """The allow-list in force: the default plus ``configured`` (``*`` = any host)."""
    if not configured:
        return default_allowed(bind_host)
    if "*" in configured:
        return None
    base = default_allowed(bind_host) or frozenset({*LOOPBACK_HOSTS})
    return base | {host_of(h) for h in configured}


class HostAllowList:
    """Pure ASGI middleware: a request whose ``Host`` is not allowed gets 403."""

    def __init__(self, app: ASGIApp, allowed: frozenset[str] | None) -> None:
        self.app = app
        self.allowed = allowed

    def _ok(self, header: bytes | None) -> bool:
        if self.allowed is None or header is None:
            return True  # HTTP/1.0 without Host: no browser sends that
        host = host_of(header.decode("latin-1"))
        return host in self.allowed or (
            "127.0.0.1" in self.allowed and is_loopback_host(host)  # all of 127/8
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self._ok(dict(scope.get("headers") or []).get(b"host")):
            await self.app(scope, receive, send)
            return
        shown = sorted(self.allowed or ())
        body = json.dumps(
            {
                "code": "host_not_allowed",
                "detail": f"Host header not allowed here (allowed: {shown}); reach the server "
                "by one of those names, or start it with --allowed-host NAME",
            }
        ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 403,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})
