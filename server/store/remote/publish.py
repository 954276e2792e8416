"""Publishing datasets to object storage: what ``shardserve ingest --store s3://...`` writes.

Reading a remote store is :class:`~.remote.RemoteStore`'s; this writes to one through the same
file system, names and error scrubbing. Publishing is "the manifest is written last": each
upload puts its shards under a fresh ``shards-<random>/`` prefix and replaces the one manifest
object last (an object PUT is atomic), so a reader sees the old dataset or the new one, never a
mix, and a failed upload leaves only unreferenced objects.

::

    store = RemoteStore("s3://bucket/datasets")
    manifest = RemotePublisher(store).upload(Path("out/cifar"), "cifar", overwrite=False)
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import time
from pathlib import Path

import pyarrow as pa

from shardserve.proto.errors import InvalidDataError
from shardserve.proto.manifest import Manifest, validate_dataset_name

from .. import layout
from .stores import RemoteStore

log = logging.getLogger(__name__)

#: Bytes read from a local file per write to the store.
_COPY_CHUNK = 8 << 20
# A file:// store is a real file system: folders must exist before a file is written in them,
# and a written file is not atomic as an object PUT is, so it is written beside its place and
# renamed there (what readers of the manifest rely on).
_PARTIAL = ".partial"


def new_shard_prefix() -> str:
    """A fresh folder name for one upload's shards (``shards-<random>``)."""
    return f"{layout.SHARDS_DIR}-{secrets.token_hex(4)}"


class RemotePublisher:
    """Writes datasets into the store of ``store``: shards first, the manifest last."""

    def __init__(self, store: RemoteStore) -> None:
        self.store = store

    def upload(self, folder: Path, name: str, *, overwrite: bool) -> Manifest:
        """Publish the local dataset ``folder`` as ``name``: shards first, the manifest last."""
        self.check_absent(name, overwrite)
        local = layout.read_manifest(folder)
        prefix = new_shard_prefix()
        shards = []
        for info in local.shards:
            rel = f"{prefix}/{Path(info.path).name}"
            self.put_file(folder / info.path, f"{name}/{rel}")
            shards.append(info.model_copy(update={"path": rel}))
        manifest = local.model_copy(update={"shards": tuple(shards)})
        self.publish_manifest(manifest, overwrite=overwrite)
        return manifest

    def check_absent(self, name: str, overwrite: bool) -> None:
        """Refuse to write ``name`` over an existing dataset unless ``overwrite``."""
        validate_dataset_name(name)
        if not overwrite and self.store.exists(name):
            raise InvalidDataError(
                f"dataset {name!r} already exists in {self.store.root}; "
                "pass --overwrite to replace it"
            )

    def publish_manifest(self, manifest: Manifest, *, overwrite: bool) -> None:
        """Write ``manifest.json`` of ``manifest.name``, the step that publishes it."""
        self.check_absent(manifest.name, overwrite)
        body = manifest.model_dump_json(indent=2).encode()
        self._put_bytes(body, f"{manifest.name}/{layout.MANIFEST}")
        log.info("published dataset %s at %s", manifest.name, self.store.where(manifest.name))

    def put_file(self, src: Path, rel: str) -> None:
        """Upload the local file ``src`` to ``rel`` under the store."""
        started = time.monotonic()
        try:
            with open(src, "rb") as f, self._output(rel) as out:
                while chunk := f.read(_COPY_CHUNK):
                    out.write(chunk)
            self._settle(rel)
        except OSError as e:
            raise self.store.unavailable(f"uploading {self.store.where(rel)}", e, started) from None

    def delete_prefix(self, rel: str) -> None:
        """Remove everything under ``rel`` (best effort: leftovers are unreferenced anyway)."""
        with contextlib.suppress(OSError):
            self.store.fs.delete_dir(self.store.path(rel))

    def _put_bytes(self, data: bytes, rel: str) -> None:
        started = time.monotonic()
        try:
            with self._output(rel) as out:
                out.write(data)
            self._settle(rel)
        except OSError as e:
            raise self.store.unavailable(f"uploading {self.store.where(rel)}", e, started) from None

    def _output(self, rel: str) -> pa.NativeFile:
        fs, target = self.store.fs, self.store.path(rel)
        if fs.type_name != "local":
            return fs.open_output_stream(target)
        fs.create_dir(target.rsplit("/", 1)[0], recursive=True)
        return fs.open_output_stream(target + _PARTIAL)

    def _settle(self, rel: str) -> None:
        if self.store.fs.type_name == "local":
            self.store.fs.move(self.store.path(rel) + _PARTIAL, self.store.path(rel))
