"""The vectorised variable-size gather (``take_ragged``) against Arrow's own take, over stores
of many shards: same values, same offsets, in fresh memory, whatever chunks a batch touches."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardserve.proto.jobs import GraphOptions
from shardserve.proto.manifest import FieldSpec
from shardserve.server.store.catalog import Store
from shardserve.server.store.read import gather
from shardserve.server.store.read.dataset import Dataset
from shardserve.server.store.read.index import locate
from shardserve.server.store.read.shard_set import Chunks
from shardserve.server.store.write.writer import ShardWriter
from tests.support.data import graph_sample, make_graph_like

N = 300
ODD_FIELDS = (
    FieldSpec(name="flags", dtype="bool", shape=(-1,)),
    FieldSpec(name="seq", dtype="int16", shape=(-1, 3)),
    FieldSpec(name="big", dtype="float32", shape=(-1,)),
)


def _odd(i: int) -> dict[str, object]:
    rng = np.random.default_rng(i)
    n = int(rng.integers(0, 6))  # some samples are empty
    return {
        "flags": rng.integers(0, 2, n).astype(bool),
        "seq": rng.integers(-9, 9, (n, 3)).astype(np.int16),
        # Far more units per sample than SLICE_MIN_UNITS: one slice per sample.
        "big": np.full(gather.SLICE_MIN_UNITS * 20 + i % 7, i, dtype=np.float32),
        "maybe": None if i % 4 == 0 else np.arange(i % 5, dtype=np.int32),
    }


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory) -> tuple[Dataset, Dataset]:
    root: Path = tmp_path_factory.mktemp("ragged")
    make_graph_like(root, n=N, shard_bytes=6 << 10)  # tens of shards
    with ShardWriter(root, "odd", shard_bytes=40 << 10, variable=["maybe"]) as w:
        for i in range(N):
            w.add(_odd(i))
    store = Store(root)
    return store.open("graphs"), store.open("odd")


def _chunks(ds: Dataset) -> Chunks:
    """Every chunk of a local dataset (its shard set hands out all of them)."""
    return ds.shards.acquire(range(len(ds.manifest.shards)))


def _reference(ds: Dataset, name: str, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    chunk, rows = locate(idx, _chunks(ds).starts)
    g = gather.groups(chunk)
    spec = next(f for f in ds.fields if f.name == name)
    return gather.ragged_parts(
        gather.take_arrow(list(_chunks(ds).arrays[name]), g, rows), spec.dtype
    )


def _assert_same(ds: Dataset, idx: np.ndarray) -> None:
    parts = ds.take(idx)
    chunks = [v for n, a in _chunks(ds).arrays.items() for c in range(len(a)) for v in a.views(c)]
    for name in _chunks(ds).arrays:
        want_v, want_o = _reference(ds, name, idx)
        np.testing.assert_array_equal(parts[name + ".offsets"], want_o)
        np.testing.assert_array_equal(parts[name], want_v)
        assert parts[name].dtype == want_v.dtype
        assert not any(np.shares_memory(parts[name], v) for v in chunks), f"{name} views the store"
        # The remote store passes plain lists (no cached views): the same answer.
        chunk, rows = locate(idx, _chunks(ds).starts)
        spec = next(f for f in ds.fields if f.name == name)
        v, o = gather.take_ragged(
            list(_chunks(ds).arrays[name]), gather.groups(chunk), rows, spec.dtype, spec.shape
        )
        np.testing.assert_array_equal(v, want_v)
        np.testing.assert_array_equal(o, want_o)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_ragged_take_equals_arrow_take(
    stores: tuple[Dataset, Dataset], data: st.DataObject
) -> None:
    """Any batch (repeats, any order, one chunk or many) gathers what Arrow's take gathers."""
    for ds in stores:
        idx = np.asarray(data.draw(st.lists(st.integers(0, N - 1), min_size=1, max_size=90)))
        _assert_same(ds, idx)


def test_batches_spanning_every_shard(stores: tuple[Dataset, Dataset]) -> None:
    """A shuffled epoch over a store of many shards, batch by batch, and one sorted batch in one chunk."""
    graphs = stores[0]
    assert len(graphs.manifest.shards) >= 10
    perm = np.random.default_rng(3).permutation(N)
    for ds in stores:
        for s in range(0, N, 64):
            _assert_same(ds, perm[s : s + 64])
        _assert_same(ds, np.arange(3))


