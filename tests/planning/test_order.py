"""Invariants of ``epoch_order``: a permutation, deterministic, new each epoch, block-local."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardserve.proto.jobs import JobSpec, job_id
from shardserve.server.planning import SHUFFLES, epoch_order
from shardserve.server.planning.cache import PlanCache
from shardserve.server.planning.rng import order_dtype
from shardserve.server.registry.jobs import Job
from tests.support.slowness import scaled

from .strategies import epochs, seeds, shard_layouts, shuffles, sizes, windows

SETTINGS = settings(max_examples=60, deadline=None)


@SETTINGS
@given(n=sizes, seed=seeds, epoch=epochs, shuffle=shuffles, window=windows)
def test_order_is_a_permutation(n: int, seed: int, epoch: int, shuffle: str, window: int) -> None:
    """Every mode yields each id 0..n-1 exactly once, as uint32."""
    order = epoch_order(n, seed, epoch, shuffle, block_window=window)  # type: ignore[arg-type]
    assert order.dtype == np.uint32
    assert np.array_equal(np.sort(order), np.arange(n))


@SETTINGS
@given(rows=shard_layouts(), seed=seeds, epoch=epochs, shuffle=shuffles, window=windows)
def test_order_with_shards_is_a_permutation(
    rows: list[int], seed: int, epoch: int, shuffle: str, window: int
) -> None:
    """Given shard sizes (empty shards included), every mode is still a permutation."""
    n = sum(rows)
    order = epoch_order(n, seed, epoch, shuffle, rows, window)  # type: ignore[arg-type]
    assert np.array_equal(np.sort(order), np.arange(n))


@SETTINGS
@given(n=sizes, seed=seeds, epoch=epochs, shuffle=shuffles)
def test_order_is_deterministic(n: int, seed: int, epoch: int, shuffle: str) -> None:
    """The same (seed, epoch) gives the same order twice in one process."""
    a = epoch_order(n, seed, epoch, shuffle)  # type: ignore[arg-type]
    b = epoch_order(n, seed, epoch, shuffle)  # type: ignore[arg-type]
    assert np.array_equal(a, b)


@SETTINGS
@given(
    n=st.integers(20, 200),
    seed=seeds,
    epoch=epochs,
    shuffle=st.sampled_from(["global", "block"]),
    rows_per_shard=st.integers(1, 20),
    window=windows,
)
def test_order_changes_each_epoch(
    n: int, seed: int, epoch: int, shuffle: str, rows_per_shard: int, window: int
) -> None:
    """Consecutive epochs (and another seed) give different orders (chance of a tie < 1/20!)."""
    rows = [rows_per_shard] * (n // rows_per_shard) + (
        [n % rows_per_shard] if n % rows_per_shard else []
    )
    a = epoch_order(n, seed, epoch, shuffle, rows, window)  # type: ignore[arg-type]
    b = epoch_order(n, seed, epoch + 1, shuffle, rows, window)  # type: ignore[arg-type]
    c = epoch_order(n, seed + 1, epoch, shuffle, rows, window)  # type: ignore[arg-type]
    assert not np.array_equal(a, b)
    assert not np.array_equal(a, c)


def test_none_is_identity() -> None:
    """Shuffle "none" is arange whatever the seed and epoch."""
    assert np.array_equal(epoch_order(50, 7, 9, "none"), np.arange(50))


@SETTINGS
@given(rows=shard_layouts(), seed=seeds, epoch=epochs, window=windows)
def test_block_order_is_runs_of_whole_shards(
    rows: list[int], seed: int, epoch: int, window: int
) -> None:
    """A block order splits into consecutive runs, each the rows of at most block_window whole shards."""
    order = epoch_order(sum(rows), seed, epoch, "block", rows, window).astype(np.int64)
    shard_of = np.repeat(np.arange(len(rows)), rows)[order].tolist()
    left = list(rows)  # rows of each shard not yet seen
    run: set[int] = set()
    for k in shard_of:
        run.add(k)
        left[k] -= 1
        if all(left[j] == 0 for j in run):  # the run so far is whole shards: cut here
            assert len(run) <= window
            run = set()
    assert not run


@SETTINGS
@given(rows=shard_layouts(min_rows=1), seed=seeds, window=windows)
def test_block_window_one_keeps_shards_contiguous(rows: list[int], seed: int, window: int) -> None:
    """With block_window=1 each shard's rows are one contiguous run of the order."""
    order = epoch_order(sum(rows), seed, 0, "block", rows, 1).astype(np.int64)
    shard_of = np.repeat(np.arange(len(rows)), rows)[order]
    changes = int(np.count_nonzero(np.diff(shard_of))) if len(shard_of) else 0
    assert changes == len(rows) - 1


