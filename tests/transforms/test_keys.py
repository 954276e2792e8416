"""Counter-based per-sample keys and the built-ins' parameter draws: known answers, and a
sample's numbers the same in any batch."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardserve.server.transforms import compiled, draws
from shardserve.server.transforms.keys import SampleKeys, below, derive_key, philox4x32_10

# Random123's kat_vectors for philox4x32 with 10 rounds: (counter, key, output).
KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    (
        (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
        (0xA4093822, 0x299F31D0),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
    ),
]


@pytest.mark.parametrize(("ctr", "key", "want"), KAT)
def test_philox_known_answers(ctr: tuple, key: tuple, want: tuple) -> None:
    """Philox4x32-10 gives Random123's published known-answer vectors."""
    got = philox4x32_10(*(np.array([c], np.uint64) for c in ctr), *key)
    assert tuple(int(w[0]) for w in got) == want


def test_derived_key_is_one_philox_block() -> None:
    """The scalar key derivation equals the vectorised block it stands for."""
    block = philox4x32_10(*(np.array([c], np.uint64) for c in (5, 0, 3, 1)), 7, 0)
    assert derive_key(7, 5, 3, 1) == (int(block[0][0]), int(block[1][0]))


def test_pinned_values() -> None:
    """A few drawn values are pinned: changing them changes every job's augmentations."""
    k = SampleKeys(seed=1, epoch=2, step=3, ids=np.array([0, 7, 1 << 40], np.uint64))
    assert k.words(2).tolist() == PINNED_WORDS
    assert draws.crop_offsets(k, 8, 8)[0].tolist() == PINNED_OY


def test_pinned_subsets() -> None:
    """random_subset's rows of a batch that takes every way of drawing are pinned bytes."""
    keys = SampleKeys(seed=11, epoch=3, step=1, ids=np.array([0, 5, 1 << 33, 77, 4099, 12]))
    # 16-bit first distinct values, 32-bit ones (300,000 rows), smallest sort keys (n < 2k)
    sizes = np.array([1000, 5000, 300_000, 700, 2048, 513])
    for replace, want in PINNED_SUBSETS.items():
        rows = draws.subset_indices(keys, sizes, 512, replace=replace)
        assert hashlib.sha256(rows.astype("<i8").tobytes()).hexdigest() == want, replace


PINNED_SUBSETS = {
    False: "22791630a27adc06847adc5e00faad9d5dc92093507dd2ae86026753e4685b79",
    True: "9c633d04ee46fd0e32ab962944e3dedb6862da440f45a8d2e6333d0d159b06de",
}
PINNED_WORDS = [[2426033021, 3071568952], [2930669187, 3520203820], [1637496381, 3046953726]]
PINNED_OY = [5, 6, 3]


@settings(max_examples=40, deadline=None)
@given(
    ids=st.lists(st.integers(0, (1 << 64) - 1), min_size=1, max_size=12, unique=True),
    seed=st.integers(0, (1 << 63) - 1),
    epoch=st.integers(0, 1 << 40),
    step=st.integers(0, 63),
    data=st.data(),
)
def test_a_sample_draws_the_same_in_any_batch(
    ids: list, seed: int, epoch: int, step: int, data: st.DataObject
) -> None:
    """Every draw of a sample equals the same draw made for that sample alone."""
    keys = SampleKeys(seed=seed, epoch=epoch, step=step, ids=np.array(ids, np.uint64))
    sizes = np.array(
        data.draw(st.lists(st.integers(1, 3000), min_size=len(ids), max_size=len(ids)))
    )
    k = data.draw(st.integers(1, int(sizes.min())))
    hw = np.array(
        data.draw(st.lists(st.integers(1, 600), min_size=2 * len(ids), max_size=2 * len(ids)))
    ).reshape(2, -1)
    batch = {
        "uniform": keys.uniform(3),
        "integers": keys.integers(sizes, 5),
        "crop": np.stack(draws.crop_offsets(keys, 9, 4), 1),
        "flips": draws.flips(keys, 0.3),
        "boxes": draws.resized_crop_boxes(keys, hw[0], hw[1], (0.08, 1.0), (0.75, 4 / 3)),
        "subset": draws.subset_indices(keys, sizes, k),
        "replace": draws.subset_indices(keys, sizes, k, replace=True),
    }
    for i in range(len(ids)):
        one, sl = keys.take(np.array([i])), slice(i, i + 1)
        alone = {
            "uniform": one.uniform(3),
            "integers": one.integers(sizes[sl], 5),
            "crop": np.stack(draws.crop_offsets(one, 9, 4), 1),
            "flips": draws.flips(one, 0.3),
            "boxes": draws.resized_crop_boxes(
                one, hw[0, sl], hw[1, sl], (0.08, 1.0), (0.75, 4 / 3)
            ),
            "subset": draws.subset_indices(one, sizes[sl], k),
            "replace": draws.subset_indices(one, sizes[sl], k, replace=True),
        }
        for name, got in alone.items():
            assert np.array_equal(got[0], batch[name][i]), name
    rows = batch["subset"]
    assert (rows < sizes[:, None]).all() and (np.diff(rows, axis=1) > 0).all()
    b = batch["boxes"]
    assert (b[:, 0] + b[:, 2] <= hw[0]).all() and (b[:, 1] + b[:, 3] <= hw[1]).all()


