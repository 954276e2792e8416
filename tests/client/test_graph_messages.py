"""Graph batches of 1-2 MiB against a real server: two to a message, each exactly the batch
sent alone."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from shardserve.client import Loader
from shardserve.proto.manifest import FieldSpec
from shardserve.server.store.write.writer import ShardWriter

CRYSTAL = (
    FieldSpec(name="atom_fea", dtype="float32", shape=(-1, 16)),
    FieldSpec(name="edge_index", dtype="int64", shape=(2, -1)),
    FieldSpec(name="bond_fea", dtype="float32", shape=(-1, 8)),
    FieldSpec(name="energy", dtype="float32", shape=()),
)
N, BATCH = 480, 48  # ~25 KB a graph: ~1.2 MB a batch, one fits in 2 MiB, two do not


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("store")
    rng = np.random.default_rng(0)
    with ShardWriter(root, "crystals", fields=CRYSTAL, shard_bytes=4 << 20) as w:
        for i in range(N):
            atoms = int(rng.integers(80, 121))
            w.add(
                {
                    "atom_fea": rng.standard_normal((atoms, 16), dtype=np.float32),
                    "edge_index": rng.integers(0, atoms, (2, 4 * atoms)).astype(np.int64),
                    "bond_fea": rng.standard_normal((4 * atoms, 8), dtype=np.float32),
                    "energy": np.float32(i),
                }
            )
    return root


def _epoch(url: str, prefetch: int | None) -> tuple[list[dict[str, torch.Tensor]], int]:
    collate = {"graph": {"node_field": "atom_fea"}}
    kw = {"seed": 1, "rank": 0, "world_size": 1, "prefetch": prefetch, "collate": collate}
    with Loader(url, "crystals", BATCH, **kw) as ld:  # type: ignore[arg-type]
        return list(ld), ld.stats().messages


def test_graph_batches_of_a_megabyte_come_two_to_a_message(server) -> None:
    """Batches of ~1.2 MB of graphs come two to a message, equal to those sent one at a time."""
    one, n_one = _epoch(server.http_url, 1)
    two, n_two = _epoch(server.http_url, None)
    assert n_one == len(one) == len(two) == N // BATCH
    # Two to a message (the first message may come before the credit allows two).
    assert n_two <= len(two) // 2 + 1, (n_two, len(two))
    for a, b in zip(one, two, strict=True):
        assert sorted(a) == sorted(b)
        for k in a:
            assert torch.equal(a[k], b[k]), k
