"""Input formats by name, and detection of the format of a source path.

Each reader module declares its :class:`~.source.Reader` (name, suffixes, opener); this
module only lists them. ``open_ingest_source(src, "auto")`` picks the format from file suffixes; a
folder holding files of more than one known format is refused with a request for
``--format``. Formats known by their folder, not a suffix: a Hugging Face
``save_to_disk`` folder (``state.json`` beside ``dataset_info.json``), an LMDB environment
(``data.mdb``), a MosaicML MDS folder (an ``index.json`` listing MDS shards) and a LitData
``optimize()`` folder (an ``index.json`` with ``chunks`` and ``config``).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from shardserve.proto.errors import InvalidDataError

from . import (
    arrow_files,
    hdf5_files,
    hf_folder,
    image_folder,
    litdata_chunks,
    lmdb_env,
    mds,
    numpy_files,
    pt_files,
    webdataset_tar,
)
from .source import IngestSource, Reader, other_files

#: Every reader; those known by a folder are tried first, in this order.
READERS: tuple[Reader, ...] = (
    pt_files.READER,
    numpy_files.READER,
    arrow_files.PARQUET,
    arrow_files.ARROW,
    webdataset_tar.READER,
    hdf5_files.READER,
    hf_folder.READER,
    lmdb_env.READER,
    mds.READER,
    litdata_chunks.READER,
    image_folder.READER,
)
_BY_NAME = {r.name: r for r in READERS}
FORMATS = ("auto", *_BY_NAME)


#: Every suffix a file-based reader reads.
SUFFIXES: tuple[str, ...] = tuple(s for r in READERS for s in r.suffixes)


def claimed(src: Path) -> str | None:
    """The folder format that claims ``src`` (a save_to_disk folder, an LMDB environment, a
    LitData folder)."""
    for r in READERS:
        if r.claims is not None and r.claims(src):
            return r.name
    return None


def detect(src: Path, only: Sequence[Path] | None = None) -> str:
    """The format of an existing ``src``: a folder format that claims it, else the one format
    of its suffix (a file) or of its files' suffixes (a folder, or ``only`` those files)."""
    if only is None and (name := claimed(src)) is not None:
        return name
    if only is not None:
        names = {p.suffix.lower() for p in only}
    elif src.is_file():
        names = {src.suffix.lower()}
    else:
        names = {p.suffix.lower() for p in src.rglob("*") if p.is_file()}
    found = sorted(r.name for r in READERS if names.intersection(r.suffixes))
    if not found:
        known = ", ".join(s for r in READERS for s in r.suffixes)
        raise InvalidDataError(
            f"source {src} holds no files ingest can read ({known}); nothing to ingest"
        )
    if len(found) > 1:
        raise InvalidDataError(
            f"source {src} holds files of several formats ({', '.join(found)}); "
            "choose one with --format"
        )
    return found[0]


def open_ingest_source(
    src: Path,
    fmt: str = "auto",
    threads: int = 2,
    stacked: bool = False,
    only: Sequence[Path] | None = None,
    max_sample_bytes: int | None = None,
    value_format: str = "auto",
) -> IngestSource:
    """Open ``src`` as format ``fmt`` (``"auto"`` detects it); ``stacked`` is for ``.pt``;
    ``only``: read just these files of ``src`` (one split of it).

    The one place a missing source is reported."""
    if fmt not in FORMATS:
        raise InvalidDataError(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")
    if not src.exists():
        raise InvalidDataError(f"source {src} does not exist")
    if fmt == "auto":
        fmt = detect(src, only)
    if stacked and fmt != "pt":
        raise InvalidDataError(f"--stacked applies to .pt files; {src} is {fmt}")
    reader = _BY_NAME[fmt]
    kw: dict[str, object] = {"threads": threads}
    if stacked:
        kw["stacked"] = True
    if only is not None:
        if not reader.suffixes:
            raise InvalidDataError(f"source {src}: a {fmt} source is a whole folder, not files")
        kw["only"] = list(only)
    if value_format != "auto":
        if not reader.valued:
            raise InvalidDataError(f"--value-format applies to LMDB values; {src} is {fmt}")
        kw["value_format"] = value_format
    if max_sample_bytes is not None and reader.bounded:
        kw["max_sample_bytes"] = max_sample_bytes
    source = reader.open(src, **kw)
    # Files of no format beside the ones read (a .pkl or a suffix-less torch.save file among
    # .pt files, notes): reported, never dropped without a word. A folder format reads its own
    # metadata files, and a split's files were chosen by the split: neither is reported.
    if only is None and src.is_dir() and reader.suffixes:
        source.left_out = other_files(src, source.files)
    return source
