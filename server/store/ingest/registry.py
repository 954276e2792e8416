"""Input formats by name, and detection of the format of a source path.

``open_source(src, "auto")`` picks the format from file suffixes; a folder holding files of
more than one known format is refused with a request for ``--format``. Two formats are known
by their folder, not a suffix: a Hugging Face ``save_to_disk`` folder (``state.json`` beside
``dataset_info.json``) and an LMDB environment (``data.mdb``).
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
    "webdataset": (".tar",),
    "hdf5": (".h5", ".hdf5"),
    "imagefolder": (".jpg", ".jpeg", ".png"),  # CLASS/IMAGE.jpg (issue 15)
}
#: Formats recognised by a marker file in the source folder.
FOLDER_FORMATS = ("hf", "lmdb")
FORMATS = ("auto", *SUFFIXES, *FOLDER_FORMATS)


def _folder_format(src: Path) -> str | None:
    if src.is_file():
        return "lmdb" if src.name == "data.mdb" else None
    if (src / "state.json").is_file() and (src / "dataset_info.json").is_file():
        return "hf"
    if (src / "data.mdb").is_file():
        return "lmdb"
    return None


def detect(src: Path) -> str:
    """The format of ``src`` from its suffix (a file) or its files' suffixes (a folder)."""
    if not src.exists():
        raise InvalidDataError(f"source {src} does not exist")
    folder = _folder_format(src)
    if folder is not None:
        return folder
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
    from .hdf5_files import open_hdf5
    from .hf_folder import open_hf
    from .image_folder import open_image_folder
    from .lmdb_env import open_lmdb
    from .numpy_files import open_numpy
    from .pt_files import open_pt
    from .webdataset_tar import open_webdataset

    return {
        "pt": open_pt, "npz": open_numpy, "parquet": open_parquet, "arrow": open_arrow,
        "webdataset": open_webdataset, "hdf5": open_hdf5, "hf": open_hf, "lmdb": open_lmdb,
        "imagefolder": open_image_folder,
    }  # fmt: skip


def open_source(src: Path, fmt: str = "auto", threads: int = 2, stacked: bool = False) -> Source:
    """Open ``src`` as format ``fmt`` (``"auto"`` detects it); ``stacked`` is for ``.pt``."""
    if fmt not in FORMATS:
        raise InvalidDataError(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")
    if not src.exists():
        raise InvalidDataError(f"source {src} does not exist")
    if fmt == "auto":
        fmt = detect(src)
    if stacked and fmt != "pt":
        raise InvalidDataError(f"--stacked applies to .pt files; {src} is {fmt}")
    if fmt == "pt":
        return _readers()["pt"](src, threads=threads, stacked=stacked)
    return _readers()[fmt](src, threads=threads)
