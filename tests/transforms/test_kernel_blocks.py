"""The image kernels' shortcuts change no byte: normalize in blocks against cached
per-sample mean/std arrays equals the step-by-step reference on batches of many blocks, and a
padding border kept from the thread's last call is the one a fresh padding writes."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardserve.server.transforms.kernels import NORM_BLOCK_BYTES, normalize_into, pad_batch
from tests.transforms.test_fused import ref_norm


@pytest.mark.parametrize("layout", ["CHW", "HWC"])
@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
@settings(max_examples=10, deadline=None)
@given(
    extra=st.integers(0, 40),
    seed=st.integers(0, 1 << 30),
    channels=st.sampled_from([1, 3]),
    per_channel=st.booleans(),
)
def test_normalize_in_blocks_gives_the_step_by_step_bytes(
    layout: str, dtype: str, extra: int, seed: int, channels: int, per_channel: bool
) -> None:
    """A batch of several normalize blocks (and a part block) has the reference's bytes."""
    rng = np.random.default_rng(seed)
    sample = (channels, 32, 32) if layout == "CHW" else (32, 32, channels)
    per_block = NORM_BLOCK_BYTES // (np.dtype(dtype).itemsize * int(np.prod(sample)))
    b = 2 * per_block + extra
    x = rng.integers(0, 256, (b, *sample), dtype=np.uint8)
    n = channels if per_channel else 1
    p = {
        "layout": layout,
        "scale": float(rng.uniform(0.001, 2)),
        "mean": rng.uniform(-1, 1, n).tolist(),
        "std": rng.uniform(0.1, 2, n).tolist(),
        "dtype": dtype,
    }
    y = np.empty(x.shape, dtype)
    got = normalize_into(x, y, layout == "CHW", p["scale"], p["mean"], p["std"])
    assert got.tobytes() == ref_norm(x, p, None).tobytes()  # type: ignore[arg-type]


def test_a_kept_padding_border_is_what_a_fresh_one_writes() -> None:
    """Padding again on one thread, with another fill or geometry in between, is np.pad's."""
    rng = np.random.default_rng(3)
    x = rng.integers(0, 256, (5, 3, 6, 7), dtype=np.uint8)
    for fill, pad, axes in [
        (0, 2, (2, 3)),
        (0, 2, (2, 3)),
        (9, 2, (2, 3)),
        (0, 3, (2, 3)),
        (0, 2, (1, 2)),
        (0, 2, (2, 3)),
    ]:
        widths = [(0, 0)] * 4
        widths[axes[0]] = widths[axes[1]] = (pad, pad)
        want = np.pad(x, widths, constant_values=fill)
        got = pad_batch(x, axes[0], axes[1], pad, fill)
        assert got.tobytes() == want.tobytes(), (fill, pad, axes)
        with pytest.raises(ValueError):
            got[:] = 200  # read-only: the border is kept for the next call
