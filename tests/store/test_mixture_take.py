"""A mixture batch read from real stores: every part equals what each source's own ``take``
gives for its samples, in the batch's order, fixed and ragged fields alike."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from shardserve.proto.parts import SOURCE_PART
from shardserve.server.planning.mixture import MixSource, Segment, mixture_order, source_offsets
from shardserve.server.store.catalog import Store
from shardserve.server.store.mixture_take import take_mixture
from tests.support.data import make_cifar_like, make_graph_like, sample_id_of


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Store:
    root = tmp_path_factory.mktemp("mixtake")
    make_cifar_like(root, "a", n=300, seed=1)
    make_cifar_like(root, "b", n=200, seed=2)
    make_graph_like(root, "g1", n=120, seed=1)
    make_graph_like(root, "g2", n=90, seed=2)
    return Store(Path(root))


def _check(store: Store, names: list[str], batch: int) -> None:
    sets = [store.open(n) for n in names]
    sizes = [d.num_samples for d in sets]
    offsets = source_offsets([MixSource(n) for n in sizes])
    order = mixture_order(
        [MixSource(n) for n in sizes], 3, 0, 600, [Segment(0, (1.0,) * len(names))]
    )
    for lo in range(0, len(order), batch):
        ids = order[lo : lo + batch].astype(np.int64)
        parts = take_mixture(sets, offsets, ids)
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
    sets = [store.open("a"), store.open("b")]
    offsets = source_offsets([MixSource(300), MixSource(200)])
    parts = take_mixture(sets, offsets, np.array([300 + 5, 7, 300 + 199]))
    assert sample_id_of(parts).tolist() == [5, 7, 199]


def test_ragged_fields_in_batch_order(store: Store) -> None:
    """Graph-like sources: variable tensors and bytes keep each sample's values and shape."""
    _check(store, ["g1", "g2"], batch=17)


def test_empty_batch(store: Store) -> None:
    """No ids: the parts are empty, with a source part."""
    parts = take_mixture(
        [store.open("a"), store.open("b")], np.array([0, 300, 500]), np.zeros(0, np.int64)
    )
    assert len(parts[SOURCE_PART]) == 0 and parts["label"].shape == (0,)
