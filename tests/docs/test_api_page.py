"""The Python API page as mkdocstrings renders it: Markdown in the docstrings it shows.

mkdocstrings reads the objects that ``docs/reference/*.md`` name (``::: path``) from source
(griffe, the same static analysis, the same search path as ``mkdocs.yml``) and renders their
docstrings as Markdown. Sphinx roles (``:meth:`x```), doctest directives and ``::`` literal
blocks come out as raw text there, and a default that is a constant's name tells a reader
nothing: examples are fenced code blocks, cross-references ``[name][dotted.path]`` links,
defaults literal values.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Iterator

import griffe

from shardserve.client import Loader, plan
from tests.docs.pages import DOCS, ROOT

#: What renders as raw text in a Markdown docstring: Sphinx roles, doctest directives, reST
#: literal blocks; and interpreter prompts outside an ``Examples:`` section (which mkdocstrings
#: renders as code).
RAW = re.compile(r":(?:meth|func|class|mod|attr|data|exc|obj):`|doctest:|::$", re.M)
PROMPT = re.compile(r"^[ \t]*>>> ", re.M)


def rendered() -> list[griffe.Object]:
    """The objects the reference pages render, with their public members (mkdocs.yml's
    ``filters: ["!^_"]``)."""
    loader = griffe.GriffeLoader(search_paths=[str(ROOT / ".mypy")])
    out: list[griffe.Object] = []
    for page in sorted((DOCS / "reference").glob("*.md")):
        for path in re.findall(r"^::: ([\w.]+)", page.read_text(), re.M):
            loader.load(".".join(path.split(".")[:2]))
            found = loader.modules_collection[path]
            out += _public(found.final_target if found.is_alias else found)
    return out


def _public(obj: griffe.Object) -> Iterator[griffe.Object]:
    yield obj
    for name, member in obj.members.items():
        if not name.startswith("_") and not member.is_alias:
            yield from _public(member)  # type: ignore[arg-type]


def test_the_api_page_docstrings_are_markdown() -> None:
    objects = rendered()
    assert {"shardserve.client.loader.Loader", "shardserve.client.plan.plan"} <= {
        o.path for o in objects
    }
    raw = [
        f"{o.path} ({o.relative_filepath}:{o.lineno}): {m.group(0)!r}"
        for o in objects
        if o.docstring
        for m in [*RAW.finditer(o.docstring.value), *PROMPT.finditer(_prose(o.docstring))]
    ]
    assert raw == []


def _prose(doc: griffe.Docstring) -> str:
    """The docstring's text but its ``Examples:`` sections, as mkdocstrings parses it."""
    sections = doc.parse("google")
    return "\n".join(
        str(s.value) for s in sections if s.kind != griffe.DocstringSectionKind.examples
    )


def test_the_api_page_shows_defaults_as_values() -> None:
    """A default the page shows is a value (``True``, ``"auto"``, ``60.0``), not the name of a
    constant defined somewhere else."""
    named = [
        f"{o.path}({p.name}={p.default})"
        for o in rendered()
        if o.is_function or o.is_class
        for p in (
            o.parameters
            if o.is_function
            else o.members["__init__"].parameters
            if "__init__" in o.members
            else []
        )
        if p.default is not None and re.fullmatch(r"[A-Z][A-Z0-9_]+", str(p.default))
    ]
    assert named == []


def test_loader_and_plan_share_their_defaults() -> None:
    """plan() takes a Loader's job arguments with the Loader's defaults: its ids are the
    batches of the same job."""
    loader = inspect.signature(Loader.__init__).parameters
    ids = inspect.signature(plan).parameters
    shared = set(loader) & set(ids) - {"self"}
    assert {"shuffle", "seed", "drop_last", "env_shuffle", "timeout"} <= shared
    assert {n: ids[n].default for n in shared} == {n: loader[n].default for n in shared}
