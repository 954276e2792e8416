"""A remote store reads a nullable field as a local store does: the same values and the same
masks (a remote store once served the stored fill values of missing samples as data)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from shardserve.client import Loader, Masked
from tests.support.server import run_server
from tests.support.slowness import scaled


def _write_pt_folder(folder: Path, n: int) -> None:
    """``{"a": tensor, "p": {"nu": tensor} or None}`` samples, as torch.save writes them."""
    folder.mkdir()
    for i in range(n):
        p = {"nu": torch.full((2,), float(i) + 0.5)} if i % 3 else None
        torch.save({"a": torch.arange(3, dtype=torch.float32) + i, "p": p}, folder / f"{i:04d}.pt")


def _batches(url: str) -> list[dict[str, Any]]:
    with Loader(url, "pde", 7, shuffle=True, seed=3, timeout=scaled(60)) as loader:
        loader.set_epoch(1)
        return list(loader)


def test_a_nullable_field_reads_the_same_from_a_local_and_a_file_store(
    tmp_path: Path, cli: Callable[..., Any]
) -> None:
    _write_pt_folder(tmp_path / "src", 40)
    local, remote = tmp_path / "local", (tmp_path / "remote").as_uri()
    for store in (str(local), remote):
        r = cli(
            "ingest",
            tmp_path / "src",
            "--store",
            store,
            "--name",
            "pde",
            "--quiet",
            "--shard-size",
            "1KB",
        )
        assert r.returncode == 0, r.stderr
    with run_server(local) as srv:
        want = _batches(srv.http_url)
    with run_server(remote, "--cache-dir", str(tmp_path / "cache")) as srv:  # type: ignore[arg-type]
        got = _batches(srv.http_url)
    assert len(got) == len(want) == 6
    seen_missing = 0
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(g["a"], w["a"]), f"batch {i}: a"
        nu_g, nu_w = g["p"]["nu"], w["p"]["nu"]
        assert isinstance(nu_w, Masked), f"batch {i}: the local store gives Masked"
        assert isinstance(nu_g, Masked), f"batch {i}: the remote store gives {type(nu_g)}"
        assert torch.equal(nu_g.mask, nu_w.mask), f"batch {i}: mask"
        assert torch.equal(nu_g.values[nu_g.mask], nu_w.values[nu_w.mask]), f"batch {i}: values"
        seen_missing += int((~nu_w.mask).sum())
    # samples 0, 3, ..., 39 have no p (14), the 2 padding samples may repeat one of them
    assert seen_missing >= 14
