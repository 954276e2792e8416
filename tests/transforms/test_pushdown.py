"""``random_subset`` alone in a chain is read as a gather of the chosen rows (the read
pushdown): the bytes are those of the batch kernel run on the whole stored clouds, with the
same per-sample keys, whichever batch or epoch carries a sample."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from shardserve.client import Loader
from shardserve.proto.errors import TransformError
from shardserve.server.store.write.writer import ShardWriter
from shardserve.server.transforms.keys import SampleKeys
from shardserve.server.transforms.rows import RandomSubset, random_subset
from tests.support.server import ServerProc, run_server
from tests.support.slowness import scaled

N, BATCH, SEED = 150, 12, 5
#: Clouds of 3 to 40 points: below n (refused), below 2n and from 2n up (both ways of drawing).
SIZES = np.random.default_rng(7).integers(3, 41, N)
SHORT = {i for i in range(N) if SIZES[i] < 8}


def _sample(i: int) -> dict[str, Any]:
    rng = np.random.default_rng(100 + i)
    n = int(SIZES[i])
    return {
        "points": rng.standard_normal((n, 3), dtype=np.float32),
        "seq": rng.integers(0, 1 << 30, n, dtype=np.int64),
        "label": np.int64(i),
    }


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    root: Path = tmp_path_factory.mktemp("pushdown")
    # Small shards: shuffled batches span several of them.
    with ShardWriter(root, "clouds", shard_bytes=4 << 10) as w:
        for i in range(N):
            w.add(_sample(i))
    with run_server(root) as srv:
        yield srv


def _batches(srv: ServerProc, step: dict[str, Any], epoch: int, **kw: Any) -> list[dict]:
    with Loader(
        srv.http_url,
        "clouds",
        BATCH,
        seed=SEED,
        transforms=[{"name": "random_subset", "params": step}],
        timeout=scaled(30),
        **kw,
    ) as ld:
        ld.set_epoch(epoch)
        return [dict(b) for b in ld]


def _kernel(p: RandomSubset, ids: np.ndarray, epoch: int, step: int = 0) -> np.ndarray:
    """The batch kernel on the whole stored clouds of samples ``ids``, keyed as a job's
    first step is."""
    clouds = [_sample(int(i))[p.field] for i in ids]
    keys = SampleKeys(SEED, epoch, step, ids)
    return np.asarray(random_subset.fn({p.field: clouds}, p, None, keys=keys, out={})[p.field])


@pytest.mark.parametrize(
    "step",
    [
        {"field": "points", "n": 3},
        {"field": "seq", "n": 2},
        {"field": "points", "n": 8, "replace": True},
    ],
)
def test_pushed_down_rows_are_the_batch_kernels_bytes(
    server: ServerProc, step: dict[str, Any]
) -> None:
    """Every served batch equals the kernel on the stored clouds with the same keys, and not
    the kernel drawing from another step's keys (which this check would catch)."""
    p = RandomSubset.model_validate(step)
    differs = 0
    for epoch in (0, 3):
        batches = _batches(server, step, epoch)
        assert sum(len(b["label"]) for b in batches) == N
        for b in batches:
            ids = b["label"].numpy()
            got = b[p.field].numpy()
            assert got.tobytes() == _kernel(p, ids, epoch).tobytes(), (epoch, ids)
            differs += got.tobytes() != _kernel(p, ids, epoch, step=1).tobytes()
    assert differs > 0


def test_short_clouds_are_refused_or_replaced(server: ServerProc) -> None:
    """Clouds with fewer points than n fail the job naming the field; with
    on_error="replace" other samples take their places, drawn as the kernel draws them."""
    step = {"field": "points", "n": 8}
    with pytest.raises(TransformError, match="fewer rows than n=8"):
        _batches(server, step, 0, shuffle=False)
    p = RandomSubset.model_validate(step)
    batches = _batches(server, step, 1, on_error="replace")
    assert sum(len(b["label"]) for b in batches) == N
    for b in batches:
        ids = b["label"].numpy()
        assert not SHORT & set(ids.tolist())
        assert b["points"].numpy().tobytes() == _kernel(p, ids, 1).tobytes()
