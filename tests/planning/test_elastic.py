"""Elastic resume in the planner: an epoch saved on N ranks after k batches resumes on M ranks.

The consumed samples are the prefix ``order[:k * b * N]`` of the epoch's one order; the rest is
dealt over M ranks by the same rule. Plans of jobs that never resume are byte-identical to the
plans before elastic resume existed (golden digests below, made by the planner before it).
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from shardserve.proto.resume import ResumePoint, position_of, resume_point
from shardserve.server.planning import RankPlan, epoch_order, num_batches, plan
from shardserve.server.planning.envs import EnvSteps

from .strategies import batch_sizes, seeds, shuffles, world_sizes

# sha256 over every batch of every rank of the grid in ``_digest``, computed with the planner
# of main at ad5c23a (before ``offset``/``position`` existed).
GOLDEN = {
    ("global", False): "ff27c5bd0b0fc4fa16092d58d1b4a0f627a6408a65571bd4590732b523c62841",
    ("global", True): "4f97811e63e443de2dc6481112a42291d8aae9059cb412893d817ef5ba5d960c",
    ("block", False): "a9972e04665dd41fb98c0beca2154b8b12b5a3efce36317fd66764cd41f9bcc5",
    ("block", True): "9561c44e3c1fb10265cc86f21e93cfc7c147869d1fe5dfd6ca2e2f2c67e690f0",
    ("none", False): "e4d4f2f0509baeea8589a82d7fb91591de1c7a0bcf5ca433d2d84b36ce3d0294",
    ("none", True): "34b1f4a41d3fed1749a649edd89d15d20ccf4385a7f698026c5c9d59db66b99e",
}


def _digest(shuffle: str, drop_last: bool) -> str:
    h = hashlib.sha256()
    for n in (0, 1, 7, 100, 1000, 70001):
        for ws in (1, 3, 4, 8):
            for bs in (1, 5, 32) if n <= 1000 else (32,):
                for seed, epoch in ((0, 0), (7, 3)):
                    rows = [n // 3, n // 3, n - 2 * (n // 3)] if shuffle == "block" else None
                    for r in range(ws):
                        p = plan(n, seed, epoch, ws, r, bs, shuffle, drop_last, rows, 2)  # type: ignore[arg-type]
                        for b in p:
                            h.update(b.astype("<i8").tobytes())
                            h.update(b"|")
                        h.update(b"#")
    return h.hexdigest()


@pytest.mark.parametrize(("shuffle", "drop_last"), sorted(GOLDEN))
def test_plans_without_resume_are_byte_identical_to_before(shuffle: str, drop_last: bool) -> None:
    assert _digest(shuffle, drop_last) == GOLDEN[(shuffle, drop_last)]


def _ids(p: RankPlan | EnvSteps, start: int = 0) -> np.ndarray:
    return np.concatenate([np.zeros(0, np.int64), *(p.batch(i) for i in range(start, len(p)))])


@settings(max_examples=150, deadline=None)
@given(
    n=st.integers(1, 300),
    bs=batch_sizes,
    n_before=world_sizes,
    n_after=world_sizes,
    k_frac=st.floats(0, 1, exclude_max=True),
    drop_last=st.booleans(),
    shuffle=shuffles,
    seed=seeds,
)
def test_resume_on_another_world_size_delivers_every_sample_once(
    n: int,
    bs: int,
    n_before: int,
    n_after: int,
    k_frac: float,
    drop_last: bool,
    shuffle: str,
    seed: int,
) -> None:
    """Before (N ranks, k batches each) + after (M ranks, the rest): every sample exactly once
    (drop_last=False: plus fewer than M padding ids, cycled from the order's start; True: the
    order's tail of fewer than M * b ids dropped), ranks disjoint, equal batches per rank."""
    rows = [n // 2, n - n // 2]
    order = epoch_order(n, seed, 1, shuffle, rows, 1).astype(np.int64)  # type: ignore[arg-type]
    total = num_batches(n, n_before, bs, drop_last)
    assume(total > 0)
    k = int(k_frac * total)  # 0 <= k < total: a mid-epoch state
    before = [RankPlan.from_order(order, n_before, r, bs, drop_last) for r in range(n_before)]
    got_before = np.concatenate([np.zeros(0, np.int64)] + [_ids(p)[: k * bs] for p in before])
    position = k * bs * n_before
    # The consumed samples are exactly the order's prefix, whatever N is.
    assert np.array_equal(np.sort(got_before), np.sort(order[:position]))

    point = resume_point(position, n_after, bs)
    assert point.offset < bs * n_after and position_of(point, n_after, bs) == position
    after = [
        RankPlan.from_order(order, n_after, r, bs, drop_last, point.offset) for r in range(n_after)
    ]
    # plan(position=P) is the same deal with the first start_batch batches already gone.
    for r, p in enumerate(after):
        direct = plan(n, seed, 1, n_after, r, bs, shuffle, drop_last, rows, 1, position=position)  # type: ignore[arg-type]
        assert len(direct) == len(p) - point.start_batch
        assert np.array_equal(_ids(direct), _ids(p, point.start_batch))
    lengths = {len(p) - point.start_batch for p in after}
    assert len(lengths) == 1, f"unequal batches per rank: {lengths}"
    per_rank = [_ids(p, point.start_batch) for p in after]
    got_after = np.concatenate(per_rank)
    rest = n - position
    if drop_last:
        kept = (rest // n_after) // bs * bs * n_after
        assert rest - kept < n_after * bs
        assert np.array_equal(np.sort(got_after), np.sort(order[position : position + kept]))
    else:
        pads = -(-rest // n_after) * n_after - rest
        assert pads < n_after
        cycled = order[(position + rest + np.arange(pads)) % n]
        want = np.concatenate([order[position:], cycled])
        assert np.array_equal(np.sort(got_after), np.sort(want))
        # Every sample of the epoch exactly once, apart from those padding ids.
        union = np.concatenate([got_before, got_after])
        assert np.array_equal(np.unique(union), np.arange(n))
        assert len(union) == n + pads
    # Ranks are disjoint: the padding ids are each rank's last, at most one each.
    heads = np.concatenate([ids[:-1] for ids in per_rank if len(ids)] + [np.zeros(0, np.int64)])
    assert len(np.unique(heads)) == len(heads)
    if n_after == n_before:  # same world size: exactly the uninterrupted epoch's rest
        assert point == ResumePoint(0, k)
        for p, q in zip(after, before, strict=True):
            assert np.array_equal(_ids(p, k), _ids(q, k))


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 120),
    b=st.integers(1, 8),
    envs=st.integers(1, 3),
    n_before=world_sizes,
    n_after=world_sizes,
    k_frac=st.floats(0, 1, exclude_max=True),
    drop_last=st.booleans(),
    seed=seeds,
)
def test_env_steps_resume_with_one_position_for_every_environment(
    n: int,
    b: int,
    envs: int,
    n_before: int,
    n_after: int,
    k_frac: float,
    drop_last: bool,
    seed: int,
) -> None:
    """A step holds one batch of each environment, so after k steps every environment consumed
    the same prefix of its own order: one position resumes them all."""
    orders = [epoch_order(n, seed, 0, "global", env=e) for e in range(envs)]
    total = num_batches(n, n_before, b, drop_last)
    assume(total > 0)
    k = int(k_frac * total)
    position = k * b * n_before
    point = resume_point(position, n_after, b)
    for r in range(n_after):
        steps = EnvSteps.from_orders(orders, n_after, r, b, drop_last, point.offset)
        for e, o in enumerate(orders):
            alone = RankPlan.from_order(o, n_after, r, b, drop_last, position)
            assert np.array_equal(_ids(steps.plans[e], point.start_batch), _ids(alone))


def test_offset_out_of_range_is_refused() -> None:
    with pytest.raises(ValueError, match="offset 11 out of range 0 <= offset <= 10"):
        RankPlan.from_order(np.arange(10), 2, 0, 2, False, offset=11)
