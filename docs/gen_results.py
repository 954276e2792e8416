"""The "Benchmark results" page, generated from ``bench/results/*.json`` (docs/gen_ref.py
writes it with the reference pages).

Benchmarks record their facts under keys of their own; this page shows each result as a
table of how it ran (command, date, machine, cores, load average, or "not recorded"), then its
measurements as tables whose headers carry the units the keys' suffixes name (``epoch_s``,
``samples_s``, ``cpu_ms_per_batch``, ``idle_kib``...). No local path reaches the page.
"""

from __future__ import annotations

import ast
import json
import re
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"


def _cell(value: object) -> str:
    text = "" if value is None else str(value)
    return text.replace("|", "\\|").replace("\n", " ")


def table(head: list[str], rows: list[list[object]]) -> str:
    """A Markdown table (the reference pages use it too)."""
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


#: How, when and where a benchmark ran: the keys of the ``run`` object ``python -m bench``
#: adds to each result, and the older keys results recorded the same facts under (they differ
#: between benchmarks; the first present wins). What is not recorded is said to be.
RUN_KEYS: dict[str, tuple[str, ...]] = {
    "command": (),  # a result's own "command" is the program it timed, not how it was run
    "date": ("date", "when"),
    "load_before": ("load_before", "load_average_before", "load", "load_average"),
    "load_after": ("load_after", "load_average_after"),
}
#: Keys about the run, not measurements: shown in the run table, not again below it.
NOT_MEASURED = {
    "run",
    "machine",
    "host",
    "bench",
    "benchmark",
    "quick",
    "torch",
    "python",
    *(k for keys in RUN_KEYS.values() for k in keys),
}
NOT_RECORDED = "not recorded"
#: Rates, whose ``_s`` is "per second" (elsewhere ``_s`` is a duration in seconds), and the
#: names that say more than their keys.
LABELS = {
    "samples_s": ("samples/s", ""),
    "steps_s": ("steps/s", ""),
    "trial_samples_s": ("each trial", "samples/s"),
    "shardserve_x": ("shardserve faster by", "×"),
    "command": ("program run", ""),
}
#: The columns of a list of targets: [what, measured, bound] or [what, measured, rule, bound].
TARGET_COLUMNS = {3: ["target", "measured", "bound"], 4: ["target", "measured", "rule", "bound"]}
_UNITS = {"s": "s", "ms": "ms", "us": "µs", "mb": "MB", "gb": "GB", "kib": "KiB", "bytes": "bytes"}
_RATIO = re.compile(r"(^|_)(vs|x|over|ratios?|speedup|spread)(_|$)")
#: Section names for the keys benchmarks group their measurements under.
HEADINGS = {
    "rows": "Measured",
    "config": "Configuration",
    "cases": "Cases",
    "formats": "Formats",
    "graphs": "Graphs",
    "ratios": "Ratios (×)",
    "target": "Target",
    "targets": "Targets",
}
#: An absolute path (a venv's interpreter, a temporary store): only its last part is shown.
_ABS_PATH = re.compile(r"(?<![\w:/.~])/(?:[\w.+@-]+/)+([\w.+@-]+)")


def _label_unit(key: str, inherited: str = "") -> tuple[str, str]:
    """A measurement's name and unit, from its key's suffix (``epoch_s``: seconds,
    ``samples_s``: samples per second, ``cpu_ms_per_batch``: ms per batch, ``vs_*``: a ratio)."""
    if key in LABELS:
        return LABELS[key]
    per = re.fullmatch(r"(.+)_(s|ms|us)_per_(\w+)", key)
    if per:
        return per.group(1).replace("_", " "), f"{_UNITS[per.group(2)]}/{per.group(3)}"
    suffix = re.fullmatch(r"(.+)_(s|ms|us|mb|gb|kib|bytes)", key)
    if suffix:
        return suffix.group(1).replace("_", " "), _UNITS[suffix.group(2)]
    return key.replace("_", " "), "×" if _RATIO.search(key) else inherited


def _head(key: str, inherited: str = "", value: object = 0.0) -> str:
    """A column or row name with its unit; a unit ``×`` given by a group of ratios wins."""
    label, unit = _label_unit(key, inherited)
    unit = "×" if inherited == "×" else unit
    return f"{label} ({unit})" if unit and not isinstance(value, (bool, str)) else label


