"""One ZeroMQ PAIR over ``ipc://`` between the main process and a streaming process: each
frame one JSON :class:`~shardserve.proto.processes.Envelope`, validated on receipt (never
pickled). Not thread-safe: each end is used by one thread.
"""

from __future__ import annotations

import zmq
from pydantic import ValidationError

from shardserve.proto.processes import Envelope, LinkMessage

#: Largest frame a link takes (a report of a busy second, every metric family included).
MAX_FRAME_BYTES = 64 << 20


class LinkBroken(RuntimeError):
    """The other end sent something that is not a link message: a bug, never data."""


class Link:
    """One end of a link: ``bind`` in the main process, ``connect`` in the streaming one."""

    def __init__(self, ctx: zmq.Context, endpoint: str, *, bind: bool) -> None:
        self.endpoint = endpoint
        self.sock = ctx.socket(zmq.PAIR)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        if bind:
            self.sock.bind(endpoint)
        else:
            self.sock.connect(endpoint)

    def send(self, message: LinkMessage, *, block: bool = True) -> bool:
        """Queue ``message``; with ``block=False``, False when it cannot be now (no peer
        connected yet, or its queue full) instead of waiting. A streaming process blocks:
        the main process reads its links at least every few milliseconds, and a report
        dropped would make its counters lie."""
        frame = Envelope(message=message).model_dump_json().encode()
        try:
            self.sock.send(frame, 0 if block else zmq.NOBLOCK, copy=True)
        except zmq.Again:
            return False
        return True

    def recv(self) -> LinkMessage | None:
        """The next message, or ``None`` when none is waiting."""
        try:
            frame = self.sock.recv(zmq.NOBLOCK)
        except zmq.Again:
            return None
        try:
            return Envelope.model_validate_json(frame).message
        except ValidationError as e:
            raise LinkBroken(f"bad frame on link {self.endpoint}: {e}") from None

    def close(self) -> None:
        self.sock.close(linger=0)
