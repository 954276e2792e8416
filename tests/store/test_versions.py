"""Dataset versions in the store: content ids, and a ``Store`` that keeps a
replaced version mapped for the jobs that pin it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from shardserve.proto.errors import DatasetChanged
from shardserve.proto.jobs import JobSpec
from shardserve.server.registry.jobs import JobRegistry
from shardserve.server.store.catalog import Store
from shardserve.server.store.versions import content_id, pin_version
from tests.support.data import make_cifar_like, sample_id_of


def test_content_id_follows_content_not_paths_or_times(tmp_path: Path) -> None:
    """Same data written twice is one version; other bytes or another count is another."""
    a = make_cifar_like(tmp_path / "a", n=100, seed=0)
    b = make_cifar_like(tmp_path / "b", n=100, seed=0)
    assert content_id(a) == content_id(b)
    moved = a.model_copy(
        update={"shards": tuple(s.model_copy(update={"path": "x/" + s.path}) for s in a.shards)}
    )
    assert content_id(moved) == content_id(a)
    assert content_id(make_cifar_like(tmp_path / "c", n=100, seed=1)) != content_id(a)
    assert content_id(make_cifar_like(tmp_path / "d", n=101, seed=0)) != content_id(a)
    assert len(content_id(a)) == 16 and int(content_id(a), 16) >= 0


def test_replaced_version_stays_readable_while_pinned(tmp_path: Path) -> None:
    """After an overwrite the pinned old version reads its old bytes; unpinned it is released
    and then refused with DatasetChanged naming both ids."""
    root = tmp_path / "store"
    old = make_cifar_like(root, n=100, seed=0)
    store = Store(root)
    v_old = content_id(old)
    ds = store.open("cifar", version=v_old)
    before = ds.take(np.arange(100))["image"].copy()
    new = make_cifar_like(root.parent / "tmp", n=80, seed=1)
    # an overwrite: the writer's own publish path (rename away, delete)
    from shardserve.server.store import layout

    tmp = root / ".tmp-cifar-x"
    (root.parent / "tmp" / "cifar").rename(tmp)
    layout.publish(tmp, root, "cifar", overwrite=True)
    assert not any(p.name.startswith(".old-") for p in root.iterdir())  # old files deleted
    v_new = store.version("cifar")
    assert v_new == content_id(new) != v_old
    assert store.open("cifar").num_samples == 80  # the current one for unpinned callers
    again = store.open("cifar", version=v_old)
    assert again is ds and np.array_equal(again.take(np.arange(100))["image"], before)
    assert sample_id_of({"image": before}).tolist() == list(range(100))
    store.release_unpinned({("cifar", v_new)})
    with pytest.raises(DatasetChanged) as info:
        store.open("cifar", version=v_old)
    assert v_old in str(info.value) and v_new in str(info.value)
    store.close()


def test_pin_version_and_registry_fails_jobs_of_gone_versions(tmp_path: Path) -> None:
    """A spec is pinned to the current version; after a replay, jobs of other versions fail
    with DatasetChanged, jobs of the current one and legacy (unpinned) jobs do not."""
    m = make_cifar_like(tmp_path / "s", n=50)
    spec = JobSpec(dataset="cifar", batch_size=5)
    pinned = pin_version(spec, m)
    assert pinned.version == content_id(m)
    with pytest.raises(DatasetChanged):
        pin_version(spec.model_copy(update={"version": "f" * 16}), m)
    reg = JobRegistry()
    gone, _ = reg.create(spec.model_copy(update={"version": "f" * 16}), 50)
    live, _ = reg.create(pinned, 50)
    legacy, _ = reg.create(spec, 50)
    assert len({gone.id, live.id, legacy.id}) == 3
    failed = reg.fail_changed(lambda name: content_id(m))
    assert failed == [gone.id]
    assert reg.get(gone.id).error_code.value == "dataset_changed"
    assert reg.get(live.id).state == "pending" and reg.get(legacy.id).state == "pending"
    assert reg.pinned_versions() == {("cifar", "f" * 16), ("cifar", content_id(m)), ("cifar", None)}
