"""shardserve's contracts: wire messages and their frame codec, the store manifest schema, the
job spec, and the exception tree. Data and pure functions only: no I/O, no sockets, no clocks.
"""

from .api import JobStatus
from .distribution import __version__ as __version__
from .errors import ErrorCode, ShardserveError, error_for_code
from .framing import decode, decode_batch, encode, encode_batch
from .jobs import JobSpec, job_id
from .manifest import FORMAT_VERSION, FieldSpec, Manifest, ShardInfo, parse_manifest
from .messages import PROTOCOL_VERSION, BatchHeader, Kind, PartHeader

__all__ = [
    "FORMAT_VERSION",
    "PROTOCOL_VERSION",
    "BatchHeader",
    "ErrorCode",
    "FieldSpec",
    "JobSpec",
    "JobStatus",
    "Kind",
    "Manifest",
    "PartHeader",
    "ShardInfo",
    "ShardserveError",
    "decode",
    "decode_batch",
    "encode",
    "encode_batch",
    "error_for_code",
    "job_id",
    "parse_manifest",
]
