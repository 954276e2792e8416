"""The client's public surface and its import hygiene."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import shardserve.client as client
from tests.support.slowness import scaled


def test_all_is_pinned() -> None:
    """`shardserve.client.__all__` lists exactly the documented public names."""
    assert sorted(client.__all__) == [
        "AuthError",
        "BadRequest",
        "DataStallError",
        "DatasetChanged",
        "DatasetCorruptError",
        "DatasetNotFound",
        "JobFailed",
        "JobNotFound",
        "Loader",
        "LoaderStats",
        "Masked",
        "ProtocolError",
        "RankInUse",
        "ResidentTooLarge",
        "ResumeRefused",
        "ServerUnavailable",
        "ShardserveError",
        "StreamLimitExceeded",
        "Texts",
        "TransformError",
        "VarTensor",
        "plan",
        "serve_local",
    ]
    for name in client.__all__:
        assert getattr(client, name) is not None


def test_client_never_imports_server_dependencies() -> None:
    """Importing the client loads neither pyarrow, fastapi nor any shardserve.server module."""
    code = (
        "import sys, shardserve.client; "
        "bad = [m for m in sys.modules if m.split('.')[0] in ('pyarrow', 'fastapi', 'uvicorn') "
        "or m.startswith('shardserve.server')]; print(bad); sys.exit(1 if bad else 0)"
    )
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=scaled(60)
    )
    assert r.returncode == 0, r.stdout + r.stderr


ROOT = Path(__file__).resolve().parents[2]
_IMPORT = re.compile(
    r"^\s*(from shardserve\.client[\w.]* import \w[\w, ]*|import shardserve\.client[\w.]*)", re.M
)


def test_every_documented_client_import_still_works() -> None:
    """Each `shardserve.client` import written in the README, docs, examples, bench and tests
    resolves (the modules behind the public surface were split; these names stay)."""
    files = [ROOT / "README.md", *ROOT.glob("docs/**/*.md")]
    for folder in ("examples", "bench", "tests"):
        files += (ROOT / folder).rglob("*.py")
    imports = sorted({m.strip().rstrip(",") for f in files for m in _IMPORT.findall(f.read_text())})
    assert len(imports) > 10, imports
    code = "\n".join(imports)
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=scaled(120)
    )
    assert r.returncode == 0, code + "\n" + r.stderr


def test_a_server_only_install_names_the_client_extra() -> None:
    """Without torch (a server-only install, here torch made unimportable), `import
    shardserve.client` fails with one ImportError naming the `client` extra, raised before any
    of the client's own modules tries to import torch."""
    code = "import sys; sys.modules['torch'] = None; import shardserve.client"
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=scaled(60)
    )
    assert r.returncode == 1, r.stdout + r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: shardserve.client needs torch"), r.stderr
    assert "pip install 'shardserve[client]'" in last, r.stderr
    assert "ModuleNotFoundError" not in r.stderr and "loader.py" not in r.stderr, r.stderr
