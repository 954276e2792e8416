"""Sources laid out as splits (train / test / ...): found, so they are never merged.

Three layouts are recognised, the ones Hugging Face and most dataset downloads use:

* a ``DatasetDict.save_to_disk`` folder: ``dataset_dict.json`` listing its splits, one
  ``save_to_disk`` folder per split;
* split folders: two or more of ``SRC/train/``, ``SRC/test/``... (or under ``SRC/data/``),
  each read as a source of its own (an image folder, Parquet files...);
* split file names, as the Hub lays them out: ``data/train-00000-of-00001.parquet``,
  ``test.parquet``, ``validation_0.tar`` (the name starts with the split's word followed by
  ``-``, ``_``, ``.`` or a digit).

Split words are those the Hub recognises (``train``, ``test``, ``validation``, ``valid``,
``val``, ``dev``, ``eval``...). A source with two or more splits is ingested split by split,
each into a dataset of its own (``NAME-train``, ``NAME-test``: a dataset name is one path
component, so ``/`` is not allowed), or one split with ``split="train"``. When a folder has
splits, every readable file must belong to one, so nothing is left out or merged silently.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from shardserve.proto.errors import InvalidDataError

from .source import list_files

SPLIT_WORDS = (
    "train",
    "training",
    "test",
    "testing",
    "validation",
    "valid",
    "val",
    "dev",
    "eval",
    "evaluation",
)
_FILE = re.compile(rf"^({'|'.join(SPLIT_WORDS)})(?=$|[-_.0-9])", re.IGNORECASE)


@dataclass(frozen=True)
class Split:
    """One split: its name, and the folder (``files is None``) or files that hold it."""

    name: str
    path: Path
    files: tuple[Path, ...] | None = None


def find_splits(src: Path, suffixes: tuple[str, ...]) -> list[Split]:
    """The splits of ``src`` (see module docstring); ``[]`` when it is not split.

    ``suffixes``: the file suffixes ingest reads (a split must hold such files)."""
    if not src.is_dir():
        return []
    dd = src / "dataset_dict.json"
    if dd.is_file():
        return _dataset_dict(src, dd)
    for base in (src, src / "data"):
        if base.is_dir():
            folders = [
                Split(p.name, p)
                for p in sorted(base.iterdir())
                if p.is_dir() and p.name.lower() in SPLIT_WORDS
            ]
            if len(folders) >= 2:
                _check_rest(src, folders, suffixes)
                return folders
    return _by_file_name(src, suffixes)


def _dataset_dict(src: Path, dd: Path) -> list[Split]:
    try:
        names = [str(n) for n in json.loads(dd.read_text())["splits"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise InvalidDataError(f"{dd}: not a DatasetDict's dataset_dict.json ({e})") from None
    out = []
    for n in names:
        folder = src / n
        if not folder.is_dir() or folder.resolve().parent != src.resolve():
            raise InvalidDataError(f"{dd} lists split {n!r}, which is not a folder beside it")
        out.append(Split(n, folder))
    return out


def _split_of(path: Path, src: Path) -> str | None:
    rel = path.relative_to(src)
    for part in rel.parts[:-1]:
        if part.lower() in SPLIT_WORDS:
            return part
    m = _FILE.match(rel.name)
    return m.group(1) if m else None


def _by_file_name(src: Path, suffixes: tuple[str, ...]) -> list[Split]:
    files = list_files(src, suffixes)
    groups: dict[str, list[Path]] = {}
    loose: list[Path] = []
    for f in files:
        name = _split_of(f, src)
        if name is None:
            loose.append(f)
        else:
            groups.setdefault(name, []).append(f)
    if len(groups) < 2:
        return []
    if loose:
        raise InvalidDataError(
            f"source {src} is laid out as splits ({', '.join(sorted(groups))}), but "
            f"{loose[0].relative_to(src)} belongs to none; move it into a split or ingest the "
            "files you want one folder at a time"
        )
    return [Split(k, src, tuple(v)) for k, v in sorted(groups.items())]


def _check_rest(src: Path, folders: list[Split], suffixes: tuple[str, ...]) -> None:
    inside = {f.path.resolve() for f in folders}
    for f in list_files(src, suffixes):
        if not any(p in inside for p in f.resolve().parents):
            raise InvalidDataError(
                f"source {src} is laid out as split folders "
                f"({', '.join(s.name for s in folders)}), but {f.relative_to(src)} is in none; "
                "move it into a split or ingest the folders one at a time"
            )


def pick(splits: list[Split], wanted: str, src: Path) -> Split:
    """The split named ``wanted`` (``--split``), or an error listing those there are."""
    for s in splits:
        if s.name == wanted:
            return s
    have = ", ".join(s.name for s in splits) or "none (it is not laid out as splits)"
    raise InvalidDataError(f"--split {wanted!r}: source {src} has splits {have}")


def split_dataset_name(name: str, split: str) -> str:
    """The dataset a split is ingested into when all splits are: ``NAME-split``."""
    return f"{name}-{split}"
