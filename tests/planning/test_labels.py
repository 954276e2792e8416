"""Bucket labels are numpy's ``integers`` draws exactly, and leave the generator as it would."""

from __future__ import annotations

import numpy as np
import pytest

from shardserve.server.planning import labels
from shardserve.server.planning.labels import bucket_labels


@pytest.mark.parametrize("k", [2, 3, 7, 100, 115, 128, 129, 200, 255, 256])
@pytest.mark.parametrize("held", [0, 1])
def test_same_draws_and_state_as_integers(
    k: int, held: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Across blocks, sizes and a held 32-bit output, labels and every later draw match."""
    for n in (1, 3, 4, 5, 8, 9, 64, 297, 5003):
        ours, theirs = np.random.default_rng([k, n]), np.random.default_rng([k, n])
        for g in (ours, theirs):
            for _ in range(held):
                g.integers(0, 2**32 - 5)  # a 32-bit draw: half of a 64-bit output is held
        got = bucket_labels(ours, n, k, block_words=37)  # several blocks a call
        assert got.tolist() == theirs.integers(0, k, size=n, dtype=np.uint8).tolist()
        assert ours.bit_generator.state == theirs.bit_generator.state
        assert ours.integers(0, 1000, 9).tolist() == theirs.integers(0, 1000, 9).tolist()


def test_large_draw_matches() -> None:
    """A draw of several default blocks matches too."""
    ours, theirs = np.random.default_rng(5), np.random.default_rng(5)
    n = 3 * labels.BLOCK_WORDS * 8 + 11
    assert (bucket_labels(ours, n, 115) == theirs.integers(0, 115, n, dtype=np.uint8)).all()
    assert ours.bit_generator.state == theirs.bit_generator.state
