"""The data-plane socket: one ZeroMQ DEALER per Loader, and how its endpoint is chosen.

The socket is connected at construction and reconnects on its own (libzmq) after a server
restart; the protocol state on top of it (handshake, credit, recovery) lives in
:mod:`shardserve.client.stream`. libzmq's I/O thread receives batches in the background up
to the credit granted, which is all the prefetching the client needs: no Python threads.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from types import FrameType
from typing import Any
from urllib.parse import urlsplit

import zmq
from pydantic_core import PydanticSerializationError

from shardserve.proto.api import ServerInfo
from shardserve.proto.endpoints import is_wildcard_host, reaches_this_host
from shardserve.proto.errors import BadRequest
from shardserve.proto.framing import Frame, encode
from shardserve.proto.host import read_boot_id
from shardserve.proto.messages import Bye, ControlMessage

log = logging.getLogger(__name__)

BYE_LINGER_MS = 10
TRANSPORTS = ("auto", "ipc", "tcp", "socket")


def choose_endpoint(
    info: ServerInfo, http_host: str, transport: str = "auto", boot_id: str | None = None
) -> str:
    """The data endpoint to connect to.

    ``ipc://`` when the server runs on this host (same boot id) and its socket file is
    visible here; else ``tcp://``, with a loopback or wildcard host replaced by the host of the
    HTTP URL when that one is remote (the server only knows the address it bound).

    >>> info = ServerInfo(version="0", protocols=[1], host="h", boot_id="b", auth_required=False,
    ...                   data_endpoints=["tcp://0.0.0.0:7071"])
    >>> choose_endpoint(info, "10.0.0.5", boot_id="other")
    'tcp://10.0.0.5:7071'
    """
    if transport not in TRANSPORTS:
        raise BadRequest(f"transport {transport!r} is not one of {', '.join(TRANSPORTS)}")
    boot_id = read_boot_id() if boot_id is None else boot_id
    ipc = [e for e in info.data_endpoints if e.startswith("ipc://")]
    tcp = [e for e in info.data_endpoints if e.startswith("tcp://")]
    if transport in ("auto", "ipc", "socket") and boot_id and boot_id == info.boot_id:
        for e in ipc:
            if os.path.exists(e[len("ipc://") :]):
                return e
    if transport == "ipc":
        raise BadRequest(
            f"transport='ipc' but no usable ipc:// endpoint: server boot id {info.boot_id!r}, "
            f"ours {boot_id!r}, endpoints {info.data_endpoints}"
        )
    if not tcp:
        raise BadRequest(
            f"the server offers no tcp:// data endpoint this host can use: {info.data_endpoints}"
        )
    parts = urlsplit(tcp[0])
    host = parts.hostname or ""
    if reaches_this_host(host) and not reaches_this_host(http_host):
        return f"tcp://{http_host}:{parts.port}"
    if is_wildcard_host(host):
        return f"tcp://127.0.0.1:{parts.port}"
    return tcp[0]


class Connection:
    """A connected DEALER with its own context; every call is non-blocking or has a timeout.

    >>> conn = Connection("tcp://127.0.0.1:7071", heartbeat_s=1.0)   # doctest: +SKIP
    >>> conn.poll(0.1)                                              # doctest: +SKIP
    False
    >>> conn.close()                                                # doctest: +SKIP
    """

    def __init__(self, endpoint: str, heartbeat_s: float = 1.0) -> None:
        self.endpoint = endpoint
        self.transport = endpoint.split("://", 1)[0]
        self._heartbeat_s = heartbeat_s
        #: Stream id of the last Welcome accepted on this socket (see ``EpochStream``).
        self.last_stream: int | None = None
        self.closed = True
        # Signals wait until the context and socket are made (or undone): a handler raising
        # half-way would leave a context nobody can terminate (see close()).
        try:
            self._open(endpoint, heartbeat_s)
        except BaseException:
            # Also a signal held back above and raised as the mask lifts: no Connection is
            # returned, so nobody else could close what was made.
            self.close()
            raise

    def _open(self, endpoint: str, heartbeat_s: float) -> None:
        with _signals_deferred():
            # A context per Loader: closing it ends libzmq's I/O thread with the Loader.
            self._ctx = zmq.Context(io_threads=1)
            try:
                self._sock = self._ctx.socket(zmq.DEALER)
                self._sock.setsockopt(zmq.LINGER, 0)
                hb_ms = max(100, int(heartbeat_s * 1000))
                # ZMTP heartbeats drop a dead TCP peer so libzmq reconnects to a restarted server.
                self._sock.setsockopt(zmq.HEARTBEAT_IVL, hb_ms)
                self._sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 3 * hb_ms)
                self._sock.setsockopt(zmq.HEARTBEAT_TTL, 3 * hb_ms)
                self._sock.setsockopt(zmq.RECONNECT_IVL, 50)
                self._sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
                self._sock.connect(endpoint)
            except BaseException:
                self._ctx.destroy(linger=0)
                raise
            self.closed = False

    def send(self, msg: ControlMessage) -> bool:
        """Queue a control message without blocking; False when libzmq's queue is full."""
        (frame,) = _encode(msg)  # one frame: a send is whole or not at all
        try:
            self._sock.send(frame, flags=zmq.NOBLOCK)
            return True
        except zmq.Again:
            log.debug("send queue full, dropped %s for %s", type(msg).__name__, self.endpoint)
            return False

    def poll(self, timeout_s: float) -> bool:
        """Whether a message is ready, waiting at most ``timeout_s``."""
        return bool(self._sock.poll(max(0, int(timeout_s * 1000)), zmq.POLLIN))

    def recv(self) -> Sequence[Frame] | None:
        """One message's frames, or None when none is queued. Frames own their buffers.

        An exception half-way (a Ctrl-C between two frames of a batch) drops the rest of that
        message, so the socket's next read starts at a message again, never mid-batch.
        """
        frames: list[zmq.Frame] = []
        try:
            frames.append(self._sock.recv(flags=zmq.NOBLOCK, copy=False))
            while frames[-1].more:
                frames.append(self._sock.recv(flags=zmq.NOBLOCK, copy=False))
        except zmq.Again:
            if frames:
                raise
            return None
        except BaseException:
            self._drop_rest()
            raise
        return frames

    def _drop_rest(self) -> None:
        with contextlib.suppress(zmq.ZMQError):
            while self._sock.getsockopt(zmq.RCVMORE):
                self._sock.recv(flags=zmq.NOBLOCK, copy=False)

    def reopen(self) -> None:
        """Replace the socket with a fresh one to the same endpoint (a new peer identity).

        For a server that keeps not answering while it is up: libzmq reconnects on its own, but
        a fresh socket also rules out a connection it keeps without delivering on it.
        """
        with _signals_deferred():
            if self.closed:
                return
            self._sock.close(linger=0)
            self._ctx.term()
            self.closed = True
            self.last_stream = None  # nothing of an old stream can arrive on a new socket
        self._open(self.endpoint, self._heartbeat_s)

    def retarget(self, endpoint: str) -> None:
        """Connect a fresh socket to ``endpoint`` instead (the streaming process a stream was
        placed on); nothing of the old socket's streams arrives on it."""
        with _signals_deferred():
            if not self.closed:
                self._sock.close(linger=0)
                self._ctx.term()
                self.closed = True
            self.last_stream = None
        self.endpoint = endpoint
        self.transport = endpoint.split("://", 1)[0]
        self._open(endpoint, self._heartbeat_s)

    def close(self) -> None:
        """Say Bye (best effort) and drop the socket and context at once; idempotent.

        Signals are held back until both are closed: a handler that raises (a profiler's
        timer, Ctrl-C) used to interrupt this half-way and leak libzmq's I/O thread and its
        file descriptors; now it runs just after, with nothing left open.
        """
        if self.closed and getattr(self, "_ctx", None) is None:
            return
        with _signals_deferred():
            if self._ctx.closed:
                self.closed = True
                return
            self.closed = True
            try:
                with contextlib.suppress(zmq.ZMQError):
                    self.send(Bye())
            finally:
                # Long enough for libzmq to flush the Bye to a live server, short enough not to
                # matter when the server is gone (the socket otherwise lingers 0 from birth).
                try:
                    self._sock.close(linger=BYE_LINGER_MS)
                finally:
                    self._ctx.term()


