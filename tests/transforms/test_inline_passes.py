"""A chain of built-in image passes (crop, flip, normalize) runs on whichever thread
assembles its batch, the streamer's included, with no hand-off to a transform lane, and
gives the bytes a worker process gives; a chain with any other transform stays on its lane."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from shardserve.proto.jobs import JobSpec
from shardserve.server.source import BatchSource
from shardserve.server.store.catalog import Store
from shardserve.server.transforms.bound import Transforms
from tests.support.slowness import scaled
from tests.transforms.conftest import CIFAR_CHAIN

B = 40


@pytest.fixture
def runtimes() -> Iterator[dict[str, Transforms]]:
    made = {
        kind: Transforms(["tests.transforms.mods"], 2, kind, scaled(30), CollectorRegistry())
        for kind in ("thread", "process")
    }
    yield made
    for rt in made.values():
        rt.close()


def _bind(rt: Transforms, store: Path, chain: list) -> BatchSource:
    spec = JobSpec(dataset="cifar", batch_size=B, seed=4, transforms=chain, transform_rng=2)
    return rt.bind(Store(store).open("cifar"), spec, epoch=1, seed=4, rank=0)


def _take(src: BatchSource, batch: int) -> dict[str, np.ndarray]:
    shapes = src.part_shapes(None)
    out = {k: np.empty((B, *v[1]), np.dtype(v[0])) for k, v in shapes.items() if v is not None}
    idx = np.arange(batch * B, (batch + 1) * B, dtype=np.int64)[::-1].copy()
    return {k: v.copy() for k, v in src.take(idx, None, out=out, batch=batch).items()}


def test_builtin_passes_run_on_the_assembling_thread_with_a_worker_process_bytes(
    store: Path, runtimes: dict[str, Transforms]
) -> None:
    """Crop, flip and normalize may run inline, start no lane thread, and equal a worker's."""
    here = _bind(runtimes["thread"], store, CIFAR_CHAIN)
    remote = _bind(runtimes["process"], store, CIFAR_CHAIN)
    assert here.inline_ok and not remote.inline_ok
    for batch in range(3):
        got, want = _take(here, batch), _take(remote, batch)
        assert sorted(got) == sorted(want)
        for k in got:
            assert got[k].tobytes() == want[k].tobytes(), (batch, k)
    status = runtimes["thread"].pool.status()
    assert status["lane_threads"] == 0, status


@pytest.mark.parametrize(
    "chain",
    [
        [*CIFAR_CHAIN, {"name": "double_into"}],
        [{"name": "double_into"}],
        [{"name": "resize", "params": {"size": 16, "layout": "CHW"}}],
        [{"name": "random_crop", "params": {"size": 32, "padding": 1000, "layout": "CHW"}}],
    ],
)
def test_a_chain_that_may_take_long_is_never_run_inline(
    store: Path, runtimes: dict[str, Transforms], chain: list
) -> None:
    """A user's transform, a resampling built-in or a huge padded copy go to the job's lane."""
    assert not _bind(runtimes["thread"], store, chain).inline_ok
