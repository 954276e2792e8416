"""Reading a local shard whole, ahead of the rows asked for, when a read first touches it.

A block-shuffled epoch reads a window of shards in random row order: through the mapping,
each page fault reads one readahead window at a random place, and a store beyond RAM reads
at a fraction of the disk's sequential rate. The first read of a shard asks the kernel for
the whole file at once (``posix_fadvise(WILLNEED)``, up to ``limit_bytes`` of it), so the
disk reads it front to back while the rows are gathered; many ranks touching one shard ask
once. A read spread over more than :data:`MAX_SHARDS` shards (a global shuffle's batch) asks
for nothing: reading its shards whole would read the dataset, evicting what the next batches
need when it is larger than RAM. A shard is asked for again only after ``again_s`` (a later epoch, the pages possibly
evicted). The hints are given on a thread of their own: the kernel may block while it queues
the reads, and a batch must not wait for that.

>>> import tempfile
>>> with tempfile.TemporaryFile() as f:
...     _ = f.write(b"x" * 4096); f.flush()
...     ra = ReadAhead([(f.fileno(), 4096)], limit_bytes=1 << 20)
...     ra.touch([0]); ra.touch([0]); ra.close()
...     ra.asked
1
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor

log = logging.getLogger("shardserve.store")

#: Bytes of one shard asked for at its first read (0: read ahead nothing).
READ_AHEAD_BYTES = 1 << 30
#: Bytes one hint asks for: about what the kernel reads for one (its readahead window, or
#: the device's largest request); measured no slower than 8 MiB pieces on an 8 MiB window.
HINT_BYTES = 1 << 20
#: Most shards one read may touch and still be read ahead (a block shuffle's window is 4).
MAX_SHARDS = 8
#: Seconds before a shard is asked for again.
AGAIN_S = 30.0


class ReadAhead:
    """Whole-file read-ahead of shards ``files`` (``(fd, size)`` by shard), up to
    ``limit_bytes`` of each (negative: :data:`READ_AHEAD_BYTES`; 0: none); see the module."""

    def __init__(
        self,
        files: Sequence[tuple[int, int]],
        limit_bytes: int = READ_AHEAD_BYTES,
        again_s: float = AGAIN_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._files = list(files)
        self._limit = READ_AHEAD_BYTES if limit_bytes < 0 else limit_bytes
        self._again = again_s
        self._clock = clock
        self._last = [-float("inf")] * len(self._files)
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        #: Hints given so far (for tests and the bench).
        self.asked = 0

    def touch(self, shards: Iterable[int]) -> None:
        """Shards a read is about to read: ask for each one not asked for recently."""
        shards = list(shards)
        if self._limit <= 0 or len(shards) > MAX_SHARDS:
            return
        now = self._clock()
        todo = []
        with self._lock:
            for s in shards:
                if now - self._last[s] >= self._again:
                    self._last[s] = now
                    todo.append(self._files[s])
            if not todo:
                return
            self.asked += len(todo)
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="ss-read-ahead")
            pool = self._pool
        pool.submit(self._ask, todo)

    def _ask(self, files: list[tuple[int, int]]) -> None:
        # In pieces: the kernel reads at most one readahead window (``ra_pages``, often
        # 128 KiB) per WILLNEED, whatever the length asked for.
        for fd, size in files:
            try:
                for lo in range(0, min(size, self._limit), HINT_BYTES):
                    os.posix_fadvise(fd, lo, HINT_BYTES, os.POSIX_FADV_WILLNEED)
            except OSError as e:  # only a hint; a closed dataset's fd or a filesystem without it
                log.debug("read-ahead hint refused: %s", e)

    def close(self) -> None:
        """Stop giving hints (a hint under way finishes: it only queues reads)."""
        with self._lock:
            pool, self._pool, self._limit = self._pool, None, 0
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
