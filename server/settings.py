"""The server's one settings object (pydantic-settings, environment prefix ``SHARDSERVE_``).

Built once at the entry point (:mod:`shardserve.server.serve`) from flags and environment,
then passed down; nothing else in the server reads ``os.environ``. List settings accept JSON
or a comma-separated string from the environment, e.g.
``SHARDSERVE_DATA=tcp://127.0.0.1:7071,tcp://10.0.0.5:7071``.
"""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Annotated, Literal

from pydantic import ByteSize, Field, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

_LOOPBACK_NAMES = {"localhost", "ip6-localhost"}


def split_host_port(addr: str) -> tuple[str, int]:
    """``"127.0.0.1:7070"`` -> ``("127.0.0.1", 7070)``; ``"[::1]:80"`` -> ``("::1", 80)``."""
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ValueError(f"address {addr!r} must be HOST:PORT, e.g. 127.0.0.1:7070")
    if not 0 <= int(port) <= 65535:
        raise ValueError(f"port {port} in {addr!r} is outside 0..65535")
    return host.strip("[]"), int(port)


def is_loopback_host(host: str) -> bool:
    """Whether ``host`` names only this machine (a literal loopback address or localhost)."""
    if host.lower() in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a hostname or wildcard such as "*" may be reachable from outside


def _data_host(endpoint: str) -> str | None:
    """The host of a ``tcp://`` endpoint; ``None`` for transports that never leave the host."""
    scheme, _, rest = endpoint.partition("://")
    if scheme != "tcp":
        return None
    return split_host_port(rest)[0]