def _fmt(v: object) -> str:
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        if v != v:  # NaN: not measured in this row
            return "–"
        return f"{v:,.3g}" if abs(v) < 1000 else f"{v:,.0f}"
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, list) and all(not isinstance(x, (dict, list)) for x in v):
        return ", ".join(_fmt(x) for x in v) or "none"
    return "–" if v is None else _ABS_PATH.sub(r"\1", str(v))


def _flat(v: object) -> bool:
    """A value one table cell shows: a scalar or a list of scalars."""
    return not isinstance(v, (dict, list)) or (
        isinstance(v, list) and all(not isinstance(x, (dict, list)) for x in v)
    )


def _date(value: object) -> str:
    text = str(value)
    for parse in (
        lambda s: datetime.strptime(s, "%Y%m%dT%H%M%SZ").replace(tzinfo=timezone.utc),
        datetime.fromisoformat,
    ):
        try:
            when = parse(text)
        except ValueError:
            continue
        return when.astimezone(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return _fmt(text)


def _run_rows(data: dict[str, Any], script: Path) -> list[list[object]]:
    """Command, date, machine, cores and load of one result, or "not recorded"."""
    run = data["run"] if isinstance(data.get("run"), dict) else {}
    found = {
        name: run[name] if name in run else next((data[k] for k in keys if k in data), None)
        for name, keys in RUN_KEYS.items()
    }
    machine = run.get("machine", data.get("machine", data.get("host")))
    cpus = run.get("cpus")
    if isinstance(machine, dict):
        cpus = cpus or machine.get("cpus")
        machine = machine.get("platform", machine.get("machine"))
    elif isinstance(machine, str) and (m := re.search(r"\bcpus=(\d+)", machine)):
        cpus, machine = cpus or m.group(1), machine[: m.start()].strip()
    load = "{} (1, 5, 15 min)".format
    command = found["command"]
    quick = data.get("quick", None if command is None else "--quick" in str(command).split())
    rows: list[list[object]] = [
        [
            "command",
            f"`{command}`"
            if command
            else f"{NOT_RECORDED} (written by `{script.relative_to(ROOT)}`)",
        ],
        ["date", _date(found["date"]) if found["date"] else NOT_RECORDED],
        ["machine", _fmt(machine) if machine else NOT_RECORDED],
        ["cores", cpus or NOT_RECORDED],
        [
            "load average before",
            load(_fmt(found["load_before"])) if found["load_before"] else NOT_RECORDED,
        ],
        [
            "load average after",
            load(_fmt(found["load_after"])) if found["load_after"] else NOT_RECORDED,
        ],
        ["sizes", NOT_RECORDED if quick is None else "`--quick` (small)" if quick else "full"],
    ]
    software = [f"{k} {data[k]}" for k in ("python", "torch") if k in data]
    return [*rows, *([["software", ", ".join(software)]] if software else [])]


def _scalar_table(items: dict[str, Any], unit: str = "") -> str:
    return table(["", "value"], [[_head(k, unit, v), _fmt(v)] for k, v in items.items()])


def _row_table(rows: dict[str, dict[str, Any]], unit: str = "", named: bool = True) -> str:
    """One row per name, one column per measurement (each with its unit); a few rows of many
    measurements the other way round, so that the page needs no sideways scrolling."""
    head = list(dict.fromkeys(k for r in rows.values() for k, v in r.items() if _flat(v)))
    first = {k: next(r[k] for r in rows.values() if k in r) for k in head}
    if len(head) > 8 and len(rows) <= 4:
        return table(
            ["", *rows],
            [[_head(k, unit, first[k]), *(_fmt(r.get(k)) for r in rows.values())] for k in head],
        )
    names = [[f"**{name}**"] if named else [] for name in rows]
    return table(
        ["" for _ in names[:1] if named] + [_head(k, unit, first[k]) for k in head],
        [[*n, *(_fmt(r.get(k)) for k in head)] for n, r in zip(names, rows.values(), strict=True)],
    )


def _list_table(rows: list[Any], unit: str) -> str:
    """A list of dicts (a column per key) or of lists (targets: what, measured, bound)."""
    if all(isinstance(r, dict) for r in rows):
        return _row_table({f"run {i + 1}": r for i, r in enumerate(rows)}, unit, named=False)
    width = max(len(r) if isinstance(r, list) else 1 for r in rows)
    cells = [r if isinstance(r, list) else [r] for r in rows]
    return table(TARGET_COLUMNS.get(width, [""] * width), [[_fmt(c) for c in r] for r in cells])


def _section(key: str, value: Any, depth: int, unit: str = "") -> list[str]:
    """One group of measurements under a heading named by its key (never a path of keys).
    A group's unit (``idle_kib``: KiB, ``ratios``: ×) is its values' unit where theirs is
    not said."""
    label, unit = _label_unit(key, unit)
    title = HEADINGS.get(key) or (f"{label} ({unit})" if unit else label)
    if isinstance(value, list):
        return [f"{'#' * min(depth, 6)} {title}\n", _list_table(value, unit)] if value else []
    body = _body(value, depth + 1, unit) if isinstance(value, dict) else []
    return [f"{'#' * min(depth, 6)} {title}\n", *body] if body else []


def _rows(value: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The groups that are rows of one table: two or more dicts of values measuring the same
    things (a key in common with the most common set of keys); unrelated groups (a target
    beside the times) keep sections of their own."""
    groups = {
        k: frozenset(x for x, y in v.items() if _flat(y))
        for k, v in value.items()
        if isinstance(v, dict)
    }
    groups = {k: keys for k, keys in groups.items() if keys}
    if len(groups) < 2:
        return {}
    common = Counter(groups.values()).most_common(1)[0][0]
    rows = {k: value[k] for k, keys in groups.items() if keys & common}
    return rows if len(rows) > 1 else {}


def _row_name(key: str, shared_unit: str) -> str:
    """A row's name: a data name as it is ("raw, 1 rank"), a key as words, with its unit when
    the rows' units differ (``first_batch_s``: "first batch (s)")."""
    if not key.isidentifier():
        return key
    return _label_unit(key)[0] if shared_unit else _head(key)


def _body(value: dict[str, Any], depth: int, unit: str = "") -> list[str]:
    """Rows of measurements as one table (two or more dicts of values: one row each), single
    values as another, deeper groups below them under their own headings."""
    flat = {k: v for k, v in value.items() if _flat(v)}
    out = [_scalar_table(flat, unit)] if flat else []
    rows = _rows(value)
    if rows:
        units = {_label_unit(k)[1] for k in rows}
        shared = units.pop() if len(units) == 1 else ""  # idle_kib, peak_kib: KiB
        named = {_row_name(k, shared): r for k, r in rows.items()}
        out.append(_row_table(named, shared or unit))
    for k, v in value.items():
        if k not in rows and not _flat(v):
            out += _section(k, v, depth, unit)
    for name, r in rows.items():
        for k, v in r.items():
            if not _flat(v):
                out += _section(f"{name}: {k}", v, depth, unit)
    return out


def _script(stem: str) -> Path:
    """The benchmark that writes ``bench/results/STEM.json`` (a dated name keeps its prefix)."""
    name = re.sub(r"-\d{8}T\d{6}Z$", "", stem)
    return ROOT / "bench" / f"{name if name.startswith('bench_') else 'bench_' + name}.py"


def _result(path: Path) -> list[str]:
    script = _script(path.stem)
    title = script.stem.removeprefix("bench_").replace("_", " ")
    out = [f"## {title.upper() if len(title) <= 3 else title[:1].upper() + title[1:]}\n"]
    if script.is_file():
        doc = ast.get_docstring(ast.parse(script.read_text())) or ""
        summary = re.sub(r"\s*\(issue \d+\)", "", doc.split("\n\n")[0].replace("\n", " "))
        out.append(summary.replace("``", "`") + f" (`{path.name}`)\n")
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        return [*out, f"`{path.name}` could not be read: {e}\n"]
    if not isinstance(data, dict):
        return [*out, f"`{path.name}` holds no result object.\n"]
    out.append(table(["run", ""], _run_rows(data, script)))
    return out + _body({k: v for k, v in data.items() if k not in NOT_MEASURED}, 3)


def results_page(results: Path = RESULTS) -> str:
    """One section per ``bench/results/*.json``: how it was run (command, date, machine,
    cores, load), then its measurements as tables with units."""
    files = sorted(results.glob("*.json")) if results.is_dir() else []
    out = [
        "# Benchmark results\n",
        "Generated at docs build time from `bench/results/*.json`: the runs committed with "
        "the code (what `python -m bench` wrote on the machine each names), or a run on the "
        "machine that built these docs. Never copied by hand. Ratios (×) are within one run; "
        f'what a result did not record is marked "{NOT_RECORDED}". Load averages are over '
        "the last 1, 5 and 15 minutes, before and after the run.\n",
    ]
    if not files:
        out.append(
            "No results on the machine that built these docs: run `python -m bench --quick` "
            "(or `python -m bench`), then build the docs again.\n"
        )
    for f in files:
        out += _result(f)
    return "\n".join(out)
