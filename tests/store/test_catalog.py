"""Store: listing only published datasets, name safety, caching, and corruption detection."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from shardserve.proto.errors import DatasetCorruptError, DatasetNotFound, InvalidDataError
from shardserve.server.store.catalog import Store
from shardserve.server.store.write.writer import ShardWriter
from tests.support.data import CIFAR_FIELDS, make_cifar_like, sample_id_of


def _flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def test_list_ignores_everything_but_published_datasets(store_root: Path) -> None:
    """Hidden, temp and manifest-less folders and stray files are not datasets."""
    make_cifar_like(store_root, n=20)
    (store_root / ".shardserve").mkdir()
    (store_root / ".tmp-x-123" / "shards").mkdir(parents=True)
    (store_root / ".tmp-x-123" / "manifest.json").write_text("{}")
    (store_root / "no_manifest").mkdir()
    (store_root / "notes.txt").write_text("hi")
    (store_root / "broken").mkdir()
    (store_root / "broken" / "manifest.json").write_text("{not json")
    assert [m.name for m in Store(store_root).list()] == ["cifar"]
    assert Store(store_root / "missing").list() == []


def test_manifest_and_open_errors(store_root: Path) -> None:
    """Absent datasets raise DatasetNotFound; unsafe names raise InvalidDataError."""
    store = Store(store_root)
    make_cifar_like(store_root, n=20)
    assert store.manifest("cifar").num_samples == 20
    with pytest.raises(DatasetNotFound, match="datasets: cifar"):
        store.manifest("nope")
    with pytest.raises(DatasetNotFound):
        store.open("nope")
    for bad in ("../store", "a/b", ".tmp-x"):
        with pytest.raises(InvalidDataError):
            store.open(bad)


def test_open_is_cached_until_overwritten(store_root: Path) -> None:
    """open() shares one Dataset per name, and sees a dataset replaced by overwrite."""
    store = Store(store_root)
    make_cifar_like(store_root, n=20)
    first = store.open("cifar")
    assert store.open("cifar") is first
    with ShardWriter(store_root, "cifar", fields=CIFAR_FIELDS, overwrite=True) as w:
        w.add_batch({"image": np.zeros((30, 3, 32, 32), np.uint8), "label": np.zeros(30, np.int64)})
    second = store.open("cifar")
    assert second is not first and second.num_samples == 30
    assert sample_id_of(first.take([19])).tolist() == [19]  # the old mapping still reads
    store.close()


def test_flipped_byte_caught_lazily_and_by_verify(store_root: Path) -> None:
    """A flipped data byte fails the shard's checksum before any sample of it is served."""
    m = make_cifar_like(store_root, n=300, shard_bytes=256 << 10)
    bad = store_root / "cifar" / m.shards[1].path
    _flip_byte(bad, bad.stat().st_size // 2)
    ds = Store(store_root).open("cifar")
    assert sample_id_of(ds.take([0, 1])).tolist() == [0, 1]  # shard 0 is fine
    with pytest.raises(DatasetCorruptError, match=r"shard-00001\.arrow failed its checksum"):
        ds.take([m.shards[0].rows])
    with pytest.raises(DatasetCorruptError, match=r"shard-00001\.arrow"):
        ds.take([m.shards[0].rows + 1])  # still refused, without hashing again
    with pytest.raises(DatasetCorruptError, match=r"shard-00001\.arrow"):
        ds.verify()
    with pytest.raises(DatasetCorruptError, match=r"shard-00001\.arrow"):
        Store(store_root).open("cifar", verify="full")


def test_truncated_and_missing_shards_are_named(store_root: Path) -> None:
    """A truncated or missing shard fails open with the file name and the reason."""
    m = make_cifar_like(store_root, n=300, shard_bytes=256 << 10)
    path = store_root / "cifar" / m.shards[2].path
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(DatasetCorruptError, match=r"shard-00002\.arrow is truncated"):
        Store(store_root).open("cifar")
    path.unlink()
    with pytest.raises(DatasetCorruptError, match=r"shard-00002\.arrow is missing"):
        Store(store_root).open("cifar", verify="off")
