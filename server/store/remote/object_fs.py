"""Reaching an object store: which stores are URIs, how to show one without its credentials,
the options of its client, and its ``pyarrow.fs`` filesystem.

Credentials come from the environment the way each filesystem already reads them
(``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, GCS's application
default credentials), or from a URI's user part; :func:`display_uri` and :func:`scrub` keep them out of everything shown.
"""

from __future__ import annotations

import os
import urllib.parse
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from shardserve.proto.errors import ShardserveError

if TYPE_CHECKING:
    import pyarrow.fs as pafs

#: Environment variables whose values are secrets wherever they appear.
SECRET_ENV = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "GOOGLE_APPLICATION_CREDENTIALS_JSON",
    "AZURE_STORAGE_ACCOUNT_KEY",
)
_REDACTED = "<redacted>"


class StoreUnavailable(ShardserveError):
    """The object store did not answer (endpoint down, network, timeout, too slow). Not the
    data's fault: the same request may succeed once the store is back."""


class CacheUnwritable(ShardserveError):
    """The local shard cache could not take a fetched shard (disk full, quota, permissions):
    the store answered; the fix is on this host."""


def is_uri(store: str | os.PathLike[str]) -> bool:
    """Whether ``store`` names an object store (``scheme://...``) rather than a local folder."""
    return "://" in str(store)


def display_uri(uri: str) -> str:
    """``uri`` without user info, password or query (where credentials may ride)."""
    parts = urllib.parse.urlsplit(uri)
    host = parts.hostname or ""
    if parts.port:
        host = f"{host}:{parts.port}"
    return urllib.parse.urlunsplit((parts.scheme, host, parts.path, "", ""))


def scrub(text: str, secrets: Iterable[str]) -> str:
    """``text`` with every secret in ``secrets`` (4 characters or more) replaced."""
    for s in secrets:
        if s and len(s) >= 4:
            text = text.replace(s, _REDACTED)
    return text


@dataclass(frozen=True)
class StoreOptions:
    """How to reach an object store; built at the entry point from settings and environment.

    ``secrets`` is never shown: ``repr`` leaves it out.
    """

    #: S3-compatible endpoint (``http://127.0.0.1:9000``); ``None``: the provider's default.
    endpoint: str | None = None
    region: str | None = None
    connect_timeout_s: float = 5.0
    request_timeout_s: float = 30.0
    #: Attempts per request (the first included) before a read gives up.
    attempts: int = 3
    #: The slowest transfer a shard fetch may make: its total deadline is the request timeout
    #: plus its size at this rate (an endpoint that trickles bytes is "unavailable").
    min_bytes_per_s: float = float(1 << 20)
    secrets: tuple[str, ...] = field(default=(), repr=False)

    @classmethod
    def from_env(cls, env: Mapping[str, str], endpoint: str | None = None) -> StoreOptions:
        """Options from ``AWS_ENDPOINT_URL`` / ``AWS_REGION`` (``endpoint`` wins), and the
        values of :data:`SECRET_ENV` to keep out of every message."""
        return cls(
            endpoint=endpoint or env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL"),
            region=env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION"),
            secrets=tuple(env[k] for k in SECRET_ENV if env.get(k)),
        )


def fetch_deadline_s(options: StoreOptions, nbytes: int) -> float:
    """Seconds a read of ``nbytes`` may take in all: every attempt's request timeout, plus
    the bytes at ``min_bytes_per_s``.

    >>> fetch_deadline_s(StoreOptions(request_timeout_s=2.0, min_bytes_per_s=1e6), 10**7)
    16.0
    """
    return options.request_timeout_s * options.attempts + nbytes / options.min_bytes_per_s


def uri_secrets(uri: str) -> tuple[str, ...]:
    parts = urllib.parse.urlsplit(uri)
    found = [p for p in (parts.username, parts.password) if p]
    found += [v for _, v in urllib.parse.parse_qsl(parts.query) if v and len(v) >= 8]
    return tuple(urllib.parse.unquote(s) for s in found)


def open_filesystem(uri: str, options: StoreOptions) -> tuple[pafs.FileSystem, str]:
    """``(pyarrow FileSystem, base path)`` for ``uri``.

    ``s3://`` is built explicitly so the endpoint, timeouts and retries apply; any other
    scheme goes to ``pyarrow.fs.FileSystem.from_uri``.
    """
    import pyarrow.fs as pafs

    parts = urllib.parse.urlsplit(uri)
    if parts.scheme == "s3" and not parts.username and not parts.query:
        kwargs: dict[str, object] = {
            "connect_timeout": options.connect_timeout_s,
            "request_timeout": options.request_timeout_s,
            "retry_strategy": pafs.AwsStandardS3RetryStrategy(max_attempts=options.attempts),
        }
        if options.region:
            kwargs["region"] = options.region
        if options.endpoint:
            ep = urllib.parse.urlsplit(options.endpoint)
            if ep.scheme in ("http", "https"):
                kwargs["endpoint_override"] = ep.netloc
                kwargs["scheme"] = ep.scheme
            else:
                kwargs["endpoint_override"] = options.endpoint
        fs = pafs.S3FileSystem(**kwargs)
        return fs, f"{parts.netloc}{parts.path}".rstrip("/")
    fs, path = pafs.FileSystem.from_uri(uri)
    return fs, path.rstrip("/")
