"""The ``shardserve`` command: one entry point, one subcommand per job to do.

Each subcommand lives with the code it drives; this module only wires them together so that
``shardserve --help`` lists everything and nothing heavy is imported before it is needed.
"""

from __future__ import annotations

import argparse
import subprocess
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
    sub.add_parser(
        "demo",
        add_help=False,  # --help goes to the demo itself, like every other argument
        help="ingest a packaged dataset, serve it and train a small model through the Loader",
        description="End-to-end demo on a fresh machine (needs the client extra: torch).",
    ).set_defaults(func=_run_demo)
    return parser


def _run_demo(args: argparse.Namespace, rest: Sequence[str]) -> int:
    # The demo trains with torch, so it is the client's entry point (python -m
    # shardserve.client.demo) run as a child: the server package imports neither.
    return subprocess.call([sys.executable, "-m", "shardserve.client.demo", *rest])


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if args.func is _run_demo:
        return _run_demo(args, rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
