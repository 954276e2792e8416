"""The house rules that a grep can check: no import cycles (modules or packages, imports under
``TYPE_CHECKING`` included) and no ``__getattr__`` forwarding in the server."""

from __future__ import annotations

import ast
import re
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


def _stubbed(tree: ast.AST) -> list[str]:
    """Functions defined under ``if TYPE_CHECKING:`` (a mixin's stubs of its host's methods)."""
    return [
        f.name
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for stmt in node.body
        for f in ast.walk(stmt)
        if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
    ]


def test_no_methods_stubbed_under_type_checking_in_the_server() -> None:
    """A part calls its host through a typed Protocol it is given, not as its base class."""
    offenders = {
        str(p.relative_to(ROOT)): names
        for p in sorted((ROOT / "server").rglob("*.py"))
        if (names := _stubbed(ast.parse(p.read_text())))
    }
    assert offenders == {}


def test_the_stub_finder_finds_one() -> None:
    src = "if TYPE_CHECKING:\n    def _close(self) -> None: ...\nelse:\n    def ok(): pass\n"
    assert _stubbed(ast.parse(src)) == ["_close"]


#: A spec's job kind asked outside the one place that chooses it (``server/jobs/kinds/table.py``
#: by ``JobSpec.kind``).
ASKS_THE_KIND = re.compile(r"spec\.mixture\b|\.mixture\s+is\b")
#: Server modules that still read ``spec.mixture``, and why; none of them is streaming or the
#: ``Service``. A module leaves this list when its question moves into the kind.
READS_THE_MIXTURE = {
    # The mixture kind: it is the mixture's own code.
    "server/jobs/kinds/mixture.py": "opens and admits a mixture's sources",
    "server/jobs/mixtures.py": "the mixture kind's admission, schedule and orders, source by source",
    "server/jobs/steering.py": (
        "steering takes a job id from a URL and refuses a job of one dataset by name; the "
        "metrics loop exports weights of mixtures only; quarantines walk a job's sources"
    ),
    # The registry journals a mixture's weight changes with the job.
    "server/registry/jobs.py": "the schedule is the spec's weights and changes; a change needs weights",
}


def test_the_job_kind_is_chosen_once() -> None:
    """Streaming, the ``Service`` and every other server module ask the job's kind object
    (``server/kinds``), never the spec whether it is a mixture; the exceptions are listed."""
    asking = {
        str(p.relative_to(ROOT))
        for p in sorted((ROOT / "server").rglob("*.py"))
        if ASKS_THE_KIND.search(p.read_text())
    }
    assert asking - set(READS_THE_MIXTURE) == set(), "ask the kind (server/kinds) instead"
    assert set(READS_THE_MIXTURE) - asking == set(), "no longer reads it: strike it from the list"
    never = [f for f in asking if f.startswith("server/streaming/") or f == "server/service.py"]
    assert never == []


def test_the_kind_finder_finds_both_ways_of_asking() -> None:
    assert ASKS_THE_KIND.search("if job.spec.mixture is None:")
    assert ASKS_THE_KIND.search("if pinned.mixture is not None:")
    assert not ASKS_THE_KIND.search("self.mixture_admin.status(j.id)")
    assert not ASKS_THE_KIND.search("from .planning.mixture import MixSource")


#: Calls whose ``timeout=`` bounds something a test expects to happen: an HTTP answer, a
#: process or thread finishing, a message arriving, a server starting or stopping.
WAITS = frozenset(
    {
        "get",
        "post",
        "put",
        "delete",
        "request",
        "Client",
        "run",
        "communicate",
        "wait",
        "join",
        "result",
        "recv",
        "recv_kind",
        "create_connection",
        "terminate",
        "run_server",
    }
)
UNSCALED = "# unscaled:"
#: ``httpx.<verb>(...)`` without ``timeout=`` waits httpx's fixed 5 s: a literal too.
HTTP_VERBS = frozenset({"get", "post", "put", "delete", "patch", "request"})


