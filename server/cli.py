"""The ``shardserve`` command: one entry point, one subcommand per job to do.

Each subcommand lives with the code it drives; this module only wires them together so that
``shardserve --help`` lists everything and nothing heavy is imported before it is needed.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def build_parser() -> argparse.ArgumentParser:
    from .serve import add_serve_command
    from .store.commands import add_store_commands

    parser = argparse.ArgumentParser(
        prog="shardserve",
        description="Serve pre-collated training batches from memory-mapped Arrow shards.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_store_commands(sub)
    add_serve_command(sub)
    demo = sub.add_parser(
        "demo",
        help="ingest a packaged dataset, serve it and train a small model through the Loader",
        description="End-to-end demo on a fresh machine (needs the client extra: torch).",
    )
    demo.add_argument("--epochs", type=int, default=3)
    demo.add_argument("--batch-size", type=int, default=64)
    demo.add_argument("--store", default=None, help="store folder (default: a temporary one)")
    demo.set_defaults(func=_run_demo)
    return parser


def _run_demo(args: argparse.Namespace) -> int:
    # The demo trains with torch, so it lives in the client package and loads only when asked.
    from shardserve.client.demo import run_demo

    return run_demo(epochs=args.epochs, batch_size=args.batch_size, store=args.store)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
