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
from pathlib import Path

from shardserve.proto.errors import DatasetNotFound, InvalidDataError, ShardserveError
from shardserve.proto.manifest import Manifest, validate_dataset_name

from . import layout
from .dataset import VERIFY_MODES, Dataset

log = logging.getLogger(__name__)


class Store:
    """A store root. ``open`` returns one shared, thread-safe ``Dataset`` per name.

    The cache notices a dataset replaced by ``ingest --overwrite`` (its folder's inode
    changes) and opens the new version for later callers; holders of the old ``Dataset``
    keep reading the old files, which stay mapped until they close it.

    ``verify`` (see :mod:`.dataset`) applies when a dataset version is mapped, so each shard
    file is checked once per process however often the dataset is opened.
    """

    def __init__(self, root: str | os.PathLike[str], verify: str = "lazy") -> None:
        if verify not in VERIFY_MODES:
            raise ValueError(f"verify must be one of {VERIFY_MODES}, got {verify!r}")
        self.root = Path(root)
        self.verify = verify
        self._lock = threading.Lock()
        self._open: dict[str, tuple[int, Dataset]] = {}

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

    def open(self, name: str, verify: str | None = None) -> Dataset:
        """The shared ``Dataset`` for ``name``, mapped on first use.

        The first open of a version maps it under ``verify`` (default: the store's mode); a
        later ``verify="full"`` runs a full check on the cached dataset, any other mode none.
        """
        folder = self._folder(name)
        try:
            inode = folder.stat().st_ino
        except FileNotFoundError:
            self.manifest(name)  # raises DatasetNotFound with the list of datasets
            raise
        with self._lock:
            cached = self._open.get(name)
            if cached is not None and cached[0] == inode:
                ds = cached[1]
                if verify == "full":
                    ds.verify()
                return ds
            ds = Dataset(folder, self.manifest(name), verify=verify or self.verify)
            self._open[name] = (inode, ds)
            return ds

    def close(self) -> None:
        """Close every dataset this store opened."""
        with self._lock:
            for _, ds in self._open.values():
                ds.close()
            self._open.clear()


__all__ = ["DatasetNotFound", "InvalidDataError", "Store"]
