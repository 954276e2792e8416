"""One shard file: memory-map it, check it against the manifest, expose per-chunk views.

A :class:`MappedShard` keeps its ``pyarrow.memory_map`` open for its whole life (re-mapping
each epoch costs page faults again). For each record batch ("chunk") it holds

* fixed and scalar fields: a read-only zero-copy numpy view ``[rows, *shape]``;
* variable and binary fields: the Arrow array itself (taken with ``pyarrow.compute.take``),
  plus, for variable tensors, a numpy view ``[rows, ndim]`` of the shape column.

Every failure to read what the manifest promises raises ``DatasetCorruptError`` naming the
shard file and the reason.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa

from shardserve.proto.errors import DatasetCorruptError
from shardserve.proto.manifest import SHAPE_COLUMN_PREFIX, FieldSpec, ShardInfo

from ..layout import checksum_buffer, digest_file
from ..write.schema import check_arrow_schema
from .arrow_numpy import numbers, validity
from .blocks import RowSpan


@dataclass
class Chunk:
    """Views of one record batch."""

    rows: int
    fixed: dict[str, np.ndarray] = field(default_factory=dict)
    arrays: dict[str, pa.Array] = field(default_factory=dict)
    shapes: dict[str, np.ndarray] = field(default_factory=dict)
    #: Nullable fields: ``True`` where the row has a value.
    valid: dict[str, np.ndarray] = field(default_factory=dict)


def _fixed_view(arr: pa.Array, spec: FieldSpec) -> np.ndarray:
    # Arrow bools are bit-packed, so that one dtype is materialised (copied once, at open).
    dtype = np.dtype(spec.dtype)
    if arr.null_count:
        # Missing rows hold zeros in the values; the validity view says they are not there.
        if spec.shape == ():
            values = numbers(arr, dtype).copy()
            values[~validity(arr)] = 0
            return values
        k = spec.numel
        flat = arr.values.slice(arr.offset * k, len(arr) * k)
    else:
        flat = arr if spec.shape == () else arr.flatten()
    if flat.null_count:  # a missing element inside a present tensor: not something we write
        raise DatasetCorruptError(f"column {spec.name!r} has nulls inside its values")
    return numbers(flat, dtype).reshape(len(arr), *spec.shape)


#: Bytes at each end of a shard file read ahead before it is opened: the schema at its head,
#: the footer (and the last record batch's header) at its tail.
_ENDS_BYTES = 64 << 10


def read_ends_ahead(paths: Iterable[Path]) -> None:
    """Ask the kernel to read the head and tail of every file of ``paths`` now, all at once:
    opening shards from a cold disk one after another otherwise waits for each in turn (a
    missing file is left for its open to name)."""
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            size = os.fstat(fd).st_size
            os.posix_fadvise(fd, 0, _ENDS_BYTES, os.POSIX_FADV_WILLNEED)
            os.posix_fadvise(fd, max(0, size - _ENDS_BYTES), _ENDS_BYTES, os.POSIX_FADV_WILLNEED)
        except OSError:
            pass  # only a hint
        finally:
            os.close(fd)


def check_file(path: Path, info: ShardInfo) -> None:
    """Raise ``DatasetCorruptError`` if the shard is missing, cannot be looked at, is not a
    regular file, or is not the size the manifest says."""
    try:
        st = path.stat()
    except FileNotFoundError:
        raise DatasetCorruptError(f"shard {path} is missing") from None
    except OSError as e:
        # A symlink loop, a ``shards/`` that is a file, a folder without permission: each is
        # a dataset that cannot be served, the same as a missing shard, never a server error.
        code = errno.errorcode.get(e.errno or 0, "?")
        raise DatasetCorruptError(
            f"shard {path} cannot be read: {e.strerror or e} ({code}); restore the file "
            "or re-ingest the dataset"
        ) from None
    if not stat.S_ISREG(st.st_mode):
        raise DatasetCorruptError(
            f"shard {path} is not a regular file; restore the file or re-ingest the dataset"
        )
    size = st.st_size
    if size != info.bytes:
        what = "truncated" if size < info.bytes else "longer than expected"
        raise DatasetCorruptError(
            f"shard {path} is {what}: {size} bytes, the manifest says {info.bytes}"
        )


def verify_checksum(path: Path, info: ShardInfo, progress: object | None = None) -> None:
    """Raise ``DatasetCorruptError`` unless the whole file hashes to the manifest's checksum
    and each block to its block checksum (which the reads under ``--verify lazy`` check)."""
    check_file(path, info)
    got = digest_file(path, block_bytes=info.block_bytes, progress=progress)
    if got.checksum != info.checksum:
        raise DatasetCorruptError(
            f"shard {path} failed its checksum: the file has {got.checksum}, the manifest says "
            f"{info.checksum}"
        )
    if info.blocks is not None and got.blocks != info.blocks:
        b = next(
            i // 16
            for i in range(0, len(got.blocks), 16)
            if got.blocks[i : i + 16] != info.blocks[i : i + 16]
        )
        raise DatasetCorruptError(
            f"shard {path}: block {b} does not match its checksum in the manifest, though the "
            "whole file does: the manifest is damaged; re-ingest"
        )


class MappedShard:
    """A memory-mapped shard and the views of its chunks."""

    def __init__(self, path: Path, info: ShardInfo, specs: tuple[FieldSpec, ...]) -> None:
        self.path = path
        self.info = info
        check_file(path, info)
        self._mm: pa.MemoryMappedFile | None = None
        self._whole: pa.Buffer | None = None
        try:
            self._mm = pa.memory_map(str(path), "r")
            # A view of the mapping: ``read_at`` would copy the whole file into private
            # memory (pyarrow 26), a second copy of the dataset beside the page cache.
            self._whole = self._mm.read_buffer(info.bytes)
            self._mm.seek(0)
            st = os.fstat(self._mm.fileno())
            #: What was mapped: a later change to the file shows as another size or mtime.
            self.identity = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
            reader = pa.ipc.open_file(self._mm)
            problem = check_arrow_schema(reader.schema, specs, f"shard {path}")
            if problem:
                raise DatasetCorruptError(problem)
            self.chunks = [
                self._views(reader.get_batch(i), specs) for i in range(reader.num_record_batches)
            ]
            #: Where each chunk's rows lie in the file, for the fields read straight from it.
            self.spans = [self._spans(c, specs) for c in self.chunks]
        except DatasetCorruptError:
            self.close()
            raise
        except (pa.ArrowException, OSError, ValueError) as e:
            self.close()
            raise DatasetCorruptError(f"shard {path} is unreadable as Arrow IPC: {e}") from None
        rows = sum(c.rows for c in self.chunks)
        if rows != info.rows:
            self.close()
            raise DatasetCorruptError(
                f"shard {path} holds {rows} rows, the manifest says {info.rows}"
            )

    @staticmethod
    def _views(batch: pa.RecordBatch, specs: tuple[FieldSpec, ...]) -> Chunk:
        chunk = Chunk(rows=batch.num_rows)
        for spec in specs:
            col = batch.column(spec.name)
            if col.null_count and not spec.nullable:
                raise DatasetCorruptError(f"column {spec.name!r} has nulls")
            if spec.nullable:
                chunk.valid[spec.name] = validity(col)
            if spec.kind in ("scalar", "tensor"):
                chunk.fixed[spec.name] = _fixed_view(col, spec)
            else:
                chunk.arrays[spec.name] = col
            if spec.kind == "variable":
                shapes = batch.column(SHAPE_COLUMN_PREFIX + spec.name)
                ndim = len(spec.shape)
                chunk.shapes[spec.name] = numbers(shapes.flatten(), np.dtype(np.int64)).reshape(
                    len(shapes), ndim
                )
        return chunk

    def _spans(self, chunk: Chunk, specs: tuple[FieldSpec, ...]) -> dict[str, RowSpan]:
        """The :class:`RowSpan` of each field whose rows a read takes from the mapping
        itself (a column copied at open, a packed bool, is left out: it is verified whole)."""
        assert self._whole is not None
        base, size = self._whole.address, self._whole.size
        spans: dict[str, RowSpan] = {}
        for spec in specs:
            view = chunk.fixed.get(spec.name)
            if view is not None:
                start = view.ctypes.data - base
                if view.nbytes and start >= 0 and start + view.nbytes <= size:
                    spans[spec.name] = RowSpan(
                        start, view.nbytes, row_bytes=view.nbytes // chunk.rows
                    )
                continue
            arr = chunk.arrays.get(spec.name)
            if arr is None or spec.dtype == "bool" or arr.offset or not chunk.rows:
                continue
            bufs = arr.buffers()
            if spec.kind == "binary":
                offsets, data, itemsize = bufs[1], bufs[2], 1
            elif arr.values.offset == 0:  # a list of numbers: its child's values
                offsets, data, itemsize = bufs[1], bufs[3], np.dtype(spec.dtype).itemsize
            else:
                continue
            start = data.address - base if data is not None else -1
            if offsets is None or data is None or start < 0 or start + data.size > size:
                continue  # no values at all (an empty buffer lies outside the mapping)
            spans[spec.name] = RowSpan(
                start,
                data.size,
                offsets=np.frombuffer(offsets, dtype=np.int32, count=chunk.rows + 1),
                itemsize=itemsize,
            )
        return spans

    def verify(self, progress: object | None = None) -> None:
        """Check the checksum of the bytes this shard serves (the mapping itself, not the path:
        after an overwrite the path names a different file)."""
        if self._mm is None or self._whole is None:
            raise ValueError(f"shard {self.path} is closed")
        got = checksum_buffer(memoryview(self._whole), progress)
        if got != self.info.checksum:
            raise DatasetCorruptError(
                f"shard {self.path} failed its checksum: the file has {got}, the manifest says {self.info.checksum}"
            )

    def check_size(self) -> None:
        """Refuse to read a shard whose file was cut short or changed under us.

        Touching a mapped page past a file's new end is SIGBUS, which kills the whole server;
        one ``fstat`` per batch turns it into this shard's error instead. A file truncated and
        grown back to its size reads as zeros: its mtime moved, so the checksum it passed no
        longer vouches for it, and it is refused too.
        """
        if self._mm is None:
            raise ValueError(f"shard {self.path} is closed")
        st = os.fstat(self._mm.fileno())
        if st.st_size < self.info.bytes:
            raise DatasetCorruptError(
                f"shard {self.path} was truncated to {st.st_size} bytes while being served (the "
                f"manifest says {self.info.bytes}): shards must never change in place; re-ingest"
            )
        if st.st_mtime_ns != self.identity[3] or st.st_size != self.identity[2]:
            raise DatasetCorruptError(
                f"shard {self.path} was modified while being served (size {self.identity[2]} -> "
                f"{st.st_size}, mtime changed): shards must never change in place; re-ingest"
            )

    @property
    def whole(self) -> pa.Buffer:
        """The whole file as mapped (what reads are served from)."""
        if self._whole is None:
            raise ValueError(f"shard {self.path} is closed")
        return self._whole

    def fileno(self) -> int:
        """The descriptor of the mapped file (the one read, whatever its path names now)."""
        if self._mm is None:
            raise ValueError(f"shard {self.path} is closed")
        return self._mm.fileno()

    def close(self) -> None:
        """Drop the views and close the mapping (arrays already returned by take are copies)."""
        self.chunks = []
        self.spans = []
        self._whole = None
        if self._mm is not None:
            self._mm.close()
            self._mm = None


def verify_shard(
    path: Path, info: ShardInfo, specs: tuple[FieldSpec, ...], progress: object | None = None
) -> None:
    """Checksum plus readability (schema, row count) of one shard; ``DatasetCorruptError`` if bad."""
    verify_checksum(path, info, progress)
    MappedShard(path, info, specs).close()
