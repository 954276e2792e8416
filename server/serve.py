"""``shardserve serve``: run the data plane and the control plane in one process.

Threads: uvicorn's event loop in the main thread (it owns the signals, through
:func:`_make_server`), the streamer thread owning the ROUTER socket, and the assembly pool.
Order: settings -> logging -> service (journal replay, data plane bound) -> HTTP listening ->
ready file. SIGTERM/SIGINT: uvicorn stops accepting and drains HTTP (2 s at most), then the
service tells open streams ``SERVER_SHUTDOWN`` and closes its socket; exit code 0.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from .logs import log_event

if TYPE_CHECKING:
    from .settings import Settings

log = logging.getLogger("shardserve.serve")

HTTP_GRACE_S = 2.0
#: Exit status when the data plane thread died (EX_SOFTWARE: an internal error).
EXIT_DATA_PLANE_DIED = 70
_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def add_serve_command(sub: Any) -> None:
    """Register ``serve`` on the CLI's subparsers; flags override ``SHARDSERVE_*`` variables."""
    p = sub.add_parser(
        "serve",
        help="serve the datasets of a store to trainers",
        description="Serve pre-collated batches over ZeroMQ and a FastAPI control plane. Every "
        "flag can also be set as SHARDSERVE_<NAME> in the environment; flags win.",
    )
    p.add_argument(
        "--store", help="store folder or URI, e.g. s3://bucket/prefix (SHARDSERVE_STORE)"
    )
    p.add_argument("--http", help="control plane HOST:PORT (default 127.0.0.1:7070; port 0 = any)")
    p.add_argument(
        "--data",
        action="append",
        metavar="ENDPOINT",
        help="data plane endpoint, repeatable (default tcp://127.0.0.1:7071)",
    )
    p.add_argument("--ipc", metavar="PATH", help="also bind ipc://PATH for same-host clients")
    p.add_argument("--token", help="shared secret required from every client (SHARDSERVE_TOKEN)")
    p.add_argument(
        "--insecure",
        action="store_true",
        default=None,
        help="allow non-loopback addresses without a token",
    )
    p.add_argument(
        "--verify",
        choices=["lazy", "full", "off"],
        help="when shard checksums are checked (default lazy: before first use)",
    )
    p.add_argument(
        "--state-dir", metavar="DIR", help="where the job journal lives (default STORE/.shardserve)"
    )
    p.add_argument(
        "--ready-file", metavar="PATH", help="write JSON with the bound addresses once ready"
    )
    p.add_argument("--log-format", choices=["text", "json"])
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    p.add_argument("--assembly-threads", type=int, metavar="N")
    p.add_argument("--heartbeat-s", type=float, metavar="S")
    p.add_argument("--stream-timeout-s", type=float, metavar="S")
    p.add_argument(
        "--shm",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="shared-memory batch slots for same-host clients (default on; --no-shm: sockets only)",
    )
    p.add_argument(
        "--shm-limit-bytes",
        metavar="SIZE",
        help="shared memory all slot rings may take together (default 4GiB; units: 512MiB, 2GB)",
    )
    p.add_argument(
        "--max-batch-bytes",
        type=int,
        metavar="N",
        help="largest batch a job may ask for, in bytes (default 1 GiB); more is refused with 422",
    )
    p.add_argument(
        "--allowed-host",
        dest="allowed_hosts",
        action="append",
        metavar="HOST",
        help="another Host header the control plane answers, repeatable (always answered: "
        "localhost, loopback addresses and the --http address unless it is a wildcard, which "
        "answers any host unless this is given; '*' allows any)",
    )
    p.add_argument(
        "--http-idle-timeout-s",
        type=float,
        metavar="S",
        help="close HTTP connections without a complete request after S seconds (default 15)",
    )
    p.add_argument(
        "--idle-after-s",
        type=float,
        metavar="S",
        help="a job with no stream this long is idle (default 60)",
    )
    p.add_argument(
        "--job-ttl-s",
        type=float,
        metavar="S",
        help="forget a job idle this long (default 86400; 0 never)",
    )
    p.add_argument(
        "--max-jobs",
        type=int,
        metavar="N",
        help="live jobs the server tracks at most (default 4096)",
    )
    p.add_argument(
        "--max-streams",
        type=int,
        metavar="N",
        help="data-plane streams open at once, all jobs (default 1024)",
    )
    p.add_argument(
        "--max-streams-per-job",
        type=int,
        metavar="N",
        help="streams one job may have open (default 0: its world size)",
    )
    p.add_argument(
        "--max-hellos-per-s",
        type=float,
        metavar="R",
        help="Hellos one data-plane peer may send per second (default 20)",
    )
    p.add_argument(
        "--shm-unproven-rings",
        type=int,
        metavar="N",
        help="slot rings that may wait for their client to map them (default 16)",
    )
    p.add_argument(
        "--cache-dir",
        metavar="DIR",
        help="local shard cache of a remote --store (SHARDSERVE_CACHE_DIR)",
    )
    p.add_argument(
        "--cache-limit-bytes",
        type=int,
        metavar="N",
        help="bytes the shard cache keeps (default 64 GiB)",
    )
    p.add_argument(
        "--store-endpoint",
        metavar="URL",
        help="S3-compatible endpoint of a remote store (else AWS_ENDPOINT_URL)",
    )
    p.add_argument(
        "--store-timeout-s",
        type=float,
        metavar="S",
        help="longest object-store request, 3 attempts each (default 10)",
    )
    p.add_argument(
        "--transforms",
        action="append",
        metavar="MODULE",
        help="a module of transforms jobs may name, repeatable (SHARDSERVE_TRANSFORMS)",
    )
    p.add_argument("--transform-workers", type=int, metavar="N", help="transform pool size")
    p.add_argument("--transform-pool", choices=["auto", "thread", "process"])
    p.add_argument("--transform-timeout-s", type=float, metavar="S")
    p.set_defaults(func=run_serve)


