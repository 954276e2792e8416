"""Small columns joined across chunks behind the reads, not in the first one.

A mapped dataset joins each small fixed column end to end on first use
(:class:`~.gather.JoinedColumns`) so that a batch spanning many chunks reads it with one
``take``. Joining copies the whole column: 40 MB for one ``int64`` a sample at 5M samples,
~60 ms that a new server's first batch waited for. :class:`JoinedBehind` hands out nothing
for a column until its copy is made on a thread of its own; until then a read gathers the
column chunk by chunk, which gives the same rows (the field loop's other path), so the
first batch waits for no copy and later ones use it once it is there. The copy is asked for
at a column's second read (the first batch starts no thread) and made in pieces of
:data:`PIECE_BYTES`, each a short hold of the GIL, so the streamer's batches go on meanwhile.

>>> import numpy as np
>>> joined = JoinedBehind()
>>> chunks = [np.arange(3), np.arange(3, 5)]
>>> joined.get("x", chunks) is None and joined.get("x", chunks) is None  # asked for, not made
True
>>> joined.wait(timeout_s=10.0)
>>> joined.get("x", chunks).tolist()
[0, 1, 2, 3, 4]
>>> joined.close()
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_all

import numpy as np

from .gather import JOIN_MAX_BYTES, JOIN_MAX_ROW_BYTES, JoinedColumns

log = logging.getLogger("shardserve.store")

#: Bytes copied under one hold of the GIL while a column is joined.
PIECE_BYTES = 1 << 20


class JoinedBehind(JoinedColumns):
    """:class:`~.gather.JoinedColumns` whose copies are made on a thread of their own: a
    column is ``None`` (read chunk by chunk) until its copy is made; the same columns are
    joined (the same size limits). Thread-safe."""

    def __init__(self) -> None:
        super().__init__()
        self._made: dict[object, np.ndarray | None] = {}
        self._seen: set[object] = set()
        self._asked: dict[object, Future[None]] = {}
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._closed = False

    def get(self, key: object, chunks: Sequence[np.ndarray]) -> np.ndarray | None:
        """The column of ``chunks`` joined once its copy is made, else ``None`` (and its copy
        is asked for, once)."""
        made = self._made.get(key, self)  # a dict read: no lock on the common path
        if made is not self:
            return made  # type: ignore[return-value]
        with self._lock:
            if key in self._asked or self._closed:
                return None
            if key not in self._seen:  # the first read (a new server's first batch)
                self._seen.add(key)
                return None
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="ss-join")
            self._asked[key] = self._pool.submit(self._join, key, chunks)
        return None

    def _join(self, key: object, chunks: Sequence[np.ndarray]) -> None:
        try:
            self._made[key] = joined_in_pieces(chunks)
        except Exception:  # reads go on chunk by chunk: slower, the same rows
            log.warning("joining column %r across chunks failed", key, exc_info=True)
            self._made[key] = None

    def wait(self, timeout_s: float) -> None:
        """Return once every copy asked for is made (for tests and benches); raise
        ``TimeoutError`` naming how many are left after ``timeout_s``."""
        with self._lock:
            asked = list(self._asked.values())
        _, left = wait_all(asked, timeout=timeout_s)
        if left:
            raise TimeoutError(
                f"{len(left)} of {len(asked)} column joins unfinished after {timeout_s} s"
            )

    def close(self) -> None:
        """Drop the copies not started and wait for one under way: it reads the dataset's
        mappings, which are closed next."""
        with self._lock:
            self._closed = True
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)


def joined_in_pieces(
    chunks: Sequence[np.ndarray], piece_bytes: int = PIECE_BYTES
) -> np.ndarray | None:
    """``np.concatenate(chunks)`` copied ``piece_bytes`` at a time, or ``None`` where
    :class:`~.gather.JoinedColumns` joins nothing (rows or total too big, no chunks).

    >>> joined_in_pieces([np.arange(3), np.arange(3, 5)]).tolist()
    [0, 1, 2, 3, 4]
    """
    if not chunks:
        return None
    first = chunks[0]
    row = first.dtype.itemsize * math.prod(first.shape[1:])
    if row > JOIN_MAX_ROW_BYTES or sum(c.nbytes for c in chunks) > JOIN_MAX_BYTES:
        return None
    out = np.empty((sum(len(c) for c in chunks), *first.shape[1:]), dtype=first.dtype)
    step = max(piece_bytes // max(row, 1), 1)
    at = 0
    for c in chunks:
        for lo in range(0, len(c), step):
            piece = c[lo : lo + step]
            out[at : at + len(piece)] = piece
            at += len(piece)
    return out
