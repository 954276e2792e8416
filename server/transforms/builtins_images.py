"""The image built-ins that work on whole batches of fixed-size images: random crop with
padding, horizontal flip, normalize (a CIFAR recipe), and the parameters and field checks
every image built-in shares.

Images are ``HWC`` (what decoders give) unless ``layout="CHW"``; 2-d arrays are ``HW``. Each
random transform draws its parameters per sample from its keys through :mod:`.draws`
(:func:`~.draws.crop_offsets`, :func:`~.draws.flips`) and runs the array kernels of
:mod:`.kernels` on them; a chain of these steps runs fused (:mod:`.fused`) with the same
draws and the same kernels.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Annotated, Literal

import numpy as np
from pydantic import Field

from .draws import crop_offsets, flips
from .kernels import crop_flip, norm_table, normalize_into, pad_batch
from .keys import SampleKeys
from .onepass import gather, table_channels
from .params import FieldParams
from .registry import Columns, batch_transform
from .schema import Field as F
from .schema import Schema

Layout = Literal["HWC", "CHW"]
#: The largest height or width a transform may be asked to make (or pad to).
MAX_SIDE = 1 << 16
#: Bounds of every parameter: nonsense is refused at job creation naming the parameter.
Side = Annotated[int, Field(ge=1, le=MAX_SIDE)]
Size = Annotated[
    Side | Annotated[list[Side], Field(min_length=2, max_length=2)],
    Field(description="output N or [H, W], each 1 to 65536"),
]
Finite = Annotated[float, Field(ge=-1e12, le=1e12)]


class ImageParams(FieldParams):
    layout: Layout = "HWC"


def size2(v: int | list[int]) -> tuple[int, int]:
    if isinstance(v, int):
        return (v, v)
    if len(v) != 2:
        raise ValueError(f"size must be N or [H, W], got {v}")
    return (int(v[0]), int(v[1]))


def fill_fits(fill: float, dtype: str) -> None:
    """A fill value must be one the field's dtype holds exactly (300 in uint8 would wrap)."""
    dt = np.dtype(dtype)
    if np.issubdtype(dt, np.integer):
        info = np.iinfo(dt)
        if fill != int(fill) or not info.min <= fill <= info.max:
            raise ValueError(f"fill {fill} is not a {dtype} value ({info.min} to {info.max})")
    elif dt == np.bool_ and fill not in (0, 1):
        raise ValueError(f"fill {fill} is not a bool value (0 or 1)")


def image_field(inputs: Schema, p: ImageParams, fixed: bool) -> F:
    if p.field not in inputs:
        raise ValueError(f"no field {p.field!r}")
    f = inputs[p.field]
    if f.binary or len(f.shape) not in (2, 3):
        raise ValueError(f"field {p.field!r} is {f.describe()}, not an image (HW, HWC or CHW)")
    if fixed and not f.fixed:
        raise ValueError(
            f"field {p.field!r} is {f.describe()}: resize or crop it to a fixed size first"
        )
    return f


def spatial(f: F, layout: Layout) -> tuple[int, int]:
    """Axes of height and width in one sample."""
    return (1, 2) if len(f.shape) == 3 and layout == "CHW" else (0, 1)


def with_hw(f: F, layout: Layout, h: int, w: int, dtype: str | None = None) -> F:
    shape = list(f.shape)
    ah, aw = spatial(f, layout)
    shape[ah], shape[aw] = h, w
    return F(dtype or f.dtype, tuple(shape))


# -- random crop ------------------------------------------------------------------------------
class RandomCrop(ImageParams):
    size: Size
    padding: int = Field(default=0, ge=0, le=1024)
    fill: Finite = 0


def _crop_outputs(p: RandomCrop, inputs: Schema) -> dict[str, F]:
    """{field: same dtype, [size, size] in place of H, W}"""
    f = image_field(inputs, p, fixed=True)
    h, w = size2(p.size)
    ah, aw = spatial(f, p.layout)
    if h > f.shape[ah] + 2 * p.padding or w > f.shape[aw] + 2 * p.padding:
        raise ValueError(f"size {[h, w]} is larger than {f.describe()} padded by {p.padding}")
    fill_fits(p.fill, f.dtype)
    return {p.field: with_hw(f, p.layout, h, w)}


def _crop_peak(p: RandomCrop, inputs: Schema) -> int:
    """The padded copy of each sample that the crop is cut from."""
    f = inputs[p.field]
    if not p.padding:
        return 0
    ah, aw = spatial(f, p.layout)
    shape = list(f.shape)
    shape[ah] += 2 * p.padding
    shape[aw] += 2 * p.padding
    return math.prod(shape) * np.dtype(f.dtype).itemsize


def crop_axes(x: np.ndarray, layout: Layout) -> tuple[int, int]:
    """Batch axes of height and width of a batch ``x`` ``[B, ...]`` of images."""
    ah, aw = spatial(F(str(x.dtype), x.shape[1:]), layout)
    return ah + 1, aw + 1


