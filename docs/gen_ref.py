"""Generate the reference pages from the code, at docs build time (mkdocs-gen-files runs this).

Each page is made from the one place its facts live, so the docs cannot drift from the code:

* ``reference/cli.md``       the argparse parser (``shardserve.server.cli.build_parser``)
* ``reference/settings.md``  ``shardserve.server.settings.Settings`` (flags, variables, defaults)
* ``reference/metrics.md``   the Prometheus registry of a real ``Service`` (local and remote store)
* ``reference/http.md``      the FastAPI app's OpenAPI schema
* ``performance/results.md`` ``bench/results/*.json`` as ``python -m bench`` wrote them
  (``gen_results.py``)

Every ``*_page()`` function returns markdown and is tested (tests/docs/test_docs.py);
``python docs/gen_ref.py --out DIR`` writes the pages to a folder without mkdocs.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# gen_results.py sits beside this file, which mkdocs-gen-files runs by path, not as a module.
sys.path.insert(0, str(Path(__file__).resolve().parent))
from gen_results import results_page, table

# --- CLI -----------------------------------------------------------------------------------


def _flag_row(action: argparse.Action) -> list[object]:
    names = ", ".join(f"`{s}`" for s in action.option_strings) or f"`{action.dest}`"
    if action.metavar is not None:
        names += f" `{action.metavar}`"
    elif action.choices is not None and action.option_strings:
        names += " `{" + ",".join(map(str, action.choices)) + "}`"
    return [names, action.help or ""]


def cli_page() -> str:
    """Every subcommand: its summary, description, flags (by group) and examples."""
    from shardserve.server.cli import COMMANDS, build_parser

    parser = build_parser()
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    out = [
        "# CLI reference\n",
        "Generated from the `shardserve` argparse parser; `shardserve COMMAND --help` prints "
        "the same. See also [the CLI overview](cli-overview.md).\n",
        "```text\n" + parser.format_usage() + "```\n",
    ]
    for name, (summary, _) in COMMANDS.items():
        sp = subs.choices[name]
        out.append(f"## `shardserve {name}`\n\n{summary[0].upper() + summary[1:]}.\n")
        if sp.description:
            out.append(sp.description + "\n")
        if name == "demo":
            out.append("Its arguments are the demo's own: `shardserve demo --help`.\n")
            continue
        for group in sp._action_groups:
            rows = [_flag_row(a) for a in group._group_actions if a.help != argparse.SUPPRESS]
            rows = [r for r in rows if r[0] != "`-h`, `--help`"]
            if rows:
                out.append(f"**{group.title}**\n\n" + table(["flag", "meaning"], rows))
        if sp.epilog:
            out.append("```text\n" + sp.epilog + "\n```\n")
    return "\n".join(out)


# --- settings ------------------------------------------------------------------------------


def _binary(n: int) -> str:
    """``n`` bytes in the largest binary unit it fills (``68719476736``: ``64 GiB``)."""
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):g} {unit}"
    return f"{n} bytes"


def settings_page() -> str:
    """Every ``serve`` setting: flag, environment variable, default, meaning; by group."""
    from shardserve.server.flags import flag_name, grouped_fields
    from shardserve.server.settings import OTHER_ENV, Settings, env_name

    fields = Settings.model_fields
    out = [
        "# Settings and environment variables\n",
        "Generated from `shardserve.server.settings.Settings`. Every setting of "
        "`shardserve serve` is a flag and a `SHARDSERVE_*` variable; a flag wins over the "
        "variable, the variable over the default. List settings take JSON or a comma-separated "
        "string from the environment. An unknown `SHARDSERVE_*` variable is warned about at "
        "start, naming the closest real one.\n",
    ]
    for title, names in grouped_fields().items():
        rows = []
        for name in names:
            info = fields[name]
            default = info.get_default(call_default_factory=True)
            shown = "required" if info.is_required() else f"`{default!r}`"
            if name.endswith("bytes") and isinstance(default, int) and default >= 1 << 20:
                shown += f" ({_binary(default)})"  # 68719476736 reads as 64 GiB
            rows.append(
                [f"`{flag_name(name, info)}`", f"`{env_name(name)}`", shown, info.description]
            )
        out.append(
            f"## {title[0].upper() + title[1:]}\n\n"
            + table(["flag", "variable", "default", "meaning"], rows)
        )
    out.append(
        "## Other variables\n\nRead by the client, the compose file and the scripts, "
        "not by `serve`:\n\n"
        + table(["variable", "read by"], [[f"`{k}`", v] for k, v in OTHER_ENV.items()])
    )
    return "\n".join(out)


# --- metrics and HTTP: from a real Service (never started) ---------------------------------


def _service(tmp: Path, remote: bool) -> Any:
    from shardserve.server.service import Service
    from shardserve.server.settings import Settings

    store = tmp / ("remote" if remote else "local")
    store.mkdir()
    kw: dict[str, Any] = {"store": store.as_uri() if remote else store, "state_dir": tmp / "st"}
    if remote:
        kw["cache_dir"] = tmp / "cache"
    return Service(Settings(**kw))


def _families(remote: bool) -> Iterator[tuple[str, str, str, str]]:
    with tempfile.TemporaryDirectory() as d:
        service = _service(Path(d), remote)
        try:
            for fam in service.metrics.registry.collect():
                name = fam.name + ("_total" if fam.type == "counter" else "")
                labels = sorted(
                    {k for s in fam.samples for k in s.labels if k not in ("le", "quantile")}
                )
                yield name, fam.type, ", ".join(labels), fam.documentation
        finally:
            service.stop()


def _per_job_labels() -> dict[str, str]:
    """The labels of the per-job series, seen with one job of one rank (a server without
    jobs exports those families empty)."""
    from shardserve.server.runtime.metrics import JobsSnapshot, Metrics, RankSeries

    m = Metrics()
    m.watch_jobs(lambda: JobsSnapshot(connected={"j": 1}, ranks=[RankSeries("j", 0, 1, 1, 0, 0)]))
    out = {}
    for fam in m.registry.collect():
        name = fam.name + ("_total" if fam.type == "counter" else "")
        out[name] = ", ".join(sorted({k for s in fam.samples for k in s.labels}))
    return out


def metric_names() -> dict[str, tuple[str, str, str]]:
    """Every metric a server exports (a local store's and a remote store's): name -> (type,
    labels, help)."""
    per_job = _per_job_labels()
    out: dict[str, tuple[str, str, str]] = {}
    for remote in (False, True):
        for name, kind, labels, doc in _families(remote):
            out.setdefault(name, (kind, labels or per_job.get(name, ""), doc))
    return out


def metrics_page() -> str:
    from shardserve.server.runtime.metrics import JOB_STATES

    local = {n for n, *_ in _families(False)}
    rows = [
        [f"`{n}`", kind, labels or "", doc + ("" if n in local else " (remote stores only)")]
        for n, (kind, labels, doc) in sorted(metric_names().items())
    ]
    return (
        "# Metrics reference\n\nGenerated from the Prometheus registry of a server "
        "(`GET /metrics`). Per-job series are labelled `job_id` and `rank` and exist while "
        f"the job is {', '.join(JOB_STATES[:3])}. See also "
        "[the metrics overview](metrics-overview.md) and "
        "[the dashboard](../operations/dashboards.md).\n\n"
        + table(["name", "type", "labels", "meaning"], rows)
    )


def openapi() -> dict[str, Any]:
    """The control plane's OpenAPI schema, as the app builds it."""
    from shardserve.server.control.app import create_app

    with tempfile.TemporaryDirectory() as d:
        service = _service(Path(d), remote=False)
        try:
            return create_app(service).openapi()
        finally:
            service.stop()


