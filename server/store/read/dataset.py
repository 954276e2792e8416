"""``Dataset``: a published dataset read with vectorised ``take``, local or remote alike.

Its shards come from a :class:`~.shard_set.ShardSet`: mapped once from a local store
(:meth:`Dataset.mapped`), or leased from the cache of a remote one (:meth:`Dataset.cached`).
Either way a batch is read by the one field loop here, so both stores return the same parts
for the same samples (masks of nullable fields, offsets and shapes of variable ones).

Thread-safe: the views are read-only and the shard sets guard their own state. One
``Dataset`` is meant to be shared by every job and thread of a process (the store caches it),
so the page cache holds one copy.

``verify`` modes: ``"lazy"`` checks, before a ``take`` reads them, the blocks of a shard that
the read needs (and, before a shard's first read, its framing and the blocks outside row
data: :mod:`.blocks`; a shard written without block checksums, its whole file); ``"full"``
checks every shard's whole-file checksum at open; ``"off"`` never (sizes, schemas and row
counts are always checked at open).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TypeVar, cast

import numpy as np

from shardserve.proto.manifest import FieldSpec, Manifest
from shardserve.proto.parts import MASK, OFFSETS, SHAPES, PartShape, parts_of

from ...source import FRESH, Planned, RowPick, Tail
from ..cache import ShardCache
from .cached_shards import CachedShards, Fetch
from .gather import (
    ALL,
    JoinedColumns,
    Positions,
    groups,
    ragged_unit,
    take_fixed,
    take_ragged,
    take_ragged_across,
)
from .index import as_indices, check_bounds, chunk_of, locate
from .shard_set import VERIFY_MODES, Chunks, MappedShards, ShardSet, shard_starts
from .stitch import StitchedColumns
from .subrows import take_subrows

__all__ = ["VERIFY_MODES", "Dataset"]

T = TypeVar("T")


class Dataset:
    """A dataset's samples as batch parts; see the module docstring.

    >>> ds = Dataset.mapped(folder, manifest)                  # doctest: +SKIP
    >>> ds.take([3, 1, 2], ["label"])["label"].tolist()        # doctest: +SKIP
    [7, 2, 1]
    """

    def __init__(self, manifest: Manifest, shards: ShardSet) -> None:
        self.manifest = manifest
        self.fields: tuple[FieldSpec, ...] = manifest.fields
        self._specs = {f.name: f for f in self.fields}
        self.num_samples = manifest.num_samples
        self.shard_rows = np.array([s.rows for s in manifest.shards], dtype=np.int64)
        self._starts = shard_starts(manifest)
        self.shards = shards
        self._closed = False
        #: Facts computed once from this version (:meth:`derived`); a version never changes.
        self._derived: dict[str, object] = {}
        self._derived_lock = threading.Lock()

    @property
    def sample_bytes(self) -> float:
        """Stored bytes of the average sample."""
        return self.manifest.total_bytes / max(self.num_samples, 1)

    @classmethod
    def mapped(
        cls, folder: Path, manifest: Manifest, verify: str = "lazy", read_ahead_bytes: int = -1
    ) -> Dataset:
        """A local store's dataset: every shard in ``folder`` mapped now (``read_ahead_bytes``
        of a shard read at its first read; -1: the default)."""
        return cls(manifest, MappedShards(folder, manifest, verify, read_ahead_bytes))

    @classmethod
    def cached(
        cls, manifest: Manifest, cache: ShardCache, fetch: Fetch, where: str, verify: str = "lazy"
    ) -> Dataset:
        """A remote store's dataset: shards fetched into ``cache`` as batches need them."""
        return cls(manifest, CachedShards(manifest, cache, fetch, where, verify))

    # -- what streaming asks of a source ------------------------------------------------------
    groupable = True
    lane: str | None = None

    @property
    def inline_ok(self) -> bool:
        return not self.shards.waits

    def plan_hint(self, plan: Planned) -> None:
        self.shards.plan_hint(plan)

    def replaceable_by(self, index: int) -> tuple[int, int]:
        return 0, self.num_samples

    # -- description -------------------------------------------------------------------------
    def field_names(self, fields: Sequence[str] | None = None) -> list[str]:
        """``fields`` checked (``None``: every field), or ``KeyError`` naming the unknown one."""
        if fields is None:
            return [f.name for f in self.fields]
        names = [fields] if isinstance(fields, str) else list(fields)
        for n in names:
            if n not in self._specs:
                raise KeyError(
                    f"no field {n!r} in dataset {self.manifest.name!r}; fields are {list(self._specs)}"
                )
        return names

    def part_shapes(self, fields: Sequence[str] | None = None) -> dict[str, PartShape]:
        """Batch part name -> ``(dtype, per-sample shape)`` for fixed-size parts, ``None`` for
        variable-size ones (the layout: :mod:`shardserve.proto.parts`)."""
        return {p: shape for n in self.field_names(fields) for p, shape in parts_of(self._specs[n])}

    # -- reading -----------------------------------------------------------------------------
    def take(
        self,
        indices: np.ndarray | Sequence[int],
        fields: Sequence[str] | None = None,
        out: Mapping[str, np.ndarray] | None = None,
        batch: int = -1,
        tail: Tail = FRESH,
    ) -> dict[str, np.ndarray]:
        """Gather samples ``indices`` (global ids, any order, repeats allowed) into batch parts.

        Fixed field ``x`` -> ``x`` ``[B, *shape]``, written into ``out["x"]`` when given.
        Variable field ``x`` -> ``x`` (values, 1-d, made in ``tail``), ``x.offsets`` (int64
        ``[B+1]``), ``x.shapes`` (int64 ``[B, ndim]``). Binary ``x`` -> ``x`` (uint8) and
        ``x.offsets``. Nullable ``x`` adds ``x.mask``. ``batch`` is not needed to read stored
        samples.
        """
        if self._closed:
            raise ValueError(f"dataset {self.manifest.name!r} is closed")
        idx = as_indices(indices)
        names = self.field_names(fields)
        lo, hi = check_bounds(idx, self.num_samples)
        touched = self._touched(idx, lo, hi)
        chunks = self.shards.acquire(touched)
        try:
            self.shards.check_reads(idx, names)
            return self._read(names, idx, lo, hi, chunks, out, tail)
        finally:
            self.shards.release(touched)

    def take_rows(
        self, indices: np.ndarray, field: str, pick: RowPick, out: np.ndarray
    ) -> np.ndarray:
        """Rows ``pick(lengths)`` of variable field ``field`` (``[-1, fixed...]``, not
        nullable) of samples ``indices`` into ``out`` (``[B, k, fixed...]``), the other rows
        never read (:mod:`.subrows`). Returns ``out``."""
        if self._closed:
            raise ValueError(f"dataset {self.manifest.name!r} is closed")
        spec = self._specs[self.field_names([field])[0]]
        if spec.kind != "variable" or spec.nullable or spec.dtype == "bool" or -1 in spec.shape[1:]:
            raise ValueError(
                f"field {field!r} of dataset {self.manifest.name!r} is a {spec.kind} "
                f"{spec.dtype}{list(spec.shape)} (nullable={spec.nullable}); rows are read "
                "from a variable field [-1, fixed...] of numbers present in every sample"
            )
        idx = as_indices(indices)
        lo, hi = check_bounds(idx, self.num_samples)
        touched = self._touched(idx, lo, hi)
        chunks = self.shards.acquire(touched)
        try:
            self.shards.check_reads(idx, [field])
            g, rows = self._groups(idx, lo, hi, chunks)
            unit = ragged_unit(spec.shape, False)
            return take_subrows(chunks.arrays[field], g, rows, unit, pick, out)
        finally:
            self.shards.release(touched)

    def _touched(self, idx: np.ndarray, lo: int, hi: int) -> list[int]:
        """The shards samples ``idx`` (within ``lo..hi``) lie in, in order."""
        if not idx.size:
            return []
        # Ids map to shards monotonically: a batch inside one shard (the common case) is found
        # from its min and max alone.
        first, last = chunk_of(lo, self._starts), chunk_of(hi, self._starts)
        if first == last:
            return [first]
        # The shards touched, in order: a count per shard, not a sort of the batch.
        shard = np.searchsorted(self._starts, idx, "right") - 1
        return np.flatnonzero(np.bincount(shard)).tolist()

    @staticmethod
    def _groups(
        idx: np.ndarray, lo: int, hi: int, chunks: Chunks
    ) -> tuple[list[tuple[int, Positions]], np.ndarray]:
        """``(chunk groups, row in its chunk)`` of samples ``idx`` (see :func:`.groups`)."""
        first = chunk_of(lo, chunks.starts) if idx.size else 0
        if idx.size and first == chunk_of(hi, chunks.starts):  # one chunk: no per-id search
            base = int(chunks.starts[first])
            return [(first, ALL)], idx - base if base else idx
        chunk, rows = locate(idx, chunks.starts) if idx.size else (idx, idx)
        return groups(chunk), rows

    def _read(
        self,
        names: Sequence[str],
        idx: np.ndarray,
        lo: int,
        hi: int,
        chunks: Chunks,
        out: Mapping[str, np.ndarray] | None,
        tail: Tail,
    ) -> dict[str, np.ndarray]:
        """The one field loop: fields ``names`` of samples ``idx`` (within ``lo..hi``)."""
        b = idx.size
        at = _Located.find(idx, lo, hi, chunks, tail)
        parts: dict[str, np.ndarray] = {}
        for n in names:
            spec = self._specs[n]
            if spec.nullable:
                mask = out.get(n + MASK) if out is not None else None
                if mask is None or mask.shape != (b,):
                    mask = np.empty(b, dtype=bool)
                parts[n + MASK] = at.small(chunks.valid, "valid", n, mask)
            if spec.kind in ("scalar", "tensor"):
                parts[n] = at.small(chunks.fixed, "fixed", n, self._out_array(spec, b, out, tail))
                continue
            if b:
                parts[n], parts[n + OFFSETS] = at.ragged(n, spec)
            else:
                parts[n] = np.empty(0, dtype=np.uint8 if spec.kind == "binary" else spec.dtype)
                parts[n + OFFSETS] = np.zeros(1, dtype=np.int64)
            if spec.kind == "variable":
                shapes = np.empty((b, len(spec.shape)), dtype=np.int64)
                parts[n + SHAPES] = at.small(chunks.shapes, "shapes", n, shapes)
        return parts

    @staticmethod
    def _out_array(
        spec: FieldSpec, b: int, out: Mapping[str, np.ndarray] | None, tail: Tail
    ) -> np.ndarray:
        want = (b, *spec.shape)
        dest = out.get(spec.name) if out is not None else None
        if dest is None:  # a part whose size the layout does not fix (a graph batch's)
            return tail.empty(spec.name, want, np.dtype(spec.dtype))
        if dest.shape != want or dest.dtype != np.dtype(spec.dtype) or not dest.flags.c_contiguous:
            raise ValueError(
                f"out[{spec.name!r}] is {dest.dtype}{list(dest.shape)} (contiguous="
                f"{dest.flags.c_contiguous}); expected a C-contiguous {spec.dtype}{list(want)}"
            )
        return dest

    def stored_shapes(
        self, names: Sequence[str], limit: int, visit: Callable[[Mapping[str, np.ndarray]], bool]
    ) -> int:
        """Read the stored shapes of variable fields ``names`` (``[rows, ndim]`` int64, read
        only) of the first ``limit`` samples, chunk by chunk: ``visit`` gets each chunk's and
        says whether to go on. Returns how many samples were read.

        No value is read: the shape columns lie outside row data (verified when a shard is
        opened). One shard is held at a time (a remote store's is fetched once, into its cache).
        """
        done = 0
        for s in range(len(self.shard_rows)):
            lo, hi = int(self._starts[s]), int(self._starts[s + 1])
            if done >= limit:
                break
            if hi == lo:
                continue
            chunks = self.shards.acquire([s])
            try:
                heads = chunks.starts[:-1]
                # The chunks of shard s only (a local store's Chunks are the whole dataset's).
                first, stop = np.searchsorted(heads, [lo, hi], "left").tolist()
                for c in range(first, stop):
                    rows = min(int(chunks.starts[c + 1] - chunks.starts[c]), limit - done)
                    go = visit({n: chunks.shapes[n][c][:rows] for n in names})
                    done += rows
                    if not go or done >= limit:
                        return done
            finally:
                self.shards.release([s])
        return done

    def derived(self, key: str, compute: Callable[[], T]) -> T:
        """``compute()`` kept under ``key`` for the life of this dataset version: a fact
        read from its immutable shards once, however many jobs and streams ask."""
        with self._derived_lock:
            if key in self._derived:
                return cast(T, self._derived[key])
        value = compute()  # outside the lock: a slow scan holds up no other key
        with self._derived_lock:
            return cast(T, self._derived.setdefault(key, value))

    # -- integrity and life ----------------------------------------------------------------
    def verify(self, progress: bool = False) -> None:
        """Check every shard's checksum; raise ``DatasetCorruptError`` on the first bad one."""
        self.shards.verify(progress)

    def close(self) -> None:
        """Unmap every shard; later ``take`` calls raise ``ValueError``."""
        self._closed = True
        self.shards.close()

    def __enter__(self) -> Dataset:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(frozen=True)
