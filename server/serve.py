"""``shardserve serve``: run the data plane and the control plane in one process.

Threads: uvicorn's event loop in the main thread (it owns the signals, through
:func:`_make_server`), the streamer thread owning the ROUTER socket, and the assembly pool.
Order: settings -> logging -> service (journal replay, data plane bound) -> HTTP listening ->
ready file. SIGTERM/SIGINT: uvicorn stops accepting and drains HTTP (2 s at most), then the
service tells open streams ``SERVER_SHUTDOWN`` and closes its socket, and the store tells its
reads to stop; exit code 0. A watchdog armed by the signal (also one that comes while the
service starts) ends the process with status 1 once ``--shutdown-timeout-s`` has passed,
whatever is still running (a hung transform thread, a stuck join, a fetch from a trickling
store, which it names in its one log line as abandoned).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import math
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Protocol

from .runtime.logs import log_event
from .runtime.memory import trim

if TYPE_CHECKING:
    import uvicorn

    from .service import Service
    from .settings import Settings

log = logging.getLogger("shardserve.serve")

HTTP_GRACE_S = 2.0
#: Exit status when the data plane thread died (EX_SOFTWARE: an internal error).
EXIT_DATA_PLANE_DIED = 70
#: Exit status when the shutdown did not finish within ``--shutdown-timeout-s``.
EXIT_SHUTDOWN_FORCED = 1
_SIGNALS = (signal.SIGTERM, signal.SIGINT)


#: ``serve``'s line in ``shardserve --help``.
SERVE_SUMMARY = "serve the datasets of a store to trainers (HTTP control plane + ZeroMQ data)"

_EXAMPLES = """examples:
  shardserve serve --store ./store                      loopback, ports 7070 (HTTP) and 7071
  shardserve serve --store ./new --create               start on an empty store
  shardserve serve --store ./store --http 0.0.0.0:7070 --data tcp://0.0.0.0:7071 \\
      --token "$SHARDSERVE_TOKEN"                       other hosts (a token is required)
  shardserve serve --store s3://bucket/store --cache-dir /var/cache/shardserve
  SHARDSERVE_STORE=./store shardserve serve --transforms mymod   a module of your transforms

Every flag can also be set as SHARDSERVE_<NAME> in the environment (--max-jobs:
SHARDSERVE_MAX_JOBS); flags win over the environment."""


def add_serve_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``serve`` on the CLI's subparsers (see :func:`configure_serve`)."""
    configure_serve(sub.add_parser("serve", help=SERVE_SUMMARY))


