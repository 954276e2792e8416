"""Shared-memory slot rings as files: one mapped file in ``/dev/shm`` cut into equal slots,
made by :func:`create_ring`, swept by :func:`remove_stale`. The streams' slots
(:mod:`~..streaming.shm`) and the transform workers' input files are both rings.

A ring is one file in ``/dev/shm`` named ``shardserve-<pid>-<stream>-<random>``, cut into
``slots`` equal slots.

Why plain files and not ``multiprocessing.shared_memory``: before Python 3.13 every attach
registers the segment with a resource-tracker process that unlinks it when *that* process
exits, so a client's exit would delete the server's ring (and a tracker is a process we
promised not to start). Space is reserved with ``posix_fallocate`` so a full ``/dev/shm``
fails here, cleanly, instead of as a SIGBUS in the middle of a batch.

Liveness: the server holds an ``fcntl.flock`` on each of its rings for the ring's life. The
kernel drops it when the server dies, so :func:`remove_stale` can tell a dead server's ring
from a live one's by trying the lock, with no pid involved (a pid says nothing across PID
namespaces: every containerised server is pid 1). A ring is created under a hidden name,
locked, then renamed into place, so no sweep ever sees it unlocked.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import math
import mmap
import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

# Re-exported: where rings live and what they are called (the sweep of stale rings).
from shardserve.proto.rings import DEFAULT_DIR as DEFAULT_DIR
from shardserve.proto.rings import PREFIX as PREFIX
from shardserve.proto.rings import (
    align,
    part_fits,
    ring_bytes,
    ring_name,
    slot_start,
)

from ..source import FileSpan


class ShmUnavailable(RuntimeError):
    """The ring could not be made; the stream falls back to the socket path."""


@dataclass
class SlotRing:
    """A mapped ring of equal slots in one shared-memory file."""

    path: Path
    slots: int
    slot_bytes: int
    _mm: mmap.mmap = field(repr=False)
    free: list[int] = field(default_factory=list)
    #: An open fd of the ring file holding its flock (see the module docstring).
    lock_fd: int = -1

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def nbytes(self) -> int:
        return ring_bytes(self.slots, self.slot_bytes)

    @functools.cached_property
    def address(self) -> int:
        """Where the mapping starts in this process (to tell whether an array lies in a slot)."""
        return np.frombuffer(self._mm, dtype=np.uint8, count=1).ctypes.data

    def offset_in(self, slot: int, arr: np.ndarray) -> int | None:
        """Where ``arr`` starts inside ``slot``, or ``None`` if it does not lie in the slot."""
        start = self.address + slot * self.slot_bytes
        addr = arr.ctypes.data
        if start <= addr and addr + arr.nbytes <= start + self.slot_bytes:
            return addr - start
        return None

    def span_of(self, slot: int, arr: np.ndarray) -> FileSpan | None:
        """Where C-contiguous ``arr`` lies in this ring's file, if it lies in ``slot``: a
        transform worker process writes a batch's outputs there by path and offset."""
        if not arr.flags.c_contiguous or arr.nbytes == 0:
            return None
        at = self.offset_in(slot, arr)
        if at is None:
            return None
        return FileSpan(str(self.path), slot * self.slot_bytes + at, arr.nbytes)

    def slot_array(
        self, slot: int, offset: int, dtype: np.dtype, shape: tuple[int, ...]
    ) -> np.ndarray:
        """A writable numpy view of one part inside ``slot``: assembly writes straight into it."""
        start = slot_start(slot, self.slots, self.slot_bytes)
        # math.prod and the dtype itself: np.prod and dtype names cost microseconds a part.
        count = math.prod(shape)
        nbytes = count * dtype.itemsize
        if not part_fits(offset, nbytes, self.slot_bytes):
            raise ValueError(
                f"part of {nbytes} bytes at offset {offset} overflows a {self.slot_bytes}-byte slot"
            )
        return np.frombuffer(self._mm, dtype=dtype, count=count, offset=start + offset).reshape(
            shape
        )

    def on_disk(self) -> bool:
        """Whether :attr:`path` still names this ring's file. A cleanup of ``/dev/shm``
        (systemd-logind's ``RemoveIPC``, a container runtime, cron) may unlink it under a
        running server: every mapping of it keeps working, but nothing can open it by name
        any more, so whoever hands the name out makes a new ring instead."""
        if self.lock_fd < 0:
            return False
        try:
            st = os.stat(self.path)
        except OSError:
            return False
        own = os.fstat(self.lock_fd)
        return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)

    def close(self) -> None:
        """Unmap and unlink; a client that still has it mapped keeps its pages until it unmaps."""
        # A view still alive somewhere (an in-flight send) keeps the mapping; it goes with the view.
        with contextlib.suppress(BufferError):
            self._mm.close()
        self.path.unlink(missing_ok=True)
        if self.lock_fd >= 0:
            os.close(self.lock_fd)
            self.lock_fd = -1


