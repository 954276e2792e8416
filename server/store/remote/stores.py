"""Stores on object storage (``s3://``, ``gs://``, ``file://``, ...) through ``pyarrow.fs``.

A remote store has the layout of a local one (``<prefix>/<name>/manifest.json`` and
``<prefix>/<name>/shards/*.arrow``); publishing (:mod:`.remote_publish`) is "the manifest is
written last", since object stores have no atomic folder rename. Reads go through a local
:class:`~.cache.ShardCache`: shards are fetched whole, checksummed and memory-mapped from there
(:class:`~..read.dataset.Dataset` over :class:`~..read.cached_shards.CachedShards`).

Credentials (:mod:`.object_fs`) are never part of what this module shows:
:attr:`RemoteStore.root` is the URI without user info or query, and every error raised from
here passes through :func:`~.object_fs.scrub`, which cuts out every secret value it was told
about.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterable, Iterator, MutableSequence
from functools import partial
from pathlib import Path
from typing import Any

from shardserve.proto.errors import (
    DatasetCorruptError,
    DatasetNotFound,
    InvalidDataError,
)
from shardserve.proto.manifest import Manifest, ShardInfo, parse_manifest, validate_dataset_name

from .. import layout
from ..cache import ShardCache
from ..read.dataset import Dataset
from ..versions import VersionShelf, changed_error, content_id
from .fetch_lanes import FetchLanes
from .object_fs import (
    CacheUnwritable,
    StoreOptions,
    StoreUnavailable,
    display_uri,
    fetch_deadline_s,
    open_filesystem,
    scrub,
    uri_secrets,
)

log = logging.getLogger(__name__)

_COPY_CHUNK = 8 << 20
#: Bytes a manifest may have, for its read's deadline (they are a few kB).
_MANIFEST_BYTES = 1 << 20


@contextlib.contextmanager
def _local_write(dest: Path, info: ShardInfo, shown: str) -> Iterator[Callable[[bytes], None]]:
    """A writer of ``dest`` whose failures (a full disk) are ``CacheUnwritable``, not the
    ``OSError`` a failing read raises: the cache's disk is not the store."""

    def refused(e: OSError) -> CacheUnwritable:
        try:
            free = shutil.disk_usage(dest.parent).free
        except OSError:
            free = -1
        return CacheUnwritable(
            f"the shard cache in {dest.parent} cannot take shard {shown} ({info.bytes} bytes; "
            f"{free} bytes free there): {e.strerror or e}; free space on that disk or lower "
            "--cache-limit-bytes"
        )

    try:
        f = open(dest, "wb")  # noqa: SIM115 - closed below, its errors told apart
    except OSError as e:
        raise refused(e) from None

    def write(chunk: bytes) -> None:
        try:
            f.write(chunk)
        except OSError as e:
            raise refused(e) from None

    try:
        yield write
        try:
            f.flush()
            os.fsync(f.fileno())
        except OSError as e:
            raise refused(e) from None
    finally:
        with contextlib.suppress(OSError):
            f.close()


