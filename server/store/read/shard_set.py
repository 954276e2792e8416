"""Where a :class:`~.dataset.Dataset`'s shards come from: mapped here, or leased from a cache.

The dataset reads batches with one field loop over :class:`Chunks` (the record batches of some
shards, as numpy and Arrow views). A :class:`ShardSet` hands it the chunks that hold a batch's
shards and takes them back after the read:

* :class:`MappedShards` (a local store): every shard mapped at open; its chunks are one set
  for the whole dataset, so small columns can be joined across chunks once
  (:class:`~.gather.JoinedColumns`, behind the reads: :mod:`.joined_behind`) and fixed fields and variable fields' values mapped as
  one array across them (:mod:`.stitch`); a shard is checksummed before its first read
  (``lazy``), at open (``full``) or never (``off``).
* :class:`~.cached_shards.CachedShards` (a remote store): a shard is fetched whole into the local
  :class:`~.cache.ShardCache`, checksummed and mapped when a batch first needs it, leased while
  read, and unmapped least recently used past the cache limit; the shards a stream's plan reads
  next are fetched ahead.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import numpy as np

from shardserve.proto.errors import DatasetCorruptError
from shardserve.proto.manifest import FieldSpec, Manifest

from ...source import Planned
from ..verify import VERIFY_MODES
from .blocks import DatasetBlocks, RowSpan
from .gather import JoinedColumns, RaggedChunks
from .index import chunk_starts
from .joined_behind import JoinedBehind
from .read_ahead import ReadAhead
from .shards import MappedShard, read_ends_ahead
from .stitch import Piece, StitchedColumns

if TYPE_CHECKING:
    from tqdm import tqdm


@dataclass(frozen=True)
class Chunks:
    """The record batches of some shards, column by column, as the field loop reads them."""

    #: First global sample id of each chunk, then the end of the last one.
    starts: np.ndarray
    fixed: Mapping[str, list[np.ndarray]]
    valid: Mapping[str, list[np.ndarray]]
    shapes: Mapping[str, list[np.ndarray]]
    arrays: Mapping[str, RaggedChunks]
    #: Small columns joined across chunks; ``None`` where the chunks change between batches.
    joined: JoinedColumns | None
    #: Fields mapped as one array across chunks (fixed fields' rows, variable fields'
    #: values); ``None`` where the chunks change, as above.
    stitched: StitchedColumns | None

    @classmethod
    def of(
        cls,
        shards: Sequence[MappedShard],
        first_ids: Sequence[int],
        fields: Sequence[FieldSpec],
        joined: JoinedColumns | None,
        stitched: StitchedColumns | None,
    ) -> Chunks:
        """The chunks of ``shards``, whose first samples have the ids ``first_ids``."""
        chunks = [c for s in shards for c in s.chunks]
        starts: list[int] = []
        for shard, base in zip(shards, first_ids, strict=True):
            for c in shard.chunks:
                starts.append(base)
                base += c.rows
        end = starts[-1] + chunks[-1].rows if chunks else 0
        kinds: dict[str, list[str]] = {"fixed": [], "ragged": [], "variable": [], "nullable": []}
        for f in fields:
            if f.kind in ("scalar", "tensor"):
                kinds["fixed"].append(f.name)
            else:
                kinds["ragged"].append(f.name)
            if f.kind == "variable":
                kinds["variable"].append(f.name)
            if f.nullable:
                kinds["nullable"].append(f.name)
        dtypes = {f.name: f.dtype for f in fields}
        return cls(
            starts=np.asarray([*starts, end], dtype=np.int64),
            fixed={n: [c.fixed[n] for c in chunks] for n in kinds["fixed"]},
            valid={n: [c.valid[n] for c in chunks] for n in kinds["nullable"]},
            shapes={n: [c.shapes[n] for c in chunks] for n in kinds["variable"]},
            arrays={
                n: RaggedChunks([c.arrays[n] for c in chunks], dtypes[n]) for n in kinds["ragged"]
            },
            joined=joined,
            stitched=stitched,
        )


class ShardSet(Protocol):
    """A dataset's shards as :class:`~.dataset.Dataset` reads them (thread-safe)."""

    @property
    def waits(self) -> bool:
        """Whether :meth:`acquire` may wait (on a fetch): then never on the streamer thread."""
        ...

    def acquire(self, shards: Iterable[int]) -> Chunks:
        """Chunks holding at least ``shards``, each checked; ``DatasetCorruptError`` names a
        bad one. Every call is paired with :meth:`release` of the same shards."""
        ...

    def release(self, shards: Sequence[int]) -> None: ...

    def check_reads(self, ids: np.ndarray, fields: Sequence[str]) -> None:
        """Before fields ``fields`` of samples ``ids`` (in acquired shards) are read: verify
        the stored bytes they lie in, where the set verifies by block and not whole shards."""
        ...

    def plan_hint(self, plan: Planned) -> None:
        """The plan a stream reads (a set that fetches reads ahead)."""
        ...

    def verify(self, progress: bool = False) -> None:
        """Check every shard's checksum; ``DatasetCorruptError`` on the first bad one."""
        ...

    def close(self) -> None: ...