def _encode(msg: ControlMessage) -> list[bytes]:
    """``encode``, except that a signal handler's exception raised while pydantic-core
    serializes (a Ctrl-C) comes back wrapped in ``PydanticSerializationError`` with only its
    name left: it is raised again as itself, so ``except KeyboardInterrupt`` still works."""
    try:
        return encode(msg)
    except PydanticSerializationError as e:
        for exc in (KeyboardInterrupt, SystemExit):
            if f": {exc.__name__}" in str(e):
                raise exc() from None
        raise


#: Signals whose Python handlers may raise in the middle of a close.
_DEFERRED = frozenset(
    getattr(signal, n)
    for n in (
        "SIGINT",
        "SIGTERM",
        "SIGALRM",
        "SIGVTALRM",
        "SIGPROF",
        "SIGUSR1",
        "SIGUSR2",
        "SIGHUP",
        "SIGCHLD",
    )
    if hasattr(signal, n)
)


@contextlib.contextmanager
def _signals_deferred() -> Iterator[None]:
    """Hold the usual signals back for the block; those that came run just after it.

    Two layers, because a mask alone is not enough. Python runs handlers on the main thread
    between bytecodes, after its C handler has noted the signal on whichever thread the
    kernel chose: a signal noted just before the mask was set, or taken by another thread
    (a trainer has many), still ran its handler inside the block. So on the main thread the
    Python handlers are swapped for one that only notes the signal, and the noted ones are
    raised again once the block is over; the mask keeps the rest pending in the kernel.
    """
    noted: list[int] = []
    swapped: dict[int, Callable[[int, FrameType | None], Any]] = {}
    old_mask: set[int | signal.Signals] | None = None
    try:
        if threading.current_thread() is threading.main_thread():
            for sig in _DEFERRED:
                handler = signal.getsignal(sig)
                if callable(handler):
                    swapped[sig] = handler
                    signal.signal(sig, lambda signum, _frame: noted.append(signum))
        if hasattr(signal, "pthread_sigmask"):
            old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, _DEFERRED)
        yield
    finally:
        if old_mask is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
        for sig, handler in swapped.items():
            signal.signal(sig, handler)
        _raise_again(dict.fromkeys(noted))


def _raise_again(signums: Iterable[int]) -> None:
    """Run each signal's handler now; the first exception one raises is raised after all ran."""
    first: BaseException | None = None
    for signum in signums:
        try:
            signal.raise_signal(signum)
        except BaseException as e:  # a handler's exception, raised after the others ran
            first = first or e
    if first is not None:
        raise first
