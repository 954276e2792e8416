"""Replies to peers: the errors the data plane answers with (pure functions), and the
:class:`Outbox` that sends control messages without blocking.

Transient versus fatal is decided here: a known :class:`ShardserveError` is transient when
it says so, anything else (a bug) is fatal for the stream, with its type in the message.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import zmq

from shardserve.proto.errors import ErrorCode, ShardserveError, code_for_error
from shardserve.proto.framing import encode
from shardserve.proto.messages import ControlMessage, Error

from ..runtime.logs import log_event

log = logging.getLogger("shardserve.streaming")


class Outbox:
    """Control messages to peers on the ROUTER socket; ``on_gone(ident)`` is called when a
    peer's connection is gone (``EHOSTUNREACH``). Streamer thread only."""

    def __init__(self, sock: zmq.Socket, on_gone: Callable[[bytes], None]) -> None:
        self.sock = sock
        self.on_gone = on_gone

    def send(self, ident: bytes, msg: ControlMessage) -> bool:
        """Send; ``False`` when the peer is gone or its queue is full."""
        try:
            self.sock.send_multipart([ident, *encode(msg)], flags=zmq.NOBLOCK)
            return True
        except zmq.Again:
            return False
        except zmq.ZMQError as e:
            if e.errno != zmq.EHOSTUNREACH:
                raise
            self.on_gone(ident)
            return False

    def try_send(self, ident: bytes, msg: ControlMessage) -> bool:
        """:meth:`send` that also swallows socket errors (best-effort notices)."""
        try:
            return self.send(ident, msg)
        except zmq.ZMQError as e:
            log_event(log, "peer.send_failed", level=logging.WARNING, reason=str(e))
            return False


def stream_failure(exc: BaseException, stream: int) -> Error:
    """What the peer of ``stream`` is told when serving it raised ``exc``."""
    if isinstance(exc, ShardserveError):
        return Error(code=exc.code, message=str(exc), stream=stream, fatal=not exc.transient)
    return Error(
        code=code_for_error(exc),
        message=f"internal error serving this stream: {type(exc).__name__}: {exc}",
        stream=stream,
        fatal=True,
    )


def unknown_stream() -> Error:
    return Error(
        code=ErrorCode.UNKNOWN_STREAM,
        fatal=False,
        message="no open stream for this peer (it was closed, or the server restarted): say "
        "Hello again from your next batch",
    )


def not_accepted(kind: str) -> Error:
    return Error(
        code=ErrorCode.UNKNOWN_MESSAGE,
        fatal=False,
        message=f"the server does not accept {kind} messages",
    )


def handling_failed() -> Error:
    return Error(
        code=ErrorCode.INTERNAL,
        fatal=False,
        message="the server failed to handle this message; see its log",
    )


def credit_refused(reason: str, stream: int) -> Error:
    return Error(code=ErrorCode.BAD_REQUEST, fatal=True, stream=stream, message=reason)
