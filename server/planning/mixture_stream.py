"""A mixture source and its stream of sample ids: pass after pass, each its own permutation.

Pass ``p`` of source ``s`` is the job's shuffle of the source drawn from
``SeedSequence([seed, epoch], spawn_key=(SOURCE_KEY, s, p))``; a source of at most
``SMALL_SOURCE`` samples draws ``SMALL_BLOCK // size`` passes at a time from the key of their
block. A stream is a pure function of those numbers: who computes it, and in what slices,
changes no byte of it. That is what lets :mod:`.mixture_prefetch` shuffle a stream on another
thread while the planner places positions from its front.

>>> s = SourceStream(0, MixSource(5), seed=0, epoch=0, shuffle="global", block_window=1,
...                  dtype=np.dtype(np.uint32))
>>> ids, ran_out = s.take(12, None)
>>> sorted(ids[:5].tolist()), len(ids), ran_out
([0, 1, 2, 3, 4], 12, False)
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Literal

import numpy as np

from shardserve.proto.jobs import ShuffleMode

from .mixture_quarantine import SkippedAt
from .order import SHUFFLES, shard_sizes
from .rng import order_dtype
from .shuffle_global import global_order_steps

#: ``spawn_key`` word that keeps the sources' generators apart from every other plan's.
SOURCE_KEY = 0x737263  # "src"
#: Sources of at most this many samples draw their passes ``SMALL_BLOCK // size`` at a time
#: (see :class:`SourceStream`). Part of the plan's definition, like ``MIX_CHUNK``.
SMALL_SOURCE = 4096
SMALL_BLOCK = 1 << 16

Exhaustion = Literal["repeat", "stop"]
#: How long a reader waits for another thread's step of its stream (a bucket, or at worst
#: the layout of one pass) before it gives up.
STEP_TIMEOUT_S = 600.0
#: Other work a reader does while the stream it waits for is stepped by another thread.
Meanwhile = Callable[[], bool]


@dataclass(frozen=True)
class MixSource:
    """One source of a mixture as the planner sees it: its size and what happens at its end."""

    size: int
    on_exhausted: Exhaustion = "repeat"
    #: Rows per shard, for ``shuffle="block"`` (default: fixed-size shards).
    shard_rows: tuple[int, ...] | None = None


class SourceStream:
    """A source's stream of sample ids, stored a *segment* at a time: one pass of a source
    larger than ``SMALL_SOURCE``; ``SMALL_BLOCK // n`` passes of a smaller one, drawn together
    (one ``argsort`` of uniform keys per pass, a uniform permutation each), so a source of a
    few samples repeated millions of times costs a few vectorised blocks, not a loop per pass.

    A global pass is shuffled a bucket at a time, as far as it is read (or prefetched): the
    steps run under a lock, so one thread may run them ahead (:meth:`step`) while another
    reads the final front (:meth:`take`). Only the reading thread moves the cursor or starts
    a segment; a step writes only past the final front, which is all a reader reads.
    """

    def __init__(
        self,
        index: int,
        source: MixSource,
        seed: int,
        epoch: int,
        shuffle: ShuffleMode,
        block_window: int,
        dtype: np.dtype,
    ) -> None:
        self.index = index
        self.dtype = dtype  # of the ids it hands out: the order's
        self.source = source
        self.cursor = 0  # stream elements consumed so far
        self._seed, self._epoch = seed, epoch
        self._shuffle, self._window = shuffle, block_window
        n = source.size
        self._passes = 1 if n > SMALL_SOURCE else max(SMALL_BLOCK // max(n, 1), 1)
        self.segment_len = n * self._passes
        self._lock = threading.Lock()
        self._g = -1
        self._segment = np.empty(0, dtype=np.uint32)
        self._steps: Iterator[int] = iter(())
        self._final = 0  # leading elements of the current segment that are final

    def _start(self, g: int) -> None:
        """Make segment ``g`` the current one (the lock held)."""
        n = self.source.size
        ss = np.random.SeedSequence(
            [self._seed, self._epoch], spawn_key=(SOURCE_KEY, self.index, g)
        )
        rng = np.random.Generator(np.random.PCG64(ss))
        self._final = self.segment_len
        if self._passes == 1 and self._shuffle == "global":
            self._segment, self._steps = global_order_steps(n, rng, dtype=order_dtype(n))
            self._final = 0
        elif self._passes == 1:
            rows = shard_sizes(n, self.source.shard_rows)
            self._segment = SHUFFLES[self._shuffle](
                n, rng, dtype=order_dtype(n), shard_rows=rows, block_window=self._window
            )
        elif self._shuffle == "none":
            self._segment = np.tile(np.arange(n, dtype=np.uint32), self._passes)
        else:  # small: a window of shards is the whole source, so every mode is global
            keys = rng.random((self._passes, n))
            self._segment = np.argsort(keys, axis=1).astype(np.uint32).reshape(-1)
        self._g = g

    def segment(self, g: int, upto: int, meanwhile: Meanwhile | None = None) -> np.ndarray:
        """Segment ``g`` of the stream (passes ``g * k .. g * k + k - 1`` one after another),
        final at least in its first ``upto`` elements. While another thread is stepping it,
        ``meanwhile()`` is called (other work; ``False`` when there is none, then it waits)."""
        while meanwhile is None or not self._lock.acquire(blocking=False):
            if meanwhile is None or not meanwhile():
                if not self._lock.acquire(timeout=STEP_TIMEOUT_S):
                    raise TimeoutError(
                        f"mixture source {self.index}: another thread's shuffle step did not "
                        f"end within {STEP_TIMEOUT_S:.0f} s"
                    )
                break
        try:
            if g != self._g:
                self._start(g)
            while self._final < upto:
                self._final = next(self._steps)
            return self._segment
        finally:
            self._lock.release()

    def lead(self) -> int:
        """Final elements of the stream past the cursor (advisory: no lock taken)."""
        return max(self._g, 0) * self.segment_len + self._final - self.cursor

    def step(self, want: int) -> bool:
        """Run one step of the current segment if it is final short of stream element
        ``want`` (or of its end) and no other thread is stepping it; return whether one ran."""
        if not self._lock.acquire(blocking=False):
            return False
        try:
            if self._g < 0:  # the first segment: nobody reads it yet, whoever starts it
                if want <= 0:
                    return False
                self._start(0)
                return True
            upto = min(want - self._g * self.segment_len, self.segment_len)
            if self._final >= upto:
                return False
            first = self._final == 0
            self._final = next(self._steps)
            if first and self._final < upto:
                # The first step drew the bucket labels (a byte a sample) that the next one
                # lays out and frees: run it now, so two threads hold two passes' labels
                # at most, not every source's at once.
                self._final = next(self._steps)
            return True
        finally:
            self._lock.release()

    def peek(self, count: int, meanwhile: Meanwhile | None = None) -> np.ndarray:
        """The next ``count`` elements (fewer if a ``stop`` source runs out), not consumed:
        a read-only view of the stream when they lie in one segment of the order's dtype."""
        stop = self.cursor + count
        if self.source.on_exhausted == "stop":
            stop = min(stop, self.source.size)
        i, seg = self.cursor, self.segment_len
        g, j = divmod(i, seg) if seg else (0, 0)
        if i < stop and j + stop - i <= seg:
            part = self.segment(g, j + stop - i, meanwhile)[j : j + stop - i]
            if part.dtype == self.dtype:  # no copy: the reader adds the offset as it scatters
                part = part.view()
                part.flags.writeable = False
                return part
        out = np.empty(max(stop - self.cursor, 0), dtype=self.dtype)
        while i < stop:  # one step per segment spanned
            g, j = divmod(i, seg)
            k = min(seg - j, stop - i)
            out[i - self.cursor : i - self.cursor + k] = self.segment(g, j + k, meanwhile)[
                j : j + k
            ]
            i += k
        return out

    def take(
        self, count: int, skipped: SkippedAt | None, meanwhile: Meanwhile | None = None
    ) -> tuple[np.ndarray, bool]:
        """The next ``count`` ids not in ``skipped``; ``(ids, ran_out)``: fewer ids and
        ``ran_out`` when a ``stop`` source has no more. ``ids`` may be a read-only view."""
        if self.source.size == 0:
            return np.empty(0, dtype=self.dtype), True
        if skipped is None or not len(skipped):
            ids = self.peek(count, meanwhile)
            self.cursor += len(ids)
            return ids, len(ids) < count
        if self.source.on_exhausted == "repeat" and len(skipped) >= self.source.size:
            raise ValueError(
                f"every sample of mixture source {self.index} ({self.source.size}) is quarantined"
            )
        got: list[np.ndarray] = []
        need = count
        while need:
            cand = self.peek(need + need // 8 + 16, meanwhile)
            if not len(cand):
                break  # a stop source ran out
            ok = skipped.allows(cand)
            keep = np.flatnonzero(ok)[:need]
            # Consumed: up to and including the last id kept, or every candidate looked at.
            self.cursor += int(keep[-1]) + 1 if len(keep) == need else len(cand)
            got.append(cand[keep])
            need -= len(keep)
        ids = np.concatenate(got) if got else np.empty(0, dtype=self.dtype)
        return ids, len(ids) < count
