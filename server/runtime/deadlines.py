"""Deadlines of work that runs on the thread that asked for it: one watcher thread for all.

A piece of work handed to another thread can be waited on with a timeout; work run on the
caller's own thread cannot, and a hop to another thread costs two thread wake-ups (on this
class of virtual machine about 60-90 us, as much as many transforms' own work on a batch).
:class:`Deadlines` lets the caller run the work itself and still have something happen at
the deadline: whichever comes first, the work's :meth:`Watch.finish` or the deadline, wins,
and exactly once: a run that finishes after its deadline learns that it lost.

>>> late = []
>>> d = Deadlines("example")
>>> w = d.watch(time.monotonic() + 60, late.append)
>>> w.finish(), late
(True, [])
>>> d.close()
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections.abc import Callable

#: Seconds the watcher sleeps at most when nothing is watched (it is woken for new work).
IDLE_WAIT_S = 60.0
#: Fewest watched runs at which finished ones are dropped from the heap.
COMPACT_MIN = 1024


class Watch:
    """One run under a deadline; see :class:`Deadlines`."""

    __slots__ = ("_lock", "_on_late", "_settled", "deadline")

    def __init__(self, deadline: float, on_late: Callable[[str], None]) -> None:
        self.deadline = deadline
        self._on_late = on_late
        self._lock = threading.Lock()
        self._settled = False

    def finish(self) -> bool:
        """The run ended: ``True`` if in time, ``False`` if its deadline had already fired."""
        with self._lock:
            won, self._settled = not self._settled, True
            return won

    @property
    def settled(self) -> bool:
        """Whether it finished or fired already."""
        return self._settled

    def expire(self, why: str) -> None:
        """Call ``on_late(why)`` unless the run finished first (the watcher's side)."""
        with self._lock:
            if self._settled:
                return
            self._settled = True
        self._on_late(why)


class Deadlines:
    """Calls ``on_late("late")`` of each :meth:`watch` whose run has not finished by its
    deadline, from one daemon thread, at the deadline; ``on_late("stopping")`` of those still
    running when :meth:`close` is called."""

    def __init__(self, name: str) -> None:
        self._heap: list[tuple[float, int, Watch]] = []
        self._seq = itertools.count()
        self._cv = threading.Condition()
        self._closed = False
        #: Heap size at which settled runs are dropped from it (they would stay until their
        #: deadline: at 1,000 batches a second and 30 s, 30,000 of them).
        self._compact_at = COMPACT_MIN
        self._thread = threading.Thread(target=self._run, name=f"ss-deadlines-{name}", daemon=True)
        self._thread.start()

    def watch(self, deadline: float, on_late: Callable[[str], None]) -> Watch:
        """Watch a run that must :meth:`Watch.finish` by ``deadline`` (``time.monotonic``)."""
        w = Watch(deadline, on_late)
        with self._cv:
            if self._closed:
                raise RuntimeError("the deadline watcher is closed (server stopping)")
            # Runs share one timeout, so a new deadline is rarely the earliest: the watcher
            # is woken only when it is, not once per run.
            if len(self._heap) >= self._compact_at:
                self._heap = [e for e in self._heap if not e[2].settled]
                heapq.heapify(self._heap)
                self._compact_at = max(COMPACT_MIN, 2 * len(self._heap))
            earliest = not self._heap or deadline < self._heap[0][0]
            heapq.heappush(self._heap, (deadline, next(self._seq), w))
            if earliest:
                self._cv.notify()
        return w

    def close(self) -> None:
        """Stop watching: every run still watched is told ``"stopping"``."""
        with self._cv:
            self._closed = True
            left, self._heap = [w for _, _, w in self._heap], []
            self._cv.notify()
        for w in left:
            w.expire("stopping")

    def _run(self) -> None:
        while True:
            late: list[Watch] = []
            with self._cv:
                if self._closed:
                    return
                now = time.monotonic()
                while self._heap and self._heap[0][0] <= now:
                    late.append(heapq.heappop(self._heap)[2])
                if not late:
                    wait = self._heap[0][0] - now if self._heap else IDLE_WAIT_S
                    self._cv.wait(wait)
                    continue
            for w in late:  # outside the lock: the callbacks take locks of their own
                w.expire("late")
