"""Every built-in batch kernel equals its per-sample reference (the same chain on each
sample alone), and under randomness scheme 1 draws what the old generators drew."""

from __future__ import annotations

import io
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from shardserve.server.transforms import draws
from shardserve.server.transforms.chunks import slice_parts
from shardserve.server.transforms.keys import SampleKeys
from shardserve.server.transforms.registry import TransformRegistry
from shardserve.server.transforms.rng import batch_rng, sample_rng
from shardserve.server.transforms.runner import Where, run_chain
from shardserve.server.transforms.schema import Field
from shardserve.server.transforms.spec import compile_chain

REG = TransformRegistry.load()


def _ragged(items: list[np.ndarray], name: str, binary: bool = False) -> dict[str, np.ndarray]:
    offs = np.zeros(len(items) + 1, np.int64)
    np.cumsum([a.size for a in items], out=offs[1:])
    parts = {name: np.concatenate([a.ravel() for a in items]), name + ".offsets": offs}
    if not binary:
        parts[name + ".shapes"] = np.array([a.shape for a in items], np.int64)
    return parts


def _images(rng: np.random.Generator, b: int) -> dict[str, np.ndarray]:
    return _ragged(
        [
            rng.integers(
                0, 256, (int(rng.integers(4, 40)), int(rng.integers(4, 40)), 3), dtype=np.uint8
            )
            for _ in range(b)
        ],
        "image",
    )


def _points(rng: np.random.Generator, b: int) -> dict[str, np.ndarray]:
    pts = [
        rng.standard_normal((int(rng.integers(20, 200)), 3)).astype(np.float32) for _ in range(b)
    ]
    return _ragged(pts, "points")


def _jpegs(rng: np.random.Generator, b: int) -> dict[str, np.ndarray]:
    blobs = []
    for _ in range(b):
        x = rng.integers(0, 256, (int(rng.integers(8, 80)), int(rng.integers(8, 80)), 3), np.uint8)
        buf = io.BytesIO()
        Image.fromarray(x).save(buf, format="JPEG", quality=80)
        blobs.append(np.frombuffer(buf.getvalue(), np.uint8))
    return _ragged(blobs, "image", binary=True)


