"""Draws made together for several steps (a fused crop and flip) are each step's own draws,
and Philox under per-element keys is Philox under each key alone."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from shardserve.server.transforms import draws
from shardserve.server.transforms.keys import SampleKeys, philox4x32_10, words_together

IDS = st.lists(st.integers(0, (1 << 40) - 1), min_size=1, max_size=40)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, (1 << 63) - 1), a=IDS, b=IDS, n=st.integers(1, 9))
def test_words_together_are_each_keys_words(seed: int, a: list[int], b: list[int], n: int) -> None:
    """Each step's words drawn together equal its words drawn alone, for any word count."""
    keys = [SampleKeys(seed, 3, 0, np.array(a)), SampleKeys(seed, 3, 1, np.array(b))]
    got = words_together(keys, n)
    assert [g.tolist() for g in got] == [k.words(n).tolist() for k in keys]


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, (1 << 63) - 1),
    ids=IDS,
    room=st.tuples(st.integers(0, 40), st.integers(0, 40)),
    p=st.sampled_from([0.0, 0.3, 0.5, 1.0]),
    legacy=st.booleans(),
)
def test_crop_flips_are_the_steps_own_draws(
    seed: int, ids: list[int], room: tuple[int, int], p: float, legacy: bool
) -> None:
    """Offsets and flips drawn together equal crop_offsets and flips, in both schemes."""

    def keys(step: int) -> SampleKeys:
        gen = np.random.default_rng([seed, step]) if legacy else None
        return SampleKeys(seed, 1, step, np.array(ids), legacy=gen)

    oy, ox, flip = draws.crop_flips(keys(0), keys(1), room[0], room[1], p)
    ry, rx = draws.crop_offsets(keys(0), *room)
    assert (oy.tolist(), ox.tolist()) == (ry.tolist(), rx.tolist())
    assert flip.tolist() == draws.flips(keys(1), p).tolist()


def test_philox_under_per_element_keys_is_philox_under_each_key() -> None:
    """A batch of counters under two keys gives what each key gives alone."""
    ctr = np.arange(8, dtype=np.uint64)
    k0 = np.array([5] * 4 + [0xFFFFFFFF] * 4, np.uint64)
    k1 = np.array([7] * 4 + [1] * 4, np.uint64)
    got = np.stack(philox4x32_10(ctr, ctr, ctr, ctr, k0, k1))
    first = np.stack(philox4x32_10(ctr[:4], ctr[:4], ctr[:4], ctr[:4], 5, 7))
    second = np.stack(philox4x32_10(ctr[4:], ctr[4:], ctr[4:], ctr[4:], 0xFFFFFFFF, 1))
    assert got.tolist() == np.concatenate([first, second], axis=1).tolist()
