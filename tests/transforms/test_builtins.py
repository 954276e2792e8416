"""The built-in transforms do what their names say, checked against plain numpy (and Pillow
for decoding), and the generators they draw from are pure functions of where they are."""

from __future__ import annotations

import io
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from shardserve.proto.errors import BadRequest
from shardserve.server.transforms.keys import SampleKeys
from shardserve.server.transforms.registry import TransformRegistry
from shardserve.server.transforms.rng import (
    VECTOR_MIN,
    batch_rng,
    replacement,
    sample_rng,
    sample_rngs,
)
from shardserve.server.transforms.runner import Where, run_chain
from shardserve.server.transforms.schema import Field
from shardserve.server.transforms.spec import compile_chain

REG = TransformRegistry.load()
W = Where(seed=5, epoch=1, rank=0, batch=3)


def _run(chain: list, inputs: dict, parts: dict, n: int) -> dict:
    c = compile_chain(chain, REG, inputs, "t")
    out, _ = run_chain(c, parts, np.arange(100, 100 + n), W, list(c.outputs))
    return out


def _ragged(items: list[np.ndarray]) -> dict:
    offs = np.zeros(len(items) + 1, np.int64)
    np.cumsum([a.size for a in items], out=offs[1:])
    return {
        "values": np.concatenate([a.ravel() for a in items]),
        "offsets": offs,
        "shapes": np.array([a.shape for a in items], np.int64),
    }


def test_random_crop_is_a_window_of_the_padded_image() -> None:
    """Each output is some 32x32 window of the zero-padded input, and the offsets vary."""
    x = np.random.default_rng(0).integers(1, 255, (16, 3, 32, 32), dtype=np.uint8)
    out = _run(
        [{"name": "random_crop", "params": {"size": 32, "padding": 4, "layout": "CHW"}}],
        {"image": Field("uint8", (3, 32, 32))},
        {"image": x},
        16,
    )["image"]
    padded = np.pad(x, ((0, 0), (0, 0), (4, 4), (4, 4)))
    offsets = []
    for b in range(16):
        hits = [
            (y, z)
            for y in range(9)
            for z in range(9)
            if (padded[b, :, y : y + 32, z : z + 32] == out[b]).all()
        ]
        assert hits, f"sample {b} is no window of its padded image"
        offsets.append(hits[0])
    assert len(set(offsets)) > 4


def test_hflip_mirrors_some_and_keeps_others() -> None:
    """p=0.5: every sample is either itself or its mirror, and both happen."""
    x = np.random.default_rng(1).integers(0, 255, (32, 8, 6, 3), dtype=np.uint8)
    out = _run([{"name": "hflip"}], {"image": Field("uint8", (8, 6, 3))}, {"image": x}, 32)["image"]
    flipped = [(out[b] == x[b, :, ::-1]).all() for b in range(32)]
    same = [(out[b] == x[b]).all() for b in range(32)]
    assert all(f or s for f, s in zip(flipped, same, strict=True)) and any(flipped) and any(same)


def test_normalize_and_to_chw() -> None:
    """(x/255 - mean)/std per channel as float32, HWC turned into CHW."""
    x = np.random.default_rng(2).integers(0, 255, (4, 5, 6, 3), dtype=np.uint8)
    mean, std = [0.1, 0.2, 0.3], [0.5, 0.25, 2.0]
    out = _run(
        [
            {
                "name": "normalize",
                "params": {"scale": 1 / 255, "mean": mean, "std": std, "to_chw": True},
            }
        ],
        {"image": Field("uint8", (5, 6, 3))},
        {"image": x},
        4,
    )["image"]
    want = (x.astype(np.float32) * np.float32(1 / 255) - np.float32(mean)) / np.float32(std)
    assert out.dtype == np.float32 and out.shape == (4, 3, 5, 6)
    np.testing.assert_allclose(out, want.transpose(0, 3, 1, 2), rtol=1e-6)


