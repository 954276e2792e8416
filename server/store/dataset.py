"""``Dataset``: a published dataset, memory-mapped once, read with vectorised ``take``.

Thread-safe: the views are read-only, and the only mutable state (which shards passed their
lazy checksum) is guarded by a lock. One ``Dataset`` is meant to be shared by every job and
thread of a process (``Store.open`` caches it), so the page cache holds one copy.

``verify`` modes: ``"lazy"`` checks a shard's whole-file checksum before the first ``take``
that reads it; ``"full"`` checks every shard at open; ``"off"`` never (sizes, schemas and row
counts are always checked at open).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from shardserve.proto.errors import DatasetCorruptError
from shardserve.proto.manifest import FieldSpec, Manifest

from .gather import (
    ALL,
    JoinedColumns,
    Positions,
    RaggedChunks,
    groups,
    take_fixed,
    take_ragged,
)
from .index import as_indices, check_bounds, chunk_of, chunk_starts, locate, shard_of_chunk
from .shards import MappedShard

VERIFY_MODES = ("lazy", "full", "off")
#: Suffix of a nullable field's validity part in a batch.
MASK = ".mask"


class Dataset:
    """A memory-mapped dataset; see the module docstring."""

    def __init__(self, folder: Path, manifest: Manifest, verify: str = "lazy") -> None:
        if verify not in VERIFY_MODES:
            raise ValueError(f"verify must be one of {VERIFY_MODES}, got {verify!r}")
        self.folder = Path(folder)
        self.manifest = manifest
        self.fields: tuple[FieldSpec, ...] = manifest.fields
        self._specs = {f.name: f for f in self.fields}
        self.num_samples = manifest.num_samples
        self.shard_rows = np.array([s.rows for s in manifest.shards], dtype=np.int64)
        self._lock = threading.Lock()
        self._closed = False
        self._shards: list[MappedShard] = []
        try:
            for info in manifest.shards:
                self._shards.append(MappedShard(self.folder / info.path, info, self.fields))
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
        chunks = [c for s in self._shards for c in s.chunks]
        self._starts = chunk_starts([c.rows for c in chunks])
        self._chunk_shard = shard_of_chunk([len(s.chunks) for s in self._shards])
        fixed = [f.name for f in self.fields if f.kind in ("scalar", "tensor")]
        ragged = [f.name for f in self.fields if f.kind in ("variable", "binary")]
        variable = [f.name for f in self.fields if f.kind == "variable"]
        self._fixed = {n: [c.fixed[n] for c in chunks] for n in fixed}
        self._arrays = {
            n: RaggedChunks([c.arrays[n] for c in chunks], self._specs[n].dtype) for n in ragged
        }
        self._shapes = {n: [c.shapes[n] for c in chunks] for n in variable}
        nullable = [f.name for f in self.fields if f.nullable]
        self._valid = {n: [c.valid[n] for c in chunks] for n in nullable}
        self._joined = JoinedColumns()
        self._verified = [verify != "lazy"] * len(self._shards)
        self._failed: dict[int, DatasetCorruptError] = {}
        self._all_verified = all(self._verified)
        if verify == "full":
            self._verified = [False] * len(self._shards)
            self.verify()

    # -- description -------------------------------------------------------------------------
    def _names(self, fields: Sequence[str] | None) -> list[str]:
        if fields is None:
            return [f.name for f in self.fields]
        names = [fields] if isinstance(fields, str) else list(fields)
        for n in names:
            if n not in self._specs:
                raise KeyError(
                    f"no field {n!r} in dataset {self.manifest.name!r}; fields are {list(self._specs)}"
                )
        return names

    def part_shapes(
        self, fields: Sequence[str] | None = None
    ) -> dict[str, tuple[str, tuple[int, ...]] | None]:
        """Batch part name -> ``(dtype, per-sample shape)`` for fixed fields; ``None`` for each
        part of a variable or binary field (``x``, ``x.offsets`` and, for tensors, ``x.shapes``).
        A nullable field adds ``x.mask`` (bool, ``True`` where the sample has a value)."""
        parts: dict[str, tuple[str, tuple[int, ...]] | None] = {}
        for n in self._names(fields):
            spec = self._specs[n]
            if spec.kind in ("scalar", "tensor"):
                parts[n] = (spec.dtype, spec.shape)
            else:
                parts[n] = parts[n + ".offsets"] = None
                if spec.kind == "variable":
                    parts[n + ".shapes"] = None
            if spec.nullable:
                parts[n + MASK] = ("bool", ())
        return parts

    # -- reading -----------------------------------------------------------------------------
    def take(
        self,
        indices: np.ndarray | Sequence[int],
        fields: Sequence[str] | None = None,
        out: Mapping[str, np.ndarray] | None = None,
    ) -> dict[str, np.ndarray]:
        """Gather samples ``indices`` (global ids, any order, repeats allowed) into batch parts.

        Fixed field ``x`` -> ``x`` ``[B, *shape]``, written into ``out["x"]`` when given.
        Variable field ``x`` -> ``x`` (values, 1-d), ``x.offsets`` (int64 ``[B+1]``),
        ``x.shapes`` (int64 ``[B, ndim]``). Binary ``x`` -> ``x`` (uint8) and ``x.offsets``.
        """
        if self._closed:
            raise ValueError(f"dataset {self.manifest.name!r} is closed")
        idx = as_indices(indices)
        names = self._names(fields)
        lo, hi = check_bounds(idx, self.num_samples)
        b = idx.size
        # Ids map to chunks monotonically, so the batch lies in one chunk iff its min and max
        # do: the common case (stores of a few shards) then skips the per-id search.
        first = chunk_of(lo, self._starts) if b else 0
        if b and first == chunk_of(hi, self._starts):
            base = int(self._starts[first])
            rows = idx - base if base else idx
            g: list[tuple[int, Positions]] = [(first, ALL)]
            self._check_shards(self._chunk_shard[first : first + 1])
        else:
            chunk, rows = locate(idx, self._starts)
            g = groups(chunk)
            self._check_shards(self._chunk_shard[chunk])
        views = {"fixed": self._fixed, "valid": self._valid, "shapes": self._shapes}
        return self._read(
            names, idx, g, rows, lambda kind, n: views[kind][n], self._arrays.__getitem__, out,
            self._joined,
        )  # fmt: skip

    def _read(
        self,
        names: Sequence[str],
        idx: np.ndarray,
        g: list[tuple[int, Positions]],
        rows: np.ndarray,
        views: Callable[[str, str], list[np.ndarray]],
        arrays: Callable[[str], Any],
        out: Mapping[str, np.ndarray] | None,
        joined: JoinedColumns | None,
    ) -> dict[str, np.ndarray]:
        """The one field loop: fields ``names`` of rows ``rows`` of chunk groups ``g``.

        ``views(kind, name)``: the field's per-chunk arrays of one ``kind`` (``fixed`` values,
        ``valid`` masks, variable ``shapes``); ``arrays(name)``: a ragged field's chunks;
        ``joined``: small columns joined across chunks, ``None`` where the chunks change
        from batch to batch (a remote store's leased shards)."""
        b = idx.size
        parts: dict[str, np.ndarray] = {}

        def small(kind: str, n: str, dest: np.ndarray) -> np.ndarray:
            if not b:
                return dest
            chunks = views(kind, n)
            one = joined.get((kind, n), chunks) if joined is not None and len(g) > 1 else None
            if one is None:
                return take_fixed(chunks, g, rows, dest)
            return np.take(one, idx, axis=0, out=dest, mode="clip")  # ids are checked

        for n in names:
            spec = self._specs[n]
            if spec.nullable:
                mask = out.get(n + MASK) if out is not None else None
                if mask is None or mask.shape != (b,):
                    mask = np.empty(b, dtype=bool)
                parts[n + MASK] = small("valid", n, mask)
            if spec.kind in ("scalar", "tensor"):
                parts[n] = small("fixed", n, self._out_array(spec, b, out))
                continue
            if b:
                parts[n], parts[n + ".offsets"] = take_ragged(
                    arrays(n), g, rows, spec.dtype, spec.shape
                )
            else:
                parts[n] = np.empty(0, dtype=np.uint8 if spec.kind == "binary" else spec.dtype)
                parts[n + ".offsets"] = np.zeros(1, dtype=np.int64)
            if spec.kind == "variable":
                shapes = np.empty((b, len(spec.shape)), dtype=np.int64)
                parts[n + ".shapes"] = small("shapes", n, shapes)
        return parts

    @staticmethod
    def _out_array(spec: FieldSpec, b: int, out: Mapping[str, np.ndarray] | None) -> np.ndarray:
        want = (b, *spec.shape)
        dest = out.get(spec.name) if out is not None else None
        if dest is None:
            return np.empty(want, dtype=spec.dtype)
        if dest.shape != want or dest.dtype != np.dtype(spec.dtype) or not dest.flags.c_contiguous:
            raise ValueError(
                f"out[{spec.name!r}] is {dest.dtype}{list(dest.shape)} (contiguous="
                f"{dest.flags.c_contiguous}); expected a C-contiguous {spec.dtype}{list(want)}"
            )
        return dest

    # -- integrity ---------------------------------------------------------------------------
    def _check_shards(self, shards: np.ndarray) -> None:
        """Before reading: each touched shard is verified (lazily) and still whole on disk."""
        touched = np.unique(shards).tolist() if shards.size > 1 else shards.tolist()
        for s in touched:
            if s in self._failed:
                raise self._failed[s]
            try:
                self._shards[s].check_size()
            except DatasetCorruptError as e:
                self._failed[s] = e
                raise
        if not self._all_verified:
            self._ensure_verified(shards)

    def _ensure_verified(self, shards: np.ndarray) -> None:
        for s in np.unique(shards).tolist():
            if not self._verified[s]:
                self._verify_one(s)

    def _verify_one(self, s: int, progress: object | None = None) -> None:
        with self._lock:  # one thread hashes a shard; the others wait for its verdict
            if s in self._failed:
                raise self._failed[s]
            if self._verified[s]:
                return
            try:
                self._shards[s].verify(progress)
            except DatasetCorruptError as e:
                self._failed[s] = e
                raise
            self._verified[s] = True
            self._all_verified = all(self._verified)

    def verify(self, progress: bool = False) -> None:
        """Check every shard's checksum; raise ``DatasetCorruptError`` on the first bad one."""
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
                with self._lock:
                    self._verified[s] = False
                self._verify_one(s, bar)

    def close(self) -> None:
        """Unmap every shard; later ``take`` calls raise ``ValueError``."""
        self._closed = True
        self._joined = JoinedColumns()  # the joined copies are this dataset's own memory
        for s in self._shards:
            s.close()
        self._shards = []

    def __enter__(self) -> Dataset:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
