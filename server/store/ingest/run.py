"""Drive one ingest: open the source, stream its pieces into a ``ShardWriter``, report progress.

The progress bar (stderr) counts source bytes (so it shows MB/s) with files and samples
beside it; the result is an :class:`IngestSummary` for the one-line report.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from shardserve.proto.errors import InvalidDataError
from shardserve.proto.manifest import Manifest, validate_dataset_name

from ..writer import ShardWriter
from .mapping import mapped, resolve_map
from .registry import open_source
from .source import Piece


@dataclass(frozen=True)
class IngestSummary:
    """What one ingest produced."""

    manifest: Manifest
    files: int
    source_bytes: int
    seconds: float

    def line(self) -> str:
        m = self.manifest
        mb = m.total_bytes / 1e6
        rate = self.source_bytes / 1e6 / max(self.seconds, 1e-9)
        return (
            f"ingested {m.name}: {m.num_samples} samples, {len(m.shards)} shards, {mb:.1f} MB, "
            f"{self.seconds:.1f} s ({self.files} files, {rate:.1f} MB/s read)"
            f"{self.choices()}"
        )

    def choices(self) -> str:
        """What ingest decided on its own: variable shapes found, fields found missing."""
        var = [f"{f.name} {list(f.shape)}" for f in self.manifest.fields if f.kind == "variable"]
        null = [f.name for f in self.manifest.fields if f.nullable]
        out = ""
        if var:
            out += f"; variable: {', '.join(var)}"
        if null:
            out += f"; may be missing (masked): {', '.join(null)}"
        return out


def ingest(
    src: str | Path,
    store: str | Path,
    name: str,
    *,
    fmt: str = "auto",
    shard_bytes: int = 256 << 20,
    overwrite: bool = False,
    variable: Collection[str] = (),
    threads: int = 2,
    progress: bool = True,
    stacked: bool = False,
    map_fn: str | None = None,
    workers: int = 0,
) -> IngestSummary:
    """Ingest ``src`` into dataset ``name`` of ``store``; nothing is published on any error.

    Shapes that vary between samples are found (the field becomes variable; ``variable``
    declares one up front), and fields missing in some samples become nullable; the summary
    line says which. ``map_fn`` (``"module:function"``) runs over each source sample first,
    in ``workers`` processes (0: in this one).
    """
    validate_dataset_name(name)
    src_path = Path(src)
    started = time.perf_counter()
    source = open_source(src_path, fmt, threads=threads, stacked=stacked)
    if workers < 0:
        raise InvalidDataError(f"--workers must be 0 or more, got {workers}")
    fn = resolve_map(map_fn) if map_fn else None
    total = source.total_bytes
    info = {
        "path": str(src_path.resolve()),
        "format": source.format,
        "files": str(len(source.files)),
        **source.info,
    }
    with (
        tqdm(
            total=total,
            unit="B",
            unit_scale=True,
            desc=f"ingest {name}",
            disable=not progress,
            file=sys.stderr,
            mininterval=0.5,
        ) as bar,
        ShardWriter(
            store,
            name,
            shard_bytes=shard_bytes,
            overwrite=overwrite,
            source=info,
            variable=set(variable) | source.variable,
        ) as writer,
        mapped(source.pieces, fn, map_fn or "", workers) as pieces,
    ):
        # A map returns samples of its own making: their tree is the writer's to find.
        writer.structure = source.structure if fn is None else None
        files, read = _write(pieces, writer, bar, len(source.files), progress)
        if writer.num_samples == 0:
            raise InvalidDataError(f"source {src_path} holds no samples; nothing to ingest")
    manifest = writer.manifest
    if manifest is None:  # unreachable: a clean exit of the with-block publishes
        raise InvalidDataError(f"ingest of {name!r} finished without a manifest")
    return IngestSummary(manifest, files, read, time.perf_counter() - started)


def _write(
    pieces: Iterable[Piece], writer: ShardWriter, bar: Any, num_files: int, progress: bool
) -> tuple[int, int]:
    """Hand every piece to ``writer``, ticking ``bar``; files finished and bytes read."""
    files = read = 0
    for i, piece in enumerate(pieces):
        if piece.sample is not None:
            writer.add(piece.sample, where=piece.where)
        elif piece.columns is not None:
            writer.add_batch(piece.columns, where=piece.where)
        files += piece.files
        read += piece.nbytes
        bar.update(piece.nbytes)
        if progress and i % 256 == 0:
            bar.set_postfix_str(
                f"{files}/{num_files} files, {writer.num_samples} samples", refresh=False
            )
    if progress:  # the real final counts, not those of the last 256th piece
        bar.set_postfix_str(
            f"{files}/{num_files} files, {writer.num_samples} samples", refresh=True
        )
    return files, read
