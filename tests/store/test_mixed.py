"""A mixture read as one dataset from real stores: every part of a batch equals what each
source's own ``take`` gives for its samples, in the batch's order, fixed and ragged fields
alike, from a local store and through a remote store's evicting cache."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from shardserve.proto.errors import DatasetCorruptError
from shardserve.proto.manifest import FieldSpec
from shardserve.proto.parts import SOURCE_PART
from shardserve.server.planning.mixture import MixSource, Segment, mixture_order, source_offsets
from shardserve.server.store.cache import ShardCache
from shardserve.server.store.catalog import Store
from shardserve.server.store.read.mixed import mixed_dataset
from shardserve.server.store.remote.publish import RemotePublisher
from shardserve.server.store.remote.stores import RemoteStore
from shardserve.server.store.write.writer import ShardWriter
from tests.support.data import make_cifar_like, make_graph_like, sample_id_of


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Store:
    root = tmp_path_factory.mktemp("mixtake")
    make_cifar_like(root, "a", n=300, seed=1)
    make_cifar_like(root, "b", n=200, seed=2)
    make_graph_like(root, "g1", n=120, seed=1)
    make_graph_like(root, "g2", n=90, seed=2)
    return Store(Path(root))


@pytest.fixture(scope="module")
def remote(store: Store, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RemoteStore]:
    """The same datasets on a file:// store, read through a cache smaller than one of them."""
    tmp = tmp_path_factory.mktemp("mixremote")
    up = RemoteStore((tmp / "uri").as_uri())
    for name in ("a", "b", "g1", "g2"):
        RemotePublisher(up).upload(store.root / name, name, overwrite=False)
    up.close()
    cache = ShardCache(tmp / "cache", limit_bytes=64 << 10)
    r = RemoteStore((tmp / "uri").as_uri(), cache=cache)
    yield r
    r.close()


def _check(store: Store | RemoteStore, names: list[str], batch: int) -> None:
    sets = [store.open(n) for n in names]
    mixed = mixed_dataset("mix:" + "+".join(names), sets)
    sizes = [d.num_samples for d in sets]
    offsets = source_offsets([MixSource(n) for n in sizes])
    order = mixture_order(
        [MixSource(n) for n in sizes], 3, 0, 600, [Segment(0, (1.0,) * len(names))]
    )
    for lo in range(0, len(order), batch):
        ids = order[lo : lo + batch].astype(np.int64)
        out = {SOURCE_PART: np.empty(len(ids), np.int16)}
        parts = mixed.take(ids, out=out)
        assert parts[SOURCE_PART] is out[SOURCE_PART]  # written into the stream's memory
        src = np.searchsorted(offsets, ids, side="right") - 1
        assert parts[SOURCE_PART].dtype == np.int16
        assert parts[SOURCE_PART].tolist() == src.tolist()
        for i, (s, gid) in enumerate(zip(src.tolist(), ids.tolist(), strict=True)):
            one = sets[s].take([gid - int(offsets[s])])
            for name, value in one.items():
                if name.endswith(".offsets"):
                    continue
                got = parts[name]
                if name + ".offsets" in parts:
                    off = parts[name + ".offsets"]
                    got = got[off[i] : off[i + 1]]
                    assert np.array_equal(got, value), (name, i)
                else:
                    assert np.array_equal(got[i], value[0]), (name, i)


def test_fixed_fields_in_batch_order(store: Store) -> None:
    """Cifar-like sources: images and labels land at their batch positions."""
    _check(store, ["a", "b"], batch=64)
    parts = mixed_dataset("mix:a+b", [store.open("a"), store.open("b")]).take([305, 7, 499])
    assert sample_id_of(parts).tolist() == [5, 7, 199]


def test_ragged_fields_in_batch_order(store: Store) -> None:
    """Graph-like sources: variable tensors and bytes keep each sample's values and shape."""
    _check(store, ["g1", "g2"], batch=17)


@pytest.mark.parametrize("names", [["a", "b"], ["g1", "g2"]])
def test_through_an_evicting_cache(remote: RemoteStore, names: list[str]) -> None:
    """A remote store's sources (shards leased per batch, evicted past the cache's limit)
    give the same batches as a local store's."""
    _check(remote, names, batch=40)


def test_a_field_subset_of_sources_that_differ_elsewhere(tmp_path: Path) -> None:
    """Sources that share only ``label`` mix with ``fields=["label"]``: the first source's
    variable field, which the other lacks, is not joined (it is not read)."""
    fields = (
        FieldSpec(name="label", dtype="int64"),
        FieldSpec(name="tokens", dtype="int32", shape=(-1,)),
    )
    with ShardWriter(tmp_path, "t", fields=fields) as w:
        for i in range(20):
            w.add({"label": np.int64(100 + i), "tokens": np.arange(i % 5, dtype=np.int32)})
    make_cifar_like(tmp_path, "a", n=30, seed=1)
    s = Store(tmp_path)
    mixed = mixed_dataset("mix:t+a", [s.open("t"), s.open("a")], ["label"])
    assert list(mixed.part_shapes(None)) == ["label", SOURCE_PART]
    parts = mixed.take([0, 20 + 3, 5])
    assert parts[SOURCE_PART].tolist() == [0, 1, 0] and parts["label"].tolist() == [100, 3, 105]


def test_a_corrupt_shard_of_a_later_source_is_named(tmp_path: Path) -> None:
    """A damaged shard of the second source fails the read with its own error, naming the
    dataset, not a bug of the joining."""
    make_cifar_like(tmp_path, "a", n=50, seed=1)
    make_cifar_like(tmp_path, "b", n=50, seed=2)
    shard = next((tmp_path / "b").rglob("*.arrow"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # checked (lazily) at the first read of the shard
    shard.write_bytes(bytes(data))
    s = Store(tmp_path)
    mixed = mixed_dataset("mix:a+b", [s.open("a"), s.open("b")])
    with pytest.raises(DatasetCorruptError, match="b"):
        mixed.take([3, 50 + 3])


def test_empty_batch(store: Store) -> None:
    """No ids: the parts are empty, with a source part."""
    parts = mixed_dataset("mix:a+b", [store.open("a"), store.open("b")]).take([])
    assert len(parts[SOURCE_PART]) == 0 and parts["label"].shape == (0,)
