"""The distribution's shape: folders are packages, and the import boundaries hold."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import tomllib

from tests.support.slowness import scaled

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {
    "shardserve.proto": "proto",
    "shardserve.server": "server",
    "shardserve.client": "client",
}


def _listed_packages() -> set[str]:
    return set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )


def _package_folders() -> set[str]:
    found = set()
    for pkg, folder in FOLDERS.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            found.add(".".join([pkg, *rel.parts]))
    return found


def test_every_package_folder_is_listed() -> None:
    """Each folder with an __init__.py under proto/server/client is listed in pyproject.toml, so wheels ship it."""
    assert _package_folders() == _listed_packages()


def _imported_after(modules: str) -> set[str]:
    code = (
        "import importlib, pkgutil, sys\n"
        f"for top in {modules!r}.split(','):\n"
        "    pkg = importlib.import_module(top)\n"
        "    for m in pkgutil.walk_packages(pkg.__path__, top + '.'):\n"
        "        if not m.name.endswith(('.demo', '.__main__')):\n"
        "            importlib.import_module(m.name)\n"
        "print(','.join(sorted({n.split('.')[0] for n in sys.modules})))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=scaled(120)
    )
    assert out.returncode == 0, out.stderr
    return set(out.stdout.strip().split(","))


def test_server_and_proto_never_import_torch() -> None:
    """Importing every server and proto module loads no torch: the sidecar image has none."""
    loaded = _imported_after("shardserve.proto,shardserve.server")
    assert "torch" not in loaded


def test_client_never_imports_server_stack() -> None:
    """Importing every client module loads neither fastapi nor pyarrow nor uvicorn."""
    loaded = _imported_after("shardserve.client")
    assert not loaded & {"fastapi", "pyarrow", "uvicorn", "starlette"}


def test_nothing_unpickles() -> None:
    """No module of ours imports pickle-like loaders or turns weights_only off."""
    bad = (
        "import pickle",
        "from pickle",
        "import marshal",
        "import dill",
        "import cloudpickle",
        "weights_only=False",
        "pickle.load",
    )
    for folder in FOLDERS.values():
        for path in (ROOT / folder).rglob("*.py"):
            text = path.read_text()
            assert not [b for b in bad if b in text], path


def test_the_wheel_ships_type_markers_and_the_demo_extra(tmp_path: Path) -> None:
    """A built wheel has py.typed in each package (users' mypy reads our hints) and a `demo`
    extra that brings the server, the client and the demo's data."""
    import zipfile

    out = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp_path), str(ROOT)],
        capture_output=True, text=True, timeout=scaled(300),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    (wheel,) = tmp_path.glob("shardserve-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        meta = next(z.read(n).decode() for n in names if n.endswith(".dist-info/METADATA"))
    for pkg in FOLDERS:
        assert pkg.replace(".", "/") + "/py.typed" in names, pkg
    demo = [
        line for line in meta.splitlines() if line.startswith("Requires-Dist:") and "demo" in line
    ]
    assert any("scikit-learn" in line for line in demo), demo
    assert any("server" in line and "client" in line for line in demo), demo
