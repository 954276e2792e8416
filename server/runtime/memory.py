"""Giving freed memory back to the operating system.

Freed numpy buffers smaller than glibc's mmap threshold (which grows up to 32 MiB as large
blocks are freed) stay in malloc's arenas: the process's resident size keeps them until
``malloc_trim`` hands the free pages back. The streamer calls :func:`trim` shortly after
streams close, so buffers of closed streams do not stay resident.

>>> trim() in (True, False)
True
"""

from __future__ import annotations

import ctypes
import functools


@functools.cache
def _libc() -> ctypes.CDLL | None:
    # The process's own symbols: no library search (ctypes.util.find_library runs programs).
    try:
        libc = ctypes.CDLL(None)
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
        libc.malloc_trim.restype = ctypes.c_int
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to trim
        return None
    return libc


def trim() -> bool:
    """Return free heap pages of every arena to the OS; whether any were (False off glibc)."""
    libc = _libc()
    return bool(libc.malloc_trim(0)) if libc is not None else False
