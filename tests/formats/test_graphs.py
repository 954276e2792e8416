"""PyG graphs saved with torch.save: ingested without unpickling PyG's classes, read back as
saved, and collated on the server (collate="graph") exactly as PyG's DataLoader collates."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from shardserve.client import Loader
from shardserve.client.graphs import to_pyg
from shardserve.proto.errors import ShardserveError
from shardserve.server.store.ingest.run import ingest
from tests.formats.support import assert_same, read_all
from tests.support.server import ServerProc, run_server
from tests.support.slowness import scaled

pyg_data = pytest.importorskip("torch_geometric.data")
pyg_loader = pytest.importorskip("torch_geometric.loader")

N_GRAPHS = 1000


@dataclass
class Opaque:
    """Not one of PyG's names: weights_only loading must still refuse it."""

    value: int


def _graph(i: int) -> Any:
    g = torch.Generator().manual_seed(i)
    n = int(torch.randint(1, 30, (1,), generator=g))
    e = int(torch.randint(0, 60, (1,), generator=g))
    return pyg_data.Data(
        x=torch.randn(n, 5, generator=g),
        edge_index=torch.randint(0, n, (2, e), generator=g),
        edge_attr=torch.randn(e, 2, generator=g),
        y=torch.tensor([float(i)]),
        pos=torch.randn(n, 3, generator=g),
    )


@pytest.fixture(scope="module")
def graphs() -> list[Any]:
    return [_graph(i) for i in range(N_GRAPHS)]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, graphs: list[Any]) -> Iterator[ServerProc]:
    src = tmp_path_factory.mktemp("graphs")
    for i, d in enumerate(graphs):
        torch.save(d, src / f"{i:05d}.pt")
    hetero = tmp_path_factory.mktemp("hetero")
    for i in range(5):
        h = pyg_data.HeteroData()
        h["paper"].x = torch.randn(i + 2, 4)
        h["author"].x = torch.randn(3, 2)
        h["author", "writes", "paper"].edge_index = torch.tensor([[0, 1, 2], [0, 1, i + 1]])
        torch.save(h, hetero / f"{i}.pt")
    store = tmp_path_factory.mktemp("store")
    ingest(src, store, "graphs", progress=False, threads=2)
    ingest(hetero, store, "hetero", progress=False)
    with run_server(store) as srv:
        yield srv


def test_collated_batches_equal_pyg_dataloader(server: ServerProc, graphs: list[Any]) -> None:
    """collate="graph" batches hold the same tensors as torch_geometric's DataLoader."""
    want = list(pyg_loader.DataLoader(graphs, batch_size=37, shuffle=False))
    with Loader(server.http_url, "graphs", 37, shuffle=False, collate="graph") as loader:
        got = list(loader)
    assert len(got) == len(want)
    for b, (g, w) in enumerate(zip(got, want, strict=True)):
        assert set(g) == {"x", "edge_index", "edge_attr", "y", "pos", "batch", "ptr"}
        for key in g:
            assert torch.equal(g[key], w[key]), f"batch {b} field {key}"


def test_to_pyg_gives_a_batch_models_accept(server: ServerProc, graphs: list[Any]) -> None:
    """to_pyg wraps a graph batch in a torch_geometric Batch with the right graph count."""
    with Loader(server.http_url, "graphs", 16, shuffle=False, collate="graph") as loader:
        batch = to_pyg(next(iter(loader)))
    assert isinstance(batch, pyg_data.Batch) and batch.num_graphs == 16
    assert batch.num_nodes == sum(d.num_nodes for d in graphs[:16])
    assert torch.equal(batch.edge_index, pyg_data.Batch.from_data_list(graphs[:16]).edge_index)


def test_named_node_field_beside_num_nodes(server: ServerProc, graphs: list[Any]) -> None:
    """node_field="x" on PyG graphs (which also store num_nodes) gives PyG's batch: num_nodes
    is never a part of it (ptr says it; a [B] tensor would become the Batch's num_nodes)."""
    with Loader(
        server.http_url, "graphs", 16, shuffle=False, collate={"graph": {"node_field": "x"}}
    ) as loader:
        got = next(iter(loader))
    assert "num_nodes" not in got
    want = pyg_data.Batch.from_data_list(graphs[:16])
    assert all(torch.equal(got[k], want[k]) for k in ("x", "edge_index", "batch", "ptr"))
    assert to_pyg(got).num_nodes == want.num_nodes


def test_a_transform_that_changes_the_nodes_is_caught(server: ServerProc) -> None:
    """Stored num_nodes counts the nodes by default; a transform keeping one row of x makes
    them disagree, and the stream fails naming both fields and the node_field that fixes it,
    never a batch whose ptr does not match x."""
    chain = [{"name": "random_subset", "params": {"field": "x", "n": 1}}]
    with (
        Loader(
            server.http_url,
            "graphs",
            16,
            shuffle=False,
            collate="graph",
            transforms=chain,
            timeout=scaled(30),
        ) as loader,
        pytest.raises(ShardserveError) as caught,
    ):
        next(iter(loader))
    assert "num_nodes" in str(caught.value) and "'x'" in str(caught.value)
    assert "node_field" in str(caught.value)


def test_each_graph_reads_back_as_saved(server: ServerProc, graphs: list[Any]) -> None:
    """Without collation, every graph comes back with its tensors and its node count."""
    got = read_all(server.http_url, "graphs", batch_size=50)
    for i, (g, d) in enumerate(zip(got, graphs, strict=True)):
        assert_same(g, {**d.to_dict(), "num_nodes": torch.tensor(d.num_nodes)}, f"graph {i}")


def test_hetero_graphs_read_back_as_nested_dicts(server: ServerProc) -> None:
    """A HeteroData comes back as {node type: {...}, "src__rel__dst": {...}}."""
    with Loader(server.http_url, "hetero", 5, shuffle=False) as loader:
        batch = next(iter(loader))
    assert set(batch) == {"paper", "author", "author__writes__paper"}
    assert batch["paper"]["x"].unbind()[3].shape == (5, 4)
    assert batch["author__writes__paper"]["edge_index"].shape == (5, 2, 3)


def test_graph_job_on_a_dataset_without_nodes_is_a_4xx(server: ServerProc) -> None:
    """A graph job whose fields cannot make a graph batch is refused with what to change."""
    r = httpx.post(
        f"{server.http_url}/v1/jobs",
        json={"dataset": "hetero", "batch_size": 2, "collate": "graph"},
        timeout=scaled(10),
    )
    assert 400 <= r.status_code < 500 and "count each graph's nodes" in r.json()["detail"]


def test_plain_data_refused_without_adapter_names(tmp_path: Path) -> None:
    """Only PyG's own names get stand-ins: any other pickled class is still refused."""

    src = tmp_path / "src"
    src.mkdir()
    torch.save({"x": torch.zeros(2), "obj": Opaque(1)}, src / "0.pt")
    from shardserve.proto.errors import InvalidDataError

    with pytest.raises(InvalidDataError, match="refused"):
        ingest(src, tmp_path / "store", "x", progress=False)
