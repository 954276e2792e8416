"""An HTTP protocol for uvicorn that closes connections holding no complete request.

uvicorn starts its keep-alive timer only after a response, so a connection that is opened
and never finishes its request head (idle, or trickling one byte at a time) stays open for
ever: a few hundred of them exhaust the server's file descriptors. Here every connection
must complete a request within ``idle_timeout_s`` of opening, and the next one within
``idle_timeout_s`` of each response; a request being handled is never cut off.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol


class IdleClosingH11(H11Protocol):
    """:class:`H11Protocol` with the deadline described in the module docstring."""

    idle_timeout_s: float = 15.0

    # uvicorn's arguments pass through untouched: its constructor has changed between the
    # versions this package accepts (uvicorn>=0.27), and this class adds none of its own.
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._idle: asyncio.TimerHandle | None = None

    def _arm(self) -> None:
        if self._idle is not None:
            self._idle.cancel()
        self._idle = self.loop.call_later(self.idle_timeout_s, self._expired)

    def _expired(self) -> None:
        self._idle = None
        if self.cycle is not None and not self.cycle.response_complete:
            return  # a request is being answered; its response re-arms the deadline
        if not self.transport.is_closing():
            self.transport.close()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._idle is not None:
            self._idle.cancel()
            self._idle = None
        super().connection_lost(exc)


def protocol_with_timeout(idle_timeout_s: float) -> type[IdleClosingH11]:
    """A protocol class for ``uvicorn.Config(http=...)`` with this server's deadline."""
    return type("IdleClosingH11", (IdleClosingH11,), {"idle_timeout_s": idle_timeout_s})
