"""Dataset versions: a dataset's identity is its name plus a content id.

The content id is 16 hex digits of xxh3-128 over the canonical JSON of what decides the bytes
served: the fields, the sample count, the tree, and each shard's rows, size and checksum (in
order). Paths, ``created_at`` and provenance are left out, so the same data ingested twice,
or uploaded to object storage under another shard prefix, is the same version.

A job pins the version it was created for (``JobSpec.version``, covered by its id). The
stores keep every version a live job pins open for as long as it is pinned
(:class:`VersionShelf`): ``ingest --overwrite`` renames the old folder away and deletes it,
but its shards stay mapped by the server, so a running epoch finishes on the bytes it started
with and the disk space comes back when the last job of the old version goes. A version that
is neither current nor held (the server restarted after an overwrite) raises
:class:`~shardserve.proto.errors.DatasetChanged` naming both ids.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterable
from typing import Generic, TypeVar

import xxhash

from shardserve.proto.errors import DatasetChanged
from shardserve.proto.jobs import JobSpec
from shardserve.proto.manifest import Manifest

__all__ = ["VersionShelf", "changed_error", "content_id", "pin_version"]


def content_id(manifest: Manifest) -> str:
    """The version of ``manifest``'s data: deterministic, independent of paths and times."""
    doc = {
        "format": manifest.format_version,
        "num_samples": manifest.num_samples,
        "fields": [f.model_dump(mode="json") for f in manifest.fields],
        "structure": manifest.structure,
        "shards": [[s.rows, s.bytes, s.checksum] for s in manifest.shards],
    }
    canonical = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    return xxhash.xxh3_128_hexdigest(canonical)[:16]


def changed_error(name: str, pinned: str, current: str | None) -> DatasetChanged:
    """The error for a job pinned to ``pinned`` when the store holds ``current`` (or nothing)."""
    now = f"version {current}" if current is not None else "no dataset of that name"
    return DatasetChanged(
        f"dataset {name!r} changed: this job was created for version {pinned}, which is gone "
        f"(replaced by ingest --overwrite); the store now holds {now}. Create a new Loader "
        "(a new job) to train on the current version"
    )


#: What a shelf holds (a store's ``Dataset``).
D = TypeVar("D")


class VersionShelf(Generic[D]):
    """Open datasets of versions that are no longer current, kept while a job pins them.

    Thread-safe. The shelf holds references only; a ``Dataset`` is unmapped when the last
    holder (a stream, or the shelf) lets it go, so releasing never pulls bytes from under a
    stream that is still sending.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[tuple[str, str], D] = {}

    def put(self, name: str, version: str, dataset: D) -> None:
        with self._lock:
            self._held[(name, version)] = dataset

    def get(self, name: str, version: str) -> D | None:
        with self._lock:
            return self._held.get((name, version))

    def keep_only(self, pinned: Iterable[tuple[str, str | None]]) -> list[tuple[str, str]]:
        """Let go of every held version no job pins any more; the ``(name, version)``s dropped."""
        keep = set(pinned)
        with self._lock:
            gone = [k for k in self._held if k not in keep]
            for k in gone:
                del self._held[k]
        return gone

    def held(self) -> list[tuple[str, str]]:
        with self._lock:
            return list(self._held)

    def pop_all(self) -> list[D]:
        with self._lock:
            out = list(self._held.values())
            self._held.clear()
        return out


def pin_version(spec: JobSpec, manifest: Manifest) -> JobSpec:
    """``spec`` pinned to ``manifest``'s version; a spec that names another version is refused."""
    current = content_id(manifest)
    if spec.version is None:
        return spec.model_copy(update={"version": current})
    if spec.version != current:
        raise changed_error(spec.dataset, spec.version, current)
    return spec
