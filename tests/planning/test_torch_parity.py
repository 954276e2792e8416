"""The rank split equals torch's DistributedSampler + BatchSampler on the same sizes."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardserve.server.planning import plan

torch_data = pytest.importorskip("torch.utils.data")


@settings(max_examples=150, deadline=None)
@given(n=st.integers(0, 120), ws=st.integers(1, 9), bs=st.integers(1, 20), drop_last=st.booleans())
def test_matches_distributed_sampler(n: int, ws: int, bs: int, drop_last: bool) -> None:
    """With shuffle="none", rank r's ids and batches equal DistributedSampler(shuffle=False)'s, both drop_last."""
    dataset = range(n)
    for rank in range(ws):
        sampler = torch_data.DistributedSampler(
            dataset,
            num_replicas=ws,
            rank=rank,
            shuffle=False,
            drop_last=drop_last,  # type: ignore[arg-type]
        )
        expected = list(torch_data.BatchSampler(sampler, bs, drop_last))
        got = [b.tolist() for b in plan(n, 0, 0, ws, rank, bs, "none", drop_last)]
        assert got == expected
        if not drop_last:
            assert sum(len(b) for b in got) == len(sampler)
