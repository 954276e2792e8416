"""A TCP proxy on loopback that can make an endpoint trickle: requests pass at full speed,
answers at ``rate`` bytes a second in small pieces (each piece arrives well within any request
timeout, so only a total deadline notices).

::

    with ThrottlingProxy(("127.0.0.1", moto_port)) as proxy:
        proxy.endpoint            # http://127.0.0.1:PORT, point the server at it
        proxy.throttle(2048)      # from now on answers trickle at 2 kB/s
        proxy.unthrottle()
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from types import TracebackType

from tests.support.slowness import scaled

#: Seconds between two pieces of a trickled answer.
PIECE_S = 0.1


class ThrottlingProxy:
    """Forward 127.0.0.1:<port> to ``upstream``; see the module docstring."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.rate: float | None = None
        #: Bytes of answers trickled so far (a read is in flight, slowly), and its waiters.
        self.trickled = 0
        self._trickle_cv = threading.Condition()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.2)
        self.port = self._listener.getsockname()[1]
        self._closed = threading.Event()
        self._socks: list[socket.socket] = []
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._accept, name="proxy-accept", daemon=True)]
        self._threads[0].start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def throttle(self, bytes_per_s: float) -> None:
        self.rate = bytes_per_s

    def unthrottle(self) -> None:
        self.rate = None

    def wait_trickled(self, nbytes: int, timeout: float) -> bool:
        """Wait at most ``timeout`` s until ``nbytes`` of answers were trickled in all."""
        with self._trickle_cv:
            return self._trickle_cv.wait_for(lambda: self.trickled >= nbytes, timeout)

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                up = socket.create_connection(self.upstream, timeout=scaled(5))
            except OSError:
                client.close()
                continue
            with self._lock:
                self._socks += [client, up]
            for src, dst, slow in ((client, up, False), (up, client, True)):
                t = threading.Thread(target=self._pump, args=(src, dst, slow), daemon=True)
                t.start()

    def _pump(self, src: socket.socket, dst: socket.socket, slow: bool) -> None:
        src.settimeout(0.5)
        try:
            while not self._closed.is_set():
                try:
                    data = src.recv(65536)
                except TimeoutError:
                    continue
                if not data:
                    break
                while data and not self._closed.is_set():
                    rate = self.rate if slow else None
                    if rate is None:
                        dst.sendall(data)
                        break
                    piece = max(1, int(rate * PIECE_S))
                    dst.sendall(data[:piece])
                    with self._trickle_cv:
                        self.trickled += len(data[:piece])
                        self._trickle_cv.notify_all()
                    data = data[piece:]
                    time.sleep(PIECE_S)  # the trickle itself: the point of this proxy
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self._closed.set()
        self._listener.close()
        with self._lock:
            socks, self._socks = self._socks, []
        for s in socks:
            with contextlib.suppress(OSError):
                s.close()

    def __enter__(self) -> ThrottlingProxy:
        return self

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
