"""The documentation: generated reference pages, code blocks that run or parse, the README.

The site itself is built with warnings as errors by .ci/run (`mkdocs build --strict`); these
tests check what the build cannot: that the generated pages say what the code says, that the
Getting-started loop trains against a real server, and that every code block is valid.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import yaml

from shardserve.server.cli import COMMANDS, build_parser
from shardserve.server.settings import Settings, env_name
from tests.docs.pages import DOCS, ROOT, SNIPPET, blocks, pages
from tests.support.server import ServerProc, run_server
from tests.support.slowness import scaled


def gen_ref() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_ref", DOCS / "gen_ref.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_generated_cli_and_settings_pages_cover_the_code() -> None:
    g = gen_ref()
    cli, settings = g.cli_page(), g.settings_page()
    for name in COMMANDS:
        assert f"## `shardserve {name}`" in cli
    for name in Settings.model_fields:
        assert f"`{env_name(name)}`" in settings
    assert "`--create`" in cli and "`--format`" in cli


def test_generated_metrics_and_http_pages_cover_the_server() -> None:
    g = gen_ref()
    names = g.metric_names()
    assert "shardserve_client_wait_seconds_total" in names
    assert "shardserve_cache_hits_total" in names  # remote-store metrics are listed too
    page = g.metrics_page()
    assert all(f"`{n}`" in page for n in names)
    http = g.http_page()
    assert "`POST /v1/jobs`" in http and "`GET /metrics`" in http


def test_the_results_page_is_generated_from_bench_json(tmp_path: Path) -> None:
    """Each result is a section of tables whose headers carry units; rows of rows are one
    table, not a heading per key path; what a result did not record says so."""
    (tmp_path / "e2e.json").write_text(
        json.dumps(
            {
                "load_average": [1.5, 1.2, 1.0],
                "cases": {
                    "cifar": {
                        "n": 4096,
                        "rows": {
                            "DataLoader w2": {"samples_s": 1234.5, "vs_floor": 0.1, "epoch_s": 2.5},
                            "shardserve shm": {
                                "samples_s": 98765.4,
                                "vs_floor": 0.9,
                                "epoch_s": 0.04,
                            },
                        },
                        "targets": [{"target": "shm vs w2", "value": 80.0, "met": True}],
                    }
                },
                "first_batch_s": {"whole_file": 23.6, "blocks": 1.07},
                "read_share": {"whole_file": 1.0, "blocks": 0.19},
                "target": {"first_batch_s": 2.0, "met": True},
            }
        )
    )
    page = gen_ref().results_page(tmp_path)
    assert "## E2E" in page
    assert "|  | samples/s | vs floor (×) | epoch (s) |" in page
    assert "| **shardserve shm** | 98,765 | 0.9 | 0.04 |" in page
    assert "| shm vs w2 | 80 | yes |" in page
    # Groups of the same measurements are rows of one table, each with its unit; a group of
    # other measurements beside them keeps a section of its own.
    assert "|  | whole file | blocks |" in page and "| **first batch (s)** | 23.6 | 1.07 |" in page
    assert "### Target\n\n|  | value |\n|---|---|\n| first batch (s) | 2 |\n| met | yes |" in page
    assert "| load average before | 1.5, 1.2, 1 (1, 5, 15 min) |" in page
    for fact in ("date", "machine", "cores", "load average after"):
        assert f"| {fact} | not recorded |" in page, fact
    assert "| command | not recorded (written by `bench/bench_e2e.py`) |" in page
    assert " / " not in "".join(line for line in page.splitlines() if line.startswith("#"))
    assert "No results" in gen_ref().results_page(tmp_path / "none")


def test_a_result_the_bench_runner_stamped_names_its_command_date_cores_and_load(
    tmp_path: Path,
) -> None:
    """``python -m bench`` adds a ``run`` object to each result a script wrote; the page shows
    it instead of "not recorded", and never a local path (a venv's interpreter, a store)."""
    from bench.__main__ import stamp

    result = tmp_path / "cli.json"
    result.write_text(
        json.dumps(
            {
                "command": "/home/someone/project/.venv/bin/shardserve",
                "rows": {"a": {"median_s": 0.05}, "b": {"median_s": 0.2}},
                "store": "/tmp/tmpab12/store",
            }
        )
    )
    stamp(
        result,
        {
            "command": "python bench/bench_cli.py --quick",
            "date": "2026-11-28T02:00:00+00:00",
            "machine": "Linux-x86_64",
            "cpus": 2,
            "load_before": [3.5, 2.0, 1.0],
            "load_after": [4.0, 2.5, 1.5],
        },
    )
    page = gen_ref().results_page(tmp_path)
    assert "| command | `python bench/bench_cli.py --quick` |" in page
    assert "| date | 2026-11-28 02:00 UTC |" in page
    assert "| cores | 2 |" in page
    assert "| load average after | 4, 2.5, 1.5 (1, 5, 15 min) |" in page
    assert "not recorded" not in page.split("## CLI")[1]
    assert "| program run | shardserve |" in page and "| store | store |" in page
    assert "/home/" not in page and "/tmp/" not in page


#: An absolute path in a generated page: a checkout's, a venv's, a temporary folder's.
ABS_PATH = re.compile(r"(?<![\w:/.~])/(?:home|work|tmp|root|usr|opt|var|Users|private)/")


def test_the_committed_results_render_without_local_paths_and_with_units() -> None:
    page = gen_ref().results_page()
    assert not ABS_PATH.search(page), ABS_PATH.search(page)
    assert page.count("## ") >= len(list((ROOT / "bench" / "results").glob("*.json")))
    assert "(s)" in page and "samples/s" in page and "(×)" in page
    assert "| cores |" in page and "| date |" in page


def test_every_page_is_in_the_nav() -> None:
    config = yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=yaml.BaseLoader)

    def walk(node: object) -> list[str]:
        if isinstance(node, str):
            return [node]
        if isinstance(node, list):
            return [p for n in node for p in walk(n)]
        if isinstance(node, dict):
            return [p for n in node.values() for p in walk(n)]
        return []

    nav = set(walk(config["nav"]))
    on_disk = {str(p.relative_to(DOCS)) for p in pages()}
    assert on_disk - nav == set()
    assert nav - on_disk == set(gen_ref().PAGES)  # the generated ones