def crop_batch(
    x: np.ndarray,
    p: RandomCrop,
    keys: SampleKeys,
    flip: np.ndarray | None = None,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """The crops of ``x`` (then mirrored where ``flip``), offsets drawn from ``keys``
    (:func:`~.draws.crop_offsets`); in ``out`` if given."""
    oy, ox = crop_offsets(keys, *crop_room(x, p))
    return crop_at(x, p, oy, ox, flip, out)


def crop_room(x: np.ndarray, p: RandomCrop) -> tuple[int, int]:
    """How far a crop's corner may move down and right in the padded batch ``x``."""
    ah, aw = crop_axes(x, p.layout)
    h, w = size2(p.size)
    return x.shape[ah] + 2 * p.padding - h, x.shape[aw] + 2 * p.padding - w


def crop_at(
    x: np.ndarray,
    p: RandomCrop,
    oy: np.ndarray,
    ox: np.ndarray,
    flip: np.ndarray | None = None,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """The crops of ``x`` at corners ``(oy, ox)`` of its padded samples (then mirrored where
    ``flip``); in ``out`` if given."""
    ah, aw = crop_axes(x, p.layout)
    if p.padding:
        x = pad_batch(x, ah, aw, p.padding, p.fill)
    return crop_flip(x, ah, aw, size2(p.size), oy, ox, flip, out)


@batch_transform(params=RandomCrop, outputs=_crop_outputs, peak=_crop_peak, takes_keys=True)
def random_crop(
    batch: Columns, p: RandomCrop, rng: np.random.Generator | None, keys: SampleKeys
) -> Columns:
    """Pad by ``padding`` then crop ``size`` at a random place per sample (torchvision RandomCrop)."""
    return {p.field: crop_batch(batch[p.field], p, keys)}


# -- horizontal flip --------------------------------------------------------------------------
class HFlip(ImageParams):
    p: float = Field(default=0.5, ge=0, le=1, description="probability of a flip, 0 to 1")


def _same(p: ImageParams, inputs: Schema) -> dict[str, F]:
    """{field: unchanged}"""
    return {p.field: image_field(inputs, p, fixed=True)}


@batch_transform(params=HFlip, outputs=_same, takes_keys=True)
def hflip(batch: Columns, p: HFlip, rng: np.random.Generator | None, keys: SampleKeys) -> Columns:
    """Mirror each sample left-right with probability ``p``."""
    return {p.field: flip_batch(batch[p.field], p.layout, flips(keys, p.p))}


def flip_batch(
    x: np.ndarray, layout: Layout, flip: np.ndarray, out: np.ndarray | None = None
) -> np.ndarray:
    """``x`` with the samples where ``flip`` mirrored left-right; in ``out`` if given."""
    ah, aw = crop_axes(x, layout)
    zero = np.zeros(x.shape[0], np.intp)
    return crop_flip(x, ah, aw, (x.shape[ah], x.shape[aw]), zero, zero, flip, out)


# -- normalize / dtype ------------------------------------------------------------------------
class Normalize(ImageParams):
    mean: Annotated[list[Finite], Field(min_length=1, max_length=4096)] | None = None
    std: Annotated[list[Finite], Field(min_length=1, max_length=4096)] | None = None
    #: Multiplied first (``1/255`` maps uint8 to [0, 1]).
    scale: Finite = 1.0
    dtype: Literal["float32", "float16", "float64"] = "float32"
    #: Turn HWC into CHW (what torch models take) while at it.
    to_chw: bool = False


def _norm_outputs(p: Normalize, inputs: Schema) -> dict[str, F]:
    """{field: dtype, same shape (CHW if to_chw)}"""
    f = image_field(inputs, p, fixed=True)
    shape = f.shape
    if p.to_chw:
        if len(shape) != 3 or p.layout != "HWC":
            raise ValueError("to_chw needs an HWC image")
        shape = (shape[2], shape[0], shape[1])
    chans = (
        shape[0]
        if len(shape) == 3 and (p.to_chw or p.layout == "CHW")
        else (shape[2] if len(shape) == 3 else 1)
    )
    for name, v in (("mean", p.mean), ("std", p.std)):
        if v is not None and len(v) not in (1, chans):
            raise ValueError(f"{name} has {len(v)} values for {chans} channels")
    if p.std is not None and any(s == 0 for s in p.std):
        raise ValueError("std must not be 0")
    return {p.field: F(p.dtype, shape)}


@batch_transform(params=Normalize, outputs=_norm_outputs, takes_out=True)
def normalize(
    batch: Columns, p: Normalize, rng: np.random.Generator, out: Mapping[str, np.ndarray]
) -> Columns:
    """``(x * scale - mean) / std`` per channel, as ``dtype``."""
    x = batch[p.field]
    y = out.get(p.field)
    if y is None:
        y = np.empty(_norm_shape(x, p), np.dtype(p.dtype))
    return {p.field: normalize_batch(x, p, y)}


def _norm_shape(x: np.ndarray, p: Normalize) -> tuple[int, ...]:
    b, *rest = x.shape
    return (b, rest[2], rest[0], rest[1]) if p.to_chw else tuple(x.shape)


def normalize_batch(x: np.ndarray, p: Normalize, y: np.ndarray) -> np.ndarray:
    """``normalize`` of the batch ``x`` written into ``y`` (the step's shape and dtype)."""
    chw_in = p.layout == "CHW" and not p.to_chw
    c = table_channels(x, chw_in)
    if c is not None and gather(
        x, y, norm_table_of(p, c), chw_in=chw_in, chw_out=p.to_chw or chw_in
    ):
        return y
    if p.to_chw:
        x = np.transpose(x, (0, 3, 1, 2))
    return normalize_into(x, y, p.to_chw or p.layout == "CHW", p.scale, p.mean, p.std)


def norm_table_of(p: Normalize, channels: int) -> np.ndarray:
    """``p``'s results for each ``uint8`` value on each of ``channels`` (see
    :func:`~.kernels.norm_table`)."""
    mean = tuple(p.mean) if p.mean is not None else None
    std = tuple(p.std) if p.std is not None else None
    return norm_table(p.scale, mean, std, channels, p.dtype)
