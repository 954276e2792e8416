"""Built-in transforms, numpy only: enough for a CIFAR recipe (random crop with padding,
horizontal flip, normalize) and an ImageNet-style one (with :mod:`.images`' decode: random
resized crop, resize, normalize; or decode and random resized crop in one step, decoding
only at the scale the crop needs), plus query sampling and bit-unpacking. Pillow, where a
transform uses it, comes from the ``images`` extra.

Images are ``HWC`` (what decoders give) unless ``layout="CHW"``; 2-d arrays are ``HW``.
Crop, flip and normalize are batch transforms in :mod:`.builtins_images` (registered through
this module); resize and random resized crop run per sample (images of different sizes).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Annotated, Literal

import numpy as np
from pydantic import Field, model_validator

from .builtins_images import ImageParams, Size, image_field, size2, spatial, with_hw
from .builtins_images import hflip as hflip
from .builtins_images import normalize as normalize
from .builtins_images import random_crop as random_crop
from .images import Mode, check_encoded, open_image, pil
from .params import FieldParams, Name
from .registry import Columns, batch_transform, sample_transform
from .runner import Limits
from .schema import Field as F
from .schema import Schema


# -- resize and random resized crop (per sample) -----------------------------------------------
def _bilinear(img: np.ndarray, y0: float, x0: float, h: float, w: float, oh: int, ow: int,
              ah: int, aw: int) -> np.ndarray:  # fmt: skip
    """The box (y0, x0, h, w) of ``img`` resampled to ``oh`` x ``ow`` (half-pixel centres)."""
    H, W = img.shape[ah], img.shape[aw]
    ys = np.clip(y0 + (np.arange(oh) + 0.5) * (h / oh) - 0.5, 0, H - 1)
    xs = np.clip(x0 + (np.arange(ow) + 0.5) * (w / ow) - 0.5, 0, W - 1)
    yi, xi = np.floor(ys).astype(np.intp), np.floor(xs).astype(np.intp)
    yj, xj = np.minimum(yi + 1, H - 1), np.minimum(xi + 1, W - 1)
    wy, wx = (ys - yi).astype(np.float32), (xs - xi).astype(np.float32)
    a = np.moveaxis(img, (ah, aw), (0, 1))
    extra = (1,) * (a.ndim - 2)
    wy, wx = wy.reshape(-1, 1, *extra), wx.reshape(1, -1, *extra)
    # Gather the few source pixels first, convert only those (not the whole image).
    top_rows, bot_rows = a[yi], a[yj]
    f32 = np.float32
    top = top_rows[:, xi].astype(f32) * (1 - wx) + top_rows[:, xj].astype(f32) * wx
    bot = bot_rows[:, xi].astype(f32) * (1 - wx) + bot_rows[:, xj].astype(f32) * wx
    out = top * (1 - wy) + bot * wy
    if np.issubdtype(img.dtype, np.integer):
        info = np.iinfo(img.dtype)
        out = np.clip(np.rint(out), info.min, info.max)
    return np.ascontiguousarray(np.moveaxis(out.astype(img.dtype), (0, 1), (ah, aw)))


def _resample(x: np.ndarray, box: tuple[float, float, float, float], size: tuple[int, int],
              ah: int, aw: int, method: str) -> np.ndarray:  # fmt: skip
    """Box ``(y0, x0, h, w)`` of ``x`` resized to ``size`` (bilinear) by ``method``."""
    y0, x0, h, w = box
    if method == "numpy":
        return _bilinear(x, y0, x0, h, w, size[0], size[1], ah, aw)
    image = pil()  # Pillow's C resampler: several times faster, releases the GIL
    im = image.fromarray(x)
    out = im.resize((size[1], size[0]), image.BILINEAR, box=(x0, y0, x0 + w, y0 + h))
    return np.asarray(out)


class Resize(ImageParams):
    size: Size
    #: ``numpy`` (the default: bilinear without antialiasing, like torch's ``interpolate``;
    #: same bytes wherever numpy runs) or ``pillow`` (Pillow's antialiased bilinear, faster;
    #: uint8 HWC/HW only, needs the ``images`` extra; bytes may differ between Pillow versions).
    method: Literal["numpy", "pillow"] = "numpy"


def _resize_outputs(p: Resize, inputs: Schema) -> dict[str, F]:
    """{field: same dtype, [H, W] = size}"""
    f = image_field(inputs, p, fixed=False)
    if p.method == "pillow":
        if (
            f.dtype != "uint8"
            or p.layout != "HWC"
            or (len(f.shape) == 3 and f.shape[2] not in (-1, 3, 4))
        ):
            raise ValueError(
                f"method 'pillow' resizes uint8 HWC images; {p.field!r} is {f.describe()}"
            )
        pil()
    return {p.field: with_hw(f, p.layout, *size2(p.size))}


@sample_transform(params=Resize, outputs=_resize_outputs)
def resize(sample: Columns, p: Resize, rng: np.random.Generator) -> Columns:
    """Bilinear resize to ``size``."""
    x = sample[p.field]
    ah, aw = spatial(F(str(x.dtype), x.shape), p.layout)
    box = (0.0, 0.0, float(x.shape[ah]), float(x.shape[aw]))
    return {p.field: _resample(x, box, size2(p.size), ah, aw, p.method)}


Pair = Annotated[list[Annotated[float, Field(gt=0, le=100)]], Field(min_length=2, max_length=2)]


class RandomResizedCrop(Resize):
    #: Range of the crop's share of the image's area, each in (0, 1], low <= high.
    scale: Pair = Field(default=[0.08, 1.0])
    #: Range of the crop's aspect ratio (width / height), each in (0, 100], low <= high.
    ratio: Pair = Field(default=[3 / 4, 4 / 3])

    @model_validator(mode="after")
    def _ranges(self) -> RandomResizedCrop:
        for name, (lo, hi) in (("scale", self.scale), ("ratio", self.ratio)):
            if lo > hi:
                raise ValueError(f"{name} [{lo}, {hi}]: the low end is above the high end")
        if self.scale[1] > 1:
            raise ValueError(f"scale {self.scale}: a share of the area is at most 1")
        return self


@sample_transform(params=RandomResizedCrop, outputs=_resize_outputs)
def random_resized_crop(sample: Columns, p: RandomResizedCrop,
                        rng: np.random.Generator) -> Columns:  # fmt: skip
    """A random box of ``scale`` of the area and ``ratio`` aspect, resized to ``size``
    (torchvision RandomResizedCrop: 10 tries, then the centre crop)."""
    x = sample[p.field]
    ah, aw = spatial(F(str(x.dtype), x.shape), p.layout)
    box = _crop_box(x.shape[ah], x.shape[aw], p, rng)
    return {p.field: _resample(x, box, size2(p.size), ah, aw, p.method)}


def _crop_box(H: int, W: int, p: RandomResizedCrop,
              rng: np.random.Generator) -> tuple[int, int, int, int]:  # fmt: skip
    """``(y0, x0, h, w)`` of a random resized crop of an ``H`` x ``W`` image."""
    area = H * W
    log_r = (math.log(p.ratio[0]), math.log(p.ratio[1]))
    for _ in range(10):
        target = area * rng.uniform(p.scale[0], p.scale[1])
        aspect = math.exp(rng.uniform(*log_r))
        w = round(math.sqrt(target * aspect))
        h = round(math.sqrt(target / aspect))
        if 0 < w <= W and 0 < h <= H:
            y0 = int(rng.integers(0, H - h + 1))
            x0 = int(rng.integers(0, W - w + 1))
            break
    else:
        r = W / H
        if r < p.ratio[0]:
            w, h = W, round(W / p.ratio[0])
        elif r > p.ratio[1]:
            h, w = H, round(H * p.ratio[1])
        else:
            h, w = H, W
        y0, x0 = (H - h) // 2, (W - w) // 2
    return y0, x0, h, w


class DecodeRandomResizedCrop(RandomResizedCrop):
    """``decode_image`` then ``random_resized_crop`` with ``method="pillow"``, in one step."""

    layout: Literal["HWC"] = "HWC"
    method: Literal["pillow"] = "pillow"
    mode: Mode = "RGB"
    #: Let the JPEG decoder scale the image down by 2, 4 or 8 (its DCT scaling: Pillow's
    #: ``draft``) as far as the crop keeps at least ``size`` pixels: less to decode and to
    #: resample, as FFCV and DALI decode. ``false``: decode at full size, the same bytes as
    #: the two steps.
    draft: bool = True


def _decode_crop_outputs(p: DecodeRandomResizedCrop, inputs: Schema) -> dict[str, F]:
    """{field: uint8 [H, W, 3] (RGB) or [H, W] (L), [H, W] = size}"""
    check_encoded(inputs, p.field)
    h, w = size2(p.size)
    return {p.field: F("uint8", (h, w, 3) if p.mode == "RGB" else (h, w))}


# Worker processes by default (``--transform-pool auto``): per image, Pillow's calls are
# short and the Python around them holds the GIL, so two threads took turns (10,000 small
# JPEGs: 4,900 images/s on 2 threads, 8,700 on 2 worker processes, which get only the bytes
# from a shared file and write the crops into the stream's slot).
@sample_transform(params=DecodeRandomResizedCrop, outputs=_decode_crop_outputs,
                  takes_limits=True, pool="process")  # fmt: skip
def decode_random_resized_crop(sample: Columns, p: DecodeRandomResizedCrop,
                               rng: np.random.Generator, limits: Limits) -> Columns:  # fmt: skip
    """Encoded bytes to a random resized crop: the box is drawn from the header's size
    (the same draws as ``random_resized_crop``), then only what it needs is decoded."""
    oh, ow = size2(p.size)
    with open_image(sample[p.field], limits) as im:
        W, H = im.size
        y0, x0, h, w = _crop_box(H, W, p, rng)
        if p.draft:
            # The smallest scale at which the box still has the output's pixels; the decoder
            # picks 1/1, 1/2, 1/4 or 1/8, at least the size asked (JPEG only; else a no-op).
            s = max(ow / w, oh / h)
            if s < 1:
                im.draft(p.mode, (math.ceil(W * s), math.ceil(H * s)))
        sx, sy = im.size[0] / W, im.size[1] / H
        box = (x0 * sx, y0 * sy, (x0 + w) * sx, (y0 + h) * sy)
        # convert() to the mode the image already has would copy every decoded pixel.
        decoded = im if im.mode == p.mode else im.convert(p.mode)
        out = decoded.resize((ow, oh), pil().BILINEAR, box=box)
    return {p.field: np.asarray(out)}


# -- random subset of rows (query sampling) ---------------------------------------------------
class RandomSubset(FieldParams):
    n: int = Field(ge=1, le=1 << 24)
    #: Draw with replacement (a sample with fewer than ``n`` rows then still works).
    replace: bool = False


def _subset_outputs(p: RandomSubset, inputs: Schema) -> dict[str, F]:
    """{field: same dtype, [n, rest...]}"""
    if p.field not in inputs:
        raise ValueError(f"no field {p.field!r}")
    f = inputs[p.field]
    if f.binary or not f.shape or -1 in f.shape[1:]:
        raise ValueError(
            f"field {p.field!r} is {f.describe()}; rows need shape [-1 or N, fixed...]"
        )
    return {p.field: F(f.dtype, (p.n, *f.shape[1:]))}


@sample_transform(params=RandomSubset, outputs=_subset_outputs)
def random_subset(sample: Columns, p: RandomSubset, rng: np.random.Generator) -> Columns:
    """``n`` random rows of a field with a variable first dimension (query points of a latent)."""
    x = sample[p.field]
    if not p.replace and x.shape[0] < p.n:
        raise ValueError(f"field {p.field!r} has {x.shape[0]} rows, fewer than n={p.n}; "
                         "pass replace=true to draw with replacement")  # fmt: skip
    if p.replace:
        rows = rng.choice(x.shape[0], size=p.n, replace=True)
    else:
        # The same rows as a shuffled draw, sorted (the shuffle only orders them).
        rows = rng.choice(x.shape[0], size=p.n, replace=False, shuffle=False)
        rows.sort()
    return {p.field: np.take(x, rows, axis=0)}  # 2-3x faster than x[rows] on rows of floats


# -- bit unpacking ----------------------------------------------------------------------------
class UnpackBits(FieldParams):
    #: Per-sample shape of the planes, e.g. ``[104, 9, 9]``; its product bits are read.
    shape: list[Annotated[int, Field(ge=1, le=1 << 31)]] = Field(min_length=1, max_length=8)
    dtype: Literal["uint8", "bool", "float32", "float16"] = "uint8"
    bitorder: Literal["big", "little"] = "big"
    #: Write the planes to this field (default: replace ``field``).
    to: Name | None = None


def _unpack_outputs(p: UnpackBits, inputs: Schema) -> dict[str, F]:
    """{to or field: dtype, shape}"""
    if p.field not in inputs:
        raise ValueError(f"no field {p.field!r}")
    f = inputs[p.field]
    if f.dtype != "uint8" or not f.fixed:
        raise ValueError(f"field {p.field!r} is {f.describe()}; packed records are fixed uint8")
    bits = math.prod(f.shape) * 8
    need = math.prod(p.shape)
    if need > bits or min(p.shape) < 1:
        raise ValueError(f"shape {p.shape} needs {need} bits; a record holds {bits}")
    return {p.to or p.field: F(p.dtype, tuple(p.shape))}


@batch_transform(params=UnpackBits, outputs=_unpack_outputs, takes_out=True)
def unpack_bits(batch: Columns, p: UnpackBits, rng: np.random.Generator,
                out: Mapping[str, np.ndarray]) -> Columns:  # fmt: skip
    """Packed bit records (uint8) into planes of ``shape`` (``numpy.unpackbits``)."""
    x = batch[p.field]
    b = x.shape[0]
    need = math.prod(p.shape)
    name = p.to or p.field
    bits = np.unpackbits(x.reshape(b, -1), axis=1, count=need, bitorder=p.bitorder)
    planes = bits.reshape(b, *p.shape)
    dest = out.get(name)
    if dest is None:
        return {name: planes.astype(p.dtype, copy=False)}
    np.copyto(dest, planes, casting="unsafe")  # the cast writes where the batch is sent from
    return {name: dest}
