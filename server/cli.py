"""The ``shardserve`` command: one entry point, one subcommand per job to do.

Each subcommand lives with the code it drives; this module only wires them together. Only the
subcommand being run (or asked for ``--help``) is built: ``shardserve --help`` lists every
command from their one-line summaries and imports neither pydantic nor pyarrow, so it answers
at once (``bench/bench_cli.py`` measures it).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Callable, Collection, Sequence
from typing import Any

from .serve import SERVE_SUMMARY, configure_serve
from .store.commands import STORE_COMMANDS, configure_store_command

#: The server extra's import packages: a command that needs one of them and finds it missing
#: says how to install it instead of printing a traceback.
SERVER_EXTRA_MODULES = (
    "pyarrow",
    "zmq",
    "fastapi",
    "uvicorn",
    "pydantic_settings",
    "prometheus_client",
    "xxhash",
    "tqdm",
)
# From a clone, as the README says (shardserve is on no package index yet).
INSTALL_SERVER = "pip install '.[server]' in a clone of shardserve"
INSTALL_DEMO = "pip install '.[demo]' in a clone of shardserve"

_DEMO_SUMMARY = "ingest a packaged dataset, serve it and train a small model through the Loader"

_EPILOG = """getting started:
  shardserve demo                                         the whole path in one command
  shardserve ingest ./my_pt_files --store ./store --name train
  shardserve serve --store ./store                        then, in the trainer:
      loader = shardserve.client.Loader("http://127.0.0.1:7070", dataset="train",
                                        batch_size=256)

`shardserve COMMAND --help` shows a command's flags and examples."""


def _configure_demo(p: argparse.ArgumentParser) -> None:
    p.set_defaults(func=_run_demo)


#: name -> (one-line summary, what fills the command's parser); in `--help` order.
COMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None]]] = {
    "demo": (_DEMO_SUMMARY, _configure_demo),
    "ingest": (STORE_COMMANDS["ingest"], lambda p: configure_store_command("ingest", p)),
    "serve": (SERVE_SUMMARY, configure_serve),
    "ls": (STORE_COMMANDS["ls"], lambda p: configure_store_command("ls", p)),
    "inspect": (STORE_COMMANDS["inspect"], lambda p: configure_store_command("inspect", p)),
    "verify": (STORE_COMMANDS["verify"], lambda p: configure_store_command("verify", p)),
}


class _VersionAction(argparse.Action):
    """``--version``, reading the installed metadata only when asked."""

    def __init__(self, option_strings: list[str], dest: str, **kw: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, help="print the version and exit")

    def __call__(self, parser: argparse.ArgumentParser, *_: Any) -> None:
        from shardserve.proto.distribution import installed_version

        print(f"shardserve {installed_version()}")  # stdout, as `--version` conventionally does
        parser.exit()


def build_parser(commands: Collection[str] | None = None) -> argparse.ArgumentParser:
    """The ``shardserve`` parser; ``commands`` names the subcommands to build in full (their
    flags, defaults and function), ``None`` all of them. The others are listed, not built."""
    parser = argparse.ArgumentParser(
        prog="shardserve",
        description="Serve pre-collated training batches from memory-mapped Arrow shards: "
        "ingest a source once into a store, serve the store, read batches with "
        "shardserve.client.Loader.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action=_VersionAction)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (summary, configure) in COMMANDS.items():
        if name == "demo":
            # --help goes to the demo itself, like every other argument
            p = sub.add_parser(
                name,
                add_help=False,
                help=summary,
                description=f"End-to-end demo on a fresh machine ({INSTALL_DEMO}).",
            )
        else:
            p = sub.add_parser(name, help=summary)
        if commands is None or name in commands:
            configure(p)
    return parser


#: What the demo imports (its child, its server and its data): the `demo` extra's packages.
DEMO_MODULES = ("torch", "httpx", "zmq", "pyarrow", "fastapi", "uvicorn", "sklearn")


def _run_demo(args: argparse.Namespace, rest: Sequence[str]) -> int:
    import importlib.util

    missing = [m for m in DEMO_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        print(
            f"shardserve demo: needs the demo extra ({', '.join(missing)} missing): {INSTALL_DEMO}",
            file=sys.stderr,
        )
        return 2
    # The demo trains with torch, so it is the client's entry point (python -m
    # shardserve.client.demo) run as a child: the server package imports neither.
    return subprocess.call([sys.executable, "-m", "shardserve.client.demo", *rest])


def _chosen(argv: Sequence[str]) -> set[str]:
    """The subcommand ``argv`` names (its first word that is not an option), if any."""
    first = next((a for a in argv if not a.startswith("-")), None)
    return {first} if first in COMMANDS else set()


def _warn_unknown_env() -> None:
    from .settings import unknown_env

    for line in unknown_env(os.environ):
        print(f"shardserve: warning: {line}", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        return _main(argv)
    except ModuleNotFoundError as e:
        if e.name is None or e.name.split(".")[0] not in SERVER_EXTRA_MODULES:
            raise
        print(
            f"shardserve: this command needs the server extra ({e.name} is missing): "
            f"{INSTALL_SERVER}",
            file=sys.stderr,
        )
        return 2


def _search_cwd() -> None:
    """Find ``--transforms mymod`` and ``--map mymod:fn`` next to the user, as ``python -m``
    would: the console script's ``sys.path`` starts at its own folder, not the current one.
    Appended, so a file here never shadows an installed package."""
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.append(cwd)


def _main(argv: list[str]) -> int:
    _search_cwd()
    parser = build_parser(_chosen(argv))
    args, rest = parser.parse_known_args(argv)
    if args.func is _run_demo:
        return _run_demo(args, rest)
    if rest:
        hint = ""
        port = any(a == "--port" or a.startswith("--port=") for a in rest)
        if port and "serve" in _chosen(argv):
            # The flag other servers use: say which two take its place here.
            hint = (
                "; shardserve serve takes addresses, not a port: --http HOST:PORT for the control "
                "plane and --data tcp://HOST:PORT for batches (PORT 0 picks a free one)"
            )
        parser.error(f"unrecognized arguments: {' '.join(rest)}{hint}")
    _warn_unknown_env()
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
