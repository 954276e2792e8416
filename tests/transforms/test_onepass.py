"""The compiled one-pass kernel (crop window, flip, per-channel table) writes the bytes of the
numpy kernels on random batches of every layout, padding, fill and output dtype; it refuses
a geometry that would read or write out of bounds; and it declines what it does not handle,
so the numpy kernels run instead."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardserve.server.transforms import compiled, onepass
from shardserve.server.transforms.builtins_images import (
    Normalize,
    RandomCrop,
    crop_at,
    flip_batch,
    norm_table_of,
    normalize_batch,
)
from shardserve.server.transforms.kernels import normalize_into

pytestmark = pytest.mark.skipif(compiled.windows is None, reason="the C extension was not built")


@st.composite
def batches(draw: Any) -> dict[str, Any]:
    """A uint8 batch, its layout, a crop (maybe none), flips (maybe none) and a normalize
    (maybe none: the identity table) with its output layout and dtype."""
    layout = draw(st.sampled_from(["HW", "CHW", "HWC"]))
    n, c = draw(st.integers(0, 5)), draw(st.integers(1, 4))
    h_in, w_in = draw(st.integers(1, 9)), draw(st.integers(1, 9))
    shape = {"HW": (n, h_in, w_in), "CHW": (n, c, h_in, w_in), "HWC": (n, h_in, w_in, c)}
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 256, shape[layout], dtype=np.uint8)
    case: dict[str, Any] = {"x": x, "layout": "CHW" if layout == "CHW" else "HWC", "crop": None}
    if draw(st.booleans()):
        pad = draw(st.integers(0, 3))
        size = [draw(st.integers(1, h_in + 2 * pad)), draw(st.integers(1, w_in + 2 * pad))]
        case["crop"] = RandomCrop(
            field="x", size=size, padding=pad, fill=draw(st.integers(0, 255)), layout=case["layout"]
        )
        case["oy"] = rng.integers(0, h_in + 2 * pad - size[0] + 1, n)
        case["ox"] = rng.integers(0, w_in + 2 * pad - size[1] + 1, n)
    case["flip"] = rng.random(n) < 0.5 if draw(st.booleans()) else None
    case["norm"] = None
    if draw(st.booleans()):
        chans = 1 if layout == "HW" else c
        per = draw(st.sampled_from([0, 1, chans]))
        mean = rng.uniform(0, 1, per).tolist() if per else None
        std = rng.uniform(0.1, 2, per).tolist() if per else None
        case["norm"] = Normalize(
            field="x",
            layout=case["layout"],
            scale=draw(st.sampled_from([1.0, 1 / 255, 0.37])),
            mean=mean,
            std=std,
            dtype=draw(st.sampled_from(["float16", "float32", "float64"])),
            to_chw=layout == "HWC" and draw(st.booleans()),
        )
    return case


def numpy_kernels(case: dict[str, Any]) -> np.ndarray:
    """The same steps by the numpy kernels alone."""
    x, crop, flip, norm = case["x"], case["crop"], case["flip"], case["norm"]
    if crop is not None:
        x = crop_at(x, crop, case["oy"], case["ox"], flip)
    elif flip is not None:
        x = flip_batch(x, case["layout"], flip)
    if norm is None:
        return x
    chw = norm.to_chw or norm.layout == "CHW"
    if norm.to_chw:
        x = np.transpose(x, (0, 3, 1, 2))
    y = np.empty(x.shape, np.dtype(norm.dtype))
    return normalize_into(x, y, chw, norm.scale, norm.mean, norm.std)


def one_pass(case: dict[str, Any], shape: tuple[int, ...]) -> np.ndarray:
    x, crop, norm = case["x"], case["crop"], case["norm"]
    chw_in = case["layout"] == "CHW"
    chw_out = chw_in or (norm is not None and norm.to_chw)
    chans = onepass.channels(x, chw_in)
    table = norm_table_of(norm, chans) if norm is not None else onepass.identity(chans)
    y = np.full(shape, 99, table.dtype)  # every element must be written over
    window: dict[str, Any] = {}
    if crop is not None:
        window = {"oy": case["oy"], "ox": case["ox"], "pad": crop.padding, "fill": int(crop.fill)}
    done = onepass.gather(x, y, table, chw_in=chw_in, chw_out=chw_out, flip=case["flip"], **window)
    assert done
    return y


@settings(max_examples=400, deadline=None)
@given(batches())
def test_one_pass_writes_the_bytes_of_the_numpy_kernels(case: dict[str, Any]) -> None:
    want = numpy_kernels(case)
    got = one_pass(case, want.shape)
    assert got.dtype == want.dtype
    assert got.tobytes() == want.tobytes()


def _call(
    oy: int, pad: int = 0, dst_bytes: int = 4 * 2 * 2, table_rows: int = 1, sw: int = 1
) -> None:
    x = np.zeros((1, 2, 2), np.uint8)
    geometry = (1, 1, 2, 2, 4, 2, sw, 2, 2, 4, 2, 1, pad, 0, 4)
    compiled.windows.gather(  # type: ignore[union-attr]
        x,
        bytearray(dst_bytes),
        np.array([oy], np.int64),
        np.array([0], np.int64),
        b"",
        np.zeros((table_rows, 256), np.float32),
        geometry,
    )


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        ({"oy": 1}, "offset is outside the padded image"),
        ({"oy": -1}, "offset is outside the padded image"),
        ({"oy": 0, "dst_bytes": 15}, "output is smaller"),
        ({"oy": 0, "table_rows": 0}, "fewer than 256 entries"),
        ({"oy": 0, "pad": -1}, "padding is negative"),
        ({"oy": 0, "sw": -1}, "input strides leave the sample"),
        ({"oy": 0, "sw": 2}, "input strides leave the sample"),
    ],
)
def test_a_geometry_out_of_bounds_is_refused(kwargs: dict[str, int], says: str) -> None:
    with pytest.raises(ValueError, match=says):
        _call(**kwargs)


def test_images_of_many_channels_run_on_numpy_with_the_same_bytes() -> None:
    """Past MAX_CHANNELS no table is made, and normalize gives the numpy kernels' bytes."""
    c = onepass.MAX_CHANNELS + 1
    x = np.random.default_rng(0).integers(0, 256, (2, c, 3, 3), dtype=np.uint8)
    assert onepass.table_channels(x, True) is None
    assert onepass.table_channels(x[:, : c - 1], True) == c - 1
    norm = Normalize(field="x", layout="CHW", scale=1 / 255, mean=[0.5], std=[0.25])
    case = {"x": x, "layout": "CHW", "crop": None, "flip": None, "norm": norm}
    y = np.empty(x.shape, np.float32)
    assert normalize_batch(x, norm, y).tobytes() == numpy_kernels(case).tobytes()


def test_the_kernel_declines_what_it_does_not_handle() -> None:
    x = np.zeros((2, 3, 4, 4), np.uint8)
    table = onepass.identity(3)
    y = np.zeros((2, 3, 4, 4), np.uint8)
    assert onepass.gather(x, y, table, chw_in=True, chw_out=True)
    assert not onepass.gather(x.astype(np.uint16), y, table, chw_in=True, chw_out=True)
    strided = np.zeros((2, 3, 4, 8), np.uint8)[..., ::2]
    assert not onepass.gather(x, strided, table, chw_in=True, chw_out=True)
    assert not onepass.gather(x, y.astype(np.float32), table, chw_in=True, chw_out=True)
    assert not onepass.gather(x, y, onepass.identity(1), chw_in=True, chw_out=True)
