"""The public Python writer: ``from shardserve.server.ingest import DatasetWriter``; samples
made by code read back equal through a real server and Loader; an error publishes nothing."""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from shardserve.proto.errors import InvalidDataError
from shardserve.server.ingest import DatasetWriter
from tests.formats.support import assert_same, read_all
from tests.support.server import run_server
from tests.support.slowness import scaled


def _sample(i: int) -> dict[str, object]:
    return {
        "x": torch.full((2, 3), float(i)),
        "pts": np.arange(i % 4 + 1, dtype=np.int32),
        "meta": {"name": f"s{i}", "w": 0.5 * i if i % 3 else None},
        "jpg": bytes([i]) * 5,
        "label": i % 2,
    }


def test_written_samples_read_back_equal(tmp_path: Path) -> None:
    with DatasetWriter(
        tmp_path / "store",
        "made",
        shard_bytes=512,
        classes=["even", "odd"],
        metadata={"by": "test"},
    ) as w:
        for i in range(23):
            w.add(_sample(i))
        assert w.num_samples == 23
    assert w.manifest is not None and w.manifest.num_samples == 23
    assert len(w.manifest.shards) > 1 and w.manifest.source["by"] == "test"
    with run_server(tmp_path / "store") as srv:
        got = read_all(srv.http_url, "made", batch_size=5)
        info = httpx.get(f"{srv.http_url}/v1/datasets/made", timeout=scaled(10)).json()
    assert info["classes"] == ["even", "odd"]
    for i, g in enumerate(got):
        s = _sample(i)
        want = {
            "x": s["x"],
            "pts": torch.from_numpy(s["pts"]),  # type: ignore[arg-type]
            "meta": {
                "name": f"s{i}",
                "w": torch.tensor(0.5 * i, dtype=torch.float64) if i % 3 else None,
            },
            "jpg": s["jpg"],
            "label": torch.tensor(i % 2),
        }
        assert_same(g, want, f"made[{i}]")


def test_an_error_publishes_nothing_and_names_the_sample(tmp_path: Path) -> None:
    with (
        pytest.raises(InvalidDataError, match=r"sample 3: .*'x'"),
        DatasetWriter(tmp_path / "store", "bad") as w,
    ):
        for i in range(5):
            w.add({"x": np.zeros(3) if i != 3 else "oops"})
    assert not (tmp_path / "store" / "bad").exists()
    with (
        pytest.raises(InvalidDataError, match="more than --max-sample-bytes 64"),
        DatasetWriter(tmp_path / "store", "big", max_sample_bytes=64) as w,
    ):
        w.add({"x": np.zeros(100)})
    assert not (tmp_path / "store" / "big").exists()