class _Located:
    """Samples ``idx`` of one read located in ``chunks``: ``groups`` of positions per chunk,
    each sample's row in its chunk, and, for a batch that spans chunks, each sample's chunk
    and the columns joined or stitched across them (a read within one chunk uses neither)."""

    idx: np.ndarray
    chunks: Chunks
    tail: Tail
    groups: list[tuple[int, Positions]]
    rows: np.ndarray
    #: Each sample's chunk; ``None`` when the batch is within one chunk.
    chunk: np.ndarray | None
    joined: JoinedColumns | None
    stitched: StitchedColumns | None

    @classmethod
    def find(cls, idx: np.ndarray, lo: int, hi: int, chunks: Chunks, tail: Tail) -> _Located:
        """Locate ``idx`` (within ``lo..hi``) in ``chunks``."""
        b = idx.size
        first = chunk_of(lo, chunks.starts) if b else 0
        if b and first == chunk_of(hi, chunks.starts):  # one chunk: no per-id search
            base = int(chunks.starts[first])
            rows = idx - base if base else idx
            return cls(idx, chunks, tail, [(first, ALL)], rows, None, None, None)
        chunk, rows = locate(idx, chunks.starts) if b else (idx, idx)
        g = groups(chunk)
        spans = len(g) > 1
        return cls(
            idx,
            chunks,
            tail,
            g,
            rows,
            chunk,
            chunks.joined if spans else None,
            chunks.stitched if spans else None,
        )

    def small(
        self, kind: Mapping[str, list[np.ndarray]], key: str, n: str, dest: np.ndarray
    ) -> np.ndarray:
        """Field ``n``'s rows (or masks or shapes: ``kind``, named ``key``) into ``dest``."""
        if not self.idx.size:
            return dest
        joined, stitched = self.joined, self.stitched
        one = joined.get((key, n), kind[n]) if joined is not None else None
        if one is not None:
            return np.take(one, self.idx, axis=0, out=dest, mode="clip")  # ids are checked
        if stitched is not None and self.chunk is not None and key == "fixed":
            view = kind[n][0]
            across = stitched.get(n, view.dtype, view.shape[1:])
            if across is not None:
                return across.take(self.chunk, self.rows, dest)
        return take_fixed(kind[n], self.groups, self.rows, dest)

    def ragged(self, n: str, spec: FieldSpec) -> tuple[np.ndarray, np.ndarray]:
        """Variable field ``n``'s values and offsets."""
        empty = partial(self.tail.empty, n)
        arrays, stitched = self.chunks.arrays[n], self.stitched
        # Bools are bit-packed: never stitched.
        if stitched is not None and self.chunk is not None and spec.dtype != "bool":
            binary = spec.kind == "binary"
            unit = ragged_unit(spec.shape, binary)
            dtype = np.dtype(np.uint8 if binary else spec.dtype)
            across = stitched.get(n, dtype, ())
            got = (
                take_ragged_across(across, arrays, self.chunk, self.rows, unit, dtype, empty)
                if across is not None
                else None
            )
            if got is not None:
                return got
        return take_ragged(arrays, self.groups, self.rows, spec.dtype, spec.shape, empty)