def test_block_without_shard_rows_uses_fixed_shards() -> None:
    """Without shard_rows, "block" treats the store as 65,536-row shards: window 1 keeps each contiguous."""
    order = epoch_order(200_000, 1, 2, "block", None, 1).astype(np.int64)
    assert np.count_nonzero(np.diff(order // 65_536)) == 3


def test_dtype_switches_to_int64_at_2_pow_32() -> None:
    """Orders are uint32 below 2**32 samples and int64 from there (4 bytes a sample while it fits)."""
    assert order_dtype(2**32 - 1) == np.uint32
    assert order_dtype(2**32) == np.int64


def test_shuffle_table_names() -> None:
    """The shuffle table offers exactly the three documented modes."""
    assert sorted(SHUFFLES) == ["block", "global", "none"]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"n_samples": -1}, "n_samples must be >= 0, got -1"),
        ({"seed": -1}, "seed must be >= 0, got -1"),
        ({"epoch": -2}, "epoch must be >= 0, got -2"),
        ({"shuffle": "random"}, "shuffle must be one of ['block', 'global', 'none'], got 'random'"),
        ({"block_window": 0}, "block_window must be >= 1, got 0"),
        ({"shard_rows": [3, 4]}, "shard_rows sum to 7 over 2 shards, but n_samples is 10"),
        ({"shard_rows": [12, -2]}, "shard_rows[1] = -2 must be >= 0"),
        ({"shard_rows": [[10]]}, "shard_rows must be a 1-D sequence of ints"),
        ({"shard_rows": [5.0, 5.0]}, "shard_rows must be a 1-D sequence of ints"),
    ],
)
def test_bad_arguments_name_the_bound(kwargs: dict[str, object], message: str) -> None:
    """Bad arguments raise ValueError whose message prints the value and the bound."""
    args: dict[str, object] = {"n_samples": 10, "seed": 0, "epoch": 0, "shuffle": "block"}
    args.update(kwargs)
    with pytest.raises(ValueError) as err:
        epoch_order(**args)  # type: ignore[arg-type]
    assert message in str(err.value)


def test_an_order_planned_ahead_is_the_one_its_epoch_gets() -> None:
    """The next epoch's order computed in the background is the order of that epoch (the
    same function of the same arguments), and is the one a stream of that epoch is handed."""
    spec = JobSpec(dataset="d", batch_size=8, envs=2)
    job = Job(job_id(spec), spec, num_samples=300_000)
    cache = PlanCache()
    cache.plan_ahead(job, 3, 7)
    cache.close(wait=True)  # both envs' orders planned in the background
    ahead = [cache.order(job, 3, 7, env=e) for e in range(2)]
    for e, order in enumerate(ahead):
        assert order is cache.order(job, 3, 7, env=e)  # cached, not computed again
        assert np.array_equal(order, epoch_order(300_000, 7, 3, "global", env=e))
    assert not np.array_equal(ahead[0], ahead[1])


def test_an_order_handed_out_before_its_last_buckets_is_the_whole_order() -> None:
    """A new epoch's rank plans are handed out after the bucket layout and the first bucket;
    every batch read from them, on any rank and from a deep offset, is the batch of the
    whole order, and the cache's order is that order once it is whole."""
    n = 1_000_003  # 8 buckets of ~2**17
    spec = JobSpec(dataset="d", batch_size=64, world_size=3)
    job = Job(job_id(spec), spec, num_samples=n)
    cache = PlanCache()
    whole = epoch_order(n, 5, 2, "global")
    try:
        plans = [cache.rank_plan(job, 2, 5, r) for r in range(3)]
        deep = cache.rank_plan(job, 2, 5, 1, offset=900_000)
        padded = np.concatenate([whole, whole[:2]])  # n % 3 == 1: ranks 1 and 2 pad once
        for r, p in enumerate(plans):
            ids = np.concatenate(list(p))
            assert np.array_equal(ids, padded[r::3][: p.num_samples]), f"rank {r}"
        assert np.array_equal(deep.sample_ids()[:5], whole[900_001:900_016:3])
        assert np.array_equal(cache.order(job, 2, 5), whole)
    finally:
        cache.close(wait=True)


