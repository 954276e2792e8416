"""Hypothesis strategies shared by the planner tests: small grids of plan arguments."""

from __future__ import annotations

from hypothesis import strategies as st

seeds = st.integers(0, 2**64)
epochs = st.integers(0, 1000)
sizes = st.integers(0, 200)
world_sizes = st.integers(1, 9)
batch_sizes = st.integers(1, 40)
shuffles = st.sampled_from(["global", "block", "none"])
windows = st.integers(1, 5)


@st.composite
def shard_layouts(draw: st.DrawFn, min_rows: int = 0, max_shards: int = 12) -> list[int]:
    """Rows per shard, some possibly empty unless ``min_rows`` > 0."""
    return draw(st.lists(st.integers(min_rows, 30), min_size=1, max_size=max_shards))
