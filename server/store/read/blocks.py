"""Verifying a mapped shard block by block: a read waits only for the blocks it reads.

A shard whose manifest entry has ``blocks`` (:class:`~shardserve.proto.manifest.ShardInfo`)
is verified in two steps instead of one whole-file pass before its first read:

* before its first read (:meth:`ShardBlocks.open`): the Arrow IPC framing, walked message by
  message from the file's start, each message's header verified before its lengths are
  trusted; then every block that is not wholly inside some column's *row data* (the footer,
  validity bitmaps, offsets, shapes, columns copied when the shard was mapped);
* before each read (:meth:`ShardBlocks.verify`, from the blocks the read's rows lie in): the
  blocks that hold those rows.

Why this keeps the whole-file checksum's guarantee: every byte a read returns lies in a block
verified at open or in a row-data block verified before that read. Where row data lies comes
from message headers verified first, and each chunk's row data must lie inside its own
message's body, so a damaged header or footer cannot point a read at other, intact bytes.

A shard without ``blocks`` (written before they were kept) is a single block, the whole file,
verified by its checksum before its first read, as before.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import pyarrow as pa

from shardserve.proto.errors import DatasetCorruptError
from shardserve.proto.manifest import ShardInfo

from ..layout import block_digest, checksum_buffer
from .index import locate

#: The Arrow IPC file magic and its padding, before the first message.
_MAGIC_BYTES = 8
#: A message's prefix: the continuation marker, then the header's length (0: end of stream).
_PREFIX = struct.Struct("<Ii")
_CONTINUATION = 0xFFFFFFFF
_NONE = np.zeros(0, dtype=np.int64)


@dataclass(frozen=True)
class RowSpan:
    """Where one chunk's rows of one field lie in its shard file.

    Fixed fields: row ``r`` is ``row_bytes`` bytes at ``start + r * row_bytes``. Ragged
    fields (``offsets`` set): row ``r`` is ``start + offsets[r] * itemsize`` up to
    ``start + offsets[r + 1] * itemsize``.
    """

    start: int
    #: The bytes of the buffer the rows lie in (from the message header, not the offsets).
    nbytes: int
    row_bytes: int = 0
    offsets: np.ndarray | None = None
    itemsize: int = 0

    @property
    def end(self) -> int:
        """One past the buffer's last byte."""
        return self.start + self.nbytes

    def byte_ranges(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """First and last byte (inclusive) of each of ``rows``; rows of no bytes left out."""
        if self.offsets is None:
            first = self.start + rows * self.row_bytes
            return first, first + (self.row_bytes - 1)
        first = self.start + self.offsets[rows].astype(np.int64) * self.itemsize
        end = self.start + self.offsets[rows + 1].astype(np.int64) * self.itemsize
        keep = end > first
        return first[keep], end[keep] - 1


def block_runs(first: np.ndarray, last: np.ndarray) -> np.ndarray:
    """The distinct blocks of the runs ``first[i]..last[i]`` (inclusive)."""
    if not first.size:
        return first
    if np.array_equal(first, last):
        return np.unique(first)
    counts = last - first + 1
    steps = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(
        np.cumsum(counts) - counts, counts
    )
    return np.unique(np.repeat(first, counts) + steps)


class ShardBlocks:
    """Which blocks of one mapped shard are verified, and verifying more; see the module
    docstring. ``verified`` is this shard's part of its dataset's array (written in place)."""

    def __init__(
        self, path: Path, info: ShardInfo, whole: pa.Buffer, fd: int, verified: np.ndarray
    ) -> None:
        self.path = path
        self.info = info
        self._whole = whole
        #: The mapped file's descriptor (for readahead hints).
        self._fd = fd
        self.verified = verified
        #: Bytes per block (the whole file for a shard without ``blocks``).
        self.block_bytes = info.block_bytes or max(info.bytes, 1)

    def prefetch(self, blocks: Iterable[int]) -> None:
        """Ask the kernel to read ``blocks`` now, all at once: hashing them through the
        mapping would otherwise fault them in one readahead window at a time."""
        try:
            for b in blocks:
                lo = int(b) * self.block_bytes
                os.posix_fadvise(self._fd, lo, self.block_bytes, os.POSIX_FADV_WILLNEED)
        except OSError:
            pass  # only a hint: where a filesystem refuses it, the hashing reads on demand

    def verify(self, blocks: Iterable[int]) -> None:
        """Hash each of ``blocks`` not verified yet; ``DatasetCorruptError`` names a bad one."""
        view = memoryview(self._whole)
        for b in blocks:
            b = int(b)
            if self.verified[b]:
                continue
            if self.info.blocks is None:
                got, want, where = checksum_buffer(view), self.info.checksum, ""
            else:
                lo = b * self.block_bytes
                hi = min(lo + self.block_bytes, self.info.bytes)
                got = block_digest(view[lo:hi])
                want = self.info.blocks[16 * b : 16 * b + 16]
                where = f" at block {b} (bytes {lo}..{hi})"
            if got != want:
                raise DatasetCorruptError(
                    f"shard {self.path} failed its checksum{where}: the file has {got}, the "
                    f"manifest says {want}; re-ingest"
                )
            self.verified[b] = True

    def verify_bytes(self, start: int, end: int) -> None:
        """Verify the blocks bytes ``start..end`` (exclusive) lie in."""
        if end > start:
            blocks = range(start // self.block_bytes, (end - 1) // self.block_bytes + 1)
            self.prefetch(blocks)
            self.verify(blocks)

    def read_ahead_of_open(self, chunk_spans: list[list[RowSpan]]) -> None:
        """Ask the kernel for the blocks :meth:`open` will verify, so that the shards a batch
        opens are read at once, not one after another."""
        # A whole-file checksum reads sequentially, which the kernel reads ahead by itself;
        # asking for every such file at once would only make them compete.
        if self.info.blocks is not None:
            self.prefetch(np.flatnonzero(~self._inside_rows(chunk_spans) & ~self.verified))

    def open(self, chunk_spans: list[list[RowSpan]]) -> None:
        """Verify what every read of this shard relies on: the message headers, then every
        block outside the chunks' row data (``chunk_spans``: each chunk's spans, in order)."""
        if self.info.blocks is None:
            self.verify([0])
            return
        bodies = self._bodies()
        if len(bodies) != len(chunk_spans):
            raise DatasetCorruptError(
                f"shard {self.path} frames {len(bodies)} record batches, its footer "
                f"{len(chunk_spans)}; re-ingest"
            )
        for (lo, hi), spans in zip(bodies, chunk_spans, strict=True):
            for span in spans:
                if not lo <= span.start <= span.end <= hi:
                    raise DatasetCorruptError(
                        f"shard {self.path}: a column's rows at bytes {span.start}..{span.end} "
                        f"lie outside their record batch (bytes {lo}..{hi}); re-ingest"
                    )
        eager = np.flatnonzero(~self._inside_rows(chunk_spans) & ~self.verified)
        self.prefetch(eager)
        self.verify(eager)

    def _inside_rows(self, chunk_spans: list[list[RowSpan]]) -> np.ndarray:
        """Which blocks lie wholly inside some chunk's row data (verified when a read needs
        them; every other block is verified by :meth:`open`)."""
        inside = np.zeros(self.verified.size, dtype=bool)
        bb = self.block_bytes
        for spans in chunk_spans:
            for span in spans:
                first = -(-span.start // bb)
                last = span.end // bb if span.end < self.info.bytes else self.verified.size
                inside[first:last] = True
        return inside

    def _bodies(self) -> list[tuple[int, int]]:
        """Byte ranges of the record batch bodies, in file order, from the message headers,
        each header's blocks verified before its lengths are read."""
        size = self.info.bytes
        reader = pa.BufferReader(self._whole)
        view = memoryview(self._whole)
        pos = _MAGIC_BYTES
        bodies: list[tuple[int, int]] = []
        while True:
            if pos + _PREFIX.size > size:
                raise DatasetCorruptError(f"shard {self.path}: its messages run past its end")
            self.verify_bytes(pos, pos + _PREFIX.size)
            marker, header = _PREFIX.unpack_from(view, pos)
            if marker != _CONTINUATION or header < 0 or pos + _PREFIX.size + header > size:
                raise DatasetCorruptError(f"shard {self.path}: bad message framing at {pos}")
            if header == 0:  # the end of the stream: the footer follows
                return bodies
            self.verify_bytes(pos, pos + _PREFIX.size + header)
            reader.seek(pos)
            try:
                message = pa.ipc.read_message(reader)
            except (pa.ArrowException, OSError) as e:
                raise DatasetCorruptError(f"shard {self.path}: unreadable message: {e}") from None
            pos = reader.tell()
            if message.type == "record batch":
                bodies.append((pos - message.body.size, pos))


class Mapped(Protocol):
    """A mapped shard as its blocks are checked (:class:`~.shards.MappedShard`)."""

    path: Path
    info: ShardInfo
    #: Each chunk's :class:`RowSpan` by field, for the fields read straight from the mapping.
    spans: list[dict[str, RowSpan]]

    @property
    def whole(self) -> pa.Buffer: ...

    def fileno(self) -> int: ...


class DatasetBlocks:
    """Every block of a mapped dataset's shards, and checking those a read's rows lie in.

    ``chunk_starts``: the first sample id of each chunk of the shards, in order, then the
    total. One array says which blocks are verified; each shard's :class:`ShardBlocks`
    writes its part of it. A shard with a bad block is entered in ``failed``.
    """

    def __init__(
        self,
        shards: Sequence[Mapped],
        chunk_starts: np.ndarray,
        failed: dict[int, DatasetCorruptError],
    ) -> None:
        counts = [sh.info.num_blocks for sh in shards]
        #: The dataset-wide number of each shard's first block, then the total.
        self.first_block = np.zeros(len(shards) + 1, dtype=np.int64)
        np.cumsum(counts, out=self.first_block[1:])
        self.verified = np.zeros(int(self.first_block[-1]), dtype=bool)
        self.blocks = [
            ShardBlocks(sh.path, sh.info, sh.whole, sh.fileno(), self.verified[a:b])
            for sh, a, b in zip(shards, self.first_block[:-1], self.first_block[1:], strict=True)
        ]
        self._starts = chunk_starts
        #: Per chunk: its shard's first block, and its shard's block size.
        shard_of = np.asarray([i for i, sh in enumerate(shards) for _ in sh.spans], dtype=np.int64)
        self._base = self.first_block[shard_of]
        self._bytes = np.asarray([self.blocks[i].block_bytes for i in shard_of], dtype=np.int64)
        #: Fixed fields: per chunk, the byte of row 0 (-1: not read from the mapping), and
        #: the bytes of a row; ragged fields: per chunk, the span (or ``None``).
        spans = [c for sh in shards for c in sh.spans]
        names = {n for c in spans for n in c}
        self._fixed: dict[str, tuple[np.ndarray, int]] = {}
        self._ragged: dict[str, list[RowSpan | None]] = {}
        for n in sorted(names):
            mine = [c.get(n) for c in spans]
            if any(sp is not None and sp.offsets is not None for sp in mine):
                self._ragged[n] = mine
                continue
            row_bytes = next(sp.row_bytes for sp in mine if sp is not None)
            start = np.asarray([-1 if sp is None else sp.start for sp in mine], dtype=np.int64)
            self._fixed[n] = (start, row_bytes)
        #: Per field, the blocks its rows lie in that are not verified yet: a field whose
        #: blocks are all verified costs a read one lookup.
        self._pending: dict[str, np.ndarray] = {}
        for n in names:
            runs = [
                np.arange(
                    self._base[c] + sp.start // self._bytes[c],
                    self._base[c] + (sp.end - 1) // self._bytes[c] + 1,
                )
                for c, sp in enumerate(chunk.get(n) for chunk in spans)
                if sp is not None and sp.end > sp.start
            ]
            self._pending[n] = np.unique(np.concatenate(runs)) if runs else _NONE
        #: A shard's verdict once one of its blocks failed (shared with its shard set).
        self._failed = failed

    @property
    def done(self) -> bool:
        """Whether every block that a read's rows can lie in is verified."""
        return not any(p.size for p in self._pending.values())

    def check(self, ids: np.ndarray, fields: Sequence[str]) -> None:
        """Verify the blocks that ``fields`` of samples ``ids`` lie in, if not yet."""
        fields = [n for n in fields if self._pending.get(n, _NONE).size]
        if not fields:
            return
        chunk, rows = locate(ids, self._starts)
        firsts: list[np.ndarray] = []
        lasts: list[np.ndarray] = []
        for n in fields:
            fixed = self._fixed.get(n)
            if fixed is not None:
                start, row_bytes = fixed
                at = start[chunk]
                keep = at >= 0
                c, first = chunk[keep], at[keep] + rows[keep] * row_bytes
                firsts.append(self._base[c] + first // self._bytes[c])
                lasts.append(self._base[c] + (first + row_bytes - 1) // self._bytes[c])
                continue
            for c in np.unique(chunk).tolist() if n in self._ragged else ():
                span = self._ragged[n][c]
                if span is None:
                    continue
                lo, hi = span.byte_ranges(rows[chunk == c])
                firsts.append(self._base[c] + lo // self._bytes[c])
                lasts.append(self._base[c] + hi // self._bytes[c])
        if not firsts:
            return
        needed = block_runs(np.concatenate(firsts), np.concatenate(lasts))
        todo = needed[~self.verified[needed]]
        if todo.size:
            self._verify(todo)
        # Whoever verified them (this read, an open, another field's read); a racing reader
        # that sees the longer list only checks more.
        for n in fields:
            pending = self._pending[n]
            self._pending[n] = pending[~self.verified[pending]]

    def _verify(self, todo: np.ndarray) -> None:
        """Verify dataset-wide blocks ``todo``, their reads asked for at once."""
        shards = np.searchsorted(self.first_block, todo, side="right") - 1
        local = todo - self.first_block[shards]
        for s in np.unique(shards).tolist():
            self.blocks[s].prefetch(local[shards == s].tolist())
        for b, s in zip(local.tolist(), shards.tolist(), strict=True):
            try:
                self.blocks[s].verify([b])
            except DatasetCorruptError as e:
                self._failed[s] = e
                raise

    def close(self) -> None:
        """Drop every view of the shards' mappings (so that closing them unmaps them)."""
        self.blocks = []
        self._fixed, self._ragged, self._pending = {}, {}, {}
