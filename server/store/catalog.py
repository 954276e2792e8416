"""``Store``: the datasets under one root folder, and a per-process cache of open ones.

Only published datasets count: a folder named like a dataset that holds a valid
``manifest.json``. Hidden folders (``.tmp-*`` of an ingest in progress or killed, ``.old-*``,
``.shardserve``) and anything else are ignored. Names are validated before any path is built,
so no name reaches outside the root.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from shardserve.proto.errors import DatasetNotFound, InvalidDataError, ShardserveError
from shardserve.proto.manifest import Manifest, validate_dataset_name

from . import layout
from .cache import ShardCache
from .verify import VERIFY_MODES, verify_dataset
from .versions import VersionShelf, changed_error, content_id

if TYPE_CHECKING:
    # The read path (and pyarrow under it) loads when a dataset is first opened or checked:
    # an idle server does not hold it.
    from .read.dataset import Dataset

log = logging.getLogger(__name__)


class Store:
    """A store root. ``open`` returns one shared, thread-safe ``Dataset`` per name.

    The cache notices a dataset replaced by ``ingest --overwrite`` (its folder's inode
    changes) and opens the new version for later callers; the old ``Dataset`` moves to
    :attr:`shelf`, still mapped, for the jobs pinned to its version (:mod:`.versions`).

    ``verify`` (see :mod:`.dataset`) applies when a dataset version is mapped, so each shard
    file is checked once per process however often the dataset is opened.
    """

    def __init__(
        self, root: str | os.PathLike[str], verify: str = "lazy", read_ahead_bytes: int = -1
    ) -> None:
        if verify not in VERIFY_MODES:
            raise ValueError(f"verify must be one of {VERIFY_MODES}, got {verify!r}")
        self.root = Path(root)
        self.verify = verify
        #: Bytes of a shard read ahead at its first read (-1: the default; see .read_ahead).
        self.read_ahead_bytes = read_ahead_bytes
        self._lock = threading.Lock()
        self._open: dict[str, tuple[int, Dataset]] = {}
        self.shelf: VersionShelf[Dataset] = VersionShelf()

    def list(self) -> list[Manifest]:
        """Manifests of every published dataset, sorted by name."""
        if not self.root.is_dir():
            return []
        found = []
        for entry in sorted(self.root.iterdir()):
            if entry.name.startswith(".") or not entry.is_dir():
                continue
            try:
                validate_dataset_name(entry.name)
                manifest = layout.read_manifest(entry)
            except FileNotFoundError:
                continue  # not a dataset (a folder of something else)
            except (OSError, ShardserveError) as e:
                log.warning("skipping %s: %s", entry, e)
                continue
            if manifest.name != entry.name:
                log.warning("skipping %s: its manifest names dataset %r", entry, manifest.name)
                continue
            found.append(manifest)
        return found

    def _folder(self, name: str) -> Path:
        return layout.dataset_dir(self.root, name)

    def manifest(self, name: str) -> Manifest:
        """The manifest of ``name``; ``DatasetNotFound`` if there is none, ``InvalidDataError``
        for a name that is not allowed."""
        folder = self._folder(name)
        try:
            return layout.read_manifest(folder)
        except (FileNotFoundError, NotADirectoryError):
            known = ", ".join(m.name for m in self.list()) or "none"
            raise DatasetNotFound(
                f"no dataset {name!r} in store {self.root} (datasets: {known})"
            ) from None

    def version(self, name: str) -> str:
        """The content id of ``name``'s current version (:mod:`.versions`)."""
        return content_id(self.manifest(name))

    def open(self, name: str, verify: str | None = None, version: str | None = None) -> Dataset:
        """The shared ``Dataset`` for ``name``, mapped on first use.

        The first open of a version maps it under ``verify`` (default: the store's mode); a
        later ``verify="full"`` runs a full check on the cached dataset, any other mode none.
        With ``version`` the dataset must be that version: the current one, or an older one
        this process still holds (see :mod:`.versions`); otherwise ``DatasetChanged`` names
        both.
        """
        from .read.dataset import Dataset

        folder = self._folder(name)
        try:
            inode = folder.stat().st_ino
        except FileNotFoundError:
            if version is not None and (held := self.shelf.get(name, version)) is not None:
                return held  # deleted on disk, still mapped here for the jobs that pin it
            self.manifest(name)  # raises DatasetNotFound with the list of datasets
            raise
        with self._lock:
            cached = self._open.get(name)
            if cached is None or cached[0] != inode:
                if cached is not None:
                    # Replaced on disk: the old version stays mapped while a job pins it.
                    old = cached[1]
                    self.shelf.put(name, content_id(old.manifest), old)
                ds = Dataset.mapped(
                    folder, self.manifest(name), verify or self.verify, self.read_ahead_bytes
                )
                self._open[name] = cached = (inode, ds)
                verify = None  # just mapped in the asked mode
            ds = cached[1]
            if version is not None and content_id(ds.manifest) != version:
                held = self.shelf.get(name, version)
                if held is None:
                    raise changed_error(name, version, content_id(ds.manifest))
                return held
            if verify == "full":
                ds.verify()
            return ds

    def release_unpinned(self, pinned: Iterable[tuple[str, str | None]]) -> None:
        """Let go of old versions no job pins any more (their files were deleted already).

        A version replaced or deleted on disk since it was opened is old too, even if no
        open since has noticed: without this check it stayed mapped, its disk space held,
        until the name was next opened, long after its last job ended."""
        self._shelve_replaced()
        for name, version in self.shelf.keep_only(pinned):
            log.info("released dataset %s version %s: no job pins it any more", name, version)

    def _shelve_replaced(self) -> None:
        """Move every opened dataset whose folder is gone or replaced to the shelf."""
        with self._lock:
            for name, (inode, ds) in list(self._open.items()):
                try:
                    current = self._folder(name).stat().st_ino
                except OSError:
                    current = None
                if current != inode:
                    del self._open[name]
                    self.shelf.put(name, content_id(ds.manifest), ds)

    def mapped_versions(self) -> int:
        """Dataset versions held mapped: the current ones opened, and older ones jobs pin."""
        with self._lock:
            return len(self._open) + len(self.shelf.held())

    #: Shards are read in place: no cache.
    cache: ShardCache | None = None

    def verify_dataset(self, name: str, progress: bool = False) -> Manifest:
        """Checksum, schema and row count of every shard of ``name``."""
        manifest = self.manifest(name)
        verify_dataset(self.root / manifest.name, manifest, progress=progress)
        return manifest

    def reads_in_flight(self) -> tuple[str, ...]:
        """None: shards are mapped in place, never fetched."""
        return ()

    def wait_reads(self, timeout_s: float) -> tuple[str, ...]:
        return ()

    def check_shards(self, manifest: Manifest) -> None:
        """A stat per shard file (see :class:`.StoreBackend`)."""
        from .read.shards import check_file

        folder = self._folder(manifest.name)
        for info in manifest.shards:
            check_file(folder / info.path, info)

    def unready(self) -> str | None:
        if not self.root.is_dir() or not os.access(self.root, os.R_OK | os.X_OK):
            return f"store {self.root} is not a readable folder"
        return None

    def served_bytes(self) -> float:
        try:
            return float(sum(m.total_bytes for m in self.list()))
        except Exception:  # a scrape must not fail because one manifest is unreadable
            return float("nan")

    def close(self) -> None:
        """Close every dataset this store opened."""
        with self._lock:
            for _, ds in self._open.values():
                ds.close()
            self._open.clear()
            for ds in self.shelf.pop_all():
                ds.close()


__all__ = ["DatasetNotFound", "InvalidDataError", "Store"]
