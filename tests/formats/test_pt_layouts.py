"""The .pt and numpy layouts users actually have, ingested and read back
through a real server and Loader, equal to the source, in the shape they were saved in."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from shardserve.client.structure import Masked
from shardserve.proto.errors import InvalidDataError
from shardserve.server.store.ingest.run import IngestSummary, ingest
from tests.formats.support import assert_same, read_all
from tests.support.server import ServerProc, run_server

N = 30


def _pde(i: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(i)
    return {
        "latent": torch.randn(4, 3, generator=g),
        "params": None
        if i % 3 == 0
        else {"nu": torch.tensor(0.1 * i), "re": torch.randn(2, generator=g)},
        "bc": None
        if i < 12
        else {"left": torch.full((i % 4 + 1,), i), "kind": {"id": torch.tensor(i)}},
    }


def _tuple(i: int) -> tuple[torch.Tensor, int]:
    return (torch.full((3, 5, 5), i, dtype=torch.uint8), i % 10)


def _graph(i: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + i)
    n = int(torch.randint(2, 9, (1,), generator=g))
    e = int(torch.randint(1, 15, (1,), generator=g))
    return {
        "atom_fea": torch.randn(n, 6, generator=g),
        "edge_index": torch.randint(0, n, (2, e), generator=g),
        "target": torch.randn(1, generator=g),
    }


def _chunked(i: int) -> dict[str, torch.Tensor]:
    return {"pos": torch.arange(3 * i, 3 * i + 3, dtype=torch.float32), "z": torch.tensor([i, i])}


GAME = np.dtype([("board", "u1", (32,)), ("eval", "<i2"), ("move", "<u2"), ("result", "u1")])


def _games(n: int) -> np.ndarray:
    rng = np.random.default_rng(5)
    a = np.zeros(n, dtype=GAME)
    a["board"] = rng.integers(0, 13, (n, 32))
    a["eval"] = rng.integers(-500, 500, n)
    a["move"] = rng.integers(0, 4096, n)
    a["result"] = rng.integers(0, 3, n)
    return a


class Built:
    def __init__(self) -> None:
        self.samples: dict[str, list[Any]] = {}
        self.summaries: dict[str, IngestSummary] = {}


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Built:
    src = tmp_path_factory.mktemp("src")
    store = tmp_path_factory.mktemp("store")
    b = Built()
    b.store = store  # type: ignore[attr-defined]

    def folder(name: str, samples: list[Any]) -> Path:
        d = src / name
        d.mkdir()
        for i, s in enumerate(samples):
            torch.save(s, d / f"{i:04d}.pt")
        return d

    def run(name: str, path: Path, samples: list[Any], **kw: Any) -> None:
        kw.setdefault("shard_bytes", 2048)
        b.summaries[name] = ingest(path, store, name, progress=False, **kw)
        b.samples[name] = samples

    pde = [_pde(i) for i in range(N)]
    # Small shards: several are written before "bc" first has a value (sample 12), so they
    # are rewritten with its column added as missing.
    run("pde", folder("pde", pde), pde, shard_bytes=256)
    tup = [_tuple(i) for i in range(N)]
    run("tuples", folder("tuples", tup), tup)
    graphs = [_graph(i) for i in range(N)]
    run("graphs", folder("graphs", graphs), graphs)
    chunks = src / "chunked"
    chunks.mkdir()
    flat = [_chunked(i) for i in range(3 * 11)]
    for f in range(3):
        torch.save(flat[f * 11 : (f + 1) * 11], chunks / f"chunk{f}.pt")
    run("chunked", chunks, flat)
    stacked = src / "stacked"
    stacked.mkdir()
    rows: list[Any] = []
    for f in range(2):
        block = {"img": torch.randn(9, 2, 2), "meta": {"id": torch.arange(9) + 9 * f}}
        torch.save(block, stacked / f"block{f}.pt")
        rows += [{"img": block["img"][i], "meta": {"id": block["meta"]["id"][i]}} for i in range(9)]
    run("stacked", stacked, rows, stacked=True)
    games = _games(40)
    np.save(src / "games.npy", games)
    want = [{k: torch.from_numpy(np.asarray(games[k][i])) for k in GAME.names} for i in range(40)]
    run("games", src / "games.npy", want)
    return b


@pytest.fixture(scope="module")
def server(built: Built) -> Iterator[ServerProc]:
    with run_server(built.store) as srv:  # type: ignore[attr-defined]
        yield srv


@pytest.mark.parametrize("name", ["pde", "tuples", "graphs", "chunked", "stacked", "games"])
def test_every_sample_reads_back_equal(built: Built, server: ServerProc, name: str) -> None:
    """Every source sample comes back through the Loader, in order, equal and in its shape."""
    got = read_all(server.http_url, name)
    want = built.samples[name]
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert_same(g, w, f"{name}[{i}]")


def test_nested_batch_is_a_tree_with_masks(server: ServerProc) -> None:
    """A nested dataset arrives as batch["params"]["nu"], a sometimes-None field as Masked
    whose mask is False exactly where the source was None."""
    from shardserve.client import Loader

    with Loader(server.http_url, "pde", 10, shuffle=False) as loader:
        batch = next(iter(loader))
    assert set(batch) == {"latent", "params", "bc"}
    nu = batch["params"]["nu"]
    assert isinstance(nu, Masked)
    assert nu.mask.tolist() == [i % 3 != 0 for i in range(10)]
    assert batch["latent"].shape == (10, 4, 3)
    assert not batch["bc"]["left"].mask.any()


def test_tuple_batch_is_a_tuple(server: ServerProc) -> None:
    """(image, label) samples arrive as a tuple of collated tensors, as default_collate gives."""
    from shardserve.client import Loader

    with Loader(server.http_url, "tuples", 8, shuffle=False) as loader:
        images, labels = next(iter(loader))
    assert images.shape == (8, 3, 5, 5) and labels.tolist() == [i % 10 for i in range(8)]


def test_summary_says_what_ingest_chose(built: Built) -> None:
    """Varying dimensions were found without --variable, and missing fields reported."""
    g = built.summaries["graphs"]
    assert g.manifest.field("atom_fea").shape == (-1, 6)
    assert g.manifest.field("edge_index").shape == (2, -1)
    assert "variable: atom_fea [-1, 6], edge_index [2, -1]" in g.line()
    pde = built.summaries["pde"].manifest
    assert pde.shards[0].rows < 12 < pde.num_samples  # a shard was written before bc existed
    assert pde.field("params.nu").nullable and pde.field("bc.kind.id").nullable
    assert not pde.field("latent").nullable
    assert "may be missing (masked): " in built.summaries["pde"].line()


def test_structured_records_become_fields(built: Built) -> None:
    """A structured array is one field per record field, sub-arrays as fixed tensors."""
    m = built.summaries["games"].manifest
    assert [(f.name, f.dtype, f.shape) for f in m.fields] == [
        ("board", "uint8", (32,)),
        ("eval", "int16", ()),
        ("move", "uint16", ()),
        ("result", "uint8", ()),
    ]


def test_conflicting_structure_names_file_and_publishes_nothing(tmp_path: Path) -> None:
    """A sample whose tree disagrees with earlier ones is refused naming the file."""
    src = tmp_path / "src"
    src.mkdir()
    torch.save({"a": {"b": torch.zeros(2)}}, src / "0.pt")
    torch.save({"a": torch.zeros(2)}, src / "1.pt")
    store = tmp_path / "store"
    with pytest.raises(InvalidDataError, match=r"1\.pt: a holds a .*earlier samples hold a dict"):
        ingest(src, store, "bad", progress=False)
    assert not (store / "bad").exists()
