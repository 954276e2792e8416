"""Control-plane calls made while a stream waits, run off the stream's thread.

httpx's timeouts start at the connect: the name lookup before it (``getaddrinfo``) has none.
After a server container restarted, resolving its compose service name took 40 s, and a
stream that re-created its job inline, mid-recovery, stalled past its deadline although the
data socket was already back. A stream therefore never waits on HTTP: the re-creation runs on
a daemon thread of its own (:class:`Background`), and what a stall error reports is fetched
with a wall-clock bound (:func:`within`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable


class Background:
    """At most one run of ``fn`` at a time on a daemon thread; its outcome is read later.

    >>> calls = []
    >>> job = Background(lambda: calls.append(1), "re-create job j")
    >>> job.start(); job.join(1.0); job.check()
    True
    >>> calls
    [1]
    """

    def __init__(self, fn: Callable[[], None], name: str) -> None:
        self._fn = fn
        self.name = name
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._ok = False
        self._error: BaseException | None = None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        """Run ``fn`` unless a run is still under way (that run's outcome stands for both)."""
        if self.running:
            return
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread.start()

    def join(self, timeout: float) -> None:
        """Wait for the current run at most ``timeout`` seconds (for tests and doctests)."""
        if self._thread is not None:
            self._thread.join(timeout)

    def check(self) -> bool:
        """True once after a run returned; raises a run's exception once; else False."""
        with self._lock:
            error, self._error = self._error, None
            ok, self._ok = self._ok, False
        if error is not None:
            raise error
        return ok

    def _run(self) -> None:
        try:
            self._fn()
        except BaseException as e:  # handed to the stream's thread, which decides
            with self._lock:
                self._error, self._ok = e, False
        else:
            with self._lock:
                self._error, self._ok = None, True


def within(fn: Callable[[], str], timeout: float, late: str) -> str:
    """``fn()``, or ``late`` when it has not returned within ``timeout`` seconds (the call
    goes on on its daemon thread and its result is dropped).

    >>> within(lambda: "up", 1.0, "no answer")
    'up'
    """
    out: list[str] = []
    t = threading.Thread(target=lambda: out.append(fn()), name="shardserve-within", daemon=True)
    t.start()
    t.join(timeout)
    return out[0] if out else late
