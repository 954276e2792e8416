"""Graphs whose nodes are not called x (CHGNet's ``atom_fea``, ``bond_fea``, ``edge_index``
dicts saved with torch.save): the node field is named or inferred when only one field can be
it (edge fields set aside: ``test_graph_edge_fields``), never guessed between two node-level
fields; transforms run on each graph before it is collated."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import torch

from shardserve.client import Loader
from shardserve.proto.errors import BadRequest
from shardserve.server.store.ingest.run import ingest
from tests.support.server import ServerProc, run_server
from tests.support.slowness import scaled

pyg_data = pytest.importorskip("torch_geometric.data")

N_GRAPHS = 300
BATCH = 16
CHG = {"graph": {"node_field": "atom_fea"}}


def _crystal(i: int) -> dict[str, torch.Tensor]:
    """A CHGNet-shaped graph: node features, and edge features as long as its edges."""
    g = torch.Generator().manual_seed(i)
    n = int(torch.randint(2, 40, (1,), generator=g))
    e = int(torch.randint(0, 4 * n, (1,), generator=g))
    return {
        "atom_fea": torch.randn(n, 8, generator=g),
        "bond_fea": torch.randn(e, 3, generator=g),
        "edge_index": torch.randint(0, n, (2, e), generator=g),
        "energy": torch.tensor(float(i)),
    }


@pytest.fixture(scope="module")
def crystals() -> list[dict[str, torch.Tensor]]:
    return [_crystal(i) for i in range(N_GRAPHS)]


@pytest.fixture(scope="module")
def server(
    tmp_path_factory: pytest.TempPathFactory, crystals: list[dict[str, torch.Tensor]]
) -> Iterator[ServerProc]:
    src = tmp_path_factory.mktemp("crystals")
    atoms = tmp_path_factory.mktemp("atoms")  # the same graphs without edge features
    charged = tmp_path_factory.mktemp("charged")  # and with a second node-level field
    for i, c in enumerate(crystals):
        torch.save(c, src / f"{i:05d}.pt")
        torch.save({k: v for k, v in c.items() if k != "bond_fea"}, atoms / f"{i:05d}.pt")
        charge = torch.ones(c["atom_fea"].shape[0])
        torch.save({**c, "charge": charge}, charged / f"{i:05d}.pt")
    store = tmp_path_factory.mktemp("store")
    ingest(src, store, "chg", progress=False, threads=2)
    ingest(atoms, store, "atoms", progress=False, threads=2)
    ingest(charged, store, "charged", progress=False, threads=2)
    with run_server(store, "--transforms", "tests.transforms.mods") as srv:
        yield srv


def _pyg_batches(crystals: list[dict[str, torch.Tensor]], fields: list[str]) -> list[Any]:
    """What torch_geometric makes of the same graphs, told each one's node count."""
    data = [
        pyg_data.Data(num_nodes=c["atom_fea"].shape[0], **{k: c[k] for k in fields})
        for c in crystals
    ]
    return [pyg_data.Batch.from_data_list(data[i : i + BATCH]) for i in range(0, len(data), BATCH)]


def _read(server: ServerProc, name: str = "chg", **kw: Any) -> list[dict[str, torch.Tensor]]:
    with Loader(server.http_url, name, BATCH, shuffle=False, timeout=scaled(30), **kw) as loader:
        return list(loader)


def _assert_like_pyg(
    got: list[dict[str, torch.Tensor]], want: list[Any], fields: list[str]
) -> None:
    assert len(got) == len(want)
    for b, (g, w) in enumerate(zip(got, want, strict=True)):
        assert set(g) == {*fields, "batch", "ptr"}, sorted(g)
        for key in g:
            assert torch.equal(g[key], w[key]), f"batch {b} field {key}"