def shard_starts(manifest: Manifest) -> np.ndarray:
    """First sample id of each shard, then the total."""
    return chunk_starts([s.rows for s in manifest.shards])


class MappedShards:
    """A local dataset's shards, every one mapped at open; see the module docstring."""

    waits = False

    def __init__(
        self, folder: Path, manifest: Manifest, verify: str = "lazy", read_ahead_bytes: int = -1
    ) -> None:
        if verify not in VERIFY_MODES:
            raise ValueError(f"verify must be one of {VERIFY_MODES}, got {verify!r}")
        self.manifest = manifest
        self._lock = threading.Lock()
        self._shards: list[MappedShard] = []
        self._rows = DatasetBlocks([], np.zeros(1, dtype=np.int64), {})  # until all are mapped
        self._ahead = ReadAhead([])
        # Small columns joined behind the reads: a new server's first batch waits for no copy.
        self._joined = JoinedBehind()
        read_ends_ahead(Path(folder) / info.path for info in manifest.shards)
        try:
            for info in manifest.shards:
                self._shards.append(MappedShard(Path(folder) / info.path, info, manifest.fields))
            seen: dict[tuple[int, int], str] = {}
            for sh in self._shards:
                other = seen.setdefault(sh.identity[:2], sh.info.path)
                if other != sh.info.path:  # hard or symbolic links to one file
                    raise DatasetCorruptError(
                        f"dataset {manifest.name!r}: shards {other} and {sh.info.path} are the "
                        "same file; every sample of it would be served twice; re-ingest"
                    )
        except BaseException:
            self.close()
            raise
        self._ahead = ReadAhead(
            [(sh.fileno(), sh.info.bytes) for sh in self._shards], read_ahead_bytes
        )
        self._chunks = Chunks.of(
            self._shards,
            shard_starts(manifest)[:-1].tolist(),
            manifest.fields,
            self._joined,
            StitchedColumns(self._pieces),
        )
        #: Shards whose framing and blocks outside row data are verified (:mod:`.blocks`).
        self._verified = [verify != "lazy"] * len(self._shards)
        self._failed: dict[int, DatasetCorruptError] = {}
        self._rows = DatasetBlocks(self._shards, self._chunks.starts, self._failed)
        if verify != "lazy":
            self._rows.verified[:] = True
        self._all_verified = all(self._verified) and bool(self._rows.verified.all())
        if verify == "full":
            self.verify()

    def acquire(self, shards: Iterable[int]) -> Chunks:
        """Every chunk of the dataset, once ``shards`` are checked: still whole on disk
        (always) and checksummed (lazily, before their first read)."""
        self._ahead.touch(shards)
        for s in shards:
            if s in self._failed:
                raise self._failed[s]
            try:
                self._shards[s].check_size()
            except DatasetCorruptError as e:
                self._failed[s] = e
                raise
        if not self._all_verified:
            first_reads = [s for s in shards if not self._verified[s]]
            for s in first_reads:
                self._rows.blocks[s].read_ahead_of_open(self._spans(s))
            for s in first_reads:
                self._open_one(s)
        return self._chunks

    def check_reads(self, ids: np.ndarray, fields: Sequence[str]) -> None:
        """Verify the blocks that fields ``fields`` of samples ``ids`` lie in, if not yet
        (their shards are acquired, so the rest of each shard is verified already)."""
        if self._all_verified or not ids.size:
            return
        self._rows.check(ids, fields)
        if self._rows.done and all(self._verified):
            self._all_verified = True

    def release(self, shards: Sequence[int]) -> None:
        """Nothing to give back: the shards stay mapped while the dataset is open."""

    def plan_hint(self, plan: Planned) -> None:
        """Nothing to fetch: every shard is here (and the plan's ids are never made)."""

    def _open_one(self, s: int) -> None:
        """Verify what every read of shard ``s`` relies on (:meth:`.ShardBlocks.open`), once;
        a failure is the shard's verdict."""
        with self._lock:  # one thread opens a shard; the others wait for its verdict
            if s in self._failed:
                raise self._failed[s]
            if self._verified[s]:
                return
            try:
                self._rows.blocks[s].open(self._spans(s))
            except DatasetCorruptError as e:
                self._failed[s] = e
                raise
            self._verified[s] = True

    def _pieces(self, name: str) -> list[Piece] | None:
        """Where every chunk's rows of field ``name`` lie in the open shard files: a fixed
        field's rows, a variable field's values item by item. ``None`` if a chunk's were
        copied at open (a column with missing values, bools)."""
        spec = next(f for f in self.manifest.fields if f.name == name)
        fixed = spec.kind in ("scalar", "tensor")
        out: list[Piece] = []
        try:
            for sh in self._shards:
                fd = sh.fileno()
                for chunk, spans in zip(sh.chunks, sh.spans, strict=True):
                    span = spans.get(name)
                    if not chunk.rows:
                        out.append(Piece(fd, 0, 0))
                    elif span is None or (span.offsets is None) != fixed:
                        return None
                    elif fixed:
                        out.append(Piece(fd, span.start, chunk.rows))
                    else:
                        out.append(Piece(fd, span.start, span.nbytes // span.itemsize))
        except ValueError:  # closed meanwhile: nothing to stitch
            return None
        return out

    def _spans(self, s: int) -> list[list[RowSpan]]:
        """Each chunk's row spans of shard ``s``."""
        return [list(c.values()) for c in self._shards[s].spans]

    def _verify_one(self, s: int, progress: tqdm | None = None) -> None:
        """Check shard ``s``'s whole-file checksum, whatever reads verified of it already
        (an open verifies only part of a shard); every block of it is verified then."""
        with self._lock:
            if s in self._failed:
                raise self._failed[s]
            try:
                self._shards[s].verify(progress)
            except DatasetCorruptError as e:
                self._failed[s] = e
                raise
            self._verified[s] = True
            self._rows.blocks[s].verified[:] = True
            self._all_verified = all(self._verified) and bool(self._rows.verified.all())

    def verify(self, progress: bool = False) -> None:
        from tqdm import tqdm  # the progress bar's library only where a dataset is verified

        total = sum(s.info.bytes for s in self._shards)
        with tqdm(
            total=total,
            unit="B",
            unit_scale=True,
            desc=f"verify {self.manifest.name}",
            disable=not progress,
            file=sys.stderr,
        ) as bar:
            for s in range(len(self._shards)):
                self._verify_one(s, bar)

    def close(self) -> None:
        # The joined copies are this dataset's own memory; dropping the chunks drops them.
        # A stitched array unmaps itself when the last read over it is done.
        self._ahead.close()
        self._joined.close()  # a copy under way reads the mappings closed below
        self._chunks = Chunks.of([], [], (), None, None)
        self._rows.close()  # its views of the mappings too, or they would stay mapped
        for s in self._shards:
            s.close()
        self._shards = []
