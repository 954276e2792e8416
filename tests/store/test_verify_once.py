"""The store verifies each shard file once per process, and the service closes its store."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardserve.proto.errors import DatasetCorruptError
from shardserve.server.service import Service
from shardserve.server.settings import Settings
from shardserve.server.store.catalog import Store
from tests.support.data import make_cifar_like, sample_id_of


def _flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


def test_a_full_verify_runs_once_per_mapped_version(tmp_path: Path) -> None:
    """Under verify="full" the first open hashes every shard; later opens of the same store
    reuse that verdict, while a fresh store (a new process) checks again and refuses."""
    m = make_cifar_like(tmp_path, n=300, shard_bytes=256 << 10)
    store = Store(tmp_path, verify="full")
    ds = store.open("cifar")
    _flip_byte(tmp_path / "cifar" / m.shards[1].path, 4096)
    assert store.open("cifar") is ds  # not hashed again, so the flip goes unseen here
    with pytest.raises(DatasetCorruptError, match=r"shard-00001\.arrow failed its checksum"):
        Store(tmp_path, verify="full").open("cifar")
    store.close()
    with pytest.raises(ValueError, match="verify must be one of"):
        Store(tmp_path, verify="sometimes")


def test_service_opens_through_its_store_and_stop_closes_it(tmp_path: Path) -> None:
    """A failed first open under --verify full is not cached (the next open fails again); a
    good dataset is shared between opens and unreadable once the service stopped."""
    m = make_cifar_like(tmp_path, n=300, shard_bytes=256 << 10)
    make_cifar_like(tmp_path, name="bad", n=300, shard_bytes=256 << 10)
    _flip_byte(tmp_path / "bad" / m.shards[0].path, 4096)
    svc = Service(Settings(store=tmp_path, data=["tcp://127.0.0.1:0"], shm=False, verify="full"))
    svc.start()
    try:
        for _ in range(2):
            with pytest.raises(DatasetCorruptError, match=r"shard-00000\.arrow"):
                svc.open_dataset("bad")
        ds = svc.open_dataset("cifar")
        assert svc.open_dataset("cifar") is ds
        assert sample_id_of(ds.take([5, 299])).tolist() == [5, 299]
    finally:
        svc.stop()
    with pytest.raises(ValueError):
        ds.take([0])
