"""What every input format hands to ingest: a list of files and a stream of pieces.

A piece is one sample (``.pt``: one file, one sample) or a block of whole columns
(``.npz``, Parquet, Arrow). ``where`` names the file (and rows) so a bad value is reported
where it came from.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from shardserve.proto.errors import InvalidDataError


@dataclass
class Piece:
    """One sample or one block of columns from a source."""

    where: str
    sample: Mapping[str, object] | None = None
    columns: Mapping[str, object] | None = None
    #: Files finished with this piece and source bytes it consumed (for the progress bar).
    files: int = 0
    nbytes: int = 0


@dataclass
class Source:
    """An opened input: its files (sorted, so ingest is deterministic) and its pieces."""

    format: str
    files: list[Path]
    pieces: Iterator[Piece]
    #: Fields the format knows are variable-shape (e.g. Arrow list columns).
    variable: set[str] = field(default_factory=set)

    @property
    def total_bytes(self) -> int:
        return sum(f.stat().st_size for f in self.files)


def list_files(src: Path, suffixes: Iterable[str]) -> list[Path]:
    """Files under ``src`` (or ``src`` itself) with one of ``suffixes``, in sorted path order."""
    wanted = tuple(suffixes)
    if src.is_file():
        return [src] if src.suffix.lower() in wanted else []
    return sorted(
        (p for p in src.rglob("*") if p.suffix.lower() in wanted and p.is_file()),
        key=lambda p: p.relative_to(src).as_posix(),
    )


def require_files(files: list[Path], src: Path, what: str) -> list[Path]:
    if not files:
        raise InvalidDataError(f"source {src} holds no {what} files; nothing to ingest")
    return files
