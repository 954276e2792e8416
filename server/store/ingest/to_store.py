"""Ingest into any store with any engine: the CLI's path when ``--store`` is a URI or
``--engine ray`` is asked for.

A dataset is always written as a local folder first (the same writer, the same atomic
publish); for a remote store that folder lives in a temporary directory and is then uploaded
shards first, manifest last (:meth:`~..remote_publish.RemotePublisher.upload`). Any failure
before the manifest's upload leaves no dataset under the name.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from ..remote.publish import RemotePublisher
from ..remote.stores import RemoteStore
from .run import IngestReport, IngestSummary, ingest_all


def ingest_anywhere(args: argparse.Namespace, remote: RemoteStore | None) -> IngestReport:
    """Run ``shardserve ingest`` for ``args``; ``remote`` is the :class:`RemoteStore` of a URI
    ``--store`` (``None`` for a folder)."""
    started = time.perf_counter()
    if remote is not None:
        RemotePublisher(remote).check_absent(args.name, args.overwrite)  # fail before any work
    if args.engine == "ray":
        return _ingest_with_ray(args, remote)
    assert remote is not None  # a local store with the local engine never comes here
    return _ingest_then_upload(args, remote, started)


def _ingest_with_ray(args: argparse.Namespace, remote: RemoteStore | None) -> IngestReport:
    from .ray_engine import ingest_ray

    # With a remote store the tasks upload their own shards (they may run on other machines)
    # and the driver publishes the manifest.
    return IngestReport(
        (
            ingest_ray(
                args.src,
                args.store,
                args.name,
                fmt=args.format,
                shard_bytes=args.shard_size,
                overwrite=args.overwrite,
                variable=args.variable,
                progress=not args.quiet,
                num_cpus=args.ray_cpus,
                remote=remote,
            ),
        )
    )


def _ingest_then_upload(
    args: argparse.Namespace, remote: RemoteStore, started: float
) -> IngestReport:
    """Ingest into a temporary folder with this process, then upload each dataset made."""
    with tempfile.TemporaryDirectory(prefix="shardserve-ingest-") as tmp:
        report = ingest_all(
            args.src,
            tmp,
            args.name,
            fmt=args.format,
            shard_bytes=args.shard_size,
            variable=args.variable,
            threads=args.threads,
            progress=not args.quiet,
            stacked=args.stacked,
            map_fn=args.map,
            workers=args.workers,
            split=args.split,
            max_sample_bytes=args.max_sample_bytes,
            value_format=args.value_format,
        )
        out = []
        for s in report.summaries:
            name = s.manifest.name
            manifest = RemotePublisher(remote).upload(
                Path(tmp) / name, name, overwrite=args.overwrite
            )
            out.append(
                IngestSummary(
                    manifest,
                    s.files,
                    s.source_bytes,
                    time.perf_counter() - started,
                    s.metadata,
                    s.split,
                )
            )
    return IngestReport(tuple(out), report.splits)