def test_every_python_block_compiles() -> None:
    found = blocks("python")
    assert len(found) > 10
    for b in found:
        try:
            compile(b.code, b.where, "exec")
        except SyntaxError as e:
            pytest.fail(f"{b.where}: does not compile: {e}\n{b.code}")


def test_every_shardserve_command_in_the_docs_parses() -> None:
    """Each `shardserve ...` line of a bash block parses with the real CLI parser."""
    parser = build_parser()
    problems = []
    for b in [*blocks("bash"), *blocks("sh"), *blocks("console")]:
        for line in b.code.replace("\\\n", " ").splitlines():
            line = line.split("#")[0].strip().removeprefix("$ ")
            if not line.startswith("shardserve ") or "..." in line or "<" in line:
                continue
            argv = shlex.split(line.split("&&")[0].split("|")[0])[1:]
            err = io.StringIO()
            with contextlib.redirect_stderr(err), contextlib.suppress(SystemExit):
                args, rest = parser.parse_known_args(argv)
                if not rest or args.command == "demo":
                    continue
            problems.append(
                f"{b.where}: {line}: {err.getvalue().strip() or 'unknown: ' + str(rest)}"
            )
    assert problems == []


def test_every_include_is_well_formed_and_the_loop_is_included() -> None:
    """An include marker a formatter mangled (``--8 < --"file"``) is valid Python, so the
    compile test passes while the page shows the marker instead of the file: every line that
    looks like one must be a real include of a file, and Getting started must include the
    loop the next test runs."""
    for page in pages():
        for n, line in enumerate(page.read_text().splitlines(), 1):
            if "8<" not in line.replace(" ", ""):
                continue
            found = SNIPPET.match(line)
            assert found, f'{page}:{n}: {line!r} is not an include; write --8<-- "path"'
            assert (ROOT / found.group(1)).is_file(), f"{page}:{n}: no file {found.group(1)}"
    assert any(
        b.included == ("examples/quickstart.py",)
        for b in blocks("python")
        if b.page.endswith("getting-started.md")
    ), "docs/getting-started.md does not include examples/quickstart.py"


