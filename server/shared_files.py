"""Which arrays of this process lie in a mapped shared-memory file, and where in it.

The slot rings of :mod:`.streaming.shm` register their mappings here, so that work done in
another process (a transform worker) can be told to write a batch's outputs straight where
the batch is sent from, by file and offset, instead of sending them back through a pipe
to be copied there. Pointers never leave the process: only paths and offsets do.

>>> import mmap
>>> mm = mmap.mmap(-1, 4096)
>>> a = np.frombuffer(mm, dtype=np.uint8)
>>> files = SharedFiles()
>>> files.add(a.ctypes.data, 4096, "/dev/shm/example")
>>> files.locate(a[64:128])
FileSpan(path='/dev/shm/example', offset=64, nbytes=64)
>>> files.remove(a.ctypes.data)
>>> files.locate(a) is None
True
"""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class FileSpan:
    """Bytes ``offset`` to ``offset + nbytes`` of the file at ``path``."""

    path: str
    offset: int
    nbytes: int


class SharedFiles:
    """Mapped shared files by address range; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._starts: list[int] = []
        self._maps: dict[int, tuple[int, str]] = {}

    def add(self, address: int, nbytes: int, path: str) -> None:
        """File ``path`` is mapped at ``address`` for ``nbytes``."""
        with self._lock:
            if address not in self._maps:
                bisect.insort(self._starts, address)
            self._maps[address] = (address + nbytes, path)

    def remove(self, address: int) -> None:
        """The mapping at ``address`` is going away."""
        with self._lock:
            if self._maps.pop(address, None) is not None:
                self._starts.remove(address)

    def locate(self, arr: np.ndarray) -> FileSpan | None:
        """Where C-contiguous ``arr`` lies in a registered file, or ``None``."""
        if not arr.flags.c_contiguous or arr.nbytes == 0:
            return None
        addr = arr.ctypes.data
        with self._lock:
            i = bisect.bisect_right(self._starts, addr) - 1
            if i < 0:
                return None
            start = self._starts[i]
            end, path = self._maps[start]
        if addr + arr.nbytes > end:
            return None
        return FileSpan(path, addr - start, arr.nbytes)


#: This process's shared files (one address space, so one table).
SHARED_FILES = SharedFiles()
