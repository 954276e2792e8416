"""Built-in transforms, numpy only: enough for a CIFAR recipe (random crop with padding,
horizontal flip, normalize) and an ImageNet-style one (with :mod:`.images`' decode: random
resized crop, resize, normalize; or decode and random resized crop in one step, decoding
only at the scale the crop needs), plus query sampling and bit-unpacking. Pillow, where a
transform uses it, comes from the ``images`` extra.

Images are ``HWC`` (what decoders give) unless ``layout="CHW"``; 2-d arrays are ``HW``.
Every one is a batch kernel; crop, flip and normalize live in :mod:`.builtins_images`
(registered through this module). Their random parameters come from :mod:`.draws`, drawn per
sample from the batch's :class:`~.keys.SampleKeys`; resize and random resized crop still
resample each image on its own (images of different sizes).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import Field, model_validator

from .builtins_images import ImageParams, Size, image_field, size2, spatial, with_hw
from .builtins_images import hflip as hflip
from .builtins_images import normalize as normalize
from .builtins_images import random_crop as random_crop
from .draws import resized_crop_boxes
from .images import Mode, check_encoded, open_image, pil
from .keys import SampleKeys
from .params import FieldParams, Name
from .persample import each_sample
from .registry import Columns, batch_transform
from .runner import Limits
from .schema import Field as F
from .schema import Schema


# -- resize and random resized crop (per sample) -----------------------------------------------
def _bilinear(
    img: np.ndarray, y0: float, x0: float, h: float, w: float, oh: int, ow: int, ah: int, aw: int
) -> np.ndarray:
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


def _resample(
    x: np.ndarray,
    box: tuple[float, float, float, float],
    size: tuple[int, int],
    ah: int,
    aw: int,
    method: str,
) -> np.ndarray:
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


def _resample_each(
    batch: Columns,
    p: Resize,
    boxes: np.ndarray | None,
    ids: np.ndarray,
    out: Mapping[str, np.ndarray],
    name: str,
) -> Columns:
    """Each sample's box (``None``: the whole image) resized to ``size``, stacked into the
    batch's memory when given."""
    xs = batch[p.field]
    size = size2(p.size)

    def one(i: int) -> np.ndarray:
        x = xs[i]
        ah, aw = spatial(F(str(x.dtype), x.shape), p.layout)
        box = (0.0, 0.0, float(x.shape[ah]), float(x.shape[aw])) if boxes is None else boxes[i]
        return _resample(x, tuple(box), size, ah, aw, p.method)

    return {p.field: _stacked(each_sample(name, ids, one), out.get(p.field))}


def _stacked(items: list[np.ndarray], dest: np.ndarray | None) -> np.ndarray:
    if dest is not None and items:
        return np.stack(items, out=dest)
    return np.stack(items) if items else np.empty((0,), np.uint8)


@batch_transform(params=Resize, outputs=_resize_outputs, takes_keys=True, takes_out=True)
def resize(
    batch: Columns,
    p: Resize,
    rng: np.random.Generator | None,
    keys: SampleKeys,
    out: Mapping[str, np.ndarray],
) -> Columns:
    """Bilinear resize to ``size``."""
    return _resample_each(batch, p, None, keys.ids, out, "resize")


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


@batch_transform(params=RandomResizedCrop, outputs=_resize_outputs, takes_keys=True, takes_out=True)
def random_resized_crop(
    batch: Columns,
    p: RandomResizedCrop,
    rng: np.random.Generator | None,
    keys: SampleKeys,
    out: Mapping[str, np.ndarray],
) -> Columns:
    """A random box of ``scale`` of the area and ``ratio`` aspect, resized to ``size``
    (torchvision RandomResizedCrop: 10 tries, then the centre crop); the boxes of the whole
    batch are drawn at once (:func:`~.draws.resized_crop_boxes`)."""
    xs = batch[p.field]
    hw = [x.shape[a] for x in xs for a in spatial(F(str(x.dtype), x.shape), p.layout)]
    sides = np.array(hw, np.int64).reshape(-1, 2)
    boxes = resized_crop_boxes(keys, sides[:, 0], sides[:, 1], p.scale, p.ratio)
    return _resample_each(batch, p, boxes, keys.ids, out, "random_resized_crop")


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
@batch_transform(
    params=DecodeRandomResizedCrop,
    outputs=_decode_crop_outputs,
    takes_limits=True,
    takes_keys=True,
    takes_out=True,
    pool="process",
)
def decode_random_resized_crop(
    batch: Columns,
    p: DecodeRandomResizedCrop,
    rng: np.random.Generator | None,
    limits: Limits,
    keys: SampleKeys,
    out: Mapping[str, np.ndarray],
) -> Columns:
    """Encoded bytes to a random resized crop: the boxes are drawn from the headers' sizes
    (the same draws as ``random_resized_crop``), then only what each needs is decoded."""
    data, name = batch[p.field], "decode_random_resized_crop"
    with contextlib.ExitStack() as opened:
        ims = each_sample(
            name, keys.ids, lambda i: opened.enter_context(open_image(data[i], limits))
        )
        wh = np.array([im.size for im in ims], np.int64).reshape(-1, 2)
        boxes = resized_crop_boxes(keys, wh[:, 1], wh[:, 0], p.scale, p.ratio)
        crops = each_sample(name, keys.ids, lambda i: _decode_crop(ims[i], boxes[i], p))
    return {p.field: _stacked(crops, out.get(p.field))}


def _decode_crop(im: Any, box: np.ndarray, p: DecodeRandomResizedCrop) -> np.ndarray:
    """Box ``(y0, x0, h, w)`` of an opened image, decoded at the smallest scale it needs."""
    oh, ow = size2(p.size)
    W, H = im.size
    y0, x0, h, w = (float(v) for v in box)
    if p.draft:
        # The smallest scale at which the box still has the output's pixels; the decoder
        # picks 1/1, 1/2, 1/4 or 1/8, at least the size asked (JPEG only; else a no-op).
        s = max(ow / w, oh / h)
        if s < 1:
            im.draft(p.mode, (math.ceil(W * s), math.ceil(H * s)))
    sx, sy = im.size[0] / W, im.size[1] / H
    scaled = (x0 * sx, y0 * sy, (x0 + w) * sx, (y0 + h) * sy)
    # convert() to the mode the image already has would copy every decoded pixel.
    decoded = im if im.mode == p.mode else im.convert(p.mode)
    return np.asarray(decoded.resize((ow, oh), pil().BILINEAR, box=scaled))


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
def unpack_bits(
    batch: Columns, p: UnpackBits, rng: np.random.Generator, out: Mapping[str, np.ndarray]
) -> Columns:
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