def test_values_match_samples(stores: tuple[Dataset, Dataset]) -> None:
    """Against the samples as written: bool, int16 rows of 3, empty and missing samples."""
    _, odd = stores
    idx = np.array([5, 0, 299, 4, 4, 131, 8])
    parts = odd.take(idx)
    for j, i in enumerate(idx.tolist()):
        want = _odd(i)
        for name in ("flags", "seq", "big"):
            off = parts[name + ".offsets"]
            got = parts[name][off[j] : off[j + 1]]
            np.testing.assert_array_equal(got.reshape(parts[name + ".shapes"][j]), want[name])
        assert parts["maybe.mask"][j] == (want["maybe"] is not None)
        if want["maybe"] is not None:
            off = parts["maybe.offsets"]
            np.testing.assert_array_equal(parts["maybe"][off[j] : off[j + 1]], want["maybe"])


@pytest.mark.parametrize("slice_min", [0, 10**9])
def test_slices_and_unit_index_gather_the_same(
    stores: tuple[Dataset, Dataset], monkeypatch: pytest.MonkeyPatch, slice_min: int
) -> None:
    """Long samples move as one slice each, short ones through an index per unit: forced
    each way, every batch is still Arrow's (repeats, one chunk, many chunks)."""
    monkeypatch.setattr(gather, "SLICE_MIN_UNITS", slice_min)
    perm = np.random.default_rng(5).permutation(N)
    for ds in stores:
        for s in range(0, N, 37):
            _assert_same(ds, perm[s : s + 37])
        _assert_same(ds, np.array([7, 7, 0, 299]))


@settings(max_examples=40, deadline=None)
@given(edges=st.lists(st.integers(0, 40), min_size=1, max_size=30), k=st.integers(1, 3))
def test_cat_last_slices_equal_the_index_path(edges: list[int], k: int) -> None:
    """``collate="graph"`` joins ``[k, E_g]`` blocks into ``[k, sum E]`` the same both ways."""
    from shardserve.server.store.read import graphs

    e = np.array(edges, dtype=np.int64)
    offsets = np.zeros(len(e) + 1, dtype=np.int64)
    np.cumsum(e * k, out=offsets[1:])
    values = np.arange(int(offsets[-1]), dtype=np.int64)
    shapes = np.stack([np.full(len(e), k), e], 1)
    want = np.concatenate(
        [values[o : o + k * n].reshape(k, n) for o, n in zip(offsets[:-1], e, strict=True)], 1
    )
    for slice_min in (0, 10**9):
        old, graphs.SLICE_MIN_EDGES = graphs.SLICE_MIN_EDGES, slice_min
        try:
            got = graphs._cat_last(values, offsets, shapes, np.empty)
            np.testing.assert_array_equal(got, want)
        finally:
            graphs.SLICE_MIN_EDGES = old


def _collated_reference(ids: list[int], batch_size: int) -> dict[str, np.ndarray]:
    """PyG's collation of graphs ``ids``, graph by graph, batches of ``batch_size`` end to end."""
    parts: dict[str, list[np.ndarray]] = {
        "x": [],
        "edge_index": [],
        "y": [],
        "batch": [],
        "ptr": [],
    }
    for lo in range(0, len(ids), batch_size):
        graphs = [graph_sample(i) for i in ids[lo : lo + batch_size]]
        nodes = np.cumsum([0] + [len(g["x"]) for g in graphs])
        parts["x"] += [g["x"] for g in graphs]
        parts["edge_index"] += [g["edge_index"] + n for g, n in zip(graphs, nodes, strict=False)]
        parts["y"] += [np.array([g["y"]]) for g in graphs]
        parts["batch"] += [np.full(len(g["x"]), k) for k, g in enumerate(graphs)]
        parts["ptr"].append(nodes)
    axis = {"edge_index": 1}
    return {n: np.concatenate(v, axis=axis.get(n, 0)) for n, v in parts.items()}


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    ids=st.lists(st.integers(0, N - 1), min_size=1, max_size=70),
    batch_size=st.integers(1, 80),
)
def test_graph_batches_equal_a_graph_by_graph_reference(
    stores: tuple[Dataset, Dataset], ids: list[int], batch_size: int
) -> None:
    """``collate="graph"`` over tens of shards equals PyG's rules applied graph by graph."""
    from shardserve.server.store.read.graph_shapes import ItemFields
    from shardserve.server.store.read.graphs import GraphCollated

    collated = GraphCollated(stores[0], batch_size, GraphOptions(), ItemFields())
    got = collated.take(np.array(ids), ["x", "edge_index", "y"])
    want = _collated_reference(ids, batch_size)
    for name, value in want.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)
        assert got[name].dtype == value.dtype, name
