"""Read an image folder in the torchvision ``ImageFolder`` layout: ``SRC/CLASS/IMAGE.jpg``.

Each image is stored as its encoded bytes (field ``image``, binary) with an integer
``label``: the index of its class folder in sorted class names, as ``ImageFolder`` numbers
them. Decoding happens at serving time (the ``decode_image`` transform). The class names
go into the manifest's ``source.classes`` (a JSON list) and ``GET /v1/datasets/{name}``.
Images are read in class order, then sorted file name order, 256 per block. A symlinked
image that points outside the folder is refused.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa

from shardserve.proto.errors import InvalidDataError

from .source import IngestSource, Piece, Reader

#: Suffixes of the images an image folder holds (lower case).
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png")
BLOCK = 256


def _layout(src: Path) -> tuple[list[str], list[tuple[Path, int]]]:
    if not src.is_dir():
        raise InvalidDataError(f"source {src}: an image folder is a folder of CLASS/ folders")
    root = src.resolve()
    classes = sorted(e.name for e in os.scandir(src) if e.is_dir(follow_symlinks=False))
    items: list[tuple[Path, int]] = []
    for label, cls in enumerate(classes):
        names = []
        with os.scandir(src / cls) as entries:
            found = list(entries)
        for e in found:
            if not (e.is_file() and os.path.splitext(e.name)[1].lower() in IMAGE_SUFFIXES):
                continue
            if e.is_symlink():
                _inside(Path(e.path), root)
            names.append(e.name)
        items += [(src / cls / n, label) for n in sorted(names)]
    loose = [
        e.name
        for e in os.scandir(src)
        if e.is_file() and os.path.splitext(e.name)[1].lower() in IMAGE_SUFFIXES
    ]
    if loose:
        raise InvalidDataError(
            f"source {src} has images outside class folders (e.g. {sorted(loose)[0]}); "
            "lay it out as CLASS/IMAGE.jpg"
        )
    if not items:
        raise InvalidDataError(f"source {src} holds no CLASS/IMAGE{IMAGE_SUFFIXES} files")
    return classes, items


def _inside(link: Path, root: Path) -> None:
    """A symlinked image must stay inside the folder: one that points out of it (to a system
    file) would be served to every trainer."""
    target = link.resolve()
    if not target.is_relative_to(root):
        raise InvalidDataError(
            f"{link}: a link to {target}, outside the image folder {root}; refused (copy the "
            "image into the folder if it belongs to the dataset)"
        )


def _pieces(items: list[tuple[Path, int]]) -> Iterator[Piece]:
    for start in range(0, len(items), BLOCK):
        block = items[start : start + BLOCK]
        data, size = [], 0
        for path, _ in block:
            try:
                b = path.read_bytes()
            except OSError as e:
                raise InvalidDataError(f"{path}: cannot be read ({e})") from None
            data.append(b)
            size += len(b)
        cols = {
            "image": pa.array(data, type=pa.binary()),
            "label": np.array([label for _, label in block], dtype=np.int64),
        }
        where = f"{block[0][0]} .. {block[-1][0]}"
        yield Piece(where=where, columns=cols, files=len(block), nbytes=size)


def open_image_folder(src: Path, threads: int = 1, only: list[Path] | None = None) -> IngestSource:
    """A source over ``src`` laid out as ``CLASS/IMAGE.jpg`` (see module docstring)."""
    if only is not None:
        raise InvalidDataError(
            f"source {src}: an image folder's splits are folders (train/CLASS/IMAGE.jpg), "
            "not file names"
        )
    classes, items = _layout(src)
    source = IngestSource(format="imagefolder", files=[p for p, _ in items], pieces=_pieces(items))
    source.info["classes"] = json.dumps(classes)
    return source


READER = Reader("imagefolder", open_image_folder, suffixes=IMAGE_SUFFIXES)
