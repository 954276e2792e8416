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
from shardserve.proto.manifest import TextEncoding

#: The default ``--max-sample-bytes``: no real sample is this large, and a hostile source
#: (a sparse tar member, a decompression bomb) is stopped here before it costs memory.
MAX_SAMPLE_BYTES = 256 << 20


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
class IngestSource:
    """An opened input: its files (sorted, so ingest is deterministic) and its pieces."""

    format: str
    files: list[Path]
    pieces: Iterator[Piece]
    #: Fields the format knows are variable-shape (e.g. Arrow list columns).
    variable: set[str] = field(default_factory=set)
    #: Binary fields that hold text, and how (``utf-8``: a string per sample).
    text: dict[str, TextEncoding] = field(default_factory=dict)
    #: For columnar sources whose column names are flattened paths: the tree they form
    #: (:data:`shardserve.proto.manifest.Tree`); ``None`` when flat.
    structure: object = None
    #: Facts for the manifest's ``source`` (e.g. an image folder's class names as JSON).
    #: A reader may add to it while its pieces are read (metadata found on the way).
    info: dict[str, str] = field(default_factory=dict)
    #: What the source held that is not samples (an LMDB ``__len__`` key, an HDF5 array
    #: without the sample dimension): ``name -> what was done with it``, for the summary.
    #: Also filled while the pieces are read.
    metadata: dict[str, str] = field(default_factory=dict)
    #: Files of the source folder that are not of its format, so not read (set by
    #: :func:`~.registry.open_ingest_source`, which knows the format's suffixes).
    left_out: list[Path] = field(default_factory=list)

    @property
    def total_bytes(self) -> int:
        return sum(f.stat().st_size for f in self.files)


@dataclass(frozen=True)
class Reader:
    """One input format: its name (``--format``), how to open it, and how it is recognised:
    by file suffix (lower case), or, for a format that is a whole folder, by ``claims``."""

    name: str
    open: Callable[..., IngestSource]
    suffixes: tuple[str, ...] = ()
    claims: Callable[[Path], bool] | None = None
    #: Whether ``open`` takes ``max_sample_bytes`` (a container whose members say their
    #: sizes before they are read: the bound is checked there, before any allocation).
    bounded: bool = False
    #: Whether ``open`` takes ``value_format`` (values stored as bytes: an LMDB environment).
    valued: bool = False


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


def other_files(src: Path, read: Iterable[Path]) -> list[Path]:
    """Files under folder ``src`` other than ``read``, in sorted path order; hidden files and
    folders (``.git``, ``.DS_Store``) are never data and are not listed."""
    skip = {str(p) for p in read}
    found: list[str] = []
    stack = [str(src)]
    while stack:
        with os.scandir(stack.pop()) as entries:
            for e in entries:
                if e.name.startswith("."):
                    continue
                if e.is_dir(follow_symlinks=False):
                    stack.append(e.path)
                elif e.path not in skip and e.is_file():
                    found.append(e.path)
    found.sort(key=lambda p: p.replace(os.sep, "/"))
    return [Path(p) for p in found]


def source_files(src: Path, suffixes: Iterable[str], only: Iterable[Path] | None) -> list[Path]:
    """:func:`list_files`, or the files of one split (``only``) when ingest picked them."""
    if only is None:
        return list_files(src, suffixes)
    wanted = tuple(suffixes)
    return [p for p in only if p.suffix.lower() in wanted]


def put_field(
    out: dict[str, object], name: str, value: object, origin: str, seen: dict[str, str], where: str
) -> None:
    """``out[name] = value``, refusing a second input that lands on the same field name.

    ``seen`` maps each field name to the input it came from (``origin``), so the error
    names both: two inputs silently merged into one field would drop one of them."""
    if name in out:
        raise InvalidDataError(
            f"{where}: {seen.get(name, name)!r} and {origin!r} both become the field {name!r}; "
            "rename one of them in the source (or drop one with --map)"
        )
    out[name] = value
    seen[name] = origin


def listed_file(folder: Path, name: str, index: Path) -> Path:
    """``folder / name``, a file that ``index`` lists, if it is a file in ``folder`` itself.

    An index names its files beside it: a name with a path in it, or a link whose target lies
    outside the folder, would have ingest read (and serve) a file the dataset does not hold,
    so both are refused, naming the index and the entry."""
    path = folder / name
    if path.is_symlink() and path.resolve().parent != folder.resolve():
        raise InvalidDataError(
            f"{index} lists {name}, a link to {path.resolve()} outside the folder {folder}: "
            "copy the file into the folder instead of linking it"
        )
    if not path.is_file() or path.resolve().parent != folder.resolve():
        raise InvalidDataError(f"{index} lists {name}, which is not a file in the folder {folder}")
    return path


def require_files(files: list[Path], src: Path, what: str) -> list[Path]:
    if not files:
        raise InvalidDataError(f"source {src} holds no {what} files; nothing to ingest")
    return files
