"""Lanes: threads of one owner (a job's transforms, a dataset's fetches), apart from others.

A thread cannot be stopped, so work that hangs (a transform, a read from a trickling store)
keeps its thread. On a shared pool that thread, and the work queued behind it, belonged to
everyone; on a lane it belongs to the one owner whose work hung. A lane starts threads on
demand, up to its size, and a thread idle for ``IDLE_S`` ends, so a lane of a finished job
costs nothing. Lane threads are daemon threads: a hung one never holds up the server's exit.

>>> lanes = Lanes(size=2)
>>> lanes.get("job-a").submit(sum, [1, 2]).result(timeout=5)
3
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Generic, Protocol, TypeVar

T = TypeVar("T")

#: Seconds an idle lane thread waits for work before it ends.
IDLE_S = 10.0


class _Queued(Protocol):
    def cancel(self) -> object: ...

    def run(self) -> None: ...


class _Call(Generic[T]):
    """``fn(*args)`` submitted to a lane, and the future it settles."""

    __slots__ = ("args", "fn", "fut")

    def __init__(self, fn: Callable[..., T], args: tuple[object, ...]) -> None:
        self.fut: Future[T] = Future()
        self.fn, self.args = fn, args

    def cancel(self) -> bool:
        return self.fut.cancel()

    def run(self) -> None:
        if not self.fut.set_running_or_notify_cancel():
            return
        try:
            result = self.fn(*self.args)
        except BaseException as e:
            self.fut.set_exception(e)
        else:
            self.fut.set_result(result)


class Lane:
    """A job's threads: at most ``size``, started when work waits and none is idle."""

    def __init__(self, name: str, size: int) -> None:
        self.name, self.size = name, size
        self._queue: deque[_Queued] = deque()
        self._cv = threading.Condition()
        self._threads = 0
        self._idle = 0
        self._closed = False
        #: Threads given up on while they run (see :meth:`abandon`), by ident.
        self._abandoned: set[int] = set()
        #: Bumped when a run of this lane missed its deadline: runs begun before it fail at
        #: once (their job has failed), runs begun after it go on.
        self.generation = 0

    @property
    def threads(self) -> int:
        return self._threads

    @property
    def unused(self) -> bool:
        with self._cv:
            return self._threads == 0 and not self._queue

    def submit(self, fn: Callable[..., T], *args: object) -> Future[T]:
        call = _Call(fn, args)
        with self._cv:
            if self._closed:
                raise RuntimeError(f"lane {self.name} is closed")
            self._queue.append(call)
            if self._idle == 0 and self._threads < self.size:
                self._start_thread()
            else:
                self._cv.notify()
        return call.fut

    def abandon(self, thread: int) -> None:
        """Stop counting lane thread ``thread`` (by ident), stuck in work that missed its
        deadline: queued work gets a new thread now, and the stuck one ends when its work
        returns instead of taking more."""
        with self._cv:
            if thread in self._abandoned:
                return
            self._abandoned.add(thread)
            self._threads -= 1
            if self._queue and self._idle == 0 and not self._closed:
                self._start_thread()

    def cancel_queued(self) -> int:
        """Cancel every piece not yet started; how many were cancelled."""
        with self._cv:
            items, self._queue = list(self._queue), deque()
        for call in items:
            call.cancel()
        return len(items)

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self.cancel_queued()

    def _start_thread(self) -> None:
        """Under ``_cv``."""
        self._threads += 1
        threading.Thread(target=self._work, name=f"ss-lane-{self.name[:12]}", daemon=True).start()

    def _work(self) -> None:
        me = threading.get_ident()
        while True:
            with self._cv:
                if me in self._abandoned:
                    self._abandoned.discard(me)
                    return
                while not self._queue:
                    if self._closed:
                        self._threads -= 1
                        return
                    self._idle += 1
                    woke = self._cv.wait(IDLE_S)
                    self._idle -= 1
                    if not woke and not self._queue:
                        self._threads -= 1
                        return
                call = self._queue.popleft()
            call.run()
            del call  # what the work held is not kept alive by an idle thread


class Lanes:
    """Lanes by owner; lanes with no thread and no queued work are dropped as others are made."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._lanes: dict[str, Lane] = {}
        self._lock = threading.Lock()
        self._closed = False

    def get(self, key: str) -> Lane:
        with self._lock:
            if self._closed:
                raise RuntimeError("the lanes are closed (server stopping)")
            lane = self._lanes.get(key)
            if lane is None:
                for k in [k for k, v in self._lanes.items() if v.unused]:
                    del self._lanes[k]
                lane = self._lanes[key] = Lane(key, self.size)
            return lane

    def threads(self) -> int:
        with self._lock:
            return sum(lane.threads for lane in self._lanes.values())

    def __len__(self) -> int:
        with self._lock:
            return len(self._lanes)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            lanes, self._lanes = list(self._lanes.values()), {}
        for lane in lanes:
            lane.close()