class Settings(BaseSettings):
    """Everything ``shardserve serve`` can be told; see ``shardserve serve --help``."""

    model_config = SettingsConfigDict(env_prefix="SHARDSERVE_", extra="forbid")

    #: A folder, or an object-store URI (``s3://bucket/prefix``) served through ``cache_dir``.
    store: Path | str
    http: str = "127.0.0.1:7070"
    data: Annotated[list[str], NoDecode] = Field(default_factory=lambda: ["tcp://127.0.0.1:7071"])
    ipc: Path | None = None
    token: str | None = None
    insecure: bool = False
    verify: Literal["lazy", "full", "off"] = "lazy"
    state_dir: Path | None = None
    assembly_threads: int = Field(default=2, ge=1, le=64)
    heartbeat_s: float = Field(default=1.0, gt=0, le=60)
    stream_timeout_s: float = Field(default=10.0, gt=0, le=3600)
    ready_file: Path | None = None
    log_format: Literal["text", "json"] = "text"
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    #: Largest HTTP request body accepted; more is answered 413. Sizes take units: ``4MiB``.
    max_body_bytes: ByteSize = Field(default=ByteSize(1 << 20), ge=1024)
    #: Same-host clients get batches through shared-memory slot rings unless this is off.
    shm: bool = True
    #: Bytes all slot rings together may take; a stream past it falls back to the socket path.
    shm_limit_bytes: ByteSize = Field(default=ByteSize(4 << 30), ge=0)
    #: Data-plane streams open at once, all jobs together (a stream holds its credit in batches).
    max_streams: int = Field(default=1024, ge=1, le=1 << 20)
    #: Streams one job may have open; 0 means its world size (never more than that).
    max_streams_per_job: int = Field(default=0, ge=0)
    #: Hellos one data-plane peer may send per second; more are answered with an error.
    max_hellos_per_s: float = Field(default=20.0, gt=0, le=1e6)
    #: Slot rings that may wait for their client's first Credit (proof it mapped the ring)
    #: at once; only proven rings count against ``shm_limit_bytes``.
    shm_unproven_rings: int = Field(default=16, ge=0, le=1 << 16)
    #: Largest batch a job may ask for (bytes, at the dataset's average sample); more is 422.
    max_batch_bytes: int = Field(default=1 << 30, ge=1)
    #: ``Host`` header values the control plane answers besides the loopback names and the
    #: ``http`` bind address (DNS-rebinding guard); ``*`` allows any host.
    allowed_hosts: Annotated[list[str], NoDecode] = Field(default_factory=list)
    #: Seconds an HTTP connection may stay open without a complete request (slow or idle).
    http_idle_timeout_s: float = Field(default=15.0, gt=0, le=3600)
    #: A job with no stream for this long is ``idle`` (or ``finished``) rather than ``running``.
    idle_after_s: float = Field(default=60.0, gt=0, le=86400)
    #: A job that is not live is forgotten after this long without a stream; 0 keeps it.
    job_ttl_s: float = Field(default=86400.0, ge=0)
    #: Jobs tracked at most; only live ones (pending, running) count: others are evicted.
    max_jobs: int = Field(default=4096, ge=1, le=1 << 20)
    #: Local folder for whole shards of a remote store (may be shared by servers on a host).
    cache_dir: Path | None = None
    #: Bytes of shards the cache keeps (a target: shards being read are never evicted).
    cache_limit_bytes: int = Field(default=64 << 30, ge=1)
    #: S3-compatible endpoint URL for a remote store (else ``AWS_ENDPOINT_URL``).
    store_endpoint: str | None = None
    #: Seconds one object-store request may take; with 3 attempts a read of a store that
    #: stopped answering fails within about 3x this, inside a client's default 60 s deadline.
    store_timeout_s: float = Field(default=10.0, gt=0, le=600)
    #: Modules whose transforms jobs may name (besides the built-ins and entry points).
    transforms: Annotated[list[str], NoDecode] = Field(default_factory=list)
    #: Threads or worker processes that run transforms; ``transform_pool`` picks which
    #: (``auto``: what each transform declares).
    transform_workers: int = Field(default=2, ge=1, le=256)
    transform_pool: Literal["auto", "thread", "process"] = "auto"
    #: Seconds one batch's transforms may take before the job fails (a hung worker is killed).
    transform_timeout_s: float = Field(default=30.0, gt=0, le=3600)

    @field_validator("store", mode="before")
    @classmethod
    def _store_path_or_uri(cls, v: object) -> object:
        # A URI stays a string ("s3://b/p" as a Path would lose a slash); the rest are folders.
        if isinstance(v, str) and "://" not in v:
            return Path(v)
        return v

    @model_validator(mode="after")
    def _remote_store_needs_cache(self) -> Settings:
        if self.store_is_remote and self.cache_dir is None:
            raise ValueError(
                f"store {self.store_shown} is remote: set --cache-dir (SHARDSERVE_CACHE_DIR) "
                "to a local folder for its shards"
            )
        return self

    @property
    def store_is_remote(self) -> bool:
        return isinstance(self.store, str)

    @property
    def store_shown(self) -> str:
        """The store as logs and pages show it: a URI without credentials."""
        if isinstance(self.store, str):
            from .store.remote import display_uri

            return display_uri(self.store)
        return str(self.store)

    @field_validator("data", mode="before")
    @classmethod
    def _split_data(cls, v: object) -> object:
        if isinstance(v, str):
            v = v.strip()
            if v.startswith("["):
                import json

                return json.loads(v)
            return [e.strip() for e in v.split(",") if e.strip()]
        return v

    @field_validator("transforms", mode="before")
    @classmethod
    def _split_transforms(cls, v: object) -> object:
        if isinstance(v, str):
            if v.strip().startswith("["):
                import json

                return json.loads(v)
            return [m.strip() for m in v.split(",") if m.strip()]
        return v

    @field_validator("allowed_hosts", mode="before")
    @classmethod
    def _split_hosts(cls, v: object) -> object:
        if isinstance(v, str):
            return [h.strip() for h in v.split(",") if h.strip()]
        return v

    @field_validator("data")
    @classmethod
    def _check_data(cls, v: list[str]) -> list[str]:
        if not v:
            raise ValueError("data needs at least one endpoint, e.g. tcp://127.0.0.1:7071")
        for e in v:
            scheme = e.partition("://")[0]
            if scheme not in ("tcp", "ipc") or "://" not in e:
                raise ValueError(f"data endpoint {e!r} must start with tcp:// or ipc://")
            if scheme == "tcp":
                split_host_port(e.partition("://")[2])
        return v

    @field_validator("http")
    @classmethod
    def _check_http(cls, v: str) -> str:
        split_host_port(v)
        return v

    @field_validator("token")
    @classmethod
    def _empty_token_is_none(cls, v: str | None) -> str | None:
        return v or None

    @model_validator(mode="after")
    def _refuse_public_without_token(self) -> Settings:
        public = [self.http] if not is_loopback_host(split_host_port(self.http)[0]) else []
        public += [
            e for e in self.data if (h := _data_host(e)) is not None and not is_loopback_host(h)
        ]
        if public and not self.token and not self.insecure:
            raise ValueError(
                f"refusing to listen on non-loopback address(es) {public} without a token: "
                "set --token / SHARDSERVE_TOKEN, or pass --insecure to serve without one"
            )
        return self

    @property
    def http_host_port(self) -> tuple[str, int]:
        return split_host_port(self.http)

    @property
    def state_path(self) -> Path:
        """Where the epoch journal lives: ``state_dir``, else ``<store>/.shardserve`` (a local
        store) or ``<cache_dir>/.shardserve`` (a remote one)."""
        if self.state_dir is not None:
            return self.state_dir
        if isinstance(self.store, str):
            assert self.cache_dir is not None  # the validator insists
            return self.cache_dir / ".shardserve"
        return self.store / ".shardserve"

    @property
    def data_endpoints(self) -> list[str]:
        """Every data endpoint to bind: ``data`` plus ``ipc://PATH`` when ``ipc`` is set."""
        return [*self.data, *([f"ipc://{self.ipc}"] if self.ipc else [])]
