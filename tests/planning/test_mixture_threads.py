"""Mixture epochs long enough to shuffle their sources on a second thread keep their bytes."""

from __future__ import annotations

import hashlib
import threading

import numpy as np
import pytest

from shardserve.server.planning.mixture import (
    PREFETCH_MIN,
    MixSource,
    Quarantine,
    Segment,
    mixture_order,
)

CASES = {
    "wraps_stop_quarantine": {
        "sources": [
            MixSource(700_001),
            MixSource(250_000, "stop"),
            MixSource(3000),
            MixSource(1_500_000),
        ],
        "seed": 2**40 + 7,
        "epoch": 4,
        "length": 4_300_000,
        "world_size": 8,
        "segments": [
            Segment(0, (0.4, 0.05, 0.15, 0.4)),
            Segment(1_000_003, (0.6, 0.05, 0.05, 0.3)),
            Segment(3_100_000, (0.1, 0.05, 0.45, 0.4)),
        ],
        "quarantine": [
            Quarantine(0, 500_000, np.arange(0, 700_001, 9)),
            Quarantine(3, 2_000_001, np.arange(1, 1_500_000, 5)),
        ],
    },
    "stop_runs_out": {
        "sources": [MixSource(1_000_000), MixSource(600_000, "stop")],
        "seed": 1,
        "epoch": 0,
        "length": 4_500_000,
        "world_size": 3,
        "segments": [Segment(0, (0.7, 0.3)), Segment(1_500_000, (0.5, 0.5))],
    },
    "block_many": {
        "sources": [
            MixSource(60_000 * (k + 1), shard_rows=(20_000,) * (3 * (k + 1))) for k in range(10)
        ],
        "seed": 5,
        "epoch": 2,
        "length": 4_200_000,
        "world_size": 2,
        "shuffle": "block",
        "segments": [Segment(0, tuple(float(k + 1) for k in range(10)))],
    },
}
# (length, sha256[:16] of the order as <u8), computed with the one-thread planner of main at
# e7b0692: who shuffles a source, and when, must change no byte of a plan.
GOLDEN = {
    "wraps_stop_quarantine": (4_300_000, "23a58dcdc6a3db2c"),
    "stop_runs_out": (1_801_815, "efd88cd4d3bbb229"),
    "block_many": (4_200_000, "a3fe0e014d81f9ec"),
}


def _prefetchers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "mixture-prefetch"]


@pytest.mark.parametrize("name", sorted(CASES))
def test_two_thread_orders_are_byte_identical(name: str) -> None:
    """A mixture planned with a prefetch thread hashes to what the one-thread planner gave."""
    args = CASES[name]
    assert args["length"] >= PREFETCH_MIN
    order = mixture_order(**args)
    length, digest = GOLDEN[name]
    assert len(order) == length
    assert hashlib.sha256(order.astype("<u8").tobytes()).hexdigest()[:16] == digest
    assert not _prefetchers()


def test_refusal_mid_epoch_ends_the_prefetch_thread() -> None:
    """A source quarantined whole half way refuses the plan and leaves no thread behind."""
    with pytest.raises(ValueError, match="every sample of mixture source 0"):
        mixture_order(
            [MixSource(300_000), MixSource(2_000_000)],
            seed=0,
            epoch=0,
            length=PREFETCH_MIN,
            segments=[Segment(0, (1, 1))],
            quarantine=[Quarantine(0, PREFETCH_MIN // 2, np.arange(300_000))],
        )
    assert not _prefetchers()
