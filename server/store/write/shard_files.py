"""The shard files of one dataset being written, in its temporary folder.

At most one shard is open at a time; closing it fsyncs the file while its xxh3 checksums are
computed (of the whole file and of each block) and records its :class:`ShardInfo`. A shard
keeps the schema it was opened with; :meth:`ShardFiles.upgrade` rewrites those whose schema
is not the final one (:mod:`.migrate`) before anything is published.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import pyarrow as pa

from shardserve.proto.manifest import FieldSpec, ShardInfo

from .. import layout
from .migrate import needs_upgrade, upgrade_shard


def _info(path: Path, rel: str, rows: int) -> ShardInfo:
    """The record of a finished shard file: durable, checksummed whole and by block."""
    digest = layout.digest_file(path, block_bytes=layout.BLOCK_BYTES, fsync=True)
    return ShardInfo(
        path=rel,
        rows=rows,
        bytes=path.stat().st_size,
        checksum=digest.checksum,
        block_bytes=layout.BLOCK_BYTES,
        blocks=digest.blocks,
    )


class ShardFiles:
    """Shards written so far under ``folder``, and the open one; see the module docstring."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        #: Closed shards, in order.
        self.shards: list[ShardInfo] = []
        #: Payload bytes in the chunks written to the open shard (0 when none is open).
        self.committed = 0
        self._rows = 0
        self._ipc: pa.RecordBatchFileWriter | None = None
        self._ipc_specs: tuple[FieldSpec, ...] = ()
        self._specs_of: list[tuple[FieldSpec, ...]] = []

    def write(self, batch: pa.RecordBatch, specs: tuple[FieldSpec, ...], nbytes: int) -> None:
        """Append one chunk (``nbytes`` of payload) to the open shard, opening one if needed."""
        if self._ipc is None:
            path = self.folder / layout.shard_name(len(self.shards))
            self._ipc = pa.ipc.new_file(str(path), batch.schema)
            self._ipc_specs = specs
        self._ipc.write_batch(batch)
        self.committed += nbytes
        self._rows += batch.num_rows

    def close_shard(self) -> None:
        """Close the open shard (if any) and record it with its checksum."""
        if self._ipc is None:
            return
        self._ipc.close()
        self._ipc = None
        rel = layout.shard_name(len(self.shards))
        path = self.folder / rel
        self.shards.append(_info(path, rel, self._rows))
        self._specs_of.append(self._ipc_specs)
        self.committed = 0
        self._rows = 0

    def upgrade(self, final: tuple[FieldSpec, ...]) -> None:
        """Rewrite shards written before the schema last changed to ``final``."""
        for i, old in enumerate(self._specs_of):
            if not needs_upgrade(old, final):
                continue
            info = self.shards[i]
            path = self.folder / info.path
            upgrade_shard(path, old, final)
            self.shards[i] = _info(path, info.path, info.rows)

    def abort(self) -> None:
        """Close the open shard without recording it (its folder is about to go)."""
        if self._ipc is not None:
            with contextlib.suppress(OSError, pa.ArrowException):
                self._ipc.close()
            self._ipc = None
