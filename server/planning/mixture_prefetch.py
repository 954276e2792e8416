"""Shuffling a mixture's source streams on a second thread while the planner places positions.

Planning a mixture epoch is two kinds of work: each source's permutation (the bucket shuffle
of :mod:`.permute`, steps that release the GIL in numpy's kernels) and placing positions
(draws, grouping, a scatter per source). :class:`Prefetcher` runs the first on a thread of
its own, a step at a time, on the streams the planner will read next (up to each stream's
``want``); when the planner needs a stream that thread is stepping, it steps another one
meanwhile (:meth:`Prefetcher.help`). Who runs a step changes no byte: a stream is a pure
function of its seed (see :mod:`.mixture_stream`).

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

import threading
from collections.abc import Sequence
from types import TracebackType

from .mixture_stream import SourceStream

#: How long the thread waits for more wanted elements before looking again (seconds): the
#: planner wakes it at once; this only bounds a missed wake-up.
IDLE_S = 0.05
#: How long closing waits for the step under way (a bucket, or at worst one source's layout).
JOIN_TIMEOUT_S = 600.0


class Prefetcher:
    """A thread that runs the shuffle steps of ``streams`` ahead of the planner, up to what
    it was told each stream will be read to (:meth:`want`). A context manager: leaving it
    stops the thread after its current step and raises what the thread raised, if anything.
    """

    def __init__(self, streams: Sequence[SourceStream]) -> None:
        self._streams = list(streams)
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
                with self._wake:
                    if not self._stopping and news == self._news:
                        self._wake.wait(IDLE_S)
        except BaseException as exc:  # handed to the planner's thread, raised there
            self._error = exc
