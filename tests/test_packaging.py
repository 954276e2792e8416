"""The distribution's shape: folders are packages, and the import boundaries hold."""

from __future__ import annotations

import re
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
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(ROOT),
        ],
        capture_output=True,
        text=True,
        timeout=scaled(300),
    )
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


def _extra_closure(extra: str) -> set[str]:
    """The distribution names an extra of pyproject.toml brings, its ``shardserve[...]``
    references followed."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    names: set[str] = set()
    todo, seen = [extra], set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for req in extras[name]:
            named = re.fullmatch(r"shardserve\[(.*)\]", req)
            if named:
                todo += named.group(1).split(",")
            else:
                names.add(re.split(r"[\[<>=~!; ]", req, maxsplit=1)[0].lower().replace("_", "-"))
    return names


def test_the_docs_extra_holds_what_the_docs_build_imports() -> None:
    """`pip install '.[docs]'` then `mkdocs build`: docs/gen_ref.py builds the pages from a
    real server, so the docs extra brings every dependency of the server; the generated pages
    are made without torch (the docs extra has none: the Python API pages are read from
    source)."""
    docs = _extra_closure("docs")
    assert _extra_closure("server") <= docs, _extra_closure("server") - docs
    assert {"mkdocs", "mkdocs-material", "mkdocstrings", "mkdocs-gen-files"} <= docs
    assert "torch" not in docs
    code = (
        "import runpy, sys, tempfile\n"
        "sys.modules['torch'] = None  # any import of torch fails\n"
        "out = tempfile.mkdtemp()\n"
        "sys.argv = ['gen_ref.py', '--out', out]\n"
        f"runpy.run_path({str(ROOT / 'docs' / 'gen_ref.py')!r}, run_name='__main__')\n"
        "import pathlib\n"
        "print(sorted(str(p.relative_to(out)) for p in pathlib.Path(out).rglob('*.md')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=scaled(300), cwd=ROOT
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "reference/http.md" in out.stdout and "performance/results.md" in out.stdout