def test_resize_and_random_resized_crop_on_variable_images() -> None:
    """Images of different sizes come out at the asked size; resize to its own size is the
    identity; a constant image stays constant under any crop."""
    rng = np.random.default_rng(3)
    imgs = [rng.integers(0, 255, (20 + i, 31 - i, 3), dtype=np.uint8) for i in range(5)]
    imgs[2][:] = 77
    r = _ragged(imgs)
    parts = {"image": r["values"], "image.offsets": r["offsets"], "image.shapes": r["shapes"]}
    inputs = {"image": Field("uint8", (-1, -1, 3))}
    out = _run([{"name": "random_resized_crop", "params": {"size": [12, 10]}}], inputs, parts, 5)
    assert out["image"].shape == (5, 12, 10, 3) and (out["image"][2] == 77).all()
    one = _ragged(imgs[:1])
    same = _run(
        [{"name": "resize", "params": {"size": [20, 31]}}],
        inputs,
        {"image": one["values"], "image.offsets": one["offsets"], "image.shapes": one["shapes"]},
        1,
    )["image"]
    assert (same[0] == imgs[0]).all()


def test_random_subset_takes_n_distinct_rows() -> None:
    """n rows of each sample's variable-length field, all from that sample, none twice."""
    items = [
        np.arange(k * 2, dtype=np.float32).reshape(k, 2) + 1000 * j
        for j, k in enumerate((9, 12, 30))
    ]
    r = _ragged(items)
    out = _run(
        [{"name": "random_subset", "params": {"field": "q", "n": 8}}],
        {"q": Field("float32", (-1, 2))},
        {"q": r["values"], "q.offsets": r["offsets"], "q.shapes": r["shapes"]},
        3,
    )["q"]
    assert out.shape == (3, 8, 2)
    for j, it in enumerate(items):
        rows = {tuple(v) for v in it.tolist()}
        got = [tuple(v) for v in out[j].tolist()]
        assert set(got) <= rows and len(set(got)) == 8


def test_unpack_bits_matches_numpy() -> None:
    """Packed uint8 records become bit planes of the asked shape."""
    x = np.random.default_rng(4).integers(0, 255, (6, 11), dtype=np.uint8)
    out = _run(
        [
            {
                "name": "unpack_bits",
                "params": {"field": "rec", "shape": [9, 9], "to": "planes", "dtype": "float32"},
            }
        ],
        {"rec": Field("uint8", (11,))},
        {"rec": x},
        6,
    )
    want = np.unpackbits(x, axis=1)[:, :81].reshape(6, 9, 9).astype(np.float32)
    assert (out["planes"] == want).all() and (out["rec"] == x).all()


def test_decode_image_matches_pillow() -> None:
    """PNG decodes losslessly; JPEG decodes to what Pillow gives."""
    rng = np.random.default_rng(5)
    a = rng.integers(0, 255, (9, 7, 3), dtype=np.uint8)
    blobs = []
    for fmt in ("PNG", "JPEG"):
        buf = io.BytesIO()
        Image.fromarray(a).save(buf, format=fmt)
        blobs.append(np.frombuffer(buf.getvalue(), np.uint8))
    offs = np.array([0, blobs[0].size, blobs[0].size + blobs[1].size], np.int64)
    out = _run(
        [{"name": "decode_image"}],
        {"image": Field("uint8", (-1,), binary=True)},
        {"image": np.concatenate(blobs), "image.offsets": offs},
        2,
    )
    shapes = out["image.shapes"]
    assert shapes.tolist() == [[9, 7, 3], [9, 7, 3]]
    png, jpg = out["image"][: a.size].reshape(a.shape), out["image"][a.size :].reshape(a.shape)
    assert (png == a).all()
    assert (jpg == np.asarray(Image.open(io.BytesIO(blobs[1].tobytes())).convert("RGB"))).all()


