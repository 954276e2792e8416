"""The house rules that a grep can check: no import cycles (modules or packages, imports under
``TYPE_CHECKING`` included) and no ``__getattr__`` forwarding in the server."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {
    "proto": "shardserve.proto",
    "server": "shardserve.server",
    "client": "shardserve.client",
}


def _modules() -> dict[str, Path]:
    out = {}
    for folder, name in PACKAGES.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = [name, *path.relative_to(ROOT / folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _package(module: str, path: Path) -> str:
    return module if path.name == "__init__.py" else module.rsplit(".", 1)[0]


def _imports(module: str, path: Path, known: dict[str, Path]) -> Iterator[str]:
    here = _package(module, path).split(".")
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = here[: len(here) - node.level + 1] if node.level else []
            target = ".".join([*base, *([node.module] if node.module else [])])
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                yield sub if sub in known else target
        elif isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on:
                    low[v] = min(low[v], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def test_no_import_cycles_between_modules_or_packages() -> None:
    """A cycle makes import order matter and the layers meaningless; TYPE_CHECKING hides none."""
    mods = _modules()
    graph = {m: {d for d in _imports(m, p, mods) if d in mods and d != m} for m, p in mods.items()}
    assert _cycles(graph) == [], "modules importing each other"
    packages: dict[str, set[str]] = {}
    for m, deps in graph.items():
        a = _package(m, mods[m])
        for d in deps:
            b = _package(d, mods[d])
            if a != b and not b.startswith(a + "."):  # a package may use its own subpackages
                packages.setdefault(a, set()).add(b)
    assert _cycles(packages) == [], "packages importing each other"


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_getattr_forwarding_in_the_server() -> None:
    """Wrappers delegate explicitly (``server.source.Wrapped``), so a seam says what it offers."""
    offenders = [
        str(p.relative_to(ROOT))
        for p in (ROOT / "server").rglob("*.py")
        if "def __getattr__" in p.read_text()
    ]
    assert offenders == []
