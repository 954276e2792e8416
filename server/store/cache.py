"""A local cache of whole shard files for remote stores, safe to share between processes.

::

    <dir>/xxh3_64-<hex>.arrow     a verified shard, named by its checksum (content-addressed:
                                   a re-ingested dataset never reads a stale copy)
    <dir>/.tmp-<pid>-<random>     a fetch in progress (removed on failure; a dead fetcher's
                                   leftovers are removed by the next eviction)
    <dir>/.locks/<key>.lock       held exclusively while one process fetches that shard
    <dir>/.evict.lock             held while a process evicts

A shard is fetched whole into a temp file, checked against the manifest's checksum and size,
then renamed into place (atomic publish). Users hold a :class:`Lease`: an open descriptor with
a shared ``flock`` on the file; eviction takes the exclusive lock without blocking and skips a
file it cannot get, so no process (this one or another) loses a shard it is reading. Eviction
is least-recently-used by modification time, which every hit refreshes.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from .cache_metrics import CacheMetrics
from .layout import pid_alive

log = logging.getLogger(__name__)

#: Fetches running ahead of the readers at once (one is enough to keep a link busy).
PREFETCH_THREADS = 2
_TMP = ".tmp-"
_LOCKS = ".locks"
_LOCK_WAIT_S = 300.0
_CHECKSUM = re.compile(r"[a-z0-9_]+:[0-9a-f]+")


def cache_key(checksum: str) -> str:
    """File name of a shard with ``checksum`` (``xxh3_64:ab12`` -> ``xxh3_64-ab12.arrow``)."""
    if not _CHECKSUM.fullmatch(checksum):
        raise ValueError(f"checksum {checksum!r} is not ALGO:HEX")
    algo, _, digest = checksum.partition(":")
    return f"{algo}-{digest}.arrow"


@dataclass
class Lease:
    """A shard file in the cache that cannot be evicted until :meth:`release`."""

    path: Path
    fd: int
    #: Whether this lease fetched the file (so it was checksummed just now).
    fetched: bool = False

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # drops the shared flock
            self.fd = -1


@contextlib.contextmanager
def _flock(path: Path, what: str, timeout: float = _LOCK_WAIT_S) -> Iterator[None]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline = time.monotonic() + timeout
        delay = 0.005
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"waited {timeout:.0f} s for lock {path} ({what}); another process holds it"
                    ) from None
                time.sleep(delay)  # polling a lock with a deadline
                delay = min(delay * 2, 0.1)
        yield
    finally:
        os.close(fd)


class ShardCache:
    """Whole-shard files under ``directory``, at most about ``limit_bytes`` of them.

    The limit is a target: shards that leases hold are never evicted, so a window larger than
    the limit stays whole while it is read.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        limit_bytes: int,
        metrics: CacheMetrics | None = None,
    ) -> None:
        if limit_bytes < 1:
            raise ValueError(f"cache limit must be at least 1 byte, got {limit_bytes}")
        self.dir = Path(directory)
        self.limit_bytes = limit_bytes
        self.metrics = metrics
        (self.dir / _LOCKS).mkdir(parents=True, exist_ok=True)
        self._pool: ThreadPoolExecutor | None = None
        self._pending: dict[str, Future[None]] = {}
        self._lock = threading.Lock()

    # -- leases ---------------------------------------------------------------------------
    def _try_open(self, path: Path) -> int | None:
        """A shared-locked descriptor of ``path`` if it is (still) the published file."""
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return None
        fcntl.flock(fd, fcntl.LOCK_SH)  # waits only for an evictor's brief exclusive lock
        try:
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)  # evicted between our open and our lock
        return None

    def contains(self, checksum: str) -> bool:
        return (self.dir / cache_key(checksum)).exists()

    def discard(self, checksum: str) -> None:
        """Remove the cached file of ``checksum`` (its bytes failed their check): the next
        :meth:`acquire` fetches it again. Readers that mapped it keep their pages."""
        path = self.dir / cache_key(checksum)
        lock = self.dir / _LOCKS / (path.name + ".lock")
        with _flock(lock, f"discarding {path.name}"):
            path.unlink(missing_ok=True)
        log.warning("cached shard %s failed its checksum; removed, to be fetched again", path.name)

    def acquire(
        self, checksum: str, size: int, fetch: Callable[[Path], object], *, prefetch: bool = False
    ) -> Lease:
        """A lease on the shard with ``checksum``, fetching it first if it is not here.

        ``fetch(dest)`` writes the whole shard to the new file ``dest`` and raises if its
        bytes are not the manifest's (the cache publishes only what it returns from).
        """
        path = self.dir / cache_key(checksum)
        fd = self._try_open(path)
        if fd is not None:
            self._touch(path)
            if self.metrics is not None and not prefetch:
                self.metrics.hits.inc()
            return Lease(path, fd)
        lock = self.dir / _LOCKS / (path.name + ".lock")
        with _flock(lock, f"fetch of {path.name}"):
            fd = self._try_open(path)  # another process may have fetched it meanwhile
            if fd is not None:
                if self.metrics is not None and not prefetch:
                    self.metrics.hits.inc()
                return Lease(path, fd)
            if self.metrics is not None and not prefetch:
                self.metrics.misses.inc()
            self._make_room(size)
            tmp = self.dir / f"{_TMP}{os.getpid()}-{secrets.token_hex(6)}"
            started = time.perf_counter()
            try:
                fetch(tmp)
                got = tmp.stat().st_size
                if got != size:
                    raise OSError(f"fetched {got} bytes for {path.name}, expected {size}")
                self._touch(tmp)
                os.rename(tmp, path)  # atomic publish: readers see all of it or nothing
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
            if self.metrics is not None:
                self.metrics.fetch_seconds.observe(time.perf_counter() - started)
                self.metrics.fetched_bytes.inc(size)
                self.metrics.fetches.inc()
            fd = self._try_open(path)
            if fd is None:  # evicted by another process in between: vanishingly rare
                raise OSError(f"shard {path} vanished from the cache right after its fetch")
            return Lease(path, fd, fetched=True)

    @staticmethod
    def _touch(path: Path) -> None:
        # An explicit time: the kernel's own file times tick coarsely (jiffies), which would
        # tie shards used milliseconds apart.
        now = time.time_ns()
        with contextlib.suppress(OSError):
            os.utime(path, ns=(now, now))

    # -- prefetch -------------------------------------------------------------------------
    def prefetch(self, checksum: str, size: int, fetch: Callable[[Path], object]) -> None:
        """Fetch a shard in the background if it is neither here nor on its way."""
        if self.contains(checksum):
            return
        with self._lock:
            if checksum in self._pending:
                return
            if self._pool is None:
                self._pool = ThreadPoolExecutor(PREFETCH_THREADS, thread_name_prefix="prefetch")
            self._pending[checksum] = self._pool.submit(self._prefetch_one, checksum, size, fetch)

    def _prefetch_one(self, checksum: str, size: int, fetch: Callable[[Path], object]) -> None:
        try:
            self.acquire(checksum, size, fetch, prefetch=True).release()
            if self.metrics is not None:
                self.metrics.prefetched.inc()
        except Exception as e:  # the reader fetches it again and gets the error itself
            log.warning("prefetch of %s failed: %s", cache_key(checksum), e)
        finally:
            with self._lock:
                self._pending.pop(checksum, None)

    # -- eviction -------------------------------------------------------------------------
    def _entries(self) -> list[tuple[float, int, Path]]:
        found = []
        with os.scandir(self.dir) as it:
            for e in it:
                if not e.name.endswith(".arrow") or e.name.startswith("."):
                    continue
                with contextlib.suppress(FileNotFoundError):
                    st = e.stat()
                    found.append((st.st_mtime, st.st_size, Path(e.path)))
        return found

    def used_bytes(self) -> int:
        return sum(size for _, size, _ in self._entries())

    def _make_room(self, need: int) -> None:
        """Evict unleased shards, oldest first, until ``need`` more bytes fit the limit."""
        with _flock(self.dir / ".evict.lock", "cache eviction"):
            entries = sorted(self._entries())
            total = sum(size for _, size, _ in entries)
            for _, size, path in entries:
                if total + need <= self.limit_bytes:
                    break
                if self._evict(path):
                    total -= size
            self._clean_temps()
            if self.metrics is not None:
                self.metrics.used_bytes.set(total)

    def _evict(self, path: Path) -> bool:
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return True
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False  # leased (in use by a stream here or in another process)
        try:
            path.unlink(missing_ok=True)
        finally:
            os.close(fd)
        if self.metrics is not None:
            self.metrics.evictions.inc()
        return True

    def _clean_temps(self) -> None:
        for p in self.dir.glob(f"{_TMP}*"):
            pid = p.name[len(_TMP) :].split("-", 1)[0]
            if pid.isdigit() and not pid_alive(int(pid)):
                p.unlink(missing_ok=True)

    def close(self) -> None:
        """Stop prefetching (fetches under way finish or fail on their own)."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
