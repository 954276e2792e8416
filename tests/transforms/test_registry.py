"""Transforms come from settings modules and from the ``shardserve.transforms`` entry-point
group of installed packages; a module that cannot load stops the server with its name."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx

from tests.support.server import run_server
from tests.support.slowness import scaled

PKG = '''
import numpy as np
from shardserve.server.transforms import Field, sample_transform


@sample_transform(outputs={"label": Field("int64", ())})
def plus_one(sample, params, rng):
    """label + 1"""
    return {"label": np.asarray(sample["label"] + 1)}
'''


def _install(root: Path) -> dict[str, str]:
    """A package with an entry point, 'installed' as a dist-info folder on PYTHONPATH."""
    (root / "eppkg").mkdir(parents=True)
    (root / "eppkg" / "__init__.py").write_text(PKG)
    info = root / "eppkg-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: eppkg\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[shardserve.transforms]\neppkg = eppkg\n")
    return {"PYTHONPATH": os.pathsep.join([str(root), *sys.path])}


def test_entry_point_transforms_are_listed_and_run(store: Path, tmp_path: Path) -> None:
    """A package's entry point adds its transforms; a job naming one gets its output."""
    from shardserve.client import Loader

    env = _install(tmp_path / "site")
    with run_server(store, env=env) as srv:
        names = [
            t["name"]
            for t in httpx.get(f"{srv.http_url}/v1/transforms", timeout=scaled(10)).json()[
                "transforms"
            ]
        ]
        assert "plus_one" in names and "random_crop" in names
        with Loader(
            srv.http_url,
            "cifar",
            batch_size=100,
            shuffle=False,
            timeout=scaled(20),
            transforms=[{"name": "plus_one"}],
        ) as ld:
            ld.set_epoch(0)
            labels = [int(x) for b in ld for x in b["label"]]
        assert labels == [i % 10 + 1 for i in range(600)]


def test_bad_transform_module_stops_the_server_naming_it(store: Path) -> None:
    """--transforms naming a module that does not import: the server exits with its name."""
    cmd = [
        sys.executable,
        "-m",
        "shardserve.server",
        "serve",
        "--store",
        str(store),
        "--http",
        "127.0.0.1:0",
        "--data",
        "tcp://127.0.0.1:0",
        "--transforms",
        "no.such.mod",
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=scaled(60))
    assert r.returncode != 0 and "cannot import transform module 'no.such.mod'" in r.stderr
