"""The exception tree shared by server and client.

```text
ShardserveError
├── ProtocolError              the wire contract was broken; fatal for that stream
│   ├── VersionMismatch        the peers speak no common protocol version
│   ├── MalformedFrame         a frame could not be decoded (truncated, bad sizes, bad JSON)
│   └── UnknownMessage         a message kind this side does not know
├── TransportError             the other side is not there (transient: retry may help)
│   ├── ServerUnavailable      the server did not answer within the deadline
│   └── DataStallError         a stream produced no batch within the deadline
├── DataError                  the data itself is the problem (fatal)
│   ├── DatasetNotFound
│   ├── DatasetCorruptError    checksum mismatch, truncated or missing shard
│   ├── DatasetChanged         the dataset version a job pinned is gone (--overwrite)
│   │   └── VersionConflict    a rank's job would pin another version than its peers'
│   └── InvalidDataError       input to ingest that cannot become a dataset
├── JobError                   the job cannot go on (fatal)
│   ├── JobNotFound
│   ├── JobFailed              the server marked the job failed; the reason is in the message
│   ├── RankInUse              another live client streams this (job, rank)
│   └── TransformError         a server-side transform failed (names transform, dataset, sample)
├── BadRequest                 a request with fields that cannot be served
│   ├── StreamLimitExceeded    a data-plane limit (streams, Hellos a second) refused a stream
│   └── StepInThePast          a mixture change or quarantine at a step already sent
└── AuthError                  missing or wrong token
```

Every error that crosses the wire carries an [ErrorCode][shardserve.proto.errors.ErrorCode];
[error_for_code][shardserve.proto.errors.error_for_code] turns it back into the same class on
the other side, so a trainer catches
``DatasetCorruptError`` whether the corruption was found in its process or in the server's.
"""

from __future__ import annotations

from enum import Enum


class ErrorCode(str, Enum):
    """Stable names for errors on the wire and in HTTP bodies."""

    VERSION_MISMATCH = "version_mismatch"
    MALFORMED = "malformed"
    UNKNOWN_MESSAGE = "unknown_message"
    UNAUTHORIZED = "unauthorized"
    BAD_REQUEST = "bad_request"
    DATASET_NOT_FOUND = "dataset_not_found"
    DATASET_CORRUPT = "dataset_corrupt"
    DATASET_CHANGED = "dataset_changed"
    VERSION_CONFLICT = "version_conflict"
    JOB_NOT_FOUND = "job_not_found"
    JOB_FAILED = "job_failed"
    TRANSFORM_FAILED = "transform_failed"
    UNKNOWN_STREAM = "unknown_stream"
    SERVER_SHUTDOWN = "server_shutdown"
    INTERNAL = "internal"
    RANK_IN_USE = "rank_in_use"
    STREAM_LIMIT = "stream_limit"
    STEP_IN_THE_PAST = "step_in_the_past"
    #: Not an error: a notice (never fatal) that a shared stream fell out of its share group's
    #: window and is served on its own pass of the same plan (same bytes, no longer shared).
    SHARE_DETACHED = "share_detached"


class ShardserveError(Exception):
    """Base of every error shardserve raises on purpose."""

    code: ErrorCode = ErrorCode.INTERNAL
    #: A transient error may go away on retry; a fatal one will not.
    transient: bool = False


class ProtocolError(ShardserveError):
    code = ErrorCode.MALFORMED


class VersionMismatch(ProtocolError):
    code = ErrorCode.VERSION_MISMATCH


class MalformedFrame(ProtocolError):
    code = ErrorCode.MALFORMED


class UnknownMessage(ProtocolError):
    code = ErrorCode.UNKNOWN_MESSAGE


class TransportError(ShardserveError):
    transient = True


class ServerUnavailable(TransportError):
    code = ErrorCode.SERVER_SHUTDOWN


class DataStallError(TransportError, TimeoutError):
    pass


class DataError(ShardserveError):
    pass


class DatasetNotFound(DataError, LookupError):
    code = ErrorCode.DATASET_NOT_FOUND


class DatasetCorruptError(DataError):
    code = ErrorCode.DATASET_CORRUPT


