"""Transforms on a dataset with fields missing in some samples (UPT's ``params`` and ``bc``):
the chain sees the fields every sample has, the others pass by it with their masks, for the
samples the chain kept."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch

from shardserve.client import Loader
from shardserve.server.store.write.writer import ShardWriter
from tests.formats.support import split
from tests.support.server import ServerProc, run_server
from tests.support.slowness import scaled
from tests.transforms.conftest import MODS

N, BATCH, QUERIES = 120, 16, 8
SUBSET = [{"name": "random_subset", "params": {"field": "points", "n": QUERIES}}]


def _sample(i: int) -> dict[str, Any]:
    rng = np.random.default_rng(i)
    return {
        "points": rng.standard_normal((int(rng.integers(QUERIES, 40)), 3), dtype=np.float32),
        "label": np.int64(i),
        "params": None if i % 3 == 0 else rng.standard_normal(4, dtype=np.float32),
        "bc": None if i % 5 == 0 else np.arange(i % 7, dtype=np.int32),
    }


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    root: Path = tmp_path_factory.mktemp("upt")
    with ShardWriter(root, "upt", shard_bytes=8 << 10, variable=["bc"]) as w:
        for i in range(N):
            w.add(_sample(i))
    with run_server(root, *MODS) as srv:
        yield srv


def _read(srv: ServerProc, **kw: Any) -> list[dict[str, Any]]:
    with Loader(srv.http_url, "upt", BATCH, shuffle=False, timeout=scaled(30), **kw) as loader:
        return [dict(b) for b in loader]


def test_masked_fields_pass_by_the_chain(server: ServerProc) -> None:
    """random_subset draws 8 of each sample's points; params and bc come as stored, masks
    and all; a second run gives the same bytes."""
    got = _read(server, transforms=SUBSET)
    again = _read(server, transforms=SUBSET)
    assert len(got) == N // BATCH + 1
    for b, (batch, rerun) in enumerate(zip(got, again, strict=True)):
        n = len(batch["label"])
        assert set(batch) == {"points", "label", "params", "bc"}
        assert batch["points"].shape == (n, QUERIES, 3)
        assert torch.equal(batch["points"], rerun["points"])
        for row, (i, pts, params, bc) in enumerate(
            zip(
                batch["label"].tolist(),
                batch["points"],
                split(batch["params"], n),
                split(batch["bc"], n),
                strict=True,
            )
        ):
            want = _sample(i)
            assert i == b * BATCH + row
            stored = torch.from_numpy(want["points"])
            assert all(bool((stored == p).all(1).any()) for p in pts), f"sample {i}"
            for got_v, want_v in ((params, want["params"]), (bc, want["bc"])):
                assert (got_v is None) == (want_v is None), f"sample {i}"
                if want_v is not None:
                    assert torch.equal(got_v, torch.from_numpy(want_v)), f"sample {i}"


def test_a_failing_sample_is_replaced_with_its_masked_fields(server: ServerProc) -> None:
    """on_error="replace" swaps a failing sample for another; the masked fields served are
    the replacement's, not the failed sample's."""
    chain = [{"name": "fail_labels", "params": {"labels": [5]}}]
    first = _read(server, transforms=chain, on_error="replace")[0]
    labels = first["label"].tolist()
    assert 5 not in labels
    row = 5  # the failed sample's place in the first batch
    other = _sample(labels[row])
    params = split(first["params"], len(labels))[row]
    assert (params is None) == (other["params"] is None)
    if params is not None:
        assert torch.equal(params, torch.from_numpy(other["params"]))


def test_a_step_naming_a_masked_field_is_refused(server: ServerProc) -> None:
    """A step reading params (missing in some samples) is a 4xx at job creation that says
    such fields are served as stored."""
    r = httpx.post(
        f"{server.http_url}/v1/jobs",
        json={
            "dataset": "upt",
            "batch_size": BATCH,
            "transforms": [{"name": "random_subset", "params": {"field": "params", "n": 2}}],
        },
        timeout=scaled(10),
    )
    assert 400 <= r.status_code < 500, r.text
    assert "missing in some samples" in r.text and "'params'" in r.text


def test_a_chain_that_cuts_big_clouds_sends_its_batches_several_to_a_message(
    tmp_path: Path,
) -> None:
    """Clouds of ~50 KB cut to 64 points: a stream sizes its messages by the served ~1 KB a sample, not the stored average."""
    rng = np.random.default_rng(0)
    with ShardWriter(tmp_path, "clouds", variable=["bc"]) as w:
        for i in range(256):
            w.add(
                {
                    "points": rng.standard_normal((int(rng.integers(3000, 5000)), 3), np.float32),
                    "bc": None if i % 5 == 0 else np.arange(i % 7, dtype=np.int32),
                }
            )
    chain = [{"name": "random_subset", "params": {"field": "points", "n": 64}}]
    with (
        run_server(tmp_path) as srv,
        Loader(srv.http_url, "clouds", 16, transforms=chain, prefetch=32, timeout=scaled(30)) as ld,
    ):
        batches = sum(1 for _ in ld)
        messages = ld.stats().messages
    # Sized at the stored ~50 KB a sample, a batch is ~800 KB and two go to a 2 MiB message.
    assert batches == 16 and messages <= 4, messages
