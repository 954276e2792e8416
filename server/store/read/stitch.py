"""One array over rows that lie in several mapped files: the pieces mapped side by side.

A batch that spans shards is gathered from several arrays. numpy has no take from several
sources into one output, so :func:`~.gather.take_fixed` copies every byte twice (a take per
chunk into scratch, one take back into batch order). Here each chunk's rows of a fixed field
are mapped once more, from the same open file, into one reserved range of addresses, at
addresses that keep one row stride across the pieces: a batch is then one ``np.take`` over one
array, one copy, however many shards it touches (896 CIFAR rows from 3 shards into a slot:
351-361 us against 455-512 us for the two copies). A variable field's values are stitched
the same way, item by item, so a batch of graphs finds every sample's values in one array
(:func:`~.gather.take_ragged_across`) instead of stepping through the shards it touches.

Where the rows go (:func:`layout`): a mapping starts on a page, so piece ``k``'s row 0 lands
at a virtual row ``first[k]`` whose address has the same offset within its page as the row's
offset within its file. With rows of ``R`` bytes and pages of ``P`` that is
``skew + first[k] * R == offset[k]  (mod P)``, solvable for every piece when the offsets agree
modulo ``gcd(R, P)``. Arrow IPC places buffers on 8 bytes, so rows whose size has no power
of two above 8 in it (1,053 bytes, 12, 8,424) always qualify, and so do a variable field's
values, stitched item by item. Rows of 3 or 4 KiB qualify where every shard has the field at
the same offset: the first field of our files (the same header comes before it in every
shard); a field behind others moves with their sizes, so a shorter last shard or a variable
field before it leaves it to the two copies. Otherwise, or off Linux, or past the map
budget, there is no stitched array and the two copies serve.

The gaps between pieces are reserved and unreadable: only ``(chunk, row)`` pairs located from
ids already bounds-checked are read, and a row of piece ``k`` lies inside its mapping. The
mappings are the page cache's pages again (no memory of their own), unmapped when the last
array over them goes.

>>> lay = layout([480, 480], [5, 7], row_bytes=3072, page=4096)
>>> [(lay.skew + f * 3072) % 4096 for f in lay.first.tolist()]
[480, 480]
"""

from __future__ import annotations

import ctypes
import functools
import math
import mmap
import sys
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

#: Pieces one field may be stitched from: each is a mapping (the kernel's limit is per process).
MAX_PIECES = 4096
#: Share of the process's mapping limit (``vm.max_map_count``) stitched arrays may use.
MAP_SHARE = 4


@dataclass(frozen=True)
class Piece:
    """One chunk's rows of a field in a file: ``rows`` rows from byte ``offset`` of the open
    file ``fd`` (the mapped shard's own descriptor, never a path opened again)."""

    fd: int
    offset: int
    rows: int


@dataclass(frozen=True)
class Layout:
    """Where pieces go in one reserved range (offsets from its start; see :func:`layout`)."""

    #: Bytes from the range's start to virtual row 0.
    skew: int
    #: The virtual row of each piece's row 0 (int64; 0 for a piece without rows).
    first: np.ndarray
    #: Each piece's mapping: (offset in the range, page-aligned file offset, bytes; 0 bytes
    #: for a piece without rows).
    maps: tuple[tuple[int, int, int], ...]
    #: Virtual rows, to the end of the last piece.
    rows: int
    #: Bytes the range spans.
    size: int


