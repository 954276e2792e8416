"""Refuse oversized request bodies (413) before they are read into memory."""

from __future__ import annotations

import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send


class _TooLarge(Exception):
    pass


class BodyLimit:
    """Pure ASGI middleware: a declared or streamed body over ``max_bytes`` is answered 413."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_bytes):
            await self._refuse(send)
            return
        seen = 0
        over = refused = False

        async def counting_receive() -> Message:
            nonlocal seen, over
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.max_bytes:
                    over = True
                    raise _TooLarge
            return msg

        async def guarded_send(msg: Message) -> None:
            nonlocal refused
            # The app may turn our exception into its own error response (FastAPI answers 400
            # for any body-read failure): replace whatever it says with the 413.
            if over:
                if msg["type"] == "http.response.start" and not refused:
                    refused = True
                    await self._refuse(send)
                return
            await send(msg)

        try:
            await self.app(scope, counting_receive, guarded_send)
        except _TooLarge:
            if not refused:
                await self._refuse(send)

    async def _refuse(self, send: Send) -> None:
        body = json.dumps(
            {"code": "too_large", "detail": f"request body over the {self.max_bytes}-byte limit"}
        ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})
