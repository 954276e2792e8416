"""Where things live in a store folder, and the file operations that make publishing atomic.

::

    <root>/<name>/manifest.json          a published dataset (manifest written last)
    <root>/<name>/shards/shard-00000.arrow
    <root>/.tmp-<name>-<random>/         an ingest in progress (``owner.lock`` flock'd by its writer)
    <root>/.old-<name>-<random>/         a dataset being replaced by ``--overwrite``

Everything starting with ``.`` is invisible to :class:`~shardserve.server.store.catalog.Store`,
so an interrupted ingest never lists or loads as a dataset; :func:`clean_stale` removes the
leftovers of writers whose process is gone.

Ownership is an ``fcntl.flock`` on ``owner.lock``, held by the writer from the folder's
creation until its publish rename is done: the kernel drops it when the owner dies (whatever
kills it, in any PID namespace), so a sweep that can take the lock has proof the owner is
gone, and one that cannot leaves the folder alone. The lock file gets that name only once
locked; before, a folder is left alone for its first minute. (A pid file alone was unlinked
before the publish rename, and a concurrent sweep removed a folder about to be published.)
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import secrets
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import xxhash

from shardserve.proto.manifest import Manifest, parse_manifest, validate_dataset_name

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
SHARDS_DIR = "shards"
TMP_PREFIX = ".tmp-"
OLD_PREFIX = ".old-"
OWNER_FILE = "owner.pid"
LOCK_FILE = "owner.lock"
#: A temp folder without a lock file is younger than this only while its writer is between
#: ``mkdir`` and taking the lock; older ones (a writer of an older version) are swept.
_UNLOCKED_GRACE_S = 60.0
CHECKSUM_ALGO = "xxh3_64"
_READ_CHUNK = 16 << 20
#: Bytes per checksummed block of a shard: a first read verifies the blocks it reads, not the
#: whole shard. 1 MiB: a random batch of 256 samples reads at most 256 MiB to verify them on a
#: cold disk, and the manifest holds 16 hex digits per MiB stored.
BLOCK_BYTES = 1 << 20


def dataset_dir(root: Path, name: str) -> Path:
    """The folder of dataset ``name``; the name is validated so it cannot leave ``root``."""
    return root / validate_dataset_name(name)


def shard_name(index: int) -> str:
    return f"{SHARDS_DIR}/shard-{index:05d}.arrow"


@dataclass
class OwnedDir:
    """A temp folder and the open, ``flock``'d lock file that proves its writer is alive."""

    path: Path
    lock_fd: int

    def release(self) -> None:
        """Drop the lock (after the publish rename, or after removing the folder)."""
        if self.lock_fd >= 0:
            os.close(self.lock_fd)
            self.lock_fd = -1