def test_named_node_field_collates_as_pyg_does(
    server: ServerProc, crystals: list[dict[str, torch.Tensor]]
) -> None:
    """node_field="atom_fea": edge_index shifted by the atoms before each graph, bond_fea
    joined along its edges, energy stacked, batch and ptr from the atom counts."""
    fields = ["atom_fea", "bond_fea", "edge_index", "energy"]
    _assert_like_pyg(_read(server, collate=CHG), _pyg_batches(crystals, fields), fields)


def test_two_candidates_are_refused_naming_both(server: ServerProc) -> None:
    """atom_fea [n, 8] and charge [n] could both count nodes (bond_fea, a row per edge,
    cannot): a 4xx names both and how to say which, at job creation (not a guess, not a
    failure at stream time)."""
    r = httpx.post(
        f"{server.http_url}/v1/jobs",
        json={"dataset": "charged", "batch_size": BATCH, "collate": "graph"},
        timeout=scaled(10),
    )
    assert 400 <= r.status_code < 500, r.text
    detail = r.json()["detail"]
    assert "['atom_fea', 'charge']" in detail and "node_field" in detail
    with pytest.raises(BadRequest, match="node_field 'edge_index'"):
        Loader(server.http_url, "chg", BATCH, collate={"graph": {"node_field": "edge_index"}})
    with pytest.raises(BadRequest, match="node_field 'atoms' is not a field"):
        Loader(server.http_url, "chg", BATCH, collate={"graph": {"node_field": "atoms"}})


def test_the_one_candidate_is_inferred_whatever_is_served(
    server: ServerProc, crystals: list[dict[str, torch.Tensor]]
) -> None:
    """atom_fea, the only field that can count nodes without edge features, is used, and with a
    second node-level field leaving it out with fields= still refuses."""
    # What counts the nodes never depends on what is served. {"graph": {}} is the plain "graph".
    fields = ["atom_fea", "edge_index", "energy"]
    _assert_like_pyg(
        _read(server, "atoms", collate="graph"), _pyg_batches(crystals, fields), fields
    )
    with pytest.raises(BadRequest, match="more than one field"):
        Loader(server.http_url, "charged", BATCH, collate="graph", fields=["atom_fea", "energy"])
    ids = {
        httpx.post(
            f"{server.http_url}/v1/jobs",
            json={"dataset": "atoms", "batch_size": BATCH, "collate": c},
            timeout=scaled(10),
        ).json()["id"]
        for c in ("graph", {"graph": {}})
    }
    assert len(ids) == 1
    r = httpx.post(
        f"{server.http_url}/v1/jobs",
        json={"dataset": "atoms", "batch_size": BATCH, "collate": {}},
        timeout=scaled(10),
    )
    assert r.status_code == 422, "an empty collate dict must not turn graphs on"


def test_transforms_run_on_each_graph_before_collation(
    server: ServerProc, crystals: list[dict[str, torch.Tensor]]
) -> None:
    """A thread transform changes each graph's atoms and a process transform adds a per-graph
    field; the collated batch is PyG's of the transformed graphs, the same on a second run."""
    fields = ["atom_fea", "bond_fea", "edge_index", "energy"]
    chain = [
        {"name": "add_const", "params": {"field": "atom_fea", "value": 1.0}},
        {"name": "py_noise", "params": {"scale": 2.0}},
    ]
    got = _read(server, collate=CHG, transforms=chain)
    again = _read(server, collate=CHG, transforms=chain)
    shifted = [{**c, "atom_fea": c["atom_fea"] + 1.0} for c in crystals]
    want = _pyg_batches(shifted, fields)
    for b, (g, w, a) in enumerate(zip(got, want, again, strict=True)):
        n = int(w["ptr"].numel()) - 1
        assert g["noise"].shape == (4 * n,) and torch.equal(g["noise"], a["noise"]), b
        assert bool((g["noise"] >= 0).all() and (g["noise"] < 2.0).all()), b
        del g["noise"]
    _assert_like_pyg(got, want, fields)
