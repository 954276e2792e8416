"""ShardWriter: schemas, shard splitting, manifests, and refusal of inconsistent samples."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from shardserve.proto.errors import InvalidDataError
from shardserve.proto.manifest import FieldSpec
from shardserve.server.store.catalog import Store
from shardserve.server.store.write.writer import ShardWriter
from tests.support.data import make_cifar_like, make_graph_like, sample_id_of


def test_fields_inferred_from_first_sample(store_root: Path) -> None:
    """Arrays become tensors, numbers scalars, bytes binary, with the first sample's dtypes."""
    with ShardWriter(store_root, "mixed") as w:
        for i in range(5):
            w.add({"img": np.full((2, 3), i, np.float32), "k": i, "p": float(i), "raw": b"ab" * i})
    fields = {f.name: (f.dtype, f.shape, f.kind) for f in w.manifest.fields}
    assert fields == {
        "img": ("float32", (2, 3), "tensor"),
        "k": ("int64", (), "scalar"),
        "p": ("float64", (), "scalar"),
        "raw": ("binary", (), "binary"),
    }
    parts = Store(store_root).open("mixed").take(np.arange(5))
    assert parts["img"][:, 0, 0].tolist() == [0, 1, 2, 3, 4]
    assert parts["raw"].tobytes() == b"".join(b"ab" * i for i in range(5))


def test_tiny_shard_size_splits_into_many_shards(store_root: Path) -> None:
    """A small shard size yields several shards whose rows add up to the sample count."""
    m = make_cifar_like(store_root, n=500, shard_bytes=64 << 10)
    assert len(m.shards) > 5
    assert sum(s.rows for s in m.shards) == m.num_samples == 500
    assert all((store_root / "cifar" / s.path).stat().st_size == s.bytes for s in m.shards)
    ds = Store(store_root).open("cifar")
    assert sample_id_of(ds.take(np.arange(500))).tolist() == list(range(500))


def test_add_and_add_batch_mix(store_root: Path) -> None:
    """Single samples and column batches interleave in order."""
    with ShardWriter(store_root, "mix", shard_bytes=100) as w:
        w.add({"v": np.array([0, 0], np.int32)})
        w.add_batch({"v": np.arange(2, 12, dtype=np.int32).reshape(5, 2)})
        w.add({"v": np.array([12, 12], np.int32)})
    assert w.manifest.num_samples == 7
    v = Store(store_root).open("mix").take(np.arange(7))["v"]
    assert v[:, 0].tolist() == [0, 2, 4, 6, 8, 10, 12]


def test_variable_fields_declared_by_name_are_narrowed(store_root: Path) -> None:
    """``variable=`` marks a field variable; dimensions that never change are kept fixed."""
    with ShardWriter(store_root, "var", variable={"x"}) as w:
        for n in (1, 4, 2):
            w.add({"x": np.ones((n, 8), np.float32)})
    assert w.manifest.field("x").shape == (-1, 8)


def test_graph_like_manifest(store_root: Path) -> None:
    """Variable and binary fields round-trip through the manifest with -1 dimensions."""
    m = make_graph_like(store_root, n=50)
    assert [f.kind for f in m.fields] == ["variable", "variable", "scalar", "binary"]
    assert m.field("edge_index").shape == (2, -1)


@pytest.mark.parametrize(
    ("second", "needle"),
    [
        ({"a": np.zeros(3, np.float64), "b": 1}, "dtype float64"),
        # A differing dim is now found variable; a differing rank is refused.
        ({"a": np.zeros((3, 1), np.float32), "b": 1}, "has shape (3, 1)"),
        ({"a": np.zeros(3, np.float32)}, "missing ['b']"),
        ({"a": np.zeros(3, np.float32), "b": 1, "c": 2}, "unexpected ['c']"),
        ({"a": np.zeros(3, np.float32), "b": 1.5}, "field 'b'"),
    ],
)
def test_inconsistent_sample_is_refused_and_nothing_published(
    store_root: Path, second: dict, needle: str
) -> None:
    """A sample whose fields, dtypes or fixed dims differ aborts the write, naming the field."""
    with (
        pytest.raises(InvalidDataError, match="sample 1") as err,
        ShardWriter(store_root, "bad") as w,
    ):
        w.add({"a": np.zeros(3, np.float32), "b": 1})
        w.add(second)
    assert needle in str(err.value)
    assert Store(store_root).list() == []
    assert [p.name for p in store_root.iterdir()] == []


def test_existing_dataset_needs_overwrite(store_root: Path) -> None:
    """A second write of the same name is refused unless overwrite=True, which replaces it."""
    make_cifar_like(store_root, n=10)
    with pytest.raises(InvalidDataError, match="already exists"):
        make_cifar_like(store_root, n=20)
    with ShardWriter(
        store_root, "cifar", fields=[FieldSpec(name="v", dtype="int8")], overwrite=True
    ) as w:
        w.add({"v": np.int8(1)})
    assert [(m.name, m.num_samples) for m in Store(store_root).list()] == [("cifar", 1)]
    assert sorted(p.name for p in store_root.iterdir()) == ["cifar"]


@pytest.mark.parametrize("name", ["../evil", "a/b", "..", ".hidden", "", "x" * 200])
def test_unsafe_names_are_refused(store_root: Path, name: str) -> None:
    """Names that could leave the store or hide are refused before anything is written."""
    with pytest.raises(InvalidDataError, match="not allowed"):
        ShardWriter(store_root, name)
    assert list(store_root.iterdir()) == []


def test_empty_writer_publishes_nothing(store_root: Path) -> None:
    """Closing a writer that received no samples is an error and leaves no dataset."""
    with pytest.raises(InvalidDataError, match="no samples"), ShardWriter(store_root, "empty"):
        pass
    assert list(store_root.iterdir()) == []


def test_declared_fields_are_enforced(store_root: Path) -> None:
    """With ``fields=`` given, a sample that does not fit the declared shape is refused."""
    spec = [FieldSpec(name="x", dtype="float32", shape=(-1, 8))]
    with (
        pytest.raises(InvalidDataError, match="declared shape"),
        ShardWriter(store_root, "d", fields=spec) as w,
    ):
        w.add({"x": np.zeros((3, 8), np.float32)})
        w.add({"x": np.zeros((3, 7), np.float32)})