_FLAGS = (
    "store",
    "http",
    "data",
    "ipc",
    "token",
    "insecure",
    "verify",
    "state_dir",
    "ready_file",
    "log_format",
    "log_level",
    "assembly_threads",
    "heartbeat_s",
    "stream_timeout_s",
    "shm",
    "shm_limit_bytes",
    "max_batch_bytes",
    "allowed_hosts",
    "http_idle_timeout_s",
    "idle_after_s",
    "job_ttl_s",
    "max_jobs",
    "max_streams",
    "max_streams_per_job",
    "max_hellos_per_s",
    "shm_unproven_rings",
    "cache_dir",
    "cache_limit_bytes",
    "store_endpoint",
    "store_timeout_s",
    "transforms",
    "transform_workers",
    "transform_pool",
    "transform_timeout_s",
)


def run_serve(args: argparse.Namespace) -> int:
    """Entry point of ``shardserve serve``; returns the process exit code."""
    from .settings import Settings

    overrides = {k: getattr(args, k) for k in _FLAGS if getattr(args, k, None) is not None}
    try:
        settings = Settings(**overrides)
    except ValidationError as e:
        problems = "; ".join(
            f"{'.'.join(map(str, err['loc'])) or 'settings'}: {err['msg']}" for err in e.errors()
        )
        print(f"shardserve serve: {problems}", file=sys.stderr)
        return 2
    return serve(settings)


def serve(settings: Settings) -> int:
    """Run a server with ``settings`` until SIGTERM/SIGINT; returns the exit code."""
    # Until uvicorn takes the signals over, a SIGTERM is remembered instead of killing us
    # half-started (and then ends the server as soon as it runs).
    early: list[int] = []
    originals = {s: signal.signal(s, lambda sig, _f: early.append(sig)) for s in _SIGNALS}
    try:
        return _serve(settings, early)
    finally:
        for s, h in originals.items():
            signal.signal(s, h)