FIXED = {"image": Field("uint8", (3, 10, 12))}
RAGGED = {"image": Field("uint8", (-1, -1, 3))}
POINTS = {"points": Field("float32", (-1, 3))}
#: (chain, inputs, make parts): every built-in (decode_image writes variable shapes: it stays
#: a sample transform and is covered by its own tests).
CASES = {
    "random_crop": (
        [{"name": "random_crop", "params": {"size": [6, 7], "padding": 2, "layout": "CHW"}}],
        FIXED,
        None,
    ),
    "hflip": ([{"name": "hflip", "params": {"layout": "CHW", "p": 0.5}}], FIXED, None),
    "normalize": ([{"name": "normalize", "params": {"layout": "CHW", "scale": 0.5}}], FIXED, None),
    "unpack_bits": (
        [{"name": "unpack_bits", "params": {"field": "image", "shape": [7, 3]}}],
        FIXED,
        None,
    ),
    "resize": ([{"name": "resize", "params": {"size": [5, 6]}}], RAGGED, _images),
    "random_resized_crop": (
        [{"name": "random_resized_crop", "params": {"size": 6}}],
        RAGGED,
        _images,
    ),
    "decode_random_resized_crop": (
        [{"name": "decode_random_resized_crop", "params": {"size": [8, 6]}}],
        {"image": Field("uint8", (-1,), binary=True)},
        _jpegs,
    ),
    "random_subset": (
        [{"name": "random_subset", "params": {"field": "points", "n": 20}}],
        POINTS,
        _points,
    ),
    "random_subset_replace": (
        [{"name": "random_subset", "params": {"field": "points", "n": 30, "replace": True}}],
        POINTS,
        _points,
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
@settings(max_examples=15, deadline=None)
@given(
    seed=st.integers(0, (1 << 63) - 1),
    epoch=st.integers(0, 1000),
    ids=st.lists(st.integers(0, 1 << 40), min_size=1, max_size=9, unique=True),
    data_seed=st.integers(0, 1 << 30),
)
def test_batch_kernel_equals_its_per_sample_reference(
    case: str, seed: int, epoch: int, ids: list[int], data_seed: int
) -> None:
    """A batch through the kernel is, sample for sample, the chain run on each sample alone
    in another batch, rank and place."""
    steps, inputs, make = CASES[case]
    rng = np.random.default_rng(data_seed)
    b = len(ids)
    parts = (
        make(rng, b)
        if make is not None
        else {"image": rng.integers(0, 256, (b, 3, 10, 12), dtype=np.uint8)}
    )
    chain = compile_chain(steps, REG, inputs, "t")
    names = list(chain.outputs)
    idx = np.array(ids, np.int64)
    whole, _ = run_chain(chain, parts, idx, Where(seed, epoch, 0, 0), names)
    for i in range(b):
        alone, _ = run_chain(
            chain,
            slice_parts(parts, chain.inputs, i, i + 1),
            idx[i : i + 1],
            Where(seed, epoch, 3, 100 + i),
            names,
        )
        for name in names:
            assert np.array_equal(alone[name][0], whole[name][i]), (case, name, i)


def _old_box(H: int, W: int, g: np.random.Generator) -> tuple[int, int, int, int]:
    """The old per-sample random_resized_crop box (scale 0.08-1, ratio 3/4-4/3)."""
    for _ in range(10):
        target = H * W * g.uniform(0.08, 1.0)
        aspect = math.exp(g.uniform(math.log(3 / 4), math.log(4 / 3)))
        w, h = round(math.sqrt(target * aspect)), round(math.sqrt(target / aspect))
        if 0 < w <= W and 0 < h <= H:
            return int(g.integers(0, H - h + 1)), int(g.integers(0, W - w + 1)), h, w
    r = W / H  # the centre crop, clamped to the ratio range
    h, w = (
        (round(W / (3 / 4)), W) if r < 3 / 4 else ((H, round(H * 4 / 3)) if r > 4 / 3 else (H, W))
    )
    return (H - h) // 2, (W - w) // 2, h, w


def test_scheme_1_draws_what_the_old_generators_drew() -> None:
    """Under scheme 1 crop and flip draw from the batch's generator, subset and resized crop
    from each sample's, exactly as before schemes; scheme 2 draws otherwise."""
    rng = np.random.default_rng(1)
    ids = np.array([5, 17, 2, 900, 41], np.int64)
    old = Where(seed=9, epoch=2, rank=1, batch=4, scheme=1)
    x = rng.integers(0, 256, (5, 3, 10, 12), dtype=np.uint8)
    crop_flip = compile_chain(CASES["random_crop"][0] + CASES["hflip"][0], REG, FIXED, "t")
    got = run_chain(crop_flip, {"image": x}, ids, old, ["image"])[0]["image"]
    g = batch_rng(9, 2, 1, 4, 0)
    oy, ox = g.integers(0, 9, size=5), g.integers(0, 10, size=5)
    flip = batch_rng(9, 2, 1, 4, 1).random(5) < 0.5
    padded = np.pad(x, [(0, 0), (0, 0), (2, 2), (2, 2)])
    for i in range(5):
        want = padded[i, :, oy[i] : oy[i] + 6, ox[i] : ox[i] + 7]
        assert np.array_equal(got[i], want[:, :, ::-1] if flip[i] else want), i
    new = run_chain(crop_flip, {"image": x}, ids, Where(9, 2, 1, 4), ["image"])[0]["image"]
    assert not np.array_equal(new, got)

    pts = _points(rng, 5)
    subset = compile_chain(CASES["random_subset"][0], REG, POINTS, "t")
    got = run_chain(subset, pts, ids, old, ["points"])[0]["points"]
    offs = pts["points.offsets"] // 3
    for i in range(5):
        cloud = pts["points"].reshape(-1, 3)[offs[i] : offs[i + 1]]
        rows = sample_rng(9, 2, int(ids[i]), 0).choice(len(cloud), 20, replace=False, shuffle=False)
        assert np.array_equal(got[i], cloud[np.sort(rows)]), i

    keys = SampleKeys(9, 2, 0, ids, legacy=batch_rng(9, 2, 1, 4, 0))
    heights, widths = np.array([40, 7, 300, 33, 64]), np.array([50, 90, 200, 33, 20])
    boxes = draws.resized_crop_boxes(keys, heights, widths, (0.08, 1.0), (3 / 4, 4 / 3))
    for i in range(5):
        g = sample_rng(9, 2, int(ids[i]), 0)
        assert tuple(boxes[i]) == _old_box(int(heights[i]), int(widths[i]), g), i
