"""The docs' pages and their fenced code blocks, with the directives a page gives a block.

A block's directives are HTML comments on the lines right above its fence (the rendered page
does not show them):

* ``<!-- docs-test skip: why -->``: the block is not run (say what runs it instead, or why
  nothing can here);
* ``<!-- docs-test replace: old => new -->``: ``old`` is replaced by ``new`` before the block
  runs (a size that would take hours here, a path that does not exist here).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
_OPEN = re.compile(r"^```(\w*)")
SNIPPET = re.compile(r'^--8<-- "([^"]+)"$', re.M)
_DIRECTIVE = re.compile(r"^<!-- docs-test (skip|replace): (.*?) -->$")


@dataclass
class Block:
    """One fenced block: its page, its number on that page (from 1) among blocks of its
    language, its code (includes resolved) and its directives."""

    page: str
    number: int
    lang: str
    code: str
    included: tuple[str, ...] = ()
    skip: str | None = None
    replace: list[tuple[str, str]] = field(default_factory=list)

    @property
    def where(self) -> str:
        return f"{self.page} ({self.lang} block {self.number})"

    def runnable(self) -> str:
        """The code with the page's replacements made; each ``old`` must occur."""
        code = self.code
        for old, new in self.replace:
            assert old in code, f"{self.where}: replace {old!r}, which the block does not hold"
            code = code.replace(old, new)
        return code


def pages() -> list[Path]:
    return sorted(p for p in DOCS.rglob("*.md") if "_incoming" not in p.parts)


def page_blocks(page: Path) -> list[Block]:
    """Every fenced block of ``page``, in order, includes (``--8<--``) resolved."""
    rel = str(page.relative_to(ROOT))
    out: list[Block] = []
    counts: dict[str, int] = {}
    pending: list[tuple[str, str]] = []
    lines = page.read_text().splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        directive = _DIRECTIVE.match(line)
        opened = _OPEN.match(line)
        if directive:
            pending.append((directive.group(1), directive.group(2)))
        elif opened:
            end = lines.index("```", i + 1)
            lang = opened.group(1)
            counts[lang] = counts.get(lang, 0) + 1
            raw = "\n".join(lines[i + 1 : end]) + "\n"
            block = Block(
                rel,
                counts[lang],
                lang,
                SNIPPET.sub(lambda m: (ROOT / m.group(1)).read_text(), raw),
                tuple(SNIPPET.findall(raw)),
            )
            for kind, text in pending:
                if kind == "skip":
                    block.skip = text
                else:
                    old, arrow, new = text.partition(" => ")
                    assert arrow, f"{rel}:{i}: write <!-- docs-test replace: old => new -->"
                    block.replace.append((old, new))
            out.append(block)
            pending = []
            i = end
        elif line.strip():
            assert not pending, f"{rel}:{i + 1}: a docs-test directive must sit right above a fence"
        i += 1
    return out


def blocks(lang: str) -> list[Block]:
    """Every fenced block of ``lang`` on every page."""
    return [b for page in pages() for b in page_blocks(page) if b.lang == lang]
