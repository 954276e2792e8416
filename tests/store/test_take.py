"""Dataset.take against a naive per-sample reference, for fixed, variable and binary fields."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardserve.server.store.catalog import Store
from shardserve.server.store.read.dataset import Dataset
from shardserve.server.store.read.gather import JOIN_MAX_ROW_BYTES, JoinedColumns, groups
from shardserve.server.store.read.joined_behind import JoinedBehind, joined_in_pieces
from shardserve.server.store.write.writer import ShardWriter
from tests.support.data import (
    cifar_images,
    graph_sample,
    make_cifar_like,
    make_graph_like,
    sample_id_of,
)
from tests.support.slowness import scaled

N_CIFAR = 600
N_GRAPH = 150


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory) -> tuple[Dataset, Dataset]:
    root = tmp_path_factory.mktemp("take")
    make_cifar_like(root, n=N_CIFAR, shard_bytes=200 << 10)  # several shards
    make_graph_like(root, n=N_GRAPH, shard_bytes=8 << 10)
    store = Store(root)
    return store.open("cifar"), store.open("graphs")


def _check_cifar(ds: Dataset, idx: np.ndarray) -> None:
    parts = ds.take(idx)
    assert parts["image"].shape == (len(idx), 3, 32, 32) and parts["image"].flags.c_contiguous
    assert sample_id_of(parts).tolist() == idx.tolist()
    for j, i in enumerate(idx.tolist()):
        np.testing.assert_array_equal(parts["image"][j], cifar_images(i, i + 1)[0])
    assert parts["label"].tolist() == (idx % 10).tolist()


def _check_graphs(ds: Dataset, idx: np.ndarray) -> None:
    parts = ds.take(idx)
    for name in ("x", "edge_index"):
        off, shapes = parts[f"{name}.offsets"], parts[f"{name}.shapes"]
        assert off.dtype == np.int64 and off.shape == (len(idx) + 1,) and off[0] == 0
        assert shapes.shape == (len(idx), 2)
        for j, i in enumerate(idx.tolist()):
            want = graph_sample(int(i))[name]
            np.testing.assert_array_equal(parts[name][off[j] : off[j + 1]].reshape(shapes[j]), want)
    off = parts["smiles.offsets"]
    for j, i in enumerate(idx.tolist()):
        assert parts["smiles"][off[j] : off[j + 1]].tobytes() == graph_sample(int(i))["smiles"]
    assert parts["y"].tolist() == idx.astype(np.float32).tolist()


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.lists(st.integers(0, N_CIFAR - 1), min_size=1, max_size=80))
def test_cifar_take_matches_reference(stores: tuple[Dataset, Dataset], ids: list[int]) -> None:
    """Any index list (any order, repeats, across shards) gathers exactly those samples."""
    _check_cifar(stores[0], np.array(ids, dtype=np.int64))


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.lists(st.integers(0, N_GRAPH - 1), min_size=1, max_size=40))
def test_graph_take_matches_reference(stores: tuple[Dataset, Dataset], ids: list[int]) -> None:
    """Variable and binary fields gather into values + offsets (+ shapes) in request order."""
    _check_graphs(stores[1], np.array(ids, dtype=np.int64))


@given(st.lists(st.integers(0, 6), min_size=1, max_size=70), st.sampled_from([0, 1 << 16]))
def test_groups_name_each_touched_chunk_with_its_positions(chunks: list[int], base: int) -> None:
    """A batch's chunk ids (one chunk or several, ids past 16 bits) group into each touched
    chunk, ascending, with its positions in the batch, ascending: every position once."""
    chunk = np.array(chunks, dtype=np.int64) + base
    got = [(c, np.arange(chunk.size)[p].tolist()) for c, p in groups(chunk)]
    ids = chunk.tolist()
    want = [(c, [j for j, x in enumerate(ids) if x == c]) for c in sorted(set(ids))]
    assert got == want


def test_single_shard_batch_and_full_permutation(stores: tuple[Dataset, Dataset]) -> None:
    """A batch inside one shard and a full shuffled epoch both come back exactly."""
    cifar, graphs = stores
    _check_cifar(cifar, np.arange(3, 40)[::-1].copy())
    perm = np.random.default_rng(1).permutation(N_CIFAR)
    assert sample_id_of(cifar.take(perm)).tolist() == perm.tolist()
    _check_graphs(graphs, np.random.default_rng(2).permutation(N_GRAPH))


def test_out_buffers_are_written_in_place(stores: tuple[Dataset, Dataset]) -> None:
    """Fixed fields with an ``out`` array are written into it and that same array is returned."""
    cifar = stores[0]
    out = {"image": np.empty((4, 3, 32, 32), np.uint8), "label": np.empty(4, np.int64)}
    for idx in (np.array([1, 2, 3, 4]), np.array([599, 0, 300, 5])):
        parts = cifar.take(idx, out=out)
        assert parts["image"] is out["image"] and parts["label"] is out["label"]
        assert sample_id_of(out).tolist() == idx.tolist()
    with pytest.raises(ValueError, match="expected a C-contiguous uint8"):
        cifar.take(np.arange(3), out=out)


def test_field_selection_and_errors(stores: tuple[Dataset, Dataset]) -> None:
    """Only requested fields come back; unknown fields and out-of-range ids name the bounds."""
    cifar, graphs = stores
    assert set(cifar.take([0], fields=["label"])) == {"label"}
    assert set(graphs.take([0], fields=["smiles"])) == {"smiles", "smiles.offsets"}
    with pytest.raises(KeyError, match=r"fields are \['image', 'label'\]"):
        cifar.take([0], fields=["nope"])
    with pytest.raises(IndexError, match=f"sample {N_CIFAR} out of range 0 <= i < {N_CIFAR}"):
        cifar.take([0, N_CIFAR])
    with pytest.raises(IndexError, match="sample -1 out of range"):
        cifar.take([-1])


def test_empty_take(stores: tuple[Dataset, Dataset]) -> None:
    """An empty index list gives empty parts of the right dtypes and shapes."""
    cifar, graphs = stores
    parts = cifar.take(np.array([], dtype=np.int64))
    assert parts["image"].shape == (0, 3, 32, 32)
    g = graphs.take([])
    assert (
        g["x.offsets"].tolist() == [0]
        and g["x.shapes"].shape == (0, 2)
        and g["x"].dtype == np.float32
    )


def test_descriptions(stores: tuple[Dataset, Dataset]) -> None:
    """part_shapes / shard_rows describe the batches take produces."""
    cifar, graphs = stores
    assert cifar.part_shapes(None) == {"image": ("uint8", (3, 32, 32)), "label": ("int64", ())}
    assert set(graphs.part_shapes(["x"])) == {"x", "x.offsets", "x.shapes"}
    assert cifar.shard_rows.dtype == np.int64 and int(cifar.shard_rows.sum()) == N_CIFAR


def test_concurrent_takes_share_one_dataset(tmp_path: Path) -> None:
    """Threads taking from one lazily-verified Dataset all get correct batches."""
    make_cifar_like(tmp_path, n=400, shard_bytes=100 << 10)
    store = Store(tmp_path)
    ds = store.open("cifar")
    assert store.open("cifar") is ds
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        rng = np.random.default_rng(seed)
        try:
            for _ in range(30):
                idx = rng.integers(0, 400, 64)
                assert sample_id_of(ds.take(idx)).tolist() == idx.tolist()
        except BaseException as e:  # collected and re-raised in the main thread
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=scaled(60))
    assert not errors and not any(t.is_alive() for t in threads)
    store.close()
    with pytest.raises(ValueError, match="closed"):
        ds.take([0])


@pytest.fixture(scope="module")
def big_rows(tmp_path_factory: pytest.TempPathFactory) -> tuple[Dataset, np.ndarray]:
    """32 KiB rows over several shards: the row-by-row copy of a batch spanning chunks."""
    root = tmp_path_factory.mktemp("big")
    rows = np.random.default_rng(7).standard_normal((40, 32, 256), dtype=np.float32)
    with ShardWriter(root, "big", shard_bytes=200 << 10) as w:
        w.add_batch({"x": rows, "i": np.arange(40, dtype=np.int64)})
    ds = Store(root).open("big")
    assert len(ds.manifest.shards) > 3
    return ds, rows


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.lists(st.integers(0, 39), min_size=1, max_size=30))
def test_big_rows_across_shards_match_reference(
    big_rows: tuple[Dataset, np.ndarray], ids: list[int]
) -> None:
    ds, rows = big_rows
    idx = np.array(ids, dtype=np.int64)
    out = {"x": np.empty((len(ids), 32, 256), np.float32), "i": np.empty(len(ids), np.int64)}
    parts = ds.take(idx, out=out)
    assert parts["x"] is out["x"]
    np.testing.assert_array_equal(parts["x"], rows[idx])
    assert parts["i"].tolist() == ids


def test_a_small_column_is_joined_behind_the_first_reads(tmp_path: Path) -> None:
    """A new dataset's first read of a small column across shards starts no copy of it; later
    reads ask for it on a thread of its own, and every read gives the same rows."""
    make_cifar_like(tmp_path, n=N_CIFAR, shard_bytes=200 << 10)
    ds = Store(tmp_path).open("cifar")
    try:
        idx = np.random.default_rng(0).permutation(N_CIFAR)[:64]
        joining = [t for t in threading.enumerate() if t.name.startswith("ss-join")]
        _check_cifar(ds, idx)
        started = [t for t in threading.enumerate() if t.name.startswith("ss-join")]
        assert started == joining  # the first read waited for no join
        for _ in range(3):  # while the copies are made, and (some) after
            _check_cifar(ds, idx[::-1].copy())
        started = [t for t in threading.enumerate() if t.name.startswith("ss-join")]
        assert len(started) > len(joining)
    finally:
        ds.close()


@pytest.mark.parametrize("rows", [(0,), (5,), (3, 0, 7), (1000, 1, 999)])
@pytest.mark.parametrize("shape", [(), (3,), (2, 4)])
def test_a_column_joined_in_pieces_is_the_joined_column(
    rows: tuple[int, ...], shape: tuple[int, ...]
) -> None:
    """A column copied a piece at a time behind the reads is the one joined at once, and
    one too big to join is joined by neither."""
    rng = np.random.default_rng(len(rows))
    chunks = [rng.integers(0, 100, (r, *shape)).astype(np.int16) for r in rows]
    behind = JoinedBehind()
    try:
        assert behind.get("c", chunks) is None and behind.get("c", chunks) is None
        behind.wait(scaled(30.0))
        want = JoinedColumns().get("c", chunks)
        got = behind.get("c", chunks)
        assert want is not None and got is not None
        assert got.dtype == want.dtype and np.array_equal(got, want)
        for piece_bytes in (1, 7, 64):
            with_pieces = joined_in_pieces(chunks, piece_bytes)
            assert with_pieces is not None and np.array_equal(with_pieces, want)
    finally:
        behind.close()
    wide = [np.zeros((2, JOIN_MAX_ROW_BYTES + 1), np.uint8)]
    assert joined_in_pieces(wide) is None and JoinedColumns().get("w", wide) is None