def new_temp_dir(root: Path, name: str) -> OwnedDir:
    """Create a private temp folder for writing ``name``, locked by this process until
    :meth:`OwnedDir.release` (or its death)."""
    root.mkdir(parents=True, exist_ok=True)
    path = root / f"{TMP_PREFIX}{name}-{secrets.token_hex(6)}"
    (path / SHARDS_DIR).mkdir(parents=True)
    # The lock file takes its name already locked: a sweep that opened it between its
    # creation and our flock would take the lock first and remove the folder. Until the
    # rename a sweep sees no lock file, and a folder that young is left alone.
    pending = path / (LOCK_FILE + ".new")
    fd = os.open(pending, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)  # a file no one else knows of: never blocks
    os.rename(pending, path / LOCK_FILE)
    (path / OWNER_FILE).write_text(str(os.getpid()))  # for people reading the folder
    return OwnedDir(path, fd)


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host (someone else's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    return True


def _owner_dead(entry: Path) -> tuple[bool, int]:
    """Whether ``entry``'s writer is provably gone; if so, also an fd holding its lock (or -1).

    The caller removes the folder while holding the returned lock, so that no sweep races it.
    """
    try:
        fd = os.open(entry / LOCK_FILE, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        if entry.name.startswith(OLD_PREFIX):
            return True, -1  # a replaced dataset, renamed away: garbage once its rename is done
        # No lock: a writer between mkdir and flock, or an older writer's pid-file folder.
        try:
            pid = int((entry / OWNER_FILE).read_text().strip())
        except (OSError, ValueError):
            pid = -1
        if pid > 0 and pid_alive(pid):
            return False, -1
        try:
            age = time.time() - entry.stat().st_mtime
        except OSError:
            return False, -1
        return age > _UNLOCKED_GRACE_S, -1
    except OSError:
        return False, -1
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return False, -1  # its owner holds it: alive
    return True, fd


def clean_stale(root: Path) -> list[Path]:
    """Remove temp/old folders left by writers that died (lock free); return what went.

    A folder whose owner still holds its lock belongs to a concurrent ingest and is left alone.
    """
    removed: list[Path] = []
    if not root.is_dir():
        return removed
    for entry in root.iterdir():
        if not entry.name.startswith((TMP_PREFIX, OLD_PREFIX)) or not entry.is_dir():
            continue
        dead, fd = _owner_dead(entry)
        if not dead:
            continue
        try:
            shutil.rmtree(entry, ignore_errors=True)
        finally:
            if fd >= 0:
                os.close(fd)
        removed.append(entry)
    return removed


def fsync_dir(path: Path) -> None:
    """Make a rename or file creation inside ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass(frozen=True)
class FileDigest:
    """A shard file's checksum, and those of its blocks when asked for."""

    #: ``xxh3_64:<hex>`` of the whole file.
    checksum: str
    #: :func:`block_digest` of each block, concatenated ("" when not asked).
    blocks: str


def block_digest(data: memoryview | bytes) -> str:
    """The 16 hex digits of one block's xxh3_64 (the unit a first read verifies)."""
    return xxhash.xxh3_64_hexdigest(data)


def digest_file(
    path: Path,
    *,
    block_bytes: int | None = None,
    fsync: bool = False,
    progress: object | None = None,
) -> FileDigest:
    """The whole file's checksum and, with ``block_bytes``, each block's, in one pass
    (optionally fsyncing the file on the way). ``progress`` is anything with
    ``update(nbytes)`` (a tqdm bar)."""
    h = xxhash.xxh3_64()
    parts: list[str] = []
    # Pieces of whole blocks, so that block boundaries fall where a reader expects them (a
    # buffered read returns the whole size asked for until the end of the file).
    piece = _READ_CHUNK if block_bytes is None else block_bytes * max(1, _READ_CHUNK // block_bytes)
    with open(path, "rb") as f:
        while chunk := f.read(piece):
            h.update(chunk)
            if block_bytes is not None:
                view = memoryview(chunk)
                parts.extend(
                    block_digest(view[i : i + block_bytes])
                    for i in range(0, len(view), block_bytes)
                )
            if progress is not None:
                progress.update(len(chunk))  # type: ignore[attr-defined]
        if fsync:
            os.fsync(f.fileno())
    return FileDigest(f"{CHECKSUM_ALGO}:{h.hexdigest()}", "".join(parts))


def checksum_buffer(data: memoryview, progress: object | None = None) -> str:
    """``xxh3_64:<hex>`` of an in-memory (e.g. memory-mapped) buffer, hashed in slices."""
    h = xxhash.xxh3_64()
    for start in range(0, len(data), _READ_CHUNK):
        part = data[start : start + _READ_CHUNK]
        h.update(part)
        if progress is not None:
            progress.update(len(part))  # type: ignore[attr-defined]
    return f"{CHECKSUM_ALGO}:{h.hexdigest()}"


def write_manifest(folder: Path, manifest: Manifest) -> None:
    """Write ``manifest.json`` durably (it is the last file written: its presence publishes)."""
    path = folder / MANIFEST
    with open(path, "w", encoding="utf-8") as f:
        f.write(manifest.model_dump_json(indent=2))
        f.flush()
        os.fsync(f.fileno())


def read_manifest(folder: Path) -> Manifest:
    """Parse ``folder/manifest.json``; raises ``OSError`` if missing, ``InvalidDataError`` if bad."""
    path = folder / MANIFEST
    return parse_manifest(path.read_bytes(), where=str(path))


def publish(temp: Path, root: Path, name: str, *, overwrite: bool) -> None:
    """Rename the finished ``temp`` folder to ``root/name``.

    With ``overwrite`` an existing dataset is renamed away first and deleted after the new one
    is in place, so at no moment does a half-written dataset carry the name.
    """
    from shardserve.proto.errors import InvalidDataError

    # The owner lock stays in ``temp`` (and held by the writer) through the rename below; the
    # writer removes it from the published folder afterwards (:func:`drop_owner_files`).
    (temp / OWNER_FILE).unlink(missing_ok=True)
    fsync_dir(temp)
    target = dataset_dir(root, name)
    old: Path | None = None
    if target.exists():
        if not overwrite:
            raise InvalidDataError(
                f"dataset {name!r} already exists in {root}; pass --overwrite to replace it"
            )
        old = root / f"{OLD_PREFIX}{name}-{secrets.token_hex(6)}"
        os.rename(target, old)
    os.rename(temp, target)
    fsync_dir(root)
    if old is not None:
        with contextlib.suppress(OSError):
            shutil.rmtree(old)
    log.info("published dataset %s at %s", name, target)


def drop_owner_files(folder: Path) -> None:
    """Remove the ownership lock file from a published dataset folder."""
    (folder / LOCK_FILE).unlink(missing_ok=True)
    (folder / OWNER_FILE).unlink(missing_ok=True)