def http_page() -> str:
    schema = openapi()
    rows = []
    for path, ops in sorted(schema["paths"].items()):
        for method, op in ops.items():
            codes = ", ".join(sorted(op.get("responses", {})))
            rows.append([f"`{method.upper()} {path}`", op.get("summary", ""), codes])
    models = []
    for name, model in sorted(schema.get("components", {}).get("schemas", {}).items()):
        props = model.get("properties", {})
        fields = ", ".join(f"`{k}`" for k in props)
        # The first paragraph: a sentence cut at its first line break reads as a typo.
        about = model.get("description", "").split("\n\n")[0].replace("\n", " ")
        models.append([f"`{name}`", about, fields])
    return (
        "# HTTP API reference\n\nGenerated from the control plane's OpenAPI schema (served at "
        "`GET /openapi.json`, behind the token). See also "
        "[the control plane overview](http-overview.md).\n\n"
        + table(["endpoint", "summary", "responses"], rows)
        + "\n## Models\n\n"
        + table(["model", "description", "fields"], models)
    )


PAGES = {
    "reference/cli.md": cli_page,
    "reference/settings.md": settings_page,
    "reference/metrics.md": metrics_page,
    "reference/http.md": http_page,
    "performance/results.md": results_page,
}


def write_all(open_page: Any) -> None:
    for path, make in PAGES.items():
        with open_page(path, "w") as f:
            f.write(make())


if __name__ == "__main__":  # python docs/gen_ref.py --out DIR
    out_dir = Path(sys.argv[sys.argv.index("--out") + 1])

    def _open(path: str, mode: str) -> Any:
        (out_dir / path).parent.mkdir(parents=True, exist_ok=True)
        return open(out_dir / path, mode)

    write_all(_open)
elif __name__ == "<run_path>":  # mkdocs-gen-files runs this file with runpy.run_path
    import mkdocs_gen_files

    write_all(mkdocs_gen_files.open)