def test_subset_is_uniform() -> None:
    """Every row of a 10-row sample is chosen about equally often, both ways of drawing."""
    keys = SampleKeys(seed=5, epoch=0, step=0, ids=np.arange(20000))
    for k in (3, 7):  # first distinct values; smallest sort keys
        rows = draws.subset_indices(keys, np.full(20000, 10), k)
        share = np.bincount(rows.ravel(), minlength=10) / (20000 * k / 10)
        assert np.abs(share - 1).max() < 0.05


def test_below_is_in_range_and_refuses_a_bad_high() -> None:
    """Bounded draws stay below their bound; a bound past 2**32 is refused."""
    words = SampleKeys(seed=0, epoch=0, step=0, ids=np.arange(50)).words(8)
    assert (below(words, np.full((50, 1), 3)) < 3).all()
    with pytest.raises(ValueError, match="high must be"):
        below(words, np.full((50, 1), (1 << 32) + 1))


def _first_distinct_reference(keys: SampleKeys, n: int, k: int) -> list[int]:
    """One sample's rows as the docstring defines them, one draw at a time in Python."""
    bits = 16 if n <= 1 << 16 else 32
    words = keys.words(8 * k).ravel().tolist()
    pieces = [p for w in words for p in (w & 0xFFFF, w >> 16)] if bits == 16 else words
    seen: list[int] = []
    for piece in pieces:
        prod = piece * n
        if prod & ((1 << bits) - 1) >= ((1 << bits) - n) % n and prod >> bits not in seen:
            seen.append(prod >> bits)
        if len(seen) == k:
            return sorted(seen)
    raise AssertionError("8k words did not give k distinct rows")


@pytest.mark.parametrize("top", [6000, 300_000])
def test_subset_equals_the_first_distinct_draws_one_at_a_time(top: int) -> None:
    """The batched subset equals each sample's first k distinct bounded draws, in order."""
    gen = np.random.default_rng(top)
    sizes = gen.integers(1024, top, 12)
    keys = SampleKeys(seed=9, epoch=2, step=1, ids=gen.integers(0, 1 << 40, 12))
    rows = draws.subset_indices(keys, sizes, 512)
    for i in range(12):
        assert rows[i].tolist() == _first_distinct_reference(
            keys.take(np.array([i])), int(sizes[i]), 512
        )


@pytest.mark.skipif(compiled.philox is None, reason="the C extension was not built")
@settings(max_examples=300, deadline=None)
@given(st.integers(0, 40), st.booleans(), st.integers(0, 2**32 - 1))
def test_the_compiled_blocks_are_numpys_words(n: int, per_sample: bool, seed: int) -> None:
    """The compiled Philox gives numpy's words for any counters (past 2**32 too) and keys."""
    rng = np.random.default_rng(seed)
    block, ids = (rng.integers(0, 2**64, n, dtype=np.uint64) for _ in range(2))
    k0, k1 = (rng.integers(0, 2**32, n if per_sample else 1, dtype=np.uint64) for _ in range(2))
    got = np.empty((n, 4), np.uint64)
    compiled.philox.blocks(block, ids, k0, k1, got)  # type: ignore[union-attr]
    keys = (k0, k1) if per_sample else (int(k0[0]), int(k1[0]))
    zero = np.zeros(n, np.uint64)
    want = np.stack(philox4x32_10(block, zero, ids & 0xFFFFFFFF, ids >> np.uint64(32), *keys), -1)
    assert got.tobytes() == want.reshape(n, 4).tobytes()


@pytest.mark.skipif(compiled.philox is None, reason="the C extension was not built")
def test_the_compiled_blocks_refuse_sizes_that_do_not_fit() -> None:
    """Arrays of the wrong sizes are refused before anything is written."""
    a, one = np.zeros(4, np.uint64), np.zeros(1, np.uint64)
    blocks = compiled.philox.blocks  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="one size"):
        blocks(a, a[:3], one, one, np.empty((4, 4), np.uint64))
    with pytest.raises(ValueError, match="keys"):
        blocks(a, a, a[:2], a[:2], np.empty((4, 4), np.uint64))
    with pytest.raises(ValueError, match="four uint64 words"):
        blocks(a, a, one, one, np.empty((3, 4), np.uint64))