def configure_serve(p: argparse.ArgumentParser) -> None:
    """Give ``serve``'s parser one flag per :class:`Settings` field, grouped, with examples;
    flags override ``SHARDSERVE_*`` variables."""
    from .flags import add_settings_flags

    p.description = (
        "Serve pre-collated batches over ZeroMQ and a FastAPI control plane, from a store "
        "folder (or object storage) filled by `shardserve ingest`."
    )
    p.epilog = _EXAMPLES
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    add_settings_flags(p)
    p.set_defaults(func=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    """Entry point of ``shardserve serve``; returns the process exit code."""
    from pydantic import ValidationError

    from .flags import given_settings
    from .settings import Settings

    try:
        settings = Settings(**given_settings(args))
    except ValidationError as e:
        problems = "; ".join(
            f"{'.'.join(map(str, err['loc'])) or 'settings'}: {err['msg']}" for err in e.errors()
        )
        print(f"shardserve serve: {problems}", file=sys.stderr)
        return 2
    problem = _local_store_problem(settings)
    if problem is not None:
        print(f"shardserve serve: {problem}", file=sys.stderr)
        return 2
    return serve(settings)


def _local_store_problem(settings: Settings) -> str | None:
    """Why a local ``--store`` cannot be served (``None``: it can); creates it under
    ``--create``. A typo must not start a server that reports ready on an empty store."""
    if settings.store_is_remote:
        return None
    store = Path(settings.store)
    if store.is_dir():
        return None
    if store.exists():
        return f"store {store} is not a folder; pass the folder that ingest wrote"
    if settings.create:
        store.mkdir(parents=True, exist_ok=True)
        return None
    return (
        f"store {store} does not exist; check the path (`shardserve ls --store PATH` lists a "
        "store's datasets), or pass --create (SHARDSERVE_CREATE=true) to start on an empty one"
    )


def serve(settings: Settings) -> int:
    """Run a server with ``settings`` until SIGTERM/SIGINT; returns the exit code."""
    watchdog = _Watchdog(settings.shutdown_timeout_s)
    # Until uvicorn takes the signals over, a SIGTERM is remembered instead of killing us
    # half-started (and then ends the server as soon as it runs); its deadline runs from now:
    # a start that waits on a slow store must not outlive it.
    early: list[int] = []

    def on_early(sig: int, _frame: FrameType | None) -> None:
        early.append(sig)
        watchdog.arm(signal.Signals(sig).name)

    originals = {s: signal.signal(s, on_early) for s in _SIGNALS}
    try:
        return _serve(settings, early, watchdog)
    finally:
        for s, h in originals.items():
            signal.signal(s, h)


class _Watchdog:
    """Ends the process with status 1 ``seconds`` after :meth:`arm` unless it exited first,
    in one log line naming what it abandoned (``abandoned()``: the store's reads still
    under way) and the threads still running.

    Its thread is started here, not in :meth:`arm`, which signal handlers call: starting a
    thread there could wait on a lock the interrupted main thread holds."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        #: What would be abandoned now; set once the service exists.
        self.abandoned: Callable[[], Sequence[str]] = tuple
        self._armed = threading.Event()
        self._reason = ""
        self._deadline = math.inf
        self._once = threading.Lock()
        threading.Thread(target=self._watch, name="ss-shutdown-watchdog", daemon=True).start()

    def arm(self, reason: str) -> None:
        if self._armed.is_set():
            return
        self._reason = reason
        self._deadline = time.monotonic() + self.seconds
        self._armed.set()

    def left(self) -> float:
        """Seconds until it fires (``inf`` before :meth:`arm`)."""
        return max(self._deadline - time.monotonic(), 0.0)

    def _watch(self) -> None:
        while not self._armed.wait(timeout=3600.0):
            pass  # not stopping yet: a daemon thread, waiting in long steps
        while (left := self.left()) > 0:
            time.sleep(left)  # the shutdown deadline itself
        self.fire()

    def fire(self) -> None:
        """Log what is abandoned and end the process now, with status 1."""
        if not self._once.acquire(blocking=False):
            # The other caller is ending the process: never return to a clean exit.
            self._once.acquire(timeout=self.seconds + 60.0)
            return
        stuck = sorted(t.name for t in threading.enumerate() if t is not threading.current_thread())
        log_event(
            log,
            "serve.shutdown_forced",
            level=logging.ERROR,
            after_s=self.seconds,
            reason=self._reason,
            abandoned="; ".join(self.abandoned()) or "no store read",
            threads=",".join(stuck),
        )
        for h in logging.getLogger().handlers:
            with contextlib.suppress(Exception):
                h.flush()
        os._exit(EXIT_SHUTDOWN_FORCED)


def _serve(settings: Settings, early: list[int], watchdog: _Watchdog) -> int:
    from .runtime.logs import configure_logging
    from .service import Service
    from .streaming.streamer import BindError

    configure_logging(settings.log_format, settings.log_level)
    log_event(log, "serve.sizing", choices=settings.sizing.line())
    # The transforms' kernels run compiled when the install had a C compiler, else on numpy
    # (the same bytes, a few times the CPU): a slow CIFAR chain should be told apart here.
    from .transforms.compiled import KERNELS, MISSING

    compiled = ",".join(k for k, built in KERNELS.items() if built)
    log_event(log, "serve.kernels", compiled=compiled or "none", numpy=",".join(MISSING) or "none")
    try:
        service = Service(settings)
    except ValueError as e:  # e.g. a --transforms module that does not import
        log_event(log, "serve.start_failed", level=logging.ERROR, reason=str(e))
        return 1
    watchdog.abandoned = service.store.reads_in_flight
    try:
        endpoints = service.start()
    except BindError as e:  # the message says what to change: no traceback
        log_event(log, "serve.start_failed", level=logging.ERROR, reason=str(e))
        service.stop()
        return 1
    except Exception as e:
        log_event(log, "serve.start_failed", level=logging.ERROR, reason=str(e), exc_info=True)
        service.stop()
        return 1
    host, port = settings.http_host_port
    try:
        http_sock = _listen(host, port)
    except OSError as e:
        log_event(
            log,
            "serve.http_bind_failed",
            level=logging.ERROR,
            address=settings.http,
            reason=f"{e.strerror or e} (another server may hold it); pass a free one with --http "
            "(HOST:0 picks any), or stop the other server",
        )
        service.stop()
        return 1
    try:
        exit_signal = _run_http(settings, service, endpoints, http_sock, early, watchdog)
    finally:
        watchdog.arm("stopping")
        service.stop()
        http_sock.close()
        if settings.ready_file is not None:
            with contextlib.suppress(OSError):
                settings.ready_file.unlink()
    # The store's reads were told to stop at their next chunk; one stuck in a request of a
    # trickling store never gets there: it is abandoned at the shutdown deadline, by name.
    if service.store.wait_reads(watchdog.left()):
        watchdog.fire()
    if service.streamer.failure is not None:
        log_event(log, "serve.exit", level=logging.ERROR, reason=service.streamer.failure)
        return EXIT_DATA_PLANE_DIED
    log_event(log, "serve.exit", signal=exit_signal)
    return 0


def _run_http(
    settings: Settings,
    service: Service,
    endpoints: list[str],
    http_sock: socket.socket,
    early: list[int],
    watchdog: _Watchdog,
) -> str:
    """Serve HTTP on ``http_sock`` until a signal or the data plane's death; the name of the
    signal that stopped it (``""`` for none)."""
    import uvicorn

    from .control.app import create_app
    from .control.http_idle import protocol_with_timeout

    host = settings.http_host_port[0]
    shown_host = f"[{host}]" if ":" in host else host
    http_url = f"http://{shown_host}:{http_sock.getsockname()[1]}"
    config = uvicorn.Config(
        create_app(service),
        http=protocol_with_timeout(settings.http_idle_timeout_s),
        log_config=None,
        access_log=False,
        timeout_graceful_shutdown=int(HTTP_GRACE_S),
        lifespan="off",
    )

    def on_ready() -> None:
        # Starting leaves garbage and free heap pages (import-time temporaries, the journal's
        # replay): an idle server hands them back (0.6 MiB run from an editable install,
        # whose import finder leaves the most; little from a plain one).
        gc.collect()
        trim()
        log_event(log, "serve.ready", http=http_url, data=",".join(endpoints), pid=os.getpid())
        if settings.ready_file is not None:
            _write_atomic(
                settings.ready_file,
                {"http": http_url, "data_endpoints": endpoints, "pid": os.getpid()},
            )

    server = _make_server(config, on_ready, watchdog.arm)

    def on_data_plane_death(reason: str) -> None:
        # A server whose data plane is gone must not look alive: stop, exit non-zero, and let
        # the supervisor (systemd, Kubernetes, compose restart policy) start a fresh one.
        log_event(log, "serve.data_plane_died", level=logging.CRITICAL, reason=reason)
        server.should_exit = True

    service.streamer.on_death = on_data_plane_death
    if service.streamer.failure is not None:
        on_data_plane_death(service.streamer.failure)
    if early:
        watchdog.arm(signal.Signals(early[0]).name)
        server.should_exit = True
        server.exit_signal = signal.Signals(early[0]).name
    server.run(sockets=[http_sock])
    return str(server.exit_signal or "")


class _HttpServer(Protocol):
    """The uvicorn ``Server`` that :func:`_make_server` makes, as :func:`_run_http` drives it."""

    should_exit: bool
    exit_signal: str | None

    def run(self, sockets: list[socket.socket] | None = None) -> None: ...


def _make_server(
    config: uvicorn.Config, on_ready: Callable[[], None], on_signal: Callable[[str], None]
) -> _HttpServer:
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
            on_signal(self.exit_signal)
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


def _write_atomic(path: Path, obj: Mapping[str, object]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)
