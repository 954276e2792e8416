"""The server's one settings object (pydantic-settings, environment prefix ``SHARDSERVE_``).

Built once at the entry point (:mod:`shardserve.server.serve`) from flags and environment,
then passed down; nothing else in the server reads ``os.environ``. List settings accept JSON
or a comma-separated string from the environment, e.g.
``SHARDSERVE_DATA=tcp://127.0.0.1:7071,tcp://10.0.0.5:7071``.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Literal

from pydantic import ByteSize, Field, PrivateAttr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from .runtime.sizing import STREAM_PROCESSES_FLAG_MAX, Sizing, choose, one_process, probe

# shardserve.proto is imported where a value is checked, not here: importing it loads every
# contract (numpy, the wire and job models), and `shardserve serve --help` needs none of them.


class Settings(BaseSettings):
    """Everything ``shardserve serve`` can be told; see ``shardserve serve --help``."""

    model_config = SettingsConfigDict(env_prefix="SHARDSERVE_", extra="forbid")

    store: Path | str = Field(
        description="store folder, or an object-store URI (s3://bucket/prefix) served "
        "through --cache-dir",
    )
    create: bool = Field(
        default=False,
        description="create a local --store folder that does not exist (else serve refuses "
        "it: a typo must not serve an empty store)",
    )
    http: str = Field(
        default="127.0.0.1:7070", description="control plane HOST:PORT (port 0: any free one)"
    )
    data: Annotated[list[str], NoDecode] = Field(
        default_factory=lambda: ["tcp://127.0.0.1:7071"],
        description="data plane endpoint, repeatable",
        json_schema_extra={"metavar": "ENDPOINT"},
    )
    ipc: Path | None = Field(default=None, description="also bind ipc://PATH for same-host clients")
    token: str | None = Field(default=None, description="shared secret required from every client")
    insecure: bool = Field(
        default=False, description="allow non-loopback addresses without a token"
    )
    verify: Literal["lazy", "full", "off"] = Field(
        default="lazy", description="when shard checksums are checked (lazy: before first use)"
    )
    state_dir: Path | None = Field(
        default=None,
        description="where the job journal lives (default STORE/.shardserve)",
        json_schema_extra={"metavar": "DIR"},
    )
    assembly_threads: int = Field(
        default=2,
        ge=1,
        le=64,
        description="threads assembling batches (unset: a quarter of the CPUs, at least 2)",
        json_schema_extra={"sized": True},
    )
    stream_processes: int = Field(
        default=1,
        ge=1,
        le=STREAM_PROCESSES_FLAG_MAX,
        description="processes serving streams (1: the main one; N > 1: N streaming processes "
        "beside it; unset: a quarter of the CPUs, at least 1)",
        json_schema_extra={"sized": True},
    )
    heartbeat_s: float = Field(
        default=1.0, gt=0, le=60, description="seconds between data-plane heartbeats"
    )
    stream_timeout_s: float = Field(
        default=10.0, gt=0, le=3600, description="a stream silent this long is reclaimed"
    )
    ready_file: Path | None = Field(
        default=None, description="write JSON with the bound addresses here once ready"
    )
    log_format: Literal["text", "json"] = Field(default="text", description="log line format")
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        default="info", description="least severe log level written"
    )
    max_body_bytes: ByteSize = Field(
        default=ByteSize(1 << 20),
        ge=1024,
        description="largest HTTP request body accepted; more is answered 413",
        json_schema_extra={"metavar": "SIZE"},
    )
    shm: bool = Field(
        default=True,
        description="shared-memory batch slots for same-host clients (--no-shm: sockets only)",
    )
    shm_limit_bytes: ByteSize = Field(
        default=ByteSize(4 << 30),
        ge=0,
        description="shared memory all slot rings may take together; a stream past it falls "
        "back to the socket (unset: a quarter of the memory the server may use, at most 4GiB)",
        json_schema_extra={"metavar": "SIZE", "sized": True},
    )
    shm_ring_bytes: ByteSize = Field(
        default=ByteSize(256 << 20),
        ge=0,
        description="shared memory one stream's ring takes at most (at least 2 slots): credit "
        "past it waits for a slot the client hands back; 0: no cap (credit x slot)",
        json_schema_extra={"metavar": "SIZE"},
    )
    max_batch_bytes: int = Field(
        default=1 << 30,
        ge=1,
        description="largest batch a job may ask for, in bytes at the dataset's average "
        "sample; more is refused with 422",
    )
    allowed_hosts: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="another Host header the control plane answers, repeatable (always "
        "answered: localhost, loopback addresses and the --http address unless it is a "
        "wildcard, which answers any host unless this is given; '*' allows any)",
        json_schema_extra={"flag": "--allowed-host", "metavar": "HOST"},
    )
    http_idle_timeout_s: float = Field(
        default=15.0,
        gt=0,
        le=3600,
        description="close HTTP connections without a complete request after this long",
    )
    idle_after_s: float = Field(
        default=60.0,
        gt=0,
        le=86400,
        description="a job with no stream this long is idle (or finished), not running",
    )
    job_ttl_s: float = Field(
        default=86400.0,
        ge=0,
        description="forget a job that is not live after this long without a stream; 0: never",
    )
    max_jobs: int = Field(
        default=4096,
        ge=1,
        le=1 << 20,
        description="jobs tracked at most; only live ones count, others are evicted",
    )
    cache_dir: Path | None = Field(
        default=None,
        description="local folder for whole shards of a remote --store (servers on a host "
        "may share it)",
        json_schema_extra={"metavar": "DIR"},
    )
    cache_limit_bytes: int = Field(
        default=64 << 30,
        ge=1,
        description="bytes of shards the cache keeps (a target: shards being read stay)",
    )
    store_endpoint: str | None = Field(
        default=None,
        description="S3-compatible endpoint URL of a remote store (else AWS_ENDPOINT_URL)",
        json_schema_extra={"metavar": "URL"},
    )
    store_timeout_s: float = Field(
        default=10.0,
        gt=0,
        le=600,
        description="longest object-store request; with 3 attempts a read of a store that "
        "stopped answering fails within about 3x this",
    )
    store_min_bytes_per_s: float = Field(
        default=float(1 << 20),
        gt=0,
        description="slowest transfer a shard fetch may make: a fetch fails with 'store "
        "unavailable' once it has taken --store-timeout-s x 3 plus its size at this rate",
        json_schema_extra={"metavar": "RATE"},
    )
    max_streams: int = Field(
        default=1024,
        ge=1,
        le=1 << 20,
        description="data-plane streams open at once, all jobs (each holds its credit in batches)",
    )
    max_streams_per_job: int = Field(
        default=0,
        ge=0,
        description="streams one job may have open (0: its world size, times "
        "--share-subscribers for a shared job)",
    )
    share_subscribers: int = Field(
        default=16,
        ge=1,
        le=1024,
        description="subscribers one rank of a shared job (Loader(share=...)) may have",
    )
    share_window: int = Field(
        default=64,
        ge=1,
        le=1 << 16,
        description="batches a share group keeps below its fastest subscriber; one further "
        "behind goes on on its own pass",
    )
    share_window_bytes: ByteSize = Field(
        default=ByteSize(1 << 30),
        ge=1,
        description="bytes a share group's window keeps at most (fewer batches for big ones)",
        json_schema_extra={"metavar": "SIZE"},
    )
    share_bytes: ByteSize = Field(
        default=ByteSize(2 << 30),
        ge=0,
        description="bytes all share groups keep together; past it a batch is handed to the "
        "subscribers waiting for it and not kept (the others assemble it on their own)",
        json_schema_extra={"metavar": "SIZE"},
    )
    plan_cache_bytes: ByteSize = Field(
        default=ByteSize(512 << 20),
        ge=1,
        description="bytes of epoch orders kept for reuse, mixture orders too (4 bytes a "
        "sample); the newest order is kept even when larger",
        json_schema_extra={"metavar": "SIZE"},
    )
    unread_stream_bytes: ByteSize = Field(
        default=ByteSize(64 << 20),
        ge=1,
        description="bytes one stream is sent before its client first reads (at least one "
        "message); the rest of its credit waits for its first Credit",
        json_schema_extra={"metavar": "SIZE"},
    )
    unread_bytes: ByteSize = Field(
        default=ByteSize(512 << 20),
        ge=1,
        description="bytes all streams that have not read yet are sent together; a stream past "
        "it waits, sent nothing, until one of them reads or closes",
        json_schema_extra={"metavar": "SIZE"},
    )
    max_hellos_per_s: float = Field(
        default=20.0,
        gt=0,
        le=1e6,
        description="Hellos one data-plane peer may send per second; more are coalesced",
    )
    shm_unproven_rings: int = Field(
        default=16,
        ge=0,
        le=1 << 16,
        description="slot rings that may wait for their client's first Credit (proof it mapped "
        "them); only proven rings count against --shm-limit-bytes",
    )
    read_ahead_bytes: ByteSize = Field(
        default=ByteSize(1 << 30),
        ge=0,
        description="bytes of a local shard the kernel is asked to read at once when a read "
        "first touches it, so a shuffled epoch beyond RAM reads the disk sequentially; 0: off",
        json_schema_extra={"metavar": "SIZE"},
    )
    transforms: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="a module of transforms jobs may name, besides the built-ins and the "
        "shardserve.transforms entry points; repeatable",
        json_schema_extra={"metavar": "MODULE"},
    )
    transform_workers: int = Field(
        default=2,
        ge=1,
        le=256,
        description="threads or worker processes that run transforms (unset: half the CPUs "
        "the server may use, at least 2)",
        json_schema_extra={"sized": True},
    )
    transform_pool: Literal["auto", "thread", "process"] = Field(
        default="auto",
        description="what runs transforms (auto: what each transform declares)",
    )
    transform_timeout_s: float = Field(
        default=30.0,
        gt=0,
        le=3600,
        description="seconds one batch's transforms may take before the job fails (a hung "
        "worker is killed)",
    )

    max_decoded_pixels: int = Field(
        default=1 << 26,
        ge=1,
        le=1 << 40,
        description="most pixels (width x height, read from its header before decoding) one "
        "image a transform decodes may have; a larger one fails its job naming the sample",
    )
    shutdown_timeout_s: float = Field(
        default=10.0,
        gt=0,
        le=600,
        description="seconds from SIGTERM/SIGINT to exit: what has not stopped by then (a hung "
        "transform, a fetch) is abandoned and the process exits with status 1",
    )

    _sizing: Sizing | None = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _size_from_machine(self) -> Settings:
        # Flag > environment > machine: a field set either way is in model_fields_set.
        sized = [n for n, f in type(self).model_fields.items() if _is_sized(f.json_schema_extra)]
        given = {n: int(getattr(self, n)) for n in sized if n in self.model_fields_set}
        if self.store_is_remote:
            given = one_process(given)
        sizing = choose(probe(), given)
        for name, value in sizing.applied().items():
            if name not in given:
                setattr(self, name, value)
        self._sizing = sizing
        return self

    @property
    def sizing(self) -> Sizing:
        """The sized settings' values and why each was chosen (see :mod:`.sizing`)."""
        assert self._sizing is not None  # set by the validator
        return self._sizing

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
            from .store.remote.object_fs import display_uri

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
        from shardserve.proto.endpoints import tcp_host

        for e in v:
            tcp_host(e)  # raises for an unknown scheme or a bad HOST:PORT
        return v

    @field_validator("http")
    @classmethod
    def _check_http(cls, v: str) -> str:
        from shardserve.proto.endpoints import split_host_port

        split_host_port(v)
        return v

    @field_validator("token")
    @classmethod
    def _empty_token_is_none(cls, v: str | None) -> str | None:
        return v or None

    @model_validator(mode="after")
    def _refuse_public_without_token(self) -> Settings:
        from shardserve.proto.endpoints import is_loopback_host, split_host_port, tcp_host

        public = [self.http] if not is_loopback_host(split_host_port(self.http)[0]) else []
        public += [
            e for e in self.data if (h := tcp_host(e)) is not None and not is_loopback_host(h)
        ]
        if public and not self.token and not self.insecure:
            raise ValueError(
                f"refusing to listen on non-loopback address(es) {public} without a token: "
                "set --token / SHARDSERVE_TOKEN, or pass --insecure to serve without one"
            )
        return self

    @property
    def http_host_port(self) -> tuple[str, int]:
        from shardserve.proto.endpoints import split_host_port

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