def _serve(settings: Settings, early: list[int]) -> int:
    import uvicorn

    from .control.app import create_app
    from .http_idle import protocol_with_timeout
    from .logs import configure_logging
    from .service import Service

    configure_logging(settings.log_format, settings.log_level)
    try:
        service = Service(settings)
    except ValueError as e:  # e.g. a --transforms module that does not import
        log_event(log, "serve.start_failed", level=logging.ERROR, reason=str(e))
        return 1
    try:
        endpoints = service.start()
    except Exception as e:
        log_event(log, "serve.start_failed", level=logging.ERROR, reason=str(e), exc_info=True)
        service.stop()
        return 1
    host, port = settings.http_host_port
    try:
        http_sock = _listen(host, port)
    except OSError as e:
        log_event(
            log, "serve.http_bind_failed", level=logging.ERROR, address=settings.http, reason=str(e)
        )
        service.stop()
        return 1
    bound_port = http_sock.getsockname()[1]
    shown_host = f"[{host}]" if ":" in host else host
    http_url = f"http://{shown_host}:{bound_port}"
    config = uvicorn.Config(
        create_app(service),
        http=protocol_with_timeout(settings.http_idle_timeout_s),
        log_config=None,
        access_log=False,
        timeout_graceful_shutdown=int(HTTP_GRACE_S),
        lifespan="off",
    )

    def on_ready() -> None:
        log_event(log, "serve.ready", http=http_url, data=",".join(endpoints), pid=os.getpid())
        if settings.ready_file is not None:
            _write_atomic(
                settings.ready_file,
                {"http": http_url, "data_endpoints": endpoints, "pid": os.getpid()},
            )

    server = _make_server(config, on_ready)

    def on_data_plane_death(reason: str) -> None:
        # A server whose data plane is gone must not look alive: stop, exit non-zero, and let
        # the supervisor (systemd, Kubernetes, compose restart policy) start a fresh one.
        log_event(log, "serve.data_plane_died", level=logging.CRITICAL, reason=reason)
        server.should_exit = True

    service.streamer.on_death = on_data_plane_death
    if service.streamer.failure is not None:
        on_data_plane_death(service.streamer.failure)
    if early:
        server.should_exit = True
        server.exit_signal = signal.Signals(early[0]).name
    try:
        server.run(sockets=[http_sock])
    finally:
        service.stop()
        http_sock.close()
        if settings.ready_file is not None:
            with contextlib.suppress(OSError):
                settings.ready_file.unlink()
    if service.streamer.failure is not None:
        log_event(log, "serve.exit", level=logging.ERROR, reason=service.streamer.failure)
        return EXIT_DATA_PLANE_DIED
    log_event(log, "serve.exit", signal=server.exit_signal or "")
    return 0


def _make_server(config: Any, on_ready: Callable[[], None]) -> Any:
    """A uvicorn ``Server`` whose signals are owned here, calling ``on_ready`` once HTTP listens.

    uvicorn re-raises a caught SIGTERM after its shutdown, which would kill the process with
    status -15 before the data plane is closed; this server only records the signal.
    """
    import uvicorn

    class Server(uvicorn.Server):
        exit_signal: str | None = None

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            previous = {s: signal.signal(s, self._on_signal) for s in _SIGNALS}
            try:
                yield
            finally:
                for s, h in previous.items():
                    signal.signal(s, h)

        def _on_signal(self, sig: int, frame: FrameType | None) -> None:
            if self.should_exit:  # a second signal: stop waiting for open HTTP connections
                self.force_exit = True
            self.should_exit = True
            self.exit_signal = signal.Signals(sig).name
            log_event(log, "serve.signal", signal=self.exit_signal)

        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets)
            if self.started and not self.should_exit:
                on_ready()

    return Server(config)


def _listen(host: str, port: int) -> socket.socket:
    """Bind and listen on the HTTP address ourselves, so port 0 resolves before uvicorn starts."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP, not 0: asyncio turns on TCP_NODELAY only for sockets that say they are TCP,
    # and without it every request after the first on a kept-alive connection waits ~40 ms.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(1024)
    sock.set_inheritable(True)
    return sock


def _write_atomic(path: Path, obj: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)
