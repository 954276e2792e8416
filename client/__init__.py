"""The trainer's side of shardserve: ``Loader`` and what it returns or raises.

>>> from shardserve.client import Loader, serve_local      # doctest: +SKIP
>>> with serve_local("store") as url:                      # doctest: +SKIP
...     for batch in Loader(url, dataset="digits", batch_size=64):
...         ...

Errors (all from :mod:`shardserve.proto.errors`)::

    ShardserveError
    ├── TransportError: ServerUnavailable, DataStallError     transient: retrying may help
    ├── DataError: DatasetNotFound, DatasetCorruptError,       the data is the problem
    │              DatasetChanged                              (replaced under a pinned job)
    ├── JobError: JobNotFound, JobFailed, TransformError,      the server gave up the job
    │             RankInUse                                    (or another client holds the rank)
    ├── ProtocolError: VersionMismatch, ...                    client and server disagree
    ├── BadRequest                                             arguments that cannot be served
    │   ├── ResidentTooLarge                                   resident data would not fit
    │   ├── ResumeRefused                                      a state that would not resume
    │   │                                                      exactly (version, world size)
    │   └── StreamLimitExceeded                                the server's stream limits
    └── AuthError                                              missing or wrong token
"""

from shardserve.proto.distribution import __version__ as __version__
from shardserve.proto.errors import (
    AuthError,
    BadRequest,
    DatasetChanged,
    DatasetCorruptError,
    DatasetNotFound,
    DataStallError,
    JobFailed,
    JobNotFound,
    ProtocolError,
    RankInUse,
    ServerUnavailable,
    ShardserveError,
    StreamLimitExceeded,
    TransformError,
)

from . import _needs  # noqa: F401  (first: a missing torch is one line naming the extra)
from .loader import Loader
from .local import serve_local
from .plan import plan
from .resident import ResidentTooLarge
from .state import ResumeRefused
from .structure import Masked, Texts
from .types import LoaderStats, VarTensor

__all__ = [
    "AuthError",
    "BadRequest",
    "DataStallError",
    "DatasetChanged",
    "DatasetCorruptError",
    "DatasetNotFound",
    "JobFailed",
    "JobNotFound",
    "Loader",
    "LoaderStats",
    "Masked",
    "ProtocolError",
    "RankInUse",
    "ResidentTooLarge",
    "ResumeRefused",
    "ServerUnavailable",
    "ShardserveError",
    "StreamLimitExceeded",
    "Texts",
    "TransformError",
    "VarTensor",
    "plan",
    "serve_local",
]
