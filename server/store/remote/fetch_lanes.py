"""Remote reads on lanes of their own, each under a total deadline.

An object store that trickles bytes answers every request within its timeout and still never
finishes a shard. So a read runs on its dataset's own :class:`~..lanes.Lane` and the caller
waits for it at most ``deadline_s`` (the request timeout plus the shard's size at the slowest
rate accepted); past that the caller gets its error and the read is told to stop at its next
chunk. Neither the caller (an assembly thread, the planning lane, the streamer) nor another
dataset's reads wait on a slow one beyond that.

At shutdown (:meth:`FetchLanes.close`) every read is told to stop and its caller gets its
error at once; a read stuck inside one request of a trickling store cannot be stopped (a
thread cannot be killed), so the lanes keep naming each read until it returns
(:meth:`FetchLanes.in_flight`): what the server abandons if it exits before them.

>>> lanes = FetchLanes()
>>> lanes.run("cifar", lambda stop: 42, deadline_s=5.0, timed_out=lambda: TimeoutError("x"),
...           what=lambda: "reading cifar")
42
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass
from typing import Any, TypeVar

from ...runtime.lanes import Lanes
from .object_fs import StoreUnavailable

#: Reads of one dataset at once (a prefetch and a reader or two).
FETCH_THREADS = 4

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class _Read:
    """A read under way: what it is (with its progress so far), how to tell it to stop."""

    what: Callable[[], str]
    stop: threading.Event
    fut: Future[Any]


class FetchLanes:
    """Reads by dataset, each waited for at most its deadline (see the module docstring)."""

    def __init__(self, threads: int = FETCH_THREADS) -> None:
        self._lanes = Lanes(threads)
        self._lock = threading.Lock()
        #: Reads whose function has not returned, by a serial number. At most the lanes'
        #: threads (a queued read that is given up on is cancelled, and so forgotten).
        self._reads: dict[int, _Read] = {}
        self._ids = itertools.count()
        #: Completed by :meth:`close`: wakes every caller still waiting on a read.
        self._closing: Future[None] = Future()

    def run(
        self,
        key: str,
        fn: Callable[[threading.Event], T],
        *,
        deadline_s: float,
        timed_out: Callable[[], BaseException],
        what: Callable[[], str],
    ) -> T:
        """``fn(stop)`` on ``key``'s lane; ``timed_out()`` is raised if it has not returned
        within ``deadline_s`` (``stop`` is then set: ``fn`` should end at its next chunk), and
        ``StoreUnavailable`` naming ``what()`` if the lanes close first (the server stops)."""
        stop = threading.Event()
        try:
            fut = self._lanes.get(key).submit(fn, stop)
        except RuntimeError as e:  # closed: the server is stopping
            raise timed_out() from e
        token = next(self._ids)
        with self._lock:
            self._reads[token] = _Read(what, stop, fut)
        fut.add_done_callback(lambda _: self._forget(token))
        both: list[Future[Any]] = [fut, self._closing]
        done, _ = wait(both, timeout=deadline_s, return_when=FIRST_COMPLETED)
        if fut in done and not stop.is_set():
            return fut.result()
        stop.set()
        fut.cancel()
        if self._closing.done():
            raise StoreUnavailable(f"{what()}: given up, the server is stopping")
        raise timed_out()

    def _forget(self, token: int) -> None:
        with self._lock:
            self._reads.pop(token, None)

    def in_flight(self) -> tuple[str, ...]:
        """Each read whose function has not returned yet, named with its progress."""
        with self._lock:
            reads = list(self._reads.values())
        return tuple(r.what() for r in reads)

    def wait_idle(self, timeout_s: float) -> tuple[str, ...]:
        """Wait at most ``timeout_s`` until no read runs; :meth:`in_flight` then."""
        with self._lock:
            futs = [r.fut for r in self._reads.values()]
        wait(futs, timeout=timeout_s)
        return self.in_flight()

    def close(self) -> None:
        """Tell every read to stop, fail every caller waiting on one, take no more reads."""
        with self._lock:
            reads = list(self._reads.values())
            if not self._closing.done():
                self._closing.set_result(None)
        for r in reads:
            r.stop.set()
        self._lanes.close()
