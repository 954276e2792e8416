"""Invariants of the bucket shuffle: a permutation on every path, and uniform."""

from __future__ import annotations

import itertools
from collections import Counter

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from shardserve.server.planning.permute import shuffle_inplace, shuffle_into, shuffle_steps

SETTINGS = settings(max_examples=60, deadline=None)


@SETTINGS
@given(
    n=st.integers(0, 500),
    bucket_rows=st.integers(1, 64),
    chunk_rows=st.integers(1, 100),
    seed=st.integers(0, 2**32),
    dtype=st.sampled_from([np.uint32, np.int64]),
)
def test_bucket_path_is_a_permutation(
    n: int, bucket_rows: int, chunk_rows: int, seed: int, dtype: type
) -> None:
    """With tiny buckets and chunks (many buckets, many chunks) the output is still a permutation."""
    out = shuffle_into(
        np.empty(n, dtype),
        np.random.default_rng(seed),
        bucket_rows=bucket_rows,
        chunk_rows=chunk_rows,
    )
    assert out.dtype == dtype
    assert np.array_equal(np.sort(out), np.arange(n))


@SETTINGS
@given(
    values=st.lists(st.integers(0, 10**6), max_size=300),
    bucket_rows=st.integers(1, 64),
    seed=st.integers(0, 2**32),
)
def test_bucket_path_permutes_a_source(values: list[int], bucket_rows: int, seed: int) -> None:
    """Given a source array, the output holds the same multiset of values."""
    src = np.array(values, dtype=np.int64)
    out = shuffle_into(
        np.empty_like(src), np.random.default_rng(seed), src, bucket_rows=bucket_rows, chunk_rows=37
    )
    assert sorted(out.tolist()) == sorted(values)


def test_bucket_path_is_uniform() -> None:
    """All 24 orders of 4 ids come out about equally often through the bucket path (6,000 draws)."""
    rng = np.random.default_rng(12345)
    counts = Counter(
        tuple(shuffle_into(np.empty(4, np.uint32), rng, bucket_rows=1, chunk_rows=3).tolist())
        for _ in range(6000)
    )
    assert set(counts) == set(itertools.permutations(range(4)))
    # expected 250 each; sd ~15.5, so 150..350 is > 6 sd: deterministic seed, never flaky
    assert all(150 < c < 350 for c in counts.values())


def test_inplace_large_array_is_a_permutation() -> None:
    """An array past one bucket (2**17 ids) goes through the bucket path and stays a permutation."""
    a = np.arange(300_000, dtype=np.uint32)[::-1].copy()
    shuffle_inplace(a, np.random.default_rng(3))
    assert np.array_equal(np.sort(a), np.arange(300_000))
    assert not np.array_equal(a, np.arange(300_000)[::-1])


def test_the_first_step_hands_out_bucket_0_before_laying_out_the_others() -> None:
    """The first step of the bucket shuffle writes bucket 0 only (the positions labelled 0,
    shuffled); the others are laid out in later steps, and the whole is the same order."""
    n, sentinel = 5_000, np.uint32(2**32 - 1)
    out = np.full(n, sentinel, dtype=np.uint32)
    steps = shuffle_steps(out, np.random.default_rng(3), bucket_rows=100, chunk_rows=700)
    first = next(steps)
    assert 0 < first < n
    assert (out[first:] == sentinel).all()  # no layout of the other buckets yet
    head = out[:first].copy()
    ups = list(steps)
    assert ups[-1] == n and ups == sorted(ups)
    whole = shuffle_into(np.empty(n, np.uint32), np.random.default_rng(3), bucket_rows=100)
    assert np.array_equal(out, whole) and np.array_equal(head, whole[:first])