def free_bytes(shm_dir: Path = DEFAULT_DIR) -> int:
    st = os.statvfs(shm_dir)
    return st.f_bavail * st.f_frsize


def create_ring(
    stream: int,
    slots: int,
    slot_bytes: int,
    shm_dir: Path = DEFAULT_DIR,
    limit_bytes: int | None = None,
) -> SlotRing:
    """Make a ring of ``slots`` x ``slot_bytes`` (rounded up to alignment).

    Raises ``ShmUnavailable`` with the reason and the fix when ``shm_dir`` is missing, too
    small (Docker's default /dev/shm is 64 MB), or over ``limit_bytes``.
    """
    slot_bytes = align(max(slot_bytes, 1))
    size = ring_bytes(slots, slot_bytes)
    hint = (
        "give the container more shared memory (`docker run --shm-size=2g`, compose `shm_size: 2gb`, "
        "or `ipc: host`)"
    )
    if limit_bytes is not None and size > limit_bytes:
        raise ShmUnavailable(
            f"a ring of {slots} x {slot_bytes} bytes is over the {limit_bytes}-byte limit "
            f"(--shm-limit-bytes); raise it, lower the client's prefetch, or {hint}"
        )
    if not shm_dir.is_dir():
        raise ShmUnavailable(f"{shm_dir} does not exist; shared memory is unavailable on this host")
    name = ring_name(os.getpid(), stream, secrets.token_hex(4))
    path = shm_dir / name
    hidden = shm_dir / f".{name}"
    try:
        fd = os.open(hidden, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC, 0o600)
    except OSError as e:
        raise ShmUnavailable(f"cannot create {path}: {e.strerror}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # a fresh file of ours: never contended
        os.posix_fallocate(fd, 0, size)
        mm = mmap.mmap(fd, size)
        os.rename(hidden, path)
    except OSError as e:
        hidden.unlink(missing_ok=True)
        os.close(fd)
        raise ShmUnavailable(
            f"cannot reserve {size} bytes in {shm_dir} ({free_bytes(shm_dir)} free): {e.strerror}; {hint}"
        ) from None
    return SlotRing(path, slots, slot_bytes, mm, free=list(range(slots)), lock_fd=fd)


def owner_alive(path: Path) -> bool:
    """Whether a live server holds the ring at ``path`` (its flock is taken)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return True  # gone already: nothing to remove
    except OSError:
        return True  # not ours to judge (another user's ring)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def remove_stale(shm_dir: Path = DEFAULT_DIR) -> list[str]:
    """Unlink rings whose owning server process is gone (a crash leaves them behind)."""
    removed: list[str] = []
    if not shm_dir.is_dir():
        return removed
    for path in shm_dir.glob(f"{PREFIX}*"):
        if not owner_alive(path):
            path.unlink(missing_ok=True)
            removed.append(path.name)
    return removed