def test_chain_errors_name_what_to_change() -> None:
    """A chain that does not fit says which step and which fields exist."""
    inputs = {"image": Field("uint8", (3, 32, 32))}
    with pytest.raises(BadRequest, match=r"transforms\[0\] 'random_crop' does not fit .*larger"):
        compile_chain(
            [{"name": "random_crop", "params": {"size": 64, "layout": "CHW"}}], REG, inputs, "d"
        )
    with pytest.raises(BadRequest, match=r"no field 'img'.*'image': 'uint8\[3, 32, 32\]'"):
        compile_chain([{"name": "hflip", "params": {"field": "img"}}], REG, inputs, "d")


def test_generators_are_pure_functions_of_their_keys() -> None:
    """Same key, same numbers, in another process too; any key part changed, other numbers."""
    a = sample_rng(1, 2, 3, 0).integers(0, 1 << 62, 4).tolist()
    assert a == sample_rng(1, 2, 3, 0).integers(0, 1 << 62, 4).tolist()
    others = [
        sample_rng(1, 2, 4, 0),
        sample_rng(1, 3, 3, 0),
        sample_rng(2, 2, 3, 0),
        sample_rng(1, 2, 3, 1),
        batch_rng(1, 2, 0, 3, 0),
    ]
    assert all(g.integers(0, 1 << 62, 4).tolist() != a for g in others)
    code = (
        "from shardserve.server.transforms.rng import sample_rng;"
        "print(sample_rng(1, 2, 3, 0).integers(0, 1 << 62, 4).tolist())"
    )
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert other.stdout.strip() == str(a)
    picks = {replacement(0, 0, 5, k, 10) for k in range(1, 30)}
    assert 5 not in picks and picks <= set(range(10)) and len(picks) > 3