def literal_waits(path: Path, root: Path = ROOT) -> list[str]:
    """``file:line call`` for each ``timeout=<number>`` given to one of :data:`WAITS` in
    ``path`` (or an ``httpx`` call with no ``timeout=``), unless its line says why with
    ``# unscaled: ...``."""
    text = path.read_text()
    lines = text.splitlines()
    out = []
    for node in ast.walk(ast.parse(text)):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else ""
        name = func.id if isinstance(func, ast.Name) else name
        implicit = isinstance(func, ast.Attribute) and ast.unparse(func.value) == "httpx"
        if (
            implicit
            and name in HTTP_VERBS
            and not {"timeout", None} & {k.arg for k in node.keywords}
        ):
            out.append(f"{path.relative_to(root)}:{node.lineno} {ast.unparse(func)} (httpx's 5 s)")
        for kw in node.keywords:
            v = kw.value
            literal = isinstance(v, ast.Constant) and type(v.value) in (int, float)
            said = UNSCALED in lines[v.lineno - 1]
            if name in WAITS and kw.arg == "timeout" and literal and not said:
                out.append(f"{path.relative_to(root)}:{v.lineno} {ast.unparse(func)}")
    return out


def test_waits_on_expected_events_in_tests_are_scaled() -> None:
    """A ``timeout=<number>`` that bounds an expected event in a test (an HTTP call, a subprocess, a
    process or thread wait, a raw receive) is ``scaled(...)`` (tests/support/slowness.py)."""
    # On a busy machine a fixed number fails a passing test. Worker scripts (``_*.py``) run in
    # processes of their own and are left out.
    files = [p for p in (ROOT / "tests").rglob("*.py") if not p.name.startswith("_")]
    assert [w for p in files for w in literal_waits(p)] == []


def test_the_literal_wait_finder_finds_one(tmp_path: Path) -> None:
    probe = tmp_path / "test_probe.py"
    source = (
        "import httpx\nhttpx.get('u', timeout=10)\nhttpx.get('u', timeout=scaled(10))\n"
        "t.join(timeout=5)  # unscaled: expected never to finish\nhttpx.post('u')\n"
    )
    probe.write_text(source)
    assert literal_waits(probe, tmp_path) == [
        "test_probe.py:2 httpx.get",
        "test_probe.py:5 httpx.post (httpx's 5 s)",
    ]


#: Server flags that set a timing a test then waits on (a heartbeat, an idle or stream
#: timeout, a transform or store deadline).
TIMING_FLAGS = re.compile(
    r"--(heartbeat-s|idle-after-s|job-ttl-s|stream-timeout-s|transform-timeout-s|"
    r"store-timeout-s|http-idle-timeout-s)\b"
)


def test_the_burner_pass_covers_every_test_file_that_sets_a_server_timing() -> None:
    """`.ci/run` runs again under a CPU burner each test file that starts a server with a
    timing flag (tests/server/test_flags.py only parses them)."""
    ci = (ROOT / ".ci" / "run").read_text()
    listed = re.search(r'default_burner="([^"]*)"', ci)
    assert listed, "no default_burner list in .ci/run"
    covered = listed.group(1).split()
    timed = [
        str(p.relative_to(ROOT))
        for p in sorted((ROOT / "tests").rglob("test_*.py"))
        if TIMING_FLAGS.search(p.read_text()) and p.name != "test_flags.py"
    ]
    missing = [f for f in timed if not any(f == c or f.startswith(c + "/") for c in covered)]
    assert missing == [], f"add to default_burner in .ci/run: {missing}"


def bench_header_faults(path: Path, root: Path = ROOT) -> list[str]:
    """``file:line what`` for each ``tests`` import and each ``sys.path`` edit in ``path``."""
    faults = []
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        where = f"{path.relative_to(root)}:{getattr(node, 'lineno', 0)}"
        faults += [f"{where} imports {n}" for n in names if n.split(".")[0] == "tests"]
        if (
            isinstance(node, ast.Attribute)
            and node.attr == "path"
            and isinstance(node.value, ast.Name)
            and node.value.id == "sys"
        ):
            faults.append(f"{where} edits sys.path")
    return sorted(faults, key=lambda f: int(f.split(":")[1].split()[0]))


def test_benchmarks_share_helpers_through_bench_support_only() -> None:
    """Benchmark scripts import their helpers from ``bench/_support.py`` (this folder is on a
    script's path), never from ``tests/`` and never by editing ``sys.path``."""
    faults = [f for p in sorted((ROOT / "bench").glob("*.py")) for f in bench_header_faults(p)]
    assert faults == []


def test_the_bench_header_finder_finds_both(tmp_path: Path) -> None:
    probe = tmp_path / "bench_probe.py"
    probe.write_text(
        "import sys\nsys.path.insert(0, '..')\nfrom tests.support.server import run_server\n"
        "import tests.support\nfrom _support import run_server\n"
    )
    assert bench_header_faults(probe, tmp_path) == [
        "bench_probe.py:2 edits sys.path",
        "bench_probe.py:3 imports tests.support.server",
        "bench_probe.py:4 imports tests.support",
    ]
