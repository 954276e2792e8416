"""Ingest into any store with any engine: the CLI's path when ``--store`` is a URI or
``--engine ray`` is asked for.

A dataset is always written as a local folder first (the same writer, the same atomic
publish); for a remote store that folder lives in a temporary directory and is then uploaded
shards first, manifest last (:meth:`~..remote.RemoteStore.upload`). Any failure before the
manifest's upload leaves no dataset under the name.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

from .run import IngestSummary, ingest


def ingest_anywhere(args: argparse.Namespace, remote: Any | None) -> IngestSummary:
    """Run ``shardserve ingest`` for ``args``; ``remote`` is the :class:`RemoteStore` of a URI
    ``--store`` (``None`` for a folder)."""
    started = time.perf_counter()
    if remote is not None and not args.overwrite and remote.exists(args.name):
        from shardserve.proto.errors import InvalidDataError

        raise InvalidDataError(
            f"dataset {args.name!r} already exists in {remote.root}; pass --overwrite to replace it"
        )
    with tempfile.TemporaryDirectory(prefix="shardserve-ingest-") as tmp:
        root = Path(tmp) if remote is not None else Path(args.store)
        overwrite = args.overwrite if remote is None else False
        if args.engine == "ray":
            from .ray_engine import ingest_ray

            summary = ingest_ray(
                args.src,
                root,
                args.name,
                fmt=args.format,
                shard_bytes=args.shard_size,
                overwrite=overwrite,
                variable=args.variable,
                progress=not args.quiet,
                num_cpus=args.ray_cpus,
            )
        else:
            summary = ingest(
                args.src,
                root,
                args.name,
                fmt=args.format,
                shard_bytes=args.shard_size,
                overwrite=overwrite,
                variable=args.variable,
                threads=args.threads,
                progress=not args.quiet,
            )
        if remote is None:
            return summary
        manifest = remote.upload(root / args.name, args.name, overwrite=args.overwrite)
    return IngestSummary(
        manifest, summary.files, summary.source_bytes, time.perf_counter() - started
    )