def test_batch_generators_are_the_sample_generators() -> None:
    """sample_rngs (numpy's SeedSequence hashing done over a batch) gives each sample the very
    generator sample_rng makes: seeds of 1 and 2 words, indices on both sides of 2**32,
    large epochs and steps, and batches below and above the vectorised size."""
    rng = np.random.default_rng(5)
    for trial in range(60):
        seed = int(rng.integers(0, 1 << 63)) if trial % 3 else int(rng.integers(0, 3))
        epoch = int(rng.integers(0, 1 << (trial % 40 + 1)))
        step = int(rng.integers(0, 5)) if trial % 5 else int(rng.integers(0, 1 << 40))
        n = 8 if trial % 2 else VECTOR_MIN + 9
        idx = np.concatenate(
            [rng.integers(0, 1 << 62, n // 2), rng.integers(0, 1 << 32, n - n // 2)]
        )
        idx[:3] = [0, (1 << 32) - 1, 1 << 32]
        got = [g.integers(0, 1 << 62, 3).tolist() for g in sample_rngs(seed, epoch, idx, step)]
        want = [
            sample_rng(seed, epoch, i, step).integers(0, 1 << 62, 3).tolist() for i in idx.tolist()
        ]
        assert got == want, (seed, epoch, step)
    # A transform spawning child generators gets the same children either way.
    ids = np.arange(VECTOR_MIN + 1) << 27
    (batch, one) = sample_rngs(3, 4, ids, 1)[-1], sample_rng(3, 4, int(ids[-1]), 1)
    assert [g.integers(1 << 40) for g in batch.spawn(3)] == [
        g.integers(1 << 40) for g in one.spawn(3)
    ]


def test_two_transforms_with_one_name_refuse_to_load() -> None:
    """A name defined twice stops loading, naming both modules."""
    import shardserve.server.transforms.builtins as b

    reg = TransformRegistry.load()
    clash = b.hflip.__class__(**{**b.hflip.__dict__, "module": "elsewhere"})
    with pytest.raises(ValueError, match=r"two transforms are named 'hflip'.*elsewhere"):
        reg.add(clash)


def test_pillow_resize_method_is_pillows_own() -> None:
    """method="pillow" gives exactly Pillow's antialiased bilinear box resize."""
    x = np.random.default_rng(6).integers(0, 255, (40, 50, 3), dtype=np.uint8)
    r = _ragged([x])
    out = _run(
        [{"name": "resize", "params": {"size": [16, 12], "method": "pillow"}}],
        {"image": Field("uint8", (-1, -1, 3))},
        {"image": r["values"], "image.offsets": r["offsets"], "image.shapes": r["shapes"]},
        1,
    )["image"]
    want = np.asarray(Image.fromarray(x).resize((12, 16), Image.BILINEAR))
    assert (out[0] == want).all()
    with pytest.raises(BadRequest, match="uint8 HWC"):
        compile_chain(
            [{"name": "resize", "params": {"size": 8, "method": "pillow", "layout": "CHW"}}],
            REG,
            {"image": Field("uint8", (3, 32, 32))},
            "d",
        )


def _jpegs(sizes: list[tuple[int, int]], seed: int) -> dict:
    """JPEGs of ``(h, w)`` each: smooth content with some noise, as photos have."""
    rng = np.random.default_rng(seed)
    blobs = []
    for h, w in sizes:
        base = Image.fromarray(rng.integers(0, 255, (6, 6, 3), dtype=np.uint8))
        x = np.asarray(base.resize((w, h), Image.BILINEAR)).astype(np.int16)
        x = (x + rng.integers(-20, 21, x.shape)).clip(0, 255).astype(np.uint8)
        buf = io.BytesIO()
        Image.fromarray(x).save(buf, format="JPEG", quality=90)
        blobs.append(np.frombuffer(buf.getvalue(), np.uint8))
    offs = np.zeros(len(blobs) + 1, np.int64)
    np.cumsum([b.size for b in blobs], out=offs[1:])
    return {"image": np.concatenate(blobs), "image.offsets": offs}


def test_decode_random_resized_crop_is_the_two_steps_in_one() -> None:
    """Without ``draft`` the fused step gives exactly ``decode_image`` then
    ``random_resized_crop`` (``method="pillow"``) drawn from the same keys; with it,
    images several times the crop's size decode at a reduced scale: close to the full
    decode, not the same bytes, and images the crop needs whole are untouched."""
    from shardserve.server.transforms import builtins

    sizes = [(60, 90), (120, 100), (480, 640), (500, 375), (300, 420)]
    parts = _jpegs(sizes, 7)
    binary = {"image": Field("uint8", (-1,), binary=True)}
    decoded = _run([{"name": "decode_image"}], binary, parts, len(sizes))
    want = []
    crop = builtins.RandomResizedCrop(size=[48, 40], method="pillow")
    for i, (h, w) in enumerate(sizes):
        x = decoded["image"][decoded["image.offsets"][i] : decoded["image.offsets"][i + 1]]
        keys = SampleKeys(W.seed, W.epoch, 0, np.array([100 + i]))
        got = builtins.random_resized_crop.fn(
            {"image": [x.reshape(h, w, 3)]}, crop, None, keys=keys, out={}
        )
        want.append({"image": got["image"][0]})
    step = {"name": "decode_random_resized_crop", "params": {"size": [48, 40]}}
    exact = _run([{**step, "params": {**step["params"], "draft": False}}], binary, parts, 5)
    assert exact["image"].shape == (5, 48, 40, 3)
    for i in range(len(sizes)):
        assert (exact["image"][i] == want[i]["image"]).all(), sizes[i]
    drafted = _run([step], binary, parts, 5)["image"].astype(int)
    diff = np.abs(drafted - exact["image"].astype(int)).mean(axis=(1, 2, 3))
    assert (diff[:2] == 0).all(), diff  # small images: decoded whole either way
    assert (diff[2:] > 0).any() and (diff < 4).all(), diff
    with pytest.raises(BadRequest, match="not encoded bytes"):
        compile_chain([step], REG, {"image": Field("uint8", (-1, -1, 3))}, "d")
