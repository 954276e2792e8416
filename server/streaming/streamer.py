"""The data plane: one thread owning one ROUTER socket, streaming batches within credit.

Server side of the protocol in :mod:`shardserve.proto.messages`, per peer (routing id)::

                 Hello ok                    credit > 0: assemble, send in order
    (no stream) ----------> WELCOME'd ------------------------------------+
        ^  |  Hello bad:                  |  last batch sent              |
        |  |  Reject / Error              v                               |
        |  +-------------------------  ENDED (EndOfEpoch sent) <----------+
        |   Bye, new Hello (replaces), peer gone, job deleted/failed,
        +-- idle ENDED stream, server shutdown (Error SERVER_SHUTDOWN, transient)

Rules this thread keeps:

* It alone touches the socket (zmq sockets are not thread-safe). Assembly runs on the
  :class:`~shardserve.server.reading.assembly.Assembler` pool, which wakes this thread through a
  :class:`Waker` fd in the same ``zmq.Poller``; HTTP threads reach it only through
  a command queue (e.g. a deleted job) and read its state from the :class:`~.board.StreamBoard`.
* Nothing is assembled past a stream's credit (see :mod:`.sessions`), so a slow consumer bounds
  memory; batches leave strictly in index order, payload frames sent zero-copy.
* Liveness: libzmq's ZMTP heartbeats (``HEARTBEAT_IVL``/``TIMEOUT``/``TTL``, see
  :func:`zmtp_heartbeat`) drop a dead or frozen peer's connection within
  :func:`liveness_s`, while a live peer's libzmq I/O thread answers them whatever its Python
  is doing (a long validation step, a checkpoint save); the next send to a dropped peer
  raises ``EHOSTUNREACH`` (``ROUTER_MANDATORY``) and its stream is reclaimed. So whether a
  trainer is alive never depends on its loop calling ``next()`` (see :mod:`.admission`). To make sure that next
  send happens, every open stream gets a ``Heartbeat`` after ``heartbeat_s`` without a message
  from the server (which also tells a waiting client "slow, not dead"), so a dead client is
  noticed within about ``heartbeat_s``. A stream whose epoch ended is dropped after
  ``stream_timeout_s`` without a word from its client. A client that is merely computing
  (silent, holding its batches) keeps its stream: its libzmq still answers ZMTP pings.
* Bad input from a peer gets an ``Error``/``Reject`` reply and is logged; it never ends
  this thread. Whatever goes wrong while serving one stream fails that stream only (its
  peer gets an ``Error``, its session is closed).
* Should the thread die anyway (a bug), it records why in :attr:`Streamer.failure`, which
  turns ``/readyz`` to 503 at once, and calls ``on_death`` (``shardserve serve`` then exits
  non-zero so that its supervisor restarts it): never a live-looking dead data plane.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import zmq

from shardserve.proto.errors import ErrorCode
from shardserve.proto.messages import Error

from ..runtime.logs import log_event
from .unread import UNREAD_BYTES, UNREAD_STREAM_BYTES

log = logging.getLogger("shardserve.streaming")

#: Incoming messages are all small control messages; libzmq drops a peer that sends more.
MAX_INCOMING_BYTES = 1 << 20
#: Messages handled per wake-up before timers and results get their turn.
RECV_BURST = 256


class BindError(OSError):
    """A data endpoint could not be bound: named, with what to change (no traceback)."""


class Handler(Protocol):
    """What the streamer thread calls; it owns the streams (see :mod:`.handler`)."""

    def on_message(self, ident: bytes, frames: list[bytes]) -> None:
        """One message from peer ``ident``; bad input is answered, never raised."""

    def on_results(self) -> None:
        """Apply finished assembly work."""

    def on_tick(self, now: float) -> None:
        """Timers: heartbeats, idle streams, retries of sends that hit the HWM."""

    def shutdown(self) -> None:
        """The server is stopping: tell every stream, release everything."""

    def job_gone(self, job_id: str, code: ErrorCode, message: str) -> None:
        """End every stream of a job (a command from the control plane, see :meth:`Streamer.call`)."""


#: ``factory(socket, waker) -> handler``, called on the streamer thread once bound.
HandlerFactory = Callable[[zmq.Socket, "Waker"], Handler]


class Waker:
    """A self-pipe another thread writes to so the streamer's ``zmq.Poller`` wakes up.

    Equivalent to an inproc PUSH/PULL pair without a socket per worker thread: ``wake`` is
    one non-blocking ``write`` that any thread may call; a full pipe already means "wake up".
    """

    def __init__(self) -> None:
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)
        os.set_blocking(self._w, False)

    def fileno(self) -> int:
        return self._r

    def wake(self) -> None:
        # A full pipe means the reader is already due to wake; a closed one, shutting down.
        with contextlib.suppress(BlockingIOError, OSError):
            os.write(self._w, b"\0")

    def drain(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            while os.read(self._r, 4096):
                pass

    def close(self) -> None:
        for fd in (self._r, self._w):
            with contextlib.suppress(OSError):
                os.close(fd)


def zmtp_heartbeat(heartbeat_s: float, stream_timeout_s: float) -> tuple[int, int]:
    """ZMTP ``HEARTBEAT_IVL`` and ``HEARTBEAT_TIMEOUT`` (ms) of the ROUTER: a PING every
    heartbeat, and a connection that sends nothing (not even a PONG or a PING of its own, which
    libzmq's I/O thread sends whatever its process's Python does) for ``stream_timeout_s`` (at
    least two heartbeats) is dropped."""
    ivl = max(100, int(heartbeat_s * 1000))
    return ivl, max(int(stream_timeout_s * 1000), 2 * ivl)


def liveness_s(heartbeat_s: float, stream_timeout_s: float) -> float:
    """Seconds within which libzmq drops the connection of a peer that went silent (killed,
    frozen, partitioned): one PING interval, the PING's timeout, and one heartbeat for the
    streamer thread to see the pipe go. A connection that outlives this since a moment is
    answering PINGs: its process is alive, however long since its loop last spoke."""
    ivl, timeout = zmtp_heartbeat(heartbeat_s, stream_timeout_s)
    return (ivl + timeout) / 1000 + heartbeat_s


@dataclass(frozen=True)
class StreamerConfig:
    endpoints: list[str]
    token: str | None = None
    heartbeat_s: float = 1.0
    stream_timeout_s: float = 10.0
    linger_ms: int = 500
    #: Control messages queued for one peer beyond its credit (heartbeats of a stuck peer).
    send_hwm: int = 4096
    #: Where shared-memory slot rings are made; ``None`` turns the shm path off.
    shm_dir: Path | None = None
    shm_limit_bytes: int | None = None
    #: Most bytes of one stream's ring (at least ``MIN_RING_SLOTS`` slots); ``None``: credit.
    shm_ring_bytes: int | None = None
    #: This kernel's boot id; a Hello with the same one comes from this host.
    boot_id: str = ""
    #: Largest batch (bytes, at the dataset's average sample) a stream may ask for.
    max_batch_bytes: int = 1 << 30
    #: Admission limits (see :mod:`.admission`).
    max_streams: int = 1024
    max_streams_per_job: int = 0
    max_hellos_per_s: float = 20.0
    #: Shared jobs (see :mod:`.shares`): subscribers per rank, and each group's window.
    share_subscribers: int = 16
    share_window: int = 64
    share_window_bytes: int = 1 << 30
    share_bytes: int = 2 << 30
    #: Rings that may wait for their client's first Credit at once (see ``sinks.RingBook``).
    shm_unproven_rings: int = 16
    #: Bytes one stream, and all streams together, may be sent before they read (``.unread``).
    unread_stream_bytes: int = UNREAD_STREAM_BYTES
    unread_bytes: int = UNREAD_BYTES


class Streamer:
    """Owns the ROUTER socket and its thread; see the module docstring."""

    def __init__(self, config: StreamerConfig, handler_factory: HandlerFactory) -> None:
        self.config = config
        self._factory = handler_factory
        self._waker = Waker()
        self._commands: queue.SimpleQueue[Callable[[Handler], None]] = queue.SimpleQueue()
        self._stopping = threading.Event()
        self._bound_event = threading.Event()
        self._bind_error: BaseException | None = None
        self._bound: list[str] = []
        self._thread: threading.Thread | None = None
        #: Why the streamer thread died, or ``None`` while it runs (or stopped on request).
        self.failure: str | None = None
        #: Called once, from the dying thread, with :attr:`failure`.
        self.on_death: Callable[[str], None] | None = None

    @property
    def endpoints(self) -> list[str]:
        """The endpoints actually bound (ephemeral ports resolved)."""
        return list(self._bound)

    @property
    def ready(self) -> bool:
        return (
            self._bound_event.is_set()
            and self._bind_error is None
            and not self._stopping.is_set()
            and self.failure is None
            and self._thread is not None
            and self._thread.is_alive()
        )

    def start(self, timeout: float = 10.0) -> list[str]:
        """Start the thread and return once every endpoint is bound (or raise why not)."""
        self._thread = threading.Thread(target=self._run, name="ss-streamer", daemon=True)
        self._thread.start()
        if not self._bound_event.wait(timeout):
            raise TimeoutError(
                f"data plane did not bind {self.config.endpoints} within {timeout} s"
            )
        if self._bind_error is not None:
            raise self._bind_error
        return self.endpoints

    def call(self, fn: Callable[[Handler], None]) -> None:
        """Run ``fn(handler)`` on the streamer thread (from any thread); returns at once."""
        self._commands.put(fn)
        self._waker.wake()

    def stop(self, timeout: float = 5.0) -> None:
        """Tell open streams the server is going, close the socket, join the thread."""
        self._stopping.set()
        self._waker.wake()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log_event(log, "streamer.stop_timeout", level=logging.ERROR, waited_s=timeout)
        self._waker.close()

    # -- the thread ---------------------------------------------------------------------

    def _run(self) -> None:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.ROUTER)
        try:
            self._configure(sock)
            for ep in self.config.endpoints:
                try:
                    sock.bind(ep)
                except zmq.ZMQError as e:
                    # strerror without pyzmq's "(addr=...)": the endpoint is named once.
                    why = zmq.strerror(e.errno) if e.errno is not None else str(e)
                    raise BindError(
                        f"cannot bind the data endpoint {ep}: {why} (another server may hold "
                        "it); pass a free one with --data (tcp://HOST:0 picks any) or --ipc, "
                        "or stop the other server"
                    ) from None
                self._bound.append(sock.getsockopt_string(zmq.LAST_ENDPOINT))
            handler = self._factory(sock, self._waker)
        except BaseException as e:  # reported to start(), which raises it in the caller
            self._bind_error = e
            sock.close(linger=0)
            ctx.term()
            self._bound_event.set()
            return
        self._bound_event.set()
        log_event(log, "data_plane.listening", endpoints=",".join(self._bound))
        try:
            self._loop(sock, handler)
        except BaseException as e:
            self._died(f"{type(e).__name__}: {e}")
            log_event(log, "streamer.crashed", level=logging.CRITICAL, exc_info=True)
        finally:
            try:
                handler.shutdown()
            finally:
                sock.close(linger=self.config.linger_ms)
                ctx.term()  # returns within linger: the one socket is closed with a linger
            log_event(log, "data_plane.closed")

    def _died(self, reason: str) -> None:
        self.failure = f"data plane thread died: {reason}"
        if self.on_death is not None:
            try:
                self.on_death(self.failure)
            except Exception:
                log_event(log, "streamer.on_death_failed", level=logging.ERROR, exc_info=True)

    def _configure(self, sock: zmq.Socket) -> None:
        c = self.config
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.LINGER, c.linger_ms)
        sock.setsockopt(zmq.SNDHWM, c.send_hwm)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_INCOMING_BYTES)
        ivl_ms, timeout_ms = zmtp_heartbeat(c.heartbeat_s, c.stream_timeout_s)
        sock.setsockopt(zmq.HEARTBEAT_IVL, ivl_ms)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, timeout_ms)
        # TTL is in deciseconds on the wire, at most 6553.5 s.
        sock.setsockopt(zmq.HEARTBEAT_TTL, min(timeout_ms // 100 * 100, 6_553_500))

    def _loop(self, sock: zmq.Socket, handler: Handler) -> None:
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self._waker.fileno(), zmq.POLLIN)
        tick_s = min(self.config.heartbeat_s, self.config.stream_timeout_s) / 4
        next_tick = time.monotonic() + tick_s
        while not self._stopping.is_set():
            wait_ms = int(max(0.0, next_tick - time.monotonic()) * 1000)
            events = dict(poller.poll(wait_ms))
            if sock in events:
                for _ in range(RECV_BURST):
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    handler.on_message(frames[0], frames[1:])
            if self._waker.fileno() in events:
                self._waker.drain()
            self._run_commands(handler)
            handler.on_results()
            now = time.monotonic()
            if now >= next_tick:
                handler.on_tick(now)
                next_tick = now + tick_s

    def _run_commands(self, handler: Handler) -> None:
        while True:
            try:
                fn = self._commands.get_nowait()
            except queue.Empty:
                return
            try:
                fn(handler)
            except Exception:
                log_event(log, "streamer.command_failed", level=logging.ERROR, exc_info=True)


def shutdown_error(stream: int) -> Error:
    """What every open stream is told when the server stops (transient: reconnect later)."""
    return Error(
        code=ErrorCode.SERVER_SHUTDOWN,
        message="the server is shutting down; reconnect and resume when it is back",
        fatal=False,
        stream=stream,
    )