def layout(
    offsets: Sequence[int], rows: Sequence[int], row_bytes: int, page: int = mmap.PAGESIZE
) -> Layout | None:
    """Where pieces whose row 0 lies at file byte ``offsets[k]`` (``rows[k]`` rows of
    ``row_bytes``) go so that one row stride reads them all, in order and without overlap;
    ``None`` when their offsets disagree modulo ``gcd(row_bytes, page)``.

    >>> layout([0, 100], [1, 1], row_bytes=4096, page=4096) is None
    True
    """
    used = [o for o, n in zip(offsets, rows, strict=True) if n]
    if not used or row_bytes <= 0:
        return None
    g = math.gcd(row_bytes, page)
    skew = used[0] % page
    if any((o - skew) % g for o in used):
        return None
    step = page // g  # first[k] is fixed modulo this many rows
    inv = pow(row_bytes // g, -1, step) if step > 1 else 0
    first: list[int] = []
    maps: list[tuple[int, int, int]] = []
    end = 0
    for off, n in zip(offsets, rows, strict=True):
        if not n:
            first.append(0)
            maps.append((0, 0, 0))
            continue
        within = off % page
        r = ((within - skew) % page // g) * inv % step
        # The mapping starts ``within`` bytes before row 0: not before the previous one ends.
        low = end + within - skew
        if r * row_bytes < low:
            r += -(-(low - r * row_bytes) // (step * row_bytes)) * step
        start = skew + r * row_bytes - within
        length = -(-(within + n * row_bytes) // page) * page
        first.append(r)
        maps.append((start, off - within, length))
        end = start + length
    virtual = max(f + n for f, n in zip(first, rows, strict=True))
    return Layout(skew, np.asarray(first, dtype=np.int64), tuple(maps), virtual, end)


class Stitched:
    """Rows of several pieces as one array ``[virtual rows, *shape]``; see the module."""

    def __init__(self, array: np.ndarray, first: np.ndarray) -> None:
        self.array = array
        self.first = first

    def take(self, chunk: np.ndarray, rows: np.ndarray, out: np.ndarray) -> np.ndarray:
        """Row ``rows[i]`` of piece ``chunk[i]`` for every ``i``, into ``out`` (one copy)."""
        # mode="clip": the pairs come from checked ids, and "raise" would buffer the output.
        return self.array.take(rows + self.first[chunk], axis=0, out=out, mode="clip")


def stitch(pieces: Sequence[Piece], dtype: np.dtype, shape: tuple[int, ...]) -> Stitched | None:
    """The pieces' rows (``dtype``, ``shape`` each) as one :class:`Stitched`, or ``None``
    where they cannot be (see the module): then the caller gathers piece by piece."""
    row_bytes = dtype.itemsize * math.prod(shape)
    libc = _libc()
    if libc is None or len(pieces) < 2 or len(pieces) > MAX_PIECES or not row_bytes:
        return None
    lay = layout([p.offset for p in pieces], [p.rows for p in pieces], row_bytes)
    # Each piece splits the reserved range: a mapping for it, and one for the gap after it.
    maps = 2 * len(pieces) + 1
    if lay is None or not _BUDGET.take(maps):
        return None
    base = libc.mmap(None, lay.size, _PROT_NONE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    if base is None or base == _MAP_FAILED:
        _BUDGET.give(maps)
        return None
    owner = _Range(libc, base, lay.size, maps)
    for p, (at, file_offset, length) in zip(pieces, lay.maps, strict=True):
        if not length:
            continue
        got = libc.mmap(base + at, length, mmap.PROT_READ, _PLACE, p.fd, file_offset)
        if got != base + at:
            owner.release()
            return None
    buf = (ctypes.c_char * (lay.rows * row_bytes)).from_address(base + lay.skew)
    # The array holds ``buf`` (through a memoryview): the range is unmapped when the last
    # array over it goes. Not at interpreter exit: a thread still reading would crash the
    # exit, and the kernel unmaps it with the process anyway.
    weakref.finalize(buf, owner.release).atexit = False
    array = np.frombuffer(memoryview(buf), dtype=dtype).reshape(lay.rows, *shape)
    array.flags.writeable = False  # the pages are mapped read-only: a write would be SIGSEGV
    return Stitched(array, lay.first)


class StitchedColumns:
    """The fields of one chunk list stitched (:func:`stitch`), each on first use, from the
    pieces ``pieces(name)`` says (``None``: that field cannot be): a fixed field's rows, or a
    variable field's values item by item. Thread-safe."""

    def __init__(self, pieces: Callable[[str], list[Piece] | None]) -> None:
        self.pieces = pieces
        self._lock = threading.Lock()
        self._made: dict[str, Stitched | None] = {}

    def get(self, name: str, dtype: np.dtype, shape: tuple[int, ...]) -> Stitched | None:
        """Field ``name`` stitched (its pieces' rows are ``dtype`` of ``shape``), or ``None``."""
        made = self._made.get(name, _UNMADE)
        if made is not _UNMADE:
            return made
        with self._lock:
            if name not in self._made:
                got = self.pieces(name)
                self._made[name] = stitch(got, dtype, shape) if got is not None else None
            return self._made[name]

    @classmethod
    def joining(cls, parts: Sequence[StitchedColumns]) -> StitchedColumns:
        """Chunk lists laid end to end: a field is stitched across all of them or not at all."""

        def pieces(name: str) -> list[Piece] | None:
            out: list[Piece] = []
            for p in parts:
                got = p.pieces(name)
                if got is None:
                    return None
                out += got
            return out

        return cls(pieces)


_UNMADE = Stitched(np.empty(0), np.empty(0, dtype=np.int64))


class _Budget:
    """Mappings stitched arrays may hold in this process (a share of ``vm.max_map_count``):
    past it a field is gathered piece by piece, and the mappings the rest of the server makes
    (shards, large numpy arrays) never run out."""

    def __init__(self, total: int) -> None:
        self._left = total
        self._lock = threading.Lock()

    def take(self, n: int) -> bool:
        with self._lock:
            if n > self._left:
                return False
            self._left -= n
            return True

    def give(self, n: int) -> None:
        with self._lock:
            self._left += n


class _Range:
    """A reserved range and the pieces mapped into it: unmapped once, on release."""

    def __init__(self, libc: ctypes.CDLL, base: int, size: int, maps: int) -> None:
        self._libc, self._base, self._size, self._maps = libc, base, size, maps
        self._done = False

    def release(self) -> None:
        if not self._done:
            self._done = True
            self._libc.munmap(self._base, self._size)
            _BUDGET.give(self._maps)


def _max_maps() -> int:
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 65530  # the kernel's default


_LINUX = sys.platform == "linux"
_BUDGET = _Budget(_max_maps() // MAP_SHARE if _LINUX else 0)
_MAP_FAILED = ctypes.c_void_p(-1).value
# ``mmap`` has no MAP_FIXED; it is 0x10 on every Linux architecture. Fixed mappings go only
# into a range this module reserved, never over anything else.
_PLACE = mmap.MAP_SHARED | 0x10
_PROT_NONE = 0


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """The C library's ``mmap`` and ``munmap``, typed (Linux only: elsewhere, no stitching)."""
    if not _LINUX:
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    off_t = ctypes.c_int64
    size_t, ptr, i32 = ctypes.c_size_t, ctypes.c_void_p, ctypes.c_int
    libc.mmap.argtypes = [ptr, size_t, i32, i32, i32, off_t]
    libc.munmap.argtypes = [ptr, size_t]
    return libc