def test_a_steered_order_replaces_the_one_made_under_older_steering() -> None:
    """A mixture's orders share the cache: one is made once per key, and a newer steering
    of the same job, epoch and seed drops the older one; another epoch's order stays."""
    cache = PlanCache()
    made: list[int] = []

    def make(n: int) -> Callable[[], np.ndarray]:
        def order() -> np.ndarray:
            made.append(n)
            return np.arange(n, dtype=np.uint32)

        return order

    cache.steered_order(("j", 0, 1, "weights a"), make(3))
    cache.steered_order(("j", 1, 1, "weights a"), make(4))
    cache.steered_order(("j", 0, 1, "weights b"), make(5))
    assert cache.nbytes == (4 + 5) * 4
    assert cache.steered_order(("j", 0, 1, "weights b"), make(6)).tolist() == list(range(5))
    assert made == [3, 4, 5]


def test_a_steered_order_made_off_the_planning_lane_wakes_the_streams_it_held() -> None:
    """An order found being made by another thread (a rank's Hello, an HTTP plan) is not
    ready, and the streamer is woken once it is kept, as for one made on the planning lane."""
    import threading

    cache = PlanCache()
    woken = threading.Event()
    cache.on_landed(woken.set)
    making, release = threading.Event(), threading.Event()

    def make() -> np.ndarray:
        making.set()
        release.wait(scaled(60))
        return np.arange(5, dtype=np.uint32)

    key = ("j", 0, 1, "weights b")
    maker = threading.Thread(target=cache.steered_order, args=(key, make))
    maker.start()
    try:
        assert making.wait(scaled(60))
        assert not cache.steered_ready(key, make)  # a stream is skipped until it lands
        assert not woken.is_set()
    finally:
        release.set()
        maker.join(scaled(60))
        cache.close()
    assert woken.is_set()
    assert cache.steered_ready(key, make)


def test_finishing_waits_for_its_bucket_and_names_a_failed_shuffle() -> None:
    """A read past the shuffled positions waits until they are; a failed shuffle is an error
    naming the order, not a wait to the deadline."""
    import threading

    from shardserve.server.planning.cache import Finishing

    f = Finishing("job j epoch 3", 100, 10)
    f.wait(9)  # already final
    got: list[object] = []
    reader = threading.Thread(target=lambda: got.append(f.wait(50) or "read"))
    reader.start()
    f.advance(40)
    f.advance(60)
    reader.join(timeout=scaled(60))
    assert got == ["read"]
    f.fail(ValueError("boom"))
    with pytest.raises(RuntimeError, match=r"shuffling the rest of job j epoch 3 failed: boom"):
        f.wait(80)


def test_finishing_runs_what_waits_for_the_whole_order_once_it_is_whole() -> None:
    """A callback given to an order still being shuffled runs when its last bucket is done
    (or its shuffle failed), and at once when it is whole already."""
    from shardserve.server.planning.cache import Finishing

    f = Finishing("job j epoch 3", 100, 10)
    ran: list[str] = []
    f.then(lambda: ran.append("a"))
    f.advance(60)
    assert ran == []
    f.advance(100)
    assert ran == ["a"]
    f.then(lambda: ran.append("b"))
    assert ran == ["a", "b"]
    failing = Finishing("job j epoch 4", 100, 10)
    failing.then(lambda: ran.append("c"))
    failing.fail(ValueError("boom"))
    assert ran == ["a", "b", "c"]


def test_the_next_epoch_is_planned_ahead_once_the_current_order_is_whole() -> None:
    """Asked for while the current epoch's last buckets are shuffled, the next epoch's order
    is planned after them: it is the order of that epoch, made once."""
    n = 1_000_003  # 8 buckets of ~2**17: handed out before the last ones are shuffled
    spec = JobSpec(dataset="d", batch_size=64)
    job = Job(job_id(spec), spec, num_samples=n)
    cache = PlanCache()
    try:
        cache.rank_plan(job, 2, 5, 0)
        cache.plan_ahead(job, 3, 5)
        cache.plan_ahead(job, 3, 5)  # asked twice (two ranks): planned once
        current = cache.order(job, 2, 5)  # waits for its last bucket
    finally:
        cache.close(wait=True)
    assert cache.nbytes == 2 * n * 4  # closing waited for the order planned ahead
    assert np.array_equal(current, epoch_order(n, 5, 2, "global"))
    assert np.array_equal(cache.order(job, 3, 5), epoch_order(n, 5, 3, "global"))
