"""What every input format hands to ingest: a list of files and a stream of pieces.

A piece is one sample (``.pt``: one file, one sample) or a block of whole columns
(``.npz``, Parquet, Arrow). ``where`` names the file (and rows) so a bad value is reported
where it came from.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from shardserve.proto.errors import InvalidDataError


@dataclass
class Piece:
    """One sample or one block of columns from a source."""

    where: str
    #: One sample: a dict (nested to any depth), a tuple or list, or a bare array.
    sample: object = None
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
    #: For columnar sources whose column names are flattened paths: the tree they form
    #: (:data:`shardserve.proto.manifest.Tree`); ``None`` when flat.
    structure: object = None
    #: Facts for the manifest's ``source`` (e.g. an image folder's class names as JSON).
    info: dict[str, str] = field(default_factory=dict)

    @property
    def total_bytes(self) -> int:
        return sum(f.stat().st_size for f in self.files)


@dataclass(frozen=True)
class Reader:
    """One input format: its name (``--format``), how to open it, and how it is recognised:
    by file suffix (lower case), or, for a format that is a whole folder, by ``claims``."""

    name: str
    open: Callable[..., Source]
    suffixes: tuple[str, ...] = ()
    claims: Callable[[Path], bool] | None = None


def list_files(src: Path, suffixes: Iterable[str]) -> list[Path]:
    """Files under ``src`` (or ``src`` itself) with one of ``suffixes``, in sorted path order."""
    wanted = tuple(suffixes)
    if src.is_file():
        return [src] if src.suffix.lower() in wanted else []
    # os.scandir, not Path.rglob: a folder of 100k small samples is listed with no stat per
    # file (the entry's type comes with it) and no pathlib object per candidate.
    found: list[str] = []
    stack = [str(src)]
    while stack:
        with os.scandir(stack.pop()) as entries:
            for e in entries:
                if e.is_dir(follow_symlinks=False):  # as rglob: no loops through links
                    stack.append(e.path)
                elif os.path.splitext(e.name)[1].lower() in wanted and e.is_file():
                    found.append(e.path)
    # Every path starts with src, so this is the order of the paths relative to it.
    found.sort(key=lambda p: p.replace(os.sep, "/"))
    return [Path(p) for p in found]


def require_files(files: list[Path], src: Path, what: str) -> list[Path]:
    if not files:
        raise InvalidDataError(f"source {src} holds no {what} files; nothing to ingest")
    return files
