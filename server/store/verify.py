"""Full integrity check of a dataset folder, without mapping the whole dataset first.

Used by ``shardserve verify``: each shard in turn is checked for presence, size, checksum and
readability (schema and row count), so the first bad shard is named even when others are fine.
"""

from __future__ import annotations

import sys
from pathlib import Path

from shardserve.proto.manifest import Manifest

#: How a dataset is checked when it is mapped (see :mod:`.read.dataset`); here, not beside the
#: read path, so that the store can check a mode without importing pyarrow.
VERIFY_MODES = ("lazy", "full", "off")


def verify_dataset(folder: Path, manifest: Manifest, progress: bool = False) -> None:
    """Raise ``DatasetCorruptError`` naming the first bad shard of ``folder``."""
    from tqdm import tqdm  # the progress bar's library only where a dataset is verified

    from .read.shards import verify_shard  # pyarrow only where a dataset is read

    with tqdm(
        total=manifest.total_bytes,
        unit="B",
        unit_scale=True,
        desc=f"verify {manifest.name}",
        disable=not progress,
        file=sys.stderr,
    ) as bar:
        for info in manifest.shards:
            verify_shard(folder / info.path, info, manifest.fields, bar)
