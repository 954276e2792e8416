"""``Dataset.take_rows``: chosen rows of a variable field gathered straight from the shards
are those of the whole samples read by ``take``, whatever shards a batch touches."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardserve.server.store.catalog import Store
from shardserve.server.store.read.dataset import Dataset
from shardserve.server.store.write.writer import ShardWriter

N = 200
#: The fixed dims of a row of each variable field.
ROW = {"points": (3,), "seq": ()}


def _sample(i: int) -> dict[str, object]:
    rng = np.random.default_rng(i)
    n = int(rng.integers(1, 30))
    return {
        "points": rng.standard_normal((n, 3)).astype(np.float32),
        "seq": rng.integers(-99, 99, n).astype(np.int16),
        "flags": rng.integers(0, 2, n).astype(bool),
        "label": np.int64(i),
        "maybe": None if i % 4 == 0 else np.arange(i % 5 + 1, dtype=np.float32),
    }


@pytest.fixture(scope="module")
def ds(tmp_path_factory: pytest.TempPathFactory) -> Dataset:
    root: Path = tmp_path_factory.mktemp("rows")
    with ShardWriter(root, "rows", shard_bytes=3 << 10, variable=["maybe"]) as w:  # ~20 shards
        for i in range(N):
            w.add(_sample(i))
    return Store(root).open("rows")


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    ids=st.lists(st.integers(0, N - 1), min_size=1, max_size=40),
    k=st.integers(1, 6),
    field=st.sampled_from(["points", "seq"]),
    seed=st.integers(0, 1 << 30),
)
def test_rows_are_those_of_the_whole_samples(
    ds: Dataset, ids: list[int], k: int, field: str, seed: int
) -> None:
    """Rows picked from the stored lengths equal the same rows of the samples ``take`` reads."""
    idx = np.array(ids, np.int64)
    seen: list[np.ndarray] = []

    def pick(lengths: np.ndarray) -> np.ndarray:
        seen.append(lengths.copy())
        u = np.random.default_rng(seed).random((lengths.size, k))
        return (u * lengths[:, None]).astype(np.int64)

    whole = ds.take(idx, [field])
    rest = whole[field].reshape(-1, *ROW[field])
    out = np.empty((idx.size, k, *rest.shape[1:]), rest.dtype)
    assert ds.take_rows(idx, field, pick, out) is out
    offsets = whole[field + ".offsets"] // max(1, rest[:1].size)
    assert seen[0].tolist() == np.diff(offsets).tolist()
    rows = pick(seen[0])
    for i in range(idx.size):
        cloud = rest[offsets[i] : offsets[i + 1]]
        assert out[i].tobytes() == cloud[rows[i]].tobytes(), i


@pytest.mark.parametrize("field", ["flags", "label", "maybe"])
def test_fields_without_row_views_are_refused_by_name(ds: Dataset, field: str) -> None:
    """Bit-packed bools, fixed fields and fields missing in some samples are refused, named."""
    out = np.empty((2, 1), np.float32)
    with pytest.raises(ValueError, match=f"field '{field}'"):
        ds.take_rows(np.array([1, 2]), field, lambda n: np.zeros((n.size, 1), np.int64), out)


def test_a_row_outside_its_sample_is_refused(ds: Dataset) -> None:
    """A pick past a sample's last row is an error, not a clipped read."""
    out = np.empty((2, 1, 3), np.float32)
    with pytest.raises(ValueError, match="outside its sample"):
        ds.take_rows(np.array([1, 2]), "points", lambda n: n[:, None], out)
