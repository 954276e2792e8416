"""Where things live in a store folder, and the file operations that make publishing atomic.

::

    <root>/<name>/manifest.json          a published dataset (manifest written last)
    <root>/<name>/shards/shard-00000.arrow
    <root>/.tmp-<name>-<random>/         an ingest in progress (owner pid in ``owner.pid``)
    <root>/.old-<name>-<random>/         a dataset being replaced by ``--overwrite``

Everything starting with ``.`` is invisible to :class:`~shardserve.server.store.catalog.Store`,
so an interrupted ingest never lists or loads as a dataset; :func:`clean_stale` removes the
leftovers of writers whose process is gone.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import shutil
from pathlib import Path

import xxhash

from shardserve.proto.manifest import Manifest, parse_manifest, validate_dataset_name

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
SHARDS_DIR = "shards"
TMP_PREFIX = ".tmp-"
OLD_PREFIX = ".old-"
OWNER_FILE = "owner.pid"
CHECKSUM_ALGO = "xxh3_64"
_READ_CHUNK = 16 << 20


def dataset_dir(root: Path, name: str) -> Path:
    """The folder of dataset ``name``; the name is validated so it cannot leave ``root``."""
    return root / validate_dataset_name(name)


def shard_name(index: int) -> str:
    return f"{SHARDS_DIR}/shard-{index:05d}.arrow"


def new_temp_dir(root: Path, name: str) -> Path:
    """Create a private temp folder for writing ``name`` and record our pid as its owner."""
    root.mkdir(parents=True, exist_ok=True)
    path = root / f"{TMP_PREFIX}{name}-{secrets.token_hex(6)}"
    (path / SHARDS_DIR).mkdir(parents=True)
    (path / OWNER_FILE).write_text(str(os.getpid()))
    return path


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    return True


def clean_stale(root: Path) -> list[Path]:
    """Remove temp/old folders left by writers that died (owner pid gone); return what went.

    A folder whose owner is alive belongs to a concurrent ingest and is left alone.
    """
    removed: list[Path] = []
    if not root.is_dir():
        return removed
    for entry in root.iterdir():
        if not entry.name.startswith((TMP_PREFIX, OLD_PREFIX)) or not entry.is_dir():
            continue
        try:
            pid = int((entry / OWNER_FILE).read_text().strip())
        except (OSError, ValueError):
            pid = -1
        if pid > 0 and _pid_alive(pid):
            continue
        shutil.rmtree(entry, ignore_errors=True)
        removed.append(entry)
    return removed


def fsync_dir(path: Path) -> None:
    """Make a rename or file creation inside ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def checksum_file(path: Path, *, fsync: bool = False, progress: object | None = None) -> str:
    """``xxh3_64:<hex>`` of the whole file; optionally fsync it on the way (one pass).

    ``progress`` is anything with ``update(nbytes)`` (a tqdm bar).
    """
    h = xxhash.xxh3_64()
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(_READ_CHUNK):
            h.update(chunk)
            if progress is not None:
                progress.update(len(chunk))  # type: ignore[attr-defined]
        if fsync:
            os.fsync(f.fileno())
    return f"{CHECKSUM_ALGO}:{h.hexdigest()}"


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
