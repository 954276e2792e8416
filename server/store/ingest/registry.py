"""Input formats by name, and detection of the format of a source path.

``open_source(src, "auto")`` picks the format from file suffixes; a folder holding files of
more than one known format is refused with a request for ``--format``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from shardserve.proto.errors import InvalidDataError

from .source import Source

#: Suffixes each format reads (lower case).
SUFFIXES: dict[str, tuple[str, ...]] = {
    "pt": (".pt", ".pth"),
    "npz": (".npz", ".npy"),
    "parquet": (".parquet", ".pq"),
    "arrow": (".arrow", ".feather", ".ipc"),
}
FORMATS = ("auto", *SUFFIXES)


def detect(src: Path) -> str:
    """The format of ``src`` from its suffix (a file) or its files' suffixes (a folder)."""
    if not src.exists():
        raise InvalidDataError(f"source {src} does not exist")
    if src.is_file():
        names = [src.suffix.lower()]
    else:
        names = sorted({p.suffix.lower() for p in src.rglob("*") if p.is_file()})
    found = sorted({fmt for fmt, sfx in SUFFIXES.items() for n in names if n in sfx})
    known = ", ".join(s for sfx in SUFFIXES.values() for s in sfx)
    if not found:
        raise InvalidDataError(
            f"source {src} holds no files ingest can read ({known}); nothing to ingest"
        )
    if len(found) > 1:
        raise InvalidDataError(
            f"source {src} holds files of several formats ({', '.join(found)}); choose one with --format"
        )
    return found[0]


def _readers() -> dict[str, Callable[..., Source]]:
    from .arrow_files import open_arrow, open_parquet
    from .numpy_files import open_numpy
    from .pt_files import open_pt

    return {"pt": open_pt, "npz": open_numpy, "parquet": open_parquet, "arrow": open_arrow}


def open_source(src: Path, fmt: str = "auto", threads: int = 2) -> Source:
    """Open ``src`` as format ``fmt`` (``"auto"`` detects it)."""
    if fmt not in FORMATS:
        raise InvalidDataError(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")
    if not src.exists():
        raise InvalidDataError(f"source {src} does not exist")
    if fmt == "auto":
        fmt = detect(src)
    return _readers()[fmt](src, threads=threads)
