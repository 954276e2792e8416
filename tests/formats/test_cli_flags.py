"""The new ingest flags through the real ``shardserve`` command: --stacked, --map/--workers,
and the one-line summary saying what ingest chose."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import torch

from shardserve.server.store.catalog import Store
from tests.store.conftest import cli_command
from tests.support.slowness import scaled


def _run(*args: str | os.PathLike[str]) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "SHARDSERVE_STORE"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path.cwd()), env.get("PYTHONPATH", "")])
    return subprocess.run(
        [*cli_command(), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=scaled(120),
        env=env,
    )


def test_stacked_and_map_from_the_command_line(tmp_path: Path) -> None:
    """--stacked splits rows; --map with --workers converts each; the summary names the
    variable fields it found; a bad --map is one line and exit 2."""
    src = tmp_path / "src"
    src.mkdir()
    torch.save({"pos": torch.rand(6, 4, 3) * 2, "id": torch.arange(6)}, src / "block.pt")
    store = tmp_path / "store"
    r = _run("ingest", src, "--store", store, "--name", "rows", "--stacked", "--quiet")
    assert r.returncode == 0, r.stderr
    assert "ingested rows: 6 samples" in r.stdout
    r = _run(
        "ingest",
        src,
        "--store",
        store,
        "--name",
        "graphs",
        "--stacked",
        "--quiet",
        "--map",
        "tests.formats.mapfns:to_graph",
        "--workers",
        "2",
    )
    assert r.returncode == 0, r.stderr
    assert "variable: edge_index [2, -1]" in r.stdout
    with Store(store).open("graphs") as ds:
        assert ds.num_samples == 6 and {f.name for f in ds.fields} == {"pos", "edge_index", "id"}
    r = _run("ingest", src, "--store", store, "--name", "bad", "--stacked", "--map", "nocolon")
    assert r.returncode == 2 and "MODULE:FUNCTION" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
