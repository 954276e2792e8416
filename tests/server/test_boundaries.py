"""The server package reaches the client only by starting it as a program (``demo``)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from tests.support.slowness import scaled

ROOT = Path(__file__).resolve().parents[2]


def test_no_server_module_imports_the_client() -> None:
    """No server module imports shardserve.client, even lazily inside a function."""
    pattern = re.compile(r"^\s*(from|import)\s+shardserve\.client\b", re.M)
    offenders = [p for p in (ROOT / "server").rglob("*.py") if pattern.search(p.read_text())]
    assert offenders == []


def test_cli_builds_without_loading_client_or_torch() -> None:
    """Building the whole `shardserve` parser (demo included) loads neither the client nor torch."""
    code = (
        "import sys\n"
        "from shardserve.server.cli import build_parser\n"
        "build_parser().parse_known_args(['demo', '--epochs', '1'])\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('shardserve.client')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=scaled(60)
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
