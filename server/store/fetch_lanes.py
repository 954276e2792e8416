"""Remote reads on lanes of their own, each under a total deadline.

An object store that trickles bytes answers every request within its timeout and still never
finishes a shard. So a read runs on its dataset's own :class:`~..lanes.Lane` and the caller
waits for it at most ``deadline_s`` (the request timeout plus the shard's size at the slowest
rate accepted); past that the caller gets its error and the read is told to stop at its next
chunk. Neither the caller (an assembly thread, the planning lane, the streamer) nor another
dataset's reads wait on a slow one beyond that.

>>> lanes = FetchLanes()
>>> lanes.run("cifar", lambda stop: 42, deadline_s=5.0, timed_out=lambda: TimeoutError("x"))
42
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TypeVar

from ..lanes import Lanes

#: Reads of one dataset at once (a prefetch and a reader or two).
FETCH_THREADS = 4

T = TypeVar("T")


class FetchLanes:
    """Reads by dataset, each waited for at most its deadline (see the module docstring)."""

    def __init__(self, threads: int = FETCH_THREADS) -> None:
        self._lanes = Lanes(threads)

    def run(
        self,
        key: str,
        fn: Callable[[threading.Event], T],
        *,
        deadline_s: float,
        timed_out: Callable[[], BaseException],
    ) -> T:
        """``fn(stop)`` on ``key``'s lane; ``timed_out()`` is raised if it has not returned
        within ``deadline_s`` (``stop`` is then set: ``fn`` should end at its next chunk)."""
        stop = threading.Event()
        try:
            fut = self._lanes.get(key).submit(fn, stop)
        except RuntimeError as e:  # closed: the server is stopping
            raise timed_out() from e
        try:
            return fut.result(timeout=deadline_s)
        except FutureTimeout:
            stop.set()
            fut.cancel()
            raise timed_out() from None

    def close(self) -> None:
        self._lanes.close()
