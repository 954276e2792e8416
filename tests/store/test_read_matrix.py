"""The same datasets read through a local store and a remote (``file://``) store give the same
batches, byte for byte: flat, nested, nullable, variable-size, binary, graph-collated, with
transforms, several small batches per message, and environments.

Both stores are read by one ``Dataset`` (the one field loop) over different shard sets; this
matrix is what keeps them from drifting apart again (a remote store once served the stored fill
values of missing samples as data).
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from shardserve.client import Loader, Masked
from shardserve.client.types import VarTensor
from shardserve.server.store.remote import RemoteStore
from tests.support.data import make_cifar_like, make_graph_like
from tests.support.server import ServerProc, run_server


def _write_pt_folder(folder: Path, n: int) -> None:
    """``{"a": tensor, "p": {"nu": tensor} or None, "tok": 1-d of varying length}`` samples,
    as torch.save writes them."""
    folder.mkdir()
    for i in range(n):
        p = {"nu": torch.full((2,), float(i) + 0.5)} if i % 3 else None
        sample = {"a": torch.arange(3, dtype=torch.float32) + i, "p": p,
                  "tok": torch.arange(i % 5 + 1, dtype=torch.int32) * i}  # fmt: skip
        torch.save(sample, folder / f"{i:04d}.pt")


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProc, ServerProc]]:
    """A server on a local store and one on a ``file://`` store holding the same datasets."""
    tmp = tmp_path_factory.mktemp("matrix")
    local = tmp / "local"
    make_cifar_like(local, "cifar", n=300, shard_bytes=200 << 10)
    make_graph_like(local, "graphs", n=120, shard_bytes=4 << 10)
    _write_pt_folder(tmp / "pde-src", 60)
    ingest = subprocess.run(
        [sys.executable, "-m", "shardserve.server", "ingest", str(tmp / "pde-src"), "--store",
         str(local), "--name", "pde", "--variable", "tok", "--shard-size", "1KB", "--quiet"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert ingest.returncode == 0, ingest.stderr
    remote_uri = (tmp / "remote").as_uri()
    remote = RemoteStore(remote_uri)
    for name in ("cifar", "graphs", "pde"):
        remote.upload(local / name, name, overwrite=False)
    with (
        run_server(local) as on_local,
        run_server(remote_uri, "--cache-dir", str(tmp / "cache")) as on_remote,  # type: ignore[arg-type]
    ):
        yield on_local, on_remote


CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "flat": ("cifar", {"batch_size": 32}),
    # Small batches travel several to a message (prefetch credits ~8 MiB of them).
    "grouped": ("cifar", {"batch_size": 3, "prefetch": None}),
    "transforms": (
        "cifar",
        {
            "batch_size": 16,
            "transforms": [
                {"name": "hflip", "params": {"layout": "CHW", "p": 0.5}},
                {"name": "normalize", "params": {"layout": "CHW", "scale": 1 / 255}},
            ],
        },
    ),
    "envs": ("cifar", {"batch_size": 16, "envs": 2}),
    "variable_and_binary": ("graphs", {"batch_size": 10}),
    "graph_collated": (
        "graphs",
        {"batch_size": 10, "collate": "graph", "fields": ["x", "edge_index", "y"]},
    ),
    "nested_nullable_variable": ("pde", {"batch_size": 7}),
}


def _leaves(value: object, path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of a batch with where it sits (``Masked`` as values and mask)."""
    if isinstance(value, torch.Tensor):
        yield path, value
    elif isinstance(value, Masked):
        yield from _leaves(value.values, path + ".values")
        yield path + ".mask", value.mask
    elif isinstance(value, VarTensor):
        yield path + ".values", value.values
        yield path + ".offsets", value.offsets
        yield path + ".shapes", value.shapes
    elif isinstance(value, dict):
        for k in sorted(value):
            yield from _leaves(value[k], f"{path}/{k}")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from _leaves(v, f"{path}[{i}]")
    else:
        raise AssertionError(f"{path}: unexpected {type(value).__name__} in a batch")


def _read(srv: ServerProc, dataset: str, args: dict[str, Any]) -> list[list[tuple[str, bytes]]]:
    with Loader(srv.http_url, dataset, seed=5, rank=0, world_size=1, timeout=60, **args) as ld:
        ld.set_epoch(2)
        return [
            [(p, t.contiguous().numpy().tobytes() + str((t.dtype, tuple(t.shape))).encode())
             for p, t in _leaves(batch, "")]
            for batch in ld
        ]  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_a_local_and_a_remote_store_give_the_same_bytes(
    servers: tuple[ServerProc, ServerProc], case: str
) -> None:
    dataset, args = CASES[case]
    on_local, on_remote = servers
    want = _read(on_local, dataset, args)
    got = _read(on_remote, dataset, args)
    assert want, f"{case}: no batches"
    assert len(got) == len(want), f"{case}: {len(got)} batches from the remote store, {len(want)}"
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert [p for p, _ in g] == [p for p, _ in w], f"{case}: batch {i} has other parts"
        for (p, gb), (_, wb) in zip(g, w, strict=True):
            assert gb == wb, f"{case}: batch {i}, {p} differs between the stores"