def digits_store(tmp_path: Path) -> Path:
    """A store holding Getting started's ``digits-train``, made as its commands make it."""
    data = tmp_path / "digits.npz"
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "examples" / "prepare_digits.py"),
            str(data),
            str(tmp_path / "test.npz"),
        ],
        check=True,
        timeout=scaled(120),
        capture_output=True,
    )
    store = tmp_path / "store"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "shardserve.server",
            "ingest",
            str(data),
            "--store",
            str(store),
            "--name",
            "digits-train",
            "--quiet",
        ],
        check=True,
        timeout=scaled(120),
        capture_output=True,
    )
    return store


@pytest.fixture(scope="module")
def digits_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    """A server on Getting started's store, for both examples: they read it through jobs of
    their own arguments (the sweep's in its own share group) and change nothing."""
    with run_server(digits_store(tmp_path_factory.mktemp("digits"))) as srv:
        yield srv


def test_the_getting_started_loop_trains_against_a_real_server(digits_server: ServerProc) -> None:
    """examples/quickstart.py (included in Getting started) runs to the end."""
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "examples" / "quickstart.py"),
            digits_server.http_url,
            "digits-train",
        ],
        capture_output=True,
        text=True,
        timeout=scaled(120.0),
    )
    assert out.returncode == 0, out.stderr
    assert "epoch 1: loss" in out.stdout


def test_the_sweep_example_runs_its_trials_on_one_shared_pass(digits_server: ServerProc) -> None:
    """examples/sweep.py (included in the sharing guide): three trials, each every batch of
    its two epochs; their share group's window is longer than an epoch, so none is detached."""
    assert '--8<-- "examples/sweep.py"' in (DOCS / "guides" / "sharing.md").read_text()
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "examples" / "sweep.py"),
            digits_server.http_url,
            "digits-train",
        ],
        capture_output=True,
        text=True,
        timeout=scaled(240.0),
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert [line.split(":")[0] for line in lines] == ["lr 0.03", "lr 0.1", "lr 0.3"], out.stdout
    assert all(line.endswith("46 batches, detached 0") for line in lines), out.stdout


def test_the_readme_is_short_and_its_links_exist() -> None:
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    for link in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text):
        if "://" not in link:
            assert (ROOT / link).exists(), link
    assert "python -m pytest" in text  # the test command .ci/run runs


def test_the_first_install_command_works_from_a_clone() -> None:
    """The README's and Getting started's first command installs the clone the reader has
    (shardserve is on no package index): ``pip install '.[demo]'``, then ``shardserve demo``;
    an install by name is only mentioned as what works once published."""
    for path in (ROOT / "README.md", DOCS / "getting-started.md", DOCS / "index.md"):
        text = path.read_text()
        first = re.search(r"```bash\n(.*?)```", text, re.S)
        assert first, path
        commands = [line.split("#")[0].strip() for line in first.group(1).splitlines()]
        assert commands[0].startswith("pip install '.[demo]'"), (path, commands)
        assert "shardserve demo" in first.group(1), path
        for paragraph in text.split("\n\n"):
            if "pip install 'shardserve[demo]'" in paragraph:
                assert "index" in paragraph, (path, paragraph)
