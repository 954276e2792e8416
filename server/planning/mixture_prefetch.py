"""A mixture plan's work ahead of the placing thread, on a second thread.

Planning a mixture epoch is three kinds of work: each source's permutation (the bucket shuffle
of :mod:`.permute`, steps that release the GIL in numpy's kernels), drawing each position's
source, and placing positions (grouping, a scatter per source). :class:`Prefetcher` runs the
first on a thread of its own, a step at a time, on the streams the planner will read next (up
to each stream's ``want``), and draws pieces ahead into a :class:`PieceQueue` when no step is
wanted; when the planner needs a stream that thread is stepping, it steps another one meanwhile
(:meth:`Prefetcher.help`). Who runs a step or draws a piece changes no byte: a stream is a pure
function of its seed (see :mod:`.mixture_stream`), and pieces are drawn in order.

>>> import numpy as np
>>> from .mixture_stream import MixSource, SourceStream
>>> s = SourceStream(0, MixSource(300_000), 0, 0, "global", 1, np.dtype(np.uint32))
>>> with Prefetcher([s]) as pre:
...     pre.want(0, 300_000)
...     ids, _ = s.take(300_000, None, pre.help)
>>> sorted(ids.tolist()) == list(range(300_000))
True
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Iterator, Sequence
from types import TracebackType

import numpy as np

from .mixture_stream import SourceStream

#: A piece of an epoch: its first position and the source label of each of its positions.
Drawn = tuple[int, np.ndarray]

#: How long the thread waits for more wanted elements before looking again (seconds): the
#: planner wakes it at once; this only bounds a missed wake-up.
IDLE_S = 0.05
#: Pieces drawn ahead at most (a byte a position each), and positions past the pieces drawn
#: (at each source's share so far) that the thread is told to shuffle.
QUEUE_PIECES = 8
AHEAD_POSITIONS = 8 << 20
#: Up to this many sources, a piece's labels are counted one scan a source, else by bincount.
SCAN_SOURCES = 8
#: How long closing waits for the step under way (a bucket, or at worst one source's layout).
JOIN_TIMEOUT_S = 600.0


class Prefetcher:
    """A thread that runs the shuffle steps of ``streams`` ahead of the planner, up to what
    it was told each stream will be read to (:meth:`want`). A context manager: leaving it
    stops the thread after its current step and raises what the thread raised, if anything.
    """

    def __init__(self, streams: Sequence[SourceStream], pieces: PieceQueue | None = None) -> None:
        self._streams = list(streams)
        self._pieces = pieces
        self._wants = [0] * len(self._streams)
        self._wake = threading.Condition()
        self._stopping = False
        self._news = 0  # wants told so far: the thread sleeps only if none came meanwhile
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="mixture-prefetch", daemon=True)

    def __enter__(self) -> Prefetcher:
        self._thread.start()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify()
        self._thread.join(JOIN_TIMEOUT_S)
        if self._thread.is_alive():
            raise RuntimeError(
                f"the mixture prefetch thread did not finish its shuffle step within "
                f"{JOIN_TIMEOUT_S:.0f} s of the plan's end"
            )
        if self._error is not None:
            # Raised even over the planner's own error, which a failed step may have caused
            # (a stream whose step raised has no more steps); that error is its context.
            raise self._error

    def want(self, index: int, upto: int) -> None:
        """Tell the thread that stream ``index`` will be read up to element ``upto``."""
        with self._wake:
            self._wants[index] = upto
            self._news += 1
            self._wake.notify()

    def help(self) -> bool:
        """Run one wanted step of a stream nobody is stepping; return whether one ran (the
        planner calls this while the stream it needs is being stepped by the thread)."""
        if self._error is not None:
            raise self._error
        return self._step_one()

    def _step_one(self) -> bool:
        # The stream least far ahead of its reader first: its elements are read soonest.
        by_lead = sorted(self._streams, key=lambda s: s.lead())
        return any(s.step(self._wants[s.index]) for s in by_lead)

    def _run(self) -> None:
        try:
            while not self._stopping:
                news = self._news
                if self._step_one():
                    continue
                if self._pieces is not None and self._pieces.draw_ahead(self.want):
                    continue
                with self._wake:
                    if not self._stopping and news == self._news:
                        self._wake.wait(IDLE_S)
        except BaseException as exc:  # handed to the planner's thread, raised there
            self._error = exc


def label_counts(labels: np.ndarray, n_sources: int) -> np.ndarray:
    """How many of ``labels`` are each source (no int64 copy of the labels, as ``bincount``
    makes, while there are few sources).

    >>> label_counts(np.array([2, 0, 2], np.uint8), 3).tolist()
    [1, 0, 2]
    """
    if n_sources > SCAN_SOURCES:
        return np.bincount(labels, minlength=n_sources)
    return np.array([np.count_nonzero(labels == k) for k in range(n_sources)], dtype=np.int64)


class PieceQueue:
    """An epoch's pieces, drawn in order by whichever thread comes first: the prefetch thread
    when no step is wanted (:meth:`draw_ahead`), else the planner as it reads them
    (:meth:`read`). Each piece drawn tells how far each source will be read: the positions
    drawn so far, plus ``AHEAD_POSITIONS`` at each source's share so far.

    >>> q = PieceQueue(iter([(0, np.array([0, 1, 1], np.uint8))]), n_sources=2)
    >>> [lo for lo, _ in q.read(lambda source, upto: None)]
    [0]
    """

    def __init__(self, pieces: Iterator[Drawn], n_sources: int) -> None:
        self._pieces = pieces
        self._n_sources = n_sources
        self._lock = threading.Lock()
        self._queue: collections.deque[Drawn] = collections.deque()
        self._drawn = np.zeros(n_sources, dtype=np.int64)
        self._done = False

    def _draw(self, tell: Callable[[int, int], None]) -> bool:
        """Draw the next piece into the queue (the lock held); ``False`` once all are drawn."""
        piece = next(self._pieces, None)
        if piece is None:
            self._done = True
            return False
        lo, labels = piece
        counts = label_counts(labels, self._n_sources)
        self._drawn += counts
        ahead = self._drawn * AHEAD_POSITIONS // (lo + len(labels))
        for k in np.flatnonzero(counts).tolist():
            tell(k, int(self._drawn[k] + ahead[k]))
        self._queue.append(piece)
        return True

    def draw_ahead(self, tell: Callable[[int, int], None]) -> bool:
        """Draw one more piece if the queue has room and nobody else is drawing; return
        whether one was drawn."""
        if self._done or len(self._queue) >= QUEUE_PIECES:
            return False
        if not self._lock.acquire(blocking=False):
            return False
        try:
            return self._draw(tell)
        finally:
            self._lock.release()

    def read(self, tell: Callable[[int, int], None]) -> Iterator[Drawn]:
        """The pieces in order, drawing any not drawn ahead."""
        while True:
            if not self._queue:
                if not self._lock.acquire(timeout=JOIN_TIMEOUT_S):
                    raise TimeoutError(
                        f"the mixture prefetch thread did not finish drawing a piece within "
                        f"{JOIN_TIMEOUT_S:.0f} s"
                    )
                try:
                    if not self._queue and not self._draw(tell):
                        return
                finally:
                    self._lock.release()
            yield self._queue.popleft()
