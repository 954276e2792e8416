"""Fixtures for store tests: a tmp store root and a runner for the real ``shardserve`` CLI."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support.slowness import scaled

# Until every subcommand module exists, drive the store commands through a parser holding only
# them (the same `add_store_commands` the real CLI wires in).
_STORE_ONLY = (
    "import argparse, sys\n"
    "from shardserve.server.store.commands import add_store_commands\n"
    "p = argparse.ArgumentParser(prog='shardserve')\n"
    "add_store_commands(p.add_subparsers(dest='command', required=True))\n"
    "a = p.parse_args()\n"
    "sys.exit(a.func(a))\n"
)

CliResult = subprocess.CompletedProcess[str]


def cli_command() -> list[str]:
    """argv prefix that runs ``shardserve`` in a fresh interpreter."""
    if importlib.util.find_spec("shardserve.server.serve") is not None:
        return [sys.executable, "-m", "shardserve.server"]
    return [sys.executable, "-c", _STORE_ONLY]


@pytest.fixture
def store_root(tmp_path: Path) -> Path:
    root = tmp_path / "store"
    root.mkdir()
    return root


@pytest.fixture
def cli() -> Callable[..., CliResult]:
    """Run ``shardserve ARGS...`` and return the completed process (text output)."""

    def run(*args: str | os.PathLike[str], timeout: float | None = None) -> CliResult:
        env = {k: v for k, v in os.environ.items() if k != "SHARDSERVE_STORE"}
        return subprocess.run(
            [*cli_command(), *map(str, args)],
            capture_output=True,
            text=True,
            timeout=scaled(90) if timeout is None else timeout,
            env=env,
        )

    return run
