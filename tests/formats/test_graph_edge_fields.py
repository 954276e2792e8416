"""Graphs whose edge features could pass for node features (``bond_fea [E, D]`` beside
``edge_index [2, E]``): a field with as many rows as ``edge_index`` has edges in every
stored sample never counts nodes; a dataset left with no node-level field, or whose graphs
have as many nodes as edges, is refused when the job is created, naming the fields and
what to do."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from shardserve.client import Loader
from shardserve.proto.errors import BadRequest
from shardserve.server.store.catalog import Store
from shardserve.server.store.ingest.run import ingest
from shardserve.server.store.read.graph_shapes import item_fields
from tests.support.server import ServerProc, run_server
from tests.support.slowness import scaled

pyg_data = pytest.importorskip("torch_geometric.data")

N_GRAPHS = 64
BATCH = 8


def _crystal(i: int) -> dict[str, Any]:
    """A CHGNet-shaped graph: atoms, bonds (one row per edge) and an energy."""
    g = torch.Generator().manual_seed(i)
    n = int(torch.randint(2, 30, (1,), generator=g))
    e = int(torch.randint(1, 4 * n, (1,), generator=g))
    return {
        "atom_fea": torch.randn(n, 4, generator=g),
        "bond_fea": torch.randn(e, 3, generator=g),
        "edge_index": torch.randint(0, n, (2, e), generator=g),
        "energy": torch.tensor(float(i)),
    }


def _cycle(i: int) -> dict[str, torch.Tensor]:
    """A directed cycle: as many edges as nodes in every graph."""
    n = 3 + i % 11
    ring = torch.arange(n)
    return {
        "x": torch.full((n, 2), float(i)),
        "edge_index": torch.stack([ring, (ring + 1) % n]),
        "bond_fea": torch.ones(n, 3),
    }


def _save(folder: Path, samples: list[dict[str, Any]]) -> Path:
    folder.mkdir()
    for i, s in enumerate(samples):
        torch.save(s, folder / f"{i:05d}.pt")
    return folder


@pytest.fixture(scope="module")
def crystals() -> list[dict[str, Any]]:
    return [_crystal(i) for i in range(N_GRAPHS)]


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory, crystals: list[dict[str, Any]]) -> Path:
    """Datasets ingested from torch.save'd dicts, as users' caches are."""
    src = tmp_path_factory.mktemp("src")
    store = tmp_path_factory.mktemp("store")
    no_atoms = [{k: v for k, v in c.items() if k != "atom_fea"} for c in crystals]
    with_n = [
        {**b, "num_nodes": c["atom_fea"].shape[0]} for b, c in zip(no_atoms, crystals, strict=True)
    ]
    pyg_named = [
        {"edge_index": c["edge_index"], "edge_attr": c["bond_fea"], "y": c["energy"]}
        for c in crystals
    ]
    sets = {
        "chg": crystals,
        "bonds": no_atoms,  # the report: edge_index, bond_fea, energy
        "bonds-n": with_n,
        "cycles": [_cycle(i) for i in range(N_GRAPHS)],
        "edges": pyg_named,
    }
    # "w" has a row per edge in every graph but the last: a node-level field after all.
    late = [
        {**b, "w": torch.zeros(b["bond_fea"].shape[0] + (i == N_GRAPHS - 1))}
        for i, b in enumerate(no_atoms)
    ]
    for name, samples in sets.items():
        ingest(_save(src / name, samples), store, name, progress=False, threads=2)
    # Small shards: the stored shapes are scanned across shards and chunks.
    ingest(src / "bonds", store, "bonds-sharded", progress=False, threads=2, shard_bytes=4096)
    ingest(_save(src / "late", late), store, "late", progress=False, threads=2, shard_bytes=4096)
    return store


@pytest.fixture(scope="module")
def server(store: Path) -> Iterator[ServerProc]:
    with run_server(store) as srv:
        yield srv


def _post(server: ServerProc, name: str, collate: Any) -> httpx.Response:
    return httpx.post(
        f"{server.http_url}/v1/jobs",
        json={"dataset": name, "batch_size": BATCH, "collate": collate},
        timeout=scaled(30),
    )


def _read(server: ServerProc, name: str, **kw: Any) -> list[dict[str, torch.Tensor]]:
    with Loader(server.http_url, name, BATCH, shuffle=False, timeout=30, **kw) as loader:
        return list(loader)


def _assert_like_pyg(
    got: list[dict[str, torch.Tensor]], crystals: list[dict[str, Any]], fields: list[str]
) -> None:
    """``got`` holds PyG's batches of the same graphs, told each one's atom count."""
    data = [
        pyg_data.Data(num_nodes=c["atom_fea"].shape[0], **{k: c[k] for k in fields})
        for c in crystals
    ]
    want = [pyg_data.Batch.from_data_list(data[i : i + BATCH]) for i in range(0, N_GRAPHS, BATCH)]
    assert len(got) == len(want)
    for b, (g, w) in enumerate(zip(got, want, strict=True)):
        assert set(g) == {*fields, "batch", "ptr"}, sorted(g)
        for key in g:
            assert torch.equal(g[key], w[key]), f"batch {b} field {key}"


def test_reported_case_is_refused_at_job_creation(server: ServerProc) -> None:
    """{edge_index, bond_fea, energy}: bond_fea has a row per edge, so nothing stored counts
    nodes: a 4xx names the field and both ways out, and the Loader raises BadRequest, instead
    of batches whose ptr, batch and edge_index count bonds as atoms."""
    for name in ("bonds", "bonds-sharded"):
        r = _post(server, name, "graph")
        assert 400 <= r.status_code < 500, r.text
        detail = r.json()["detail"]
        assert "'bond_fea'" in detail and "'edge_index'" in detail, detail
        assert "node_field" in detail and "num_nodes" in detail and "--map" in detail, detail
    with pytest.raises(BadRequest, match="no stored field can count each graph's nodes"):
        Loader(server.http_url, "bonds", BATCH, collate="graph")


def test_node_counts_come_from_a_node_field_or_num_nodes(
    server: ServerProc, crystals: list[dict[str, Any]]
) -> None:
    """With atom_fea stored, bond_fea (a row per edge) is set aside and atom_fea counts the
    nodes; with num_nodes stored, num_nodes does: both as PyG collates the same graphs."""
    fields = ["atom_fea", "bond_fea", "edge_index", "energy"]
    _assert_like_pyg(_read(server, "chg", collate="graph"), crystals, fields)
    _assert_like_pyg(_read(server, "bonds-n", collate="graph"), crystals, fields[1:])


def test_as_many_nodes_as_edges_is_refused(server: ServerProc) -> None:
    """Graphs with as many edges as nodes in every sample: x and bond_fea could be either
    node or edge fields, so neither counts nodes, inferred or named: a 4xx names both and
    says to store num_nodes."""
    r = _post(server, "cycles", "graph")
    assert 400 <= r.status_code < 500, r.text
    detail = r.json()["detail"]
    assert "['x', 'bond_fea']" in detail and "as many nodes as edges" in detail, detail
    assert "num_nodes" in detail, detail
    with pytest.raises(BadRequest, match="node_field 'x' cannot count nodes"):
        Loader(server.http_url, "cycles", BATCH, collate={"graph": {"node_field": "x"}})


def test_named_edge_field_is_refused(server: ServerProc) -> None:
    """node_field="bond_fea" names a field with a row per edge: refused at job creation,
    naming the field and edge_index, never served with edges counted as nodes."""
    r = _post(server, "chg", {"graph": {"node_field": "bond_fea"}})
    assert 400 <= r.status_code < 500, r.text
    detail = r.json()["detail"]
    assert "node_field 'bond_fea' cannot count nodes" in detail, detail
    assert "'edge_index'" in detail and "num_nodes" in detail, detail
    # The node field itself is still accepted by name.
    ok = _post(server, "chg", {"graph": {"node_field": "atom_fea"}})
    assert ok.is_success, ok.text


def test_edge_attr_never_counts_nodes(server: ServerProc) -> None:
    """PyG-named {edge_index, edge_attr, y} dicts: edge_attr is not inferred as the node
    count, nor accepted as node_field."""
    r = _post(server, "edges", "graph")
    assert 400 <= r.status_code < 500, r.text
    assert "'edge_attr'" in r.json()["detail"], r.text
    with pytest.raises(
        BadRequest, match="node_field 'edge_attr' cannot count nodes: 'edge_attr' is PyG's name"
    ):
        Loader(server.http_url, "edges", BATCH, collate={"graph": {"node_field": "edge_attr"}})


def test_the_shape_scan_is_bounded_and_errs_towards_refusing(store: Path) -> None:
    """The scan reads the stored shapes of at most ``limit`` samples, across shards: a field
    matching edge_index in every sample read is an edge field even if a later sample could
    differ (a refusal, never a wrong count); every sample read when the cap allows."""
    st = Store(store)
    try:
        ds = st.open("bonds-sharded")
        assert len(ds.manifest.shards) > 4
        whole = item_fields(ds)
        assert whole.follows == {"bond_fea": "edge_index"}
        assert whole.samples == whole.total == N_GRAPHS
        capped = item_fields(ds, limit=10)
        assert capped.samples == 10 and capped.follows == {"bond_fea": "edge_index"}
        # A node field differs from the edge count in some sample: not an edge field, even
        # when only the last sample of the last shard says so.
        assert item_fields(st.open("chg")).follows == {"bond_fea": "edge_index"}
        late = st.open("late")
        assert len(late.manifest.shards) > 4
        assert item_fields(late).follows == {"bond_fea": "edge_index"}
        cut = item_fields(late, limit=N_GRAPHS - 1)
        assert cut.follows == {"bond_fea": "edge_index", "w": "edge_index"}
        assert "first 63 samples" in cut.why("w")
    finally:
        st.close()
