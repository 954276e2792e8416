"""The errors the data plane answers with, built in one place. Pure: no socket.

Transient versus fatal is decided here: a known :class:`ShardserveError` is transient when
it says so, anything else (a bug) is fatal for the stream, with its type in the message.
"""

from __future__ import annotations

from shardserve.proto.errors import ErrorCode, ShardserveError, code_for_error
from shardserve.proto.messages import Error


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