class RemoteStore:
    """The datasets under one object-store prefix; the same questions as a local ``Store``.

    ``open`` needs a cache (``cache=``); listing, manifests and fetching do not. Writing to
    the store is :class:`~.remote_publish.RemotePublisher`'s.
    """

    def __init__(
        self,
        uri: str,
        options: StoreOptions | None = None,
        cache: ShardCache | None = None,
        verify: str = "lazy",
    ) -> None:
        self.options = options or StoreOptions()
        self._uri = uri  # may hold credentials: never shown, only handed to Ray tasks
        self._secrets = (*self.options.secrets, *uri_secrets(uri))
        #: What to show: never the credentials.
        self.root = display_uri(uri)
        self.cache = cache
        self.verify = verify
        try:
            self.fs, self.base = open_filesystem(uri, self.options)
        except (OSError, ValueError) as e:
            raise InvalidDataError(self.scrub(f"cannot open store {self.root}: {e}")) from None
        self._open: dict[str, Dataset] = {}
        self._lock = threading.Lock()
        self.shelf: VersionShelf[Dataset] = VersionShelf()
        #: Every read runs here, per dataset, under its total deadline.
        self.lanes = FetchLanes()

    def reopen_args(self) -> dict[str, Any]:
        """What a process elsewhere (a Ray task) needs to open this store again; credentials
        other than a URI's own come from that process's environment."""
        o = self.options
        return {"uri": self._uri, "endpoint": o.endpoint, "region": o.region}

    def __repr__(self) -> str:
        return f"RemoteStore({self.root!r})"

    # -- naming and errors ----------------------------------------------------------------
    def scrub(self, text: str) -> str:
        return scrub(text, self._secrets)

    def path(self, *parts: str) -> str:
        return "/".join([self.base, *parts]) if self.base else "/".join(parts)

    def where(self, *parts: str) -> str:
        """The shown URI of ``parts`` under the store (for messages)."""
        return "/".join([self.root.rstrip("/"), *parts])

    def unavailable(self, what: str, e: BaseException, started: float) -> StoreUnavailable:
        """The error of a store operation ``what`` that failed with ``e``, begun at ``started``
        (``time.monotonic()``), credentials cut out."""
        waited = time.monotonic() - started
        return StoreUnavailable(
            self.scrub(
                f"store {self.root} unavailable: {what} failed after {waited:.1f} s "
                f"({self.options.attempts} attempts): {e}"
            )
        )

    # -- reading --------------------------------------------------------------------------
    def _slow(
        self, what: str, started: float, got: MutableSequence[int], want: int
    ) -> StoreUnavailable:
        deadline = fetch_deadline_s(self.options, want)
        return self.unavailable(
            what,
            TimeoutError(
                f"{got[0]} of {want} bytes within its deadline of {deadline:.1f} s (request "
                f"timeout {self.options.request_timeout_s} s, slowest rate accepted "
                f"{self.options.min_bytes_per_s:.0f} bytes/s: --store-min-bytes-per-s)"
            ),
            started,
        )

    def _read_bytes(self, rel: str) -> bytes:
        started = time.monotonic()
        got = [0]

        def read(stop: threading.Event) -> bytes:
            with self.fs.open_input_stream(self.path(rel)) as f:
                data = bytes(f.read())
                got[0] = len(data)
                return data

        try:
            return self.lanes.run(
                rel.split("/", 1)[0],
                read,
                deadline_s=fetch_deadline_s(self.options, _MANIFEST_BYTES),
                timed_out=lambda: self._slow(
                    f"reading {self.where(rel)}", started, got, _MANIFEST_BYTES
                ),
                what=lambda: f"reading {self.where(rel)}",
            )
        except FileNotFoundError:
            raise
        except OSError as e:
            if "Path does not exist" in str(e) or "NoSuchKey" in str(e):
                raise FileNotFoundError(self.where(rel)) from None
            raise self.unavailable(f"reading {self.where(rel)}", e, started) from None

    def list(self) -> list[Manifest]:
        """Manifests of every published dataset, sorted by name."""
        import pyarrow.fs as pafs

        started = time.monotonic()
        try:
            infos = self.fs.get_file_info(pafs.FileSelector(self.base, allow_not_found=True))
        except OSError as e:
            raise self.unavailable(f"listing {self.root}", e, started) from None
        found = []
        for info in sorted(infos, key=lambda i: i.base_name):
            name = info.base_name
            if info.type != pafs.FileType.Directory or name.startswith("."):
                continue
            try:
                validate_dataset_name(name)
                m = self.manifest(name)
            except (DatasetNotFound, InvalidDataError):
                continue
            except DatasetCorruptError as e:
                log.warning("skipping %s: %s", self.where(name), e)
                continue
            found.append(m)
        return found

    def manifest(self, name: str) -> Manifest:
        """The manifest of ``name``; ``DatasetNotFound`` if there is none."""
        validate_dataset_name(name)
        rel = f"{name}/{layout.MANIFEST}"
        try:
            raw = self._read_bytes(rel)
        except FileNotFoundError:
            raise DatasetNotFound(f"no dataset {name!r} in store {self.root}") from None
        try:
            return parse_manifest(raw, where=self.where(rel))
        except InvalidDataError as e:
            raise DatasetCorruptError(str(e)) from None

    def exists(self, name: str) -> bool:
        try:
            self._read_bytes(f"{validate_dataset_name(name)}/{layout.MANIFEST}")
        except FileNotFoundError:
            return False
        return True

    def fetch(self, name: str, info: ShardInfo, dest: Path) -> str:
        """Copy shard ``info`` of ``name`` whole into the new file ``dest``; its checksum.

        Runs on the dataset's fetch lane under a total deadline (:func:`fetch_deadline_s`).
        Raises ``DatasetCorruptError`` (naming the shard) if the bytes are not the manifest's,
        ``StoreUnavailable`` if the store does not answer or is too slow, ``CacheUnwritable``
        if ``dest`` cannot take the bytes (disk full).
        """
        shown = self.where(name, info.path)
        started = time.monotonic()
        got = [0]
        try:
            digest = self.lanes.run(
                name,
                lambda stop: self._copy(name, info, dest, stop, got),
                deadline_s=fetch_deadline_s(self.options, info.bytes),
                timed_out=lambda: self._slow(f"fetching shard {shown}", started, got, info.bytes),
                what=lambda: f"fetching shard {shown} ({got[0]} of {info.bytes} bytes)",
            )
        except FileNotFoundError:
            raise DatasetCorruptError(f"shard {shown} is missing") from None
        except OSError as e:
            if "Path does not exist" in str(e) or "NoSuchKey" in str(e):
                raise DatasetCorruptError(f"shard {shown} is missing") from None
            raise self.unavailable(f"fetching shard {shown}", e, started) from None
        if got[0] != info.bytes:
            raise DatasetCorruptError(
                f"shard {shown} is {got[0]} bytes, the manifest says {info.bytes}"
            )
        if digest != info.checksum:
            raise DatasetCorruptError(
                f"shard {shown} failed its checksum: the object has {digest}, "
                f"the manifest says {info.checksum}"
            )
        return digest

    def _copy(
        self,
        name: str,
        info: ShardInfo,
        dest: Path,
        stop: threading.Event,
        got: MutableSequence[int],
    ) -> str:
        """On the fetch lane: the object's bytes into ``dest`` (its checksum), ``got[0]``
        counting them; ends at the next chunk once ``stop`` is set (its caller gave up)."""
        import xxhash

        h = xxhash.xxh3_64()
        with (
            self.fs.open_input_stream(self.path(name, info.path)) as src,
            _local_write(dest, info, self.where(name, info.path)) as out,
        ):
            while not stop.is_set() and (chunk := src.read(_COPY_CHUNK)):
                h.update(chunk)
                out(chunk)
                got[0] += len(chunk)
        return f"{layout.CHECKSUM_ALGO}:{h.hexdigest()}"

    def version(self, name: str) -> str:
        """The content id of ``name``'s current version (:mod:`.versions`)."""
        return content_id(self.manifest(name))

    def open(self, name: str, verify: str | None = None, version: str | None = None) -> Dataset:
        """The shared ``Dataset`` for ``name`` (shards come through the cache).

        With ``version``: that version, current or still held for a job that pins it (an
        upload never deletes the old shards' prefix, so a held version keeps fetching them);
        otherwise ``DatasetChanged`` names both.
        """
        if self.cache is None:
            raise InvalidDataError(
                f"store {self.root} is remote: serving it needs a local cache (--cache-dir)"
            )
        if version is not None and (opened := self._opened(name, version)) is not None:
            return opened
        # Read outside the lock: a slow store must not hold up opening another dataset.
        away: StoreUnavailable | None = None
        try:
            fresh: Manifest | None = self.manifest(name)
        except StoreUnavailable as e:
            fresh, away = None, e
        except DatasetNotFound:
            if version is not None and (held := self.shelf.get(name, version)) is not None:
                return held
            raise
        with self._lock:
            ds = self._open.get(name)
            if fresh is not None:
                manifest = fresh
            elif ds is not None:
                manifest = ds.manifest  # the store is away: go on with what we know
            else:
                assert away is not None
                raise away
            if ds is None or ds.manifest != manifest:
                if ds is not None and content_id(ds.manifest) != content_id(manifest):
                    self.shelf.put(name, content_id(ds.manifest), ds)
                ds = Dataset.cached(
                    manifest,
                    self.cache,
                    partial(self.fetch, name),
                    self.root,
                    verify=verify or self.verify,
                )
                self._open[name] = ds
            if version is not None and (current := content_id(ds.manifest)) != version:
                held = self.shelf.get(name, version)
                if held is None:
                    raise changed_error(name, version, current)
                return held
            return ds

    def _opened(self, name: str, version: str) -> Dataset | None:
        """Version ``version`` of ``name`` if it is open already (current or held): nothing
        to ask the store, which may be slow or away; a stream of a cached dataset must not
        wait on it."""
        with self._lock:
            ds = self._open.get(name)
            if ds is not None and content_id(ds.manifest) == version:
                return ds
        return self.shelf.get(name, version)

    def release_unpinned(self, pinned: Iterable[tuple[str, str | None]]) -> None:
        """Let go of old versions no job pins any more."""
        for name, version in self.shelf.keep_only(pinned):
            log.info("released dataset %s version %s: no job pins it any more", name, version)

    def mapped_versions(self) -> int:
        """Dataset versions held: the current ones opened, and older ones jobs pin."""
        return len(self._open) + len(self.shelf.held())

    def opened_bytes(self) -> int:
        """Bytes of the datasets opened so far (listing a bucket per scrape is too dear)."""
        return sum(ds.manifest.total_bytes for ds in list(self._open.values()))

    def check_shards(self, manifest: Manifest) -> None:
        """Nothing: asking the bucket for every shard would cost a request each, at every job
        made; a missing shard is named when its fetch fails (see :meth:`verify_dataset`)."""

    def verify_dataset(self, name: str, progress: bool = False) -> Manifest:
        """Fetch every shard of ``name`` into a temporary folder and check it whole (checksum,
        schema, rows); ``DatasetCorruptError`` names the first bad one."""
        import sys
        import tempfile

        from tqdm import tqdm

        from ..read.shards import verify_shard

        manifest = self.manifest(name)
        with (
            tempfile.TemporaryDirectory(prefix="shardserve-verify-") as tmp,
            tqdm(
                total=manifest.total_bytes,
                unit="B",
                unit_scale=True,
                desc=f"verify {name}",
                disable=not progress,
                file=sys.stderr,
            ) as bar,
        ):
            for info in manifest.shards:
                dest = Path(tmp) / "shard.arrow"
                self.fetch(name, info, dest)
                verify_shard(dest, info, manifest.fields)
                dest.unlink()
                bar.update(info.bytes)
        return manifest

    def unready(self) -> str | None:
        return None  # away for a while is not down: the streams that need it fail, by name

    def served_bytes(self) -> float:
        return float(self.opened_bytes())  # a scrape must not list a bucket

    def reads_in_flight(self) -> tuple[str, ...]:
        return self.lanes.in_flight()

    def wait_reads(self, timeout_s: float) -> tuple[str, ...]:
        return self.lanes.wait_idle(timeout_s)

    def close(self) -> None:
        # First: every read is told to stop, and nothing (an assembly thread, a prefetch)
        # waits on one any more.
        self.lanes.close()
        with self._lock:
            for ds in [*self._open.values(), *self.shelf.pop_all()]:
                ds.close()
            self._open.clear()
        if self.cache is not None:
            self.cache.close()  # no prefetch outlives the store
