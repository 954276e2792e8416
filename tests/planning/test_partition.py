"""Invariants of the rank split: coverage, equal lengths, disjoint ranks, DistributedSampler parity."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardserve.server.planning import RankPlan, epoch_order, num_batches, plan
from shardserve.server.planning.envs import EnvSteps

from .strategies import batch_sizes, seeds, shard_layouts, shuffles, sizes, windows, world_sizes

SETTINGS = settings(max_examples=80, deadline=None)


def all_ranks(order: np.ndarray, ws: int, bs: int, drop_last: bool) -> list[RankPlan]:
    return [RankPlan.from_order(order, ws, r, bs, drop_last) for r in range(ws)]


@SETTINGS
@given(n=sizes, seed=seeds, ws=world_sizes, bs=batch_sizes, shuffle=shuffles)
def test_pad_covers_every_sample_plus_documented_padding(
    n: int, seed: int, ws: int, bs: int, shuffle: str
) -> None:
    """drop_last=False: the ranks' ids are every sample once plus the order's first ceil(n/ws)*ws-n ids again."""
    order = epoch_order(n, seed, 0, shuffle)  # type: ignore[arg-type]
    ids = np.concatenate(
        [np.zeros(0, np.int64), *(b for p in all_ranks(order, ws, bs, False) for b in p)]
    )
    total = -(-n // ws) * ws
    expected = np.resize(order.astype(np.int64), total) if n else np.zeros(0, np.int64)
    assert np.array_equal(np.sort(ids), np.sort(expected))
    assert np.array_equal(np.unique(ids), np.arange(n))


@SETTINGS
@given(n=sizes, seed=seeds, ws=world_sizes, bs=batch_sizes, shuffle=shuffles)
def test_drop_last_covers_exactly_the_truncated_set(
    n: int, seed: int, ws: int, bs: int, shuffle: str
) -> None:
    """drop_last=True: ranks are disjoint and each holds its share of order[:n//ws*ws] up to whole batches."""
    order = epoch_order(n, seed, 0, shuffle).astype(np.int64)  # type: ignore[arg-type]
    plans = all_ranks(order, ws, bs, True)
    kept = (n // ws) // bs * bs  # per rank
    per_rank = [np.concatenate([np.zeros(0, np.int64), *p]) for p in plans]
    for r, ids in enumerate(per_rank):
        assert np.array_equal(ids, order[: n // ws * ws][r::ws][:kept])
    union = np.concatenate(per_rank)
    assert len(np.unique(union)) == len(union) == kept * ws


@SETTINGS
@given(n=sizes, ws=world_sizes, bs=batch_sizes, drop_last=st.booleans(), seed=seeds)
def test_every_rank_gets_the_same_batches_count(
    n: int, ws: int, bs: int, drop_last: bool, seed: int
) -> None:
    """All ranks have num_batches(n, ws, bs, drop_last) batches, and batch i has the same size on each."""
    order = epoch_order(n, seed, 0)
    plans = all_ranks(order, ws, bs, drop_last)
    expected = num_batches(n, ws, bs, drop_last)
    for p in plans:
        assert len(p) == p.num_batches == expected
        assert sum(len(b) for b in p) == p.num_samples
        assert [len(b) for b in p] == [len(b) for b in plans[0]]
        if drop_last:
            assert all(len(b) == bs for b in p)


@SETTINGS
@given(k=st.integers(0, 20), ws=world_sizes, bs=batch_sizes, drop_last=st.booleans(), seed=seeds)
def test_ranks_are_disjoint_without_padding(
    k: int, ws: int, bs: int, drop_last: bool, seed: int
) -> None:
    """When ws divides n nothing is padded: ranks are disjoint and their union is every sample."""
    n = k * ws
    order = epoch_order(n, seed, 1)
    ids = [b for p in all_ranks(order, ws, bs, drop_last) for b in p]
    union = np.concatenate([np.zeros(0, np.int64), *ids])
    assert len(np.unique(union)) == len(union)
    if not drop_last:
        assert np.array_equal(np.sort(union), np.arange(n))


@SETTINGS
@given(
    n=sizes, seed=seeds, ws=world_sizes, bs=batch_sizes, drop_last=st.booleans(), shuffle=shuffles
)
def test_plan_matches_order_then_partition(
    n: int, seed: int, ws: int, bs: int, drop_last: bool, shuffle: str
) -> None:
    """plan(...) equals RankPlan.from_order(epoch_order(...)), and returns int64 batches."""
    order = epoch_order(n, seed, 5, shuffle)  # type: ignore[arg-type]
    for r in range(ws):
        a = plan(n, seed, 5, ws, r, bs, shuffle, drop_last)  # type: ignore[arg-type]
        b = RankPlan.from_order(order, ws, r, bs, drop_last)
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert x.dtype == np.int64
            assert np.array_equal(x, y)


@SETTINGS
@given(
    rows=shard_layouts(min_rows=8),
    seed=seeds,
    window=windows,
    bs=st.integers(1, 8),
    drop_last=st.booleans(),
)
def test_block_batches_touch_few_shards(
    rows: list[int], seed: int, window: int, bs: int, drop_last: bool
) -> None:
    """Single-rank block plan: every batch (no larger than a shard) draws from <= 2*block_window shards."""
    shard_of = np.repeat(np.arange(len(rows)), rows)
    p = plan(sum(rows), seed, 0, 1, 0, bs, "block", drop_last, rows, window)
    for b in p:
        assert len(np.unique(shard_of[b])) <= 2 * window


def test_rank_plan_views_the_shared_order() -> None:
    """A rank's plan keeps a view of the order, not a copy."""
    order = epoch_order(1000, 0, 0)
    p = RankPlan.from_order(order, 4, 1, 32, False)
    assert np.shares_memory(p._ids, order)


def test_padding_repeats_the_order_several_times_when_n_below_world_size() -> None:
    """With 2 samples on 5 ranks each rank gets one id: order[r % 2], as DistributedSampler repeats."""
    order = np.array([7, 3], dtype=np.uint32)
    got = [RankPlan.from_order(order, 5, r, 4, False).batch(0).tolist() for r in range(5)]
    assert got == [[7], [3], [7], [3], [7]]


def test_zero_samples_zero_batches() -> None:
    """n_samples=0 plans zero batches on every rank, either drop_last."""
    for drop_last in (False, True):
        p = plan(0, 0, 0, 3, 2, 8, drop_last=drop_last)
        assert len(p) == 0 and p.num_samples == 0 and list(p) == []


def test_batch_index_out_of_range_prints_the_bound() -> None:
    """batch(i) outside 0 <= i < num_batches raises IndexError naming the bound."""
    p = plan(100, 0, 0, 2, 0, 16)
    assert len(p) == 4
    for i in (4, -1):
        with pytest.raises(IndexError, match=rf"batch {i} out of range 0 <= i < 4"):
            p.batch(i)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((10, 0, 0, 4), "world_size must be >= 1, got 0"),
        ((10, 3, 3, 4), "rank 3 out of range 0 <= rank < 3"),
        ((10, 3, -1, 4), "rank -1 out of range 0 <= rank < 3"),
        ((10, 3, 0, 0), "batch_size must be >= 1, got 0"),
    ],
)
def test_bad_partition_arguments_name_the_bound(
    args: tuple[int, int, int, int], message: str
) -> None:
    """Bad world size, rank or batch size raise ValueError printing the value and the bound."""
    n, ws, rank, bs = args
    with pytest.raises(ValueError, match=message):
        plan(n, 0, 0, ws, rank, bs)
    with pytest.raises(ValueError, match=message):
        RankPlan.from_order(np.arange(n), ws, rank, bs, False)


def test_num_batches_validates() -> None:
    """num_batches refuses world_size 0 and batch_size 0 with the bound in the message."""
    with pytest.raises(ValueError, match="world_size must be >= 1, got 0"):
        num_batches(10, 0, 1, False)
    with pytest.raises(ValueError, match="batch_size must be >= 1, got 0"):
        num_batches(10, 1, 0, True)


@SETTINGS
@given(
    n=sizes,
    seed=seeds,
    ws=world_sizes,
    bs=batch_sizes,
    envs=st.integers(1, 4),
    drop_last=st.booleans(),
    data=st.data(),
)
def test_env_steps_span_is_its_steps_one_after_the_other(
    n: int, seed: int, ws: int, bs: int, envs: int, drop_last: bool, data: st.DataObject
) -> None:
    """A span of steps (a message's) holds each step's environment batches in step order,
    whether its batches are full or it ends with the epoch's short one."""
    orders = [epoch_order(n, seed, 0, "global", env=e) for e in range(envs)]
    steps = EnvSteps.from_orders(orders, ws, 0, bs, drop_last)
    if len(steps) == 0:
        return
    i = data.draw(st.integers(0, len(steps) - 1))
    count = data.draw(st.integers(1, len(steps) - i))
    want = np.concatenate([steps.batch(j) for j in range(i, i + count)])
    got = steps.span(i, count)
    assert got.dtype == np.int64 and got.tolist() == want.tolist()
