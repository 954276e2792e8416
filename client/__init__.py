"""The trainer's side of shardserve: ``Loader`` and what it returns or raises.

>>> from shardserve.client import Loader, serve_local      # doctest: +SKIP
>>> with serve_local("store") as url:                      # doctest: +SKIP
...     for batch in Loader(url, dataset="digits", batch_size=64):
...         ...

Errors (all from :mod:`shardserve.proto.errors`)::

    ShardserveError
    ├── TransportError: ServerUnavailable, DataStallError     transient: retrying may help
    ├── DataError: DatasetNotFound, DatasetCorruptError        the data is the problem
    ├── JobError: JobNotFound, JobFailed                       the server gave up the job
    ├── ProtocolError: VersionMismatch, ...                    client and server disagree
    ├── BadRequest                                             arguments that cannot be served
    │   └── ResidentTooLarge                                   resident data would not fit
    └── AuthError                                              missing or wrong token
"""

from shardserve.proto.errors import (
    AuthError,
    BadRequest,
    DatasetCorruptError,
    DatasetNotFound,
    DataStallError,
    JobFailed,
    JobNotFound,
    ProtocolError,
    ServerUnavailable,
    ShardserveError,
)

from .loader import Loader
from .local import serve_local
from .plan import plan
from .resident import ResidentTooLarge
from .structure import Masked
from .types import LoaderStats, VarTensor

__all__ = [
    "AuthError",
    "BadRequest",
    "DataStallError",
    "DatasetCorruptError",
    "DatasetNotFound",
    "JobFailed",
    "JobNotFound",
    "Loader",
    "LoaderStats",
    "Masked",
    "ProtocolError",
    "ResidentTooLarge",
    "ServerUnavailable",
    "ShardserveError",
    "VarTensor",
    "plan",
    "serve_local",
]
