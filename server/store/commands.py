"""Store subcommands of the ``shardserve`` CLI: ``ingest``, ``ls``, ``inspect``, ``verify``.

Our own errors print one line to stderr (no traceback). Exit status: 0 ok; 1 a corrupt
dataset or an I/O failure; 2 bad input (missing source, bad name, inconsistent fields,
existing dataset without ``--overwrite``); 130 interrupted.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the commands import what they use when they run: a quick --help
    from .backend import StoreBackend
    from .remote.object_fs import StoreOptions
    from .remote.stores import RemoteStore

# Imports of pydantic, pyarrow and the readers wait until a command runs: `shardserve --help`
# and `shardserve ls --help` must answer at once, and `import pyarrow.dataset` alone pulls pandas.

ENV_STORE = "SHARDSERVE_STORE"

#: The store subcommands and their one-line help (the top-level `shardserve --help` lists them
#: without importing what they run).
STORE_COMMANDS: dict[str, str] = {
    "ingest": "pack a source into a dataset: .pt/.pth, .npz/.npy, .parquet, .arrow/.feather, "
    "WebDataset .tar, HDF5 .h5, LMDB, a Hugging Face save_to_disk folder, a MosaicML MDS or "
    "LitData folder, an image folder",
    "ls": "list the datasets of a store",
    "inspect": "show a dataset's schema, counts and shards",
    "verify": "check every shard's checksum and readability",
}

_EXAMPLES: dict[str, str] = {
    "ingest": "examples:\n"
    "  shardserve ingest ./train_pt/ --store ./store --name train\n"
    "  shardserve ingest data.parquet --store ./store --name tab --shard-size 128MiB\n"
    "  shardserve ingest imgs/ --store s3://bucket/store --name imgs --format imagefolder\n"
    "  shardserve ingest raw/ --store ./store --name feats --map mymod:featurize --workers 2",
    "ls": "example:\n  shardserve ls --store ./store",
    "inspect": "example:\n  shardserve inspect --store ./store train",
    "verify": "example:\n  shardserve verify --store ./store train",
}


def parse_size(text: str) -> int:
    """``"256MiB"`` -> 268435456; decimal (MB) and binary (MiB) units, bytes if none."""
    from pydantic import ByteSize, TypeAdapter, ValidationError

    try:
        size = int(TypeAdapter(ByteSize).validate_python(text))
    except ValidationError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size like 256MiB, 64MB or 1048576"
        ) from None
    if size < 1:
        raise argparse.ArgumentTypeError(f"size {text!r} must be at least 1 byte")
    return size


def _human(n: float) -> str:
    from pydantic import ByteSize

    return ByteSize(int(n)).human_readable()


def _guarded(
    command: str, fn: Callable[[argparse.Namespace], int]
) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        if args.store is None:
            print(
                f"shardserve {command}: error: --store is required (or set {ENV_STORE})",
                file=sys.stderr,
            )
            return 2
        from shardserve.proto.errors import DataError, DatasetCorruptError, ShardserveError

        from .remote.object_fs import StoreUnavailable

        try:
            return fn(args)
        except StoreUnavailable as e:
            print(f"shardserve {command}: {e}", file=sys.stderr)
            return 1
        except DatasetCorruptError as e:
            print(f"shardserve {command}: corrupt: {e}", file=sys.stderr)
            return 1
        except (DataError, ShardserveError) as e:
            print(f"shardserve {command}: error: {e}", file=sys.stderr)
            return 2
        except OSError as e:
            print(f"shardserve {command}: I/O error: {e}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            print(f"shardserve {command}: interrupted; nothing was published", file=sys.stderr)
            return 130

    return run


def _options() -> StoreOptions:
    from ..settings import StoreDefaults
    from .remote.object_fs import StoreOptions

    # The CLI entry point is where the environment is read (object-store endpoint, secrets).
    return StoreOptions.from_env(os.environ, StoreDefaults().store_endpoint)


def _open_store(store: str) -> StoreBackend:
    """An existing store to read (``ls``, ``inspect``, ``verify``): a local path that is not
    a folder is a typo to name, not an empty store."""
    from shardserve.proto.errors import InvalidDataError

    from .backend import open_store
    from .remote.object_fs import is_uri

    if not is_uri(store) and not Path(store).is_dir():
        what = "is not a folder" if Path(store).exists() else "does not exist"
        raise InvalidDataError(f"store {store} {what}; pass the folder that ingest wrote")
    return open_store(store, options=_options())


def _open_remote(store: str) -> RemoteStore:
    """The object store ``store`` (a URI), to upload to."""
    from .remote.stores import RemoteStore

    return RemoteStore(store, _options())


def _cmd_ingest(args: argparse.Namespace) -> int:
    from .remote.object_fs import is_uri

    if getattr(args, "engine", "local") == "ray" or is_uri(args.store):
        from .ingest.to_store import ingest_anywhere

        summary = ingest_anywhere(args, _open_remote(args.store) if is_uri(args.store) else None)
    else:
        from .ingest.run import ingest_all

        summary = ingest_all(
            args.src,
            args.store,
            args.name,
            fmt=args.format,
            shard_bytes=args.shard_size,
            overwrite=args.overwrite,
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
    print(summary.line())
    return 0


def _cmd_ls(args: argparse.Namespace) -> int:
    manifests = _open_store(args.store).list()
    if not manifests:
        from .remote.object_fs import display_uri, is_uri

        shown = display_uri(args.store) if is_uri(args.store) else args.store
        print(f"no datasets in {shown}", file=sys.stderr)  # never a URI's credentials
        return 0
    print(f"{'NAME':<32} {'SAMPLES':>12} {'SHARDS':>7} {'SIZE':>11}  FIELDS")
    for m in manifests:
        fields = ", ".join(f.name for f in m.fields)
        print(
            f"{m.name:<32} {m.num_samples:>12} {len(m.shards):>7} {_human(m.total_bytes):>11}  {fields}"
        )
    return 0


def _cmd_inspect(args: argparse.Namespace) -> int:
    from .versions import content_id

    m = _open_store(args.store).manifest(args.name)
    print(f"dataset   {m.name}")
    print(f"version   {content_id(m)}")  # what jobs pin (GET /v1/jobs/{id}: spec.version)
    print(f"samples   {m.num_samples}")
    print(f"shards    {len(m.shards)} ({_human(m.total_bytes)})")
    print(f"created   {m.created_at}")
    for k, v in sorted(m.source.items()):
        print(f"source.{k:<10} {v}")
    print("fields:")
    for f in m.fields:
        shape = "[" + ", ".join("?" if d == -1 else str(d) for d in f.shape) + "]"
        print(f"  {f.name:<24} {f.dtype:<8} {shape:<16} {f.kind}")
    print("shards:")
    print(f"  {'PATH':<28} {'ROWS':>10} {'BYTES':>12}  CHECKSUM")
    for s in m.shards:
        print(f"  {s.path:<28} {s.rows:>10} {s.bytes:>12}  {s.checksum}")
    return 0


def _cmd_verify(args: argparse.Namespace) -> int:
    manifest = _open_store(args.store).verify_dataset(args.name, progress=not args.quiet)
    print(f"{manifest.name}: {len(manifest.shards)} shards ok ({_human(manifest.total_bytes)})")
    return 0


def add_store_commands(sub: argparse._SubParsersAction) -> None:
    """Add ``ingest``, ``ls``, ``inspect`` and ``verify`` to the ``shardserve`` parser."""
    for name, summary in STORE_COMMANDS.items():
        configure_store_command(name, sub.add_parser(name, help=summary))


def configure_store_command(name: str, p: argparse.ArgumentParser) -> None:
    """Give the parser of store command ``name`` its arguments, examples and function."""
    from ..settings import StoreDefaults

    default_store = StoreDefaults().store  # $SHARDSERVE_STORE, read as `serve` reads it
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = _EXAMPLES[name]
    p.description = p.description or STORE_COMMANDS[name][0].upper() + STORE_COMMANDS[name][1:]
    if name == "ingest":
        p.description = (
            "Pack a source into a memory-mappable dataset; nothing is published on error."
        )
        p.add_argument("src", type=Path, help="a file or a folder (searched recursively)")
    p.add_argument(
        "--store",
        default=default_store,
        help=f"store folder or URI such as s3://bucket/prefix (default: ${ENV_STORE})",
    )
    if name == "ingest":
        _add_ingest_flags(p)
    elif name in ("inspect", "verify"):
        p.add_argument("name", help="the dataset's name (see `shardserve ls`)")
    if name == "verify":
        p.add_argument("--quiet", action="store_true", help="no progress bar")
    commands: dict[str, Callable[[argparse.Namespace], int]] = {
        "ingest": _cmd_ingest,
        "ls": _cmd_ls,
        "inspect": _cmd_inspect,
        "verify": _cmd_verify,
    }
    p.set_defaults(func=_guarded(name, commands[name]))


def _add_ingest_flags(p: argparse.ArgumentParser) -> None:
    """``shardserve ingest``'s flags: the name, how the source is read, then how the ingest
    runs (mapping, threads and processes, shard size, engine)."""
    p.add_argument("--name", required=True, help="dataset name (letters, digits, '.', '_', '-')")
    _add_reading_flags(p)
    _add_run_flags(p)


def _add_reading_flags(p: argparse.ArgumentParser) -> None:
    from .ingest.decode import VALUE_FORMATS
    from .ingest.registry import FORMATS

    p.add_argument(
        "--format",
        choices=FORMATS,
        default="auto",
        help="the source's format (default auto: from the files' suffixes, or the folder's "
        "marker files for hf, lmdb, mds and litdata)",
    )
    p.add_argument(
        "--variable",
        action="append",
        default=[],
        metavar="FIELD",
        help="declare FIELD variable-shape (repeatable)",
    )
    p.add_argument(
        "--stacked",
        action="store_true",
        help=".pt files hold a dict of tensors sharing a leading dimension: one sample per row",
    )
    p.add_argument(
        "--split",
        metavar="SPLIT",
        help="a source laid out as splits (train/, data/test-*.parquet, a DatasetDict): ingest "
        "only this one (default: each split as its own dataset NAME-SPLIT)",
    )
    p.add_argument(
        "--value-format",
        choices=VALUE_FORMATS,
        default="auto",
        help="how LMDB values are read (default auto: .pt / .npy by their magic, else raw bytes)",
    )
    p.add_argument(
        "--max-sample-bytes",
        type=parse_size,
        default=256 << 20,
        help="refuse a sample (or a tar member) larger than this (default 256MiB)",
    )


def _add_run_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--map",
        metavar="MODULE:FUNCTION",
        help="run this function over each source sample before writing (deterministic work, once)",
    )
    p.add_argument(
        "--workers", type=int, default=0, help="processes for --map (default 0: in this process)"
    )
    p.add_argument(
        "--threads", type=int, default=2, help="loader threads for .pt files (default 2)"
    )
    p.add_argument(
        "--shard-size",
        type=parse_size,
        default=256 << 20,
        help="target shard size (default 256MiB)",
    )
    p.add_argument(
        "--overwrite", action="store_true", help="replace an existing dataset of this name"
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument(
        "--engine",
        choices=("local", "ray"),
        default="local",
        help="local: this process; ray: Ray Data tasks write the shards (shardserve[ray]; "
        "a local Ray instance, or the cluster at RAY_ADDRESS)",
    )
    p.add_argument("--ray-cpus", type=int, default=None, help="CPUs of a local Ray instance")