class DatasetChanged(DataError):
    """The dataset version a job was created for is gone: ``ingest --overwrite`` replaced it
    (and the server restarted, or never had it open). The message names both version ids."""

    code = ErrorCode.DATASET_CHANGED


class VersionConflict(DatasetChanged):
    """Ranks of one run would train on two versions of a dataset: a job is refused because a
    live job of the same spec pins another version. The message names both version ids."""

    code = ErrorCode.VERSION_CONFLICT


class InvalidDataError(DataError, ValueError):
    code = ErrorCode.BAD_REQUEST


class JobError(ShardserveError):
    code = ErrorCode.JOB_FAILED


class JobNotFound(JobError, LookupError):
    code = ErrorCode.JOB_NOT_FOUND


class JobFailed(JobError):
    code = ErrorCode.JOB_FAILED


class TransformError(JobError):
    """A server-side transform raised, returned the wrong fields, hung or killed its worker;
    the message names the transform, the dataset, the sample index and what went wrong."""

    code = ErrorCode.TRANSFORM_FAILED


class UnknownStream(JobError):
    """The server has no stream for this peer (reclaimed, or the server restarted)."""

    code = ErrorCode.UNKNOWN_STREAM
    transient = True


class BadRequest(ShardserveError, ValueError):
    code = ErrorCode.BAD_REQUEST


class RankInUse(JobError):
    """Another live client already streams this (job, rank): two processes claim one rank."""

    code = ErrorCode.RANK_IN_USE


class StreamLimitExceeded(BadRequest):
    """The server's stream limits (``--max-streams``, ``--max-streams-per-job``) are reached;
    the message names the flag."""

    code = ErrorCode.STREAM_LIMIT


class StepInThePast(BadRequest):
    """A change to a job's plan (mixture weights) at a step some rank was already sent: it
    would rewrite data already delivered. The message names the job's frontier."""

    code = ErrorCode.STEP_IN_THE_PAST


class AuthError(ShardserveError, PermissionError):
    code = ErrorCode.UNAUTHORIZED


_BY_CODE: dict[ErrorCode, type[ShardserveError]] = {
    ErrorCode.VERSION_MISMATCH: VersionMismatch,
    ErrorCode.MALFORMED: MalformedFrame,
    ErrorCode.UNKNOWN_MESSAGE: UnknownMessage,
    ErrorCode.UNAUTHORIZED: AuthError,
    ErrorCode.BAD_REQUEST: BadRequest,
    ErrorCode.DATASET_NOT_FOUND: DatasetNotFound,
    ErrorCode.DATASET_CORRUPT: DatasetCorruptError,
    ErrorCode.DATASET_CHANGED: DatasetChanged,
    ErrorCode.VERSION_CONFLICT: VersionConflict,
    ErrorCode.JOB_NOT_FOUND: JobNotFound,
    ErrorCode.JOB_FAILED: JobFailed,
    ErrorCode.TRANSFORM_FAILED: TransformError,
    ErrorCode.UNKNOWN_STREAM: UnknownStream,
    ErrorCode.SERVER_SHUTDOWN: ServerUnavailable,
    ErrorCode.INTERNAL: ShardserveError,
    ErrorCode.RANK_IN_USE: RankInUse,
    ErrorCode.STREAM_LIMIT: StreamLimitExceeded,
    ErrorCode.STEP_IN_THE_PAST: StepInThePast,
    ErrorCode.SHARE_DETACHED: ShardserveError,  # a notice: never raised
}


def error_for_code(code: ErrorCode | str, message: str) -> ShardserveError:
    """The exception a peer's error code stands for, carrying the peer's message.

    Examples:
        >>> type(error_for_code("dataset_corrupt", "shard-00001.arrow: checksum mismatch"))
        <class 'shardserve.proto.errors.DatasetCorruptError'>
    """
    try:
        cls = _BY_CODE[ErrorCode(code)]
    except ValueError:
        cls = ShardserveError
    return cls(message)


def code_for_error(exc: BaseException) -> ErrorCode:
    """The wire code for an exception; anything not ours is INTERNAL."""
    return exc.code if isinstance(exc, ShardserveError) else ErrorCode.INTERNAL