def _is_sized(extra: object) -> bool:
    return isinstance(extra, dict) and extra.get("sized") is True


class StoreDefaults(BaseSettings):
    """What the store subcommands (``ingest``, ``ls``, ...) take from the environment: the
    same ``SHARDSERVE_STORE`` and ``SHARDSERVE_STORE_ENDPOINT`` that ``serve`` reads."""

    model_config = SettingsConfigDict(env_prefix="SHARDSERVE_", extra="ignore")

    store: str | None = None
    store_endpoint: str | None = None


ENV_PREFIX = "SHARDSERVE_"

#: ``SHARDSERVE_*`` variables read by something other than :class:`Settings`: what they are for.
OTHER_ENV: dict[str, str] = {
    "SHARDSERVE_URL": "client: the server Loader(None, ...) connects to",
    "SHARDSERVE_HTTP_PORT": "docker-compose.yml: host port of the control plane",
    "SHARDSERVE_DATA_PORT": "docker-compose.yml: host port of the data plane",
    "SHARDSERVE_IMAGE": "docker/podman-stack.sh: the server image",
    "SHARDSERVE_TRAINER_IMAGE": "docker/podman-stack.sh: the trainer image",
    "SHARDSERVE_TRAINER_OPTS": "docker/podman-stack.sh: extra trainer options",
    "SHARDSERVE_STACK": "docker/podman-stack.sh: the stack's name",
    "SHARDSERVE_KEEP_STACK": "docker/podman-stack.sh: keep the stack after it ran",
    "SHARDSERVE_TORCH_WHEELS": "docker/ci-engine.sh: a folder of torch wheels for the images",
    "SHARDSERVE_HEALTH_TIMEOUT_S": "docker/podman-stack.sh: how long to wait for health",
    "SHARDSERVE_SCREENSHOT": "tests: where the status-page test saves its screenshot",
    "SHARDSERVE_KILL_SEED": "tests: the seed of the random-kill test",
    "SHARDSERVE_BENCH_TF_PYTHON": "bench: the python that has TensorFlow",
    "SHARDSERVE_MDS_PYTHON": "tests, bench: the python that has MosaicML Streaming",
    "SHARDSERVE_TEST_SESSION": "tests: the prefix of this test session's shared memory",
    "SHARDSERVE_TEST_SLOWNESS": "tests: a fixed slowness factor for test deadlines",
}


def env_name(field: str) -> str:
    """The environment variable of a :class:`Settings` field: ``max_jobs`` -> ``SHARDSERVE_MAX_JOBS``."""
    return ENV_PREFIX + field.upper()


def unknown_env(environ: Mapping[str, str]) -> list[str]:
    """One warning per ``SHARDSERVE_*`` variable in ``environ`` that nothing reads, naming the
    closest real one (a misspelled ``SHARDSERVE_MAX_STREAM`` would otherwise be ignored).

    >>> unknown_env({"SHARDSERVE_MAX_STREAM": "8"})
    ['SHARDSERVE_MAX_STREAM is not a shardserve setting and is ignored; did you mean SHARDSERVE_MAX_STREAMS?']
    """
    known = sorted({env_name(f) for f in Settings.model_fields} | set(OTHER_ENV))
    out = []
    for name in sorted(environ):
        if not name.startswith(ENV_PREFIX) or name in known:
            continue
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
        hint = f"did you mean {close[0]}?" if close else "`shardserve serve --help` lists them"
        out.append(f"{name} is not a shardserve setting and is ignored; {hint}")
    return out
