"""A ``file://`` store works for every command: ingest, ls, inspect, verify and serve (read
back through a real server and Loader)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tests.formats.support import assert_same, read_all
from tests.support.server import run_server


def test_file_uri_store_for_every_command(tmp_path: Path, cli: Callable[..., Any]) -> None:
    x = np.arange(60, dtype=np.float32).reshape(20, 3)
    y = np.arange(20, dtype=np.int64)
    np.savez(tmp_path / "a.npz", x=x, y=y)
    uri = (tmp_path / "store").as_uri()
    r = cli(
        "ingest",
        tmp_path / "a.npz",
        "--store",
        uri,
        "--name",
        "d",
        "--quiet",
        "--shard-size",
        "200B",
    )
    assert r.returncode == 0, r.stderr
    assert "ingested d: 20 samples" in r.stdout
    assert not list((tmp_path / "store").rglob("*.partial"))
    r = cli("ls", "--store", uri)
    assert r.returncode == 0 and "d " in r.stdout and "x, y" in r.stdout, r.stderr
    r = cli("inspect", "d", "--store", uri)
    assert r.returncode == 0 and "samples   20" in r.stdout, r.stderr
    r = cli("verify", "d", "--store", uri, "--quiet")
    assert r.returncode == 0 and "shards ok" in r.stdout, r.stderr
    r = cli("ingest", tmp_path / "a.npz", "--store", uri, "--name", "d", "--quiet")
    assert r.returncode == 2 and "already exists" in r.stderr
    with run_server(uri, "--cache-dir", str(tmp_path / "cache")) as srv:  # type: ignore[arg-type]
        got = read_all(srv.http_url, "d")
    assert len(got) == 20
    for i, g in enumerate(got):
        assert_same(g, {"x": torch.from_numpy(x[i]), "y": torch.tensor(y[i])}, f"d[{i}]")
