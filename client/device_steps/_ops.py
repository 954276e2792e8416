"""Each device step as batched tensor ops over the whole batch, on whatever device its
inputs are; the same arithmetic as the server's transform of the same name, given the
parameters the server drew (``drawn``: ``{what: tensor [B, ...]}``).

A field is a dense tensor ``[B, ...]``, :class:`~._images.Images` (decoded images of
different sizes) or a :class:`~shardserve.client.types.VarTensor` (encoded bytes).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from shardserve.proto import device_steps as ds
from shardserve.proto.errors import BadRequest

from ..types import VarTensor
from ._codec import DecodeCounts, Decoder
from ._images import Images, resample

Value = torch.Tensor | Images | VarTensor
State = dict[str, Any]
#: A user expansion: ``fn(tensor on the device, options) -> tensor on the device``.
Expansion = Callable[[torch.Tensor, Mapping[str, Any]], torch.Tensor]


@dataclass
class Context:
    """What a step may use besides its field: the device, the codec and its counts, the
    expansions installed on this client."""

    device: torch.device
    decoder: Decoder
    counts: DecodeCounts
    expansions: Mapping[str, Expansion] = field(default_factory=dict)


def _hwc(x: Value, layout: str, name: str) -> torch.Tensor:
    """A dense image batch as ``[B, H, W, C]`` (a view)."""
    if not isinstance(x, torch.Tensor) or x.dim() not in (3, 4):
        raise BadRequest(
            f"device step on field {name!r}: expected a dense image batch, got "
            f"{type(x).__name__}; decode or resize it first"
        )
    if x.dim() == 3:
        return x[..., None]
    return x.permute(0, 2, 3, 1) if layout == "CHW" else x


def _back(y: torch.Tensor, like: torch.Tensor, layout: str) -> torch.Tensor:
    """``[B, H, W, C]`` back to the layout of ``like``."""
    if like.dim() == 3:
        return y[..., 0]
    return y.permute(0, 3, 1, 2).contiguous() if layout == "CHW" else y


def decode_image(
    s: State, p: ds.DecodeImage, drawn: Mapping[str, torch.Tensor], ctx: Context
) -> None:
    x = s[p.field]
    if not isinstance(x, VarTensor):
        raise BadRequest(f"decode_image: field {p.field!r} is not encoded bytes")
    s[p.field] = ctx.decoder.decode(x.unbind(), p.mode, ctx.device, ctx.counts)


def _images(x: Value, name: str, layout: str, device: torch.device) -> Images:
    if isinstance(x, Images):
        return x
    if isinstance(x, VarTensor):
        raise BadRequest(f"field {name!r} holds encoded bytes: decode_image it first")
    return Images.from_dense(_hwc(x.to(device), layout, name).contiguous())


def _resized(s: State, p: ds.Resize, boxes: torch.Tensor | None, ctx: Context) -> None:
    x = s[p.field]
    im = _images(x, p.field, p.layout, ctx.device)
    y = resample(im, im.whole() if boxes is None else boxes, ds.size2(p.size))
    s[p.field] = _back(y, x, p.layout) if isinstance(x, torch.Tensor) else y


def resize(s: State, p: ds.Resize, drawn: Mapping[str, torch.Tensor], ctx: Context) -> None:
    _resized(s, p, None, ctx)


def random_resized_crop(
    s: State, p: ds.RandomResizedCrop, drawn: Mapping[str, torch.Tensor], ctx: Context
) -> None:
    _resized(s, p, drawn["box"], ctx)


def random_crop(
    s: State, p: ds.RandomCrop, drawn: Mapping[str, torch.Tensor], ctx: Context
) -> None:
    x = s[p.field].to(ctx.device)
    img = _hwc(x, p.layout, p.field)
    h, w = ds.size2(p.size)
    if p.padding:
        pad = (0, 0, p.padding, p.padding, p.padding, p.padding)  # C, W, H from the last
        img = torch.nn.functional.pad(img, pad, value=p.fill)
    off = drawn["offset"].to(ctx.device)
    iy = off[:, 0:1] + torch.arange(h, device=ctx.device)
    ix = off[:, 1:2] + torch.arange(w, device=ctx.device)
    rows = torch.arange(img.shape[0], device=ctx.device)[:, None, None]
    s[p.field] = _back(img[rows, iy[:, :, None], ix[:, None, :]], x, p.layout)


def hflip(s: State, p: ds.HFlip, drawn: Mapping[str, torch.Tensor], ctx: Context) -> None:
    x = s[p.field].to(ctx.device)
    img = _hwc(x, p.layout, p.field)
    flip = drawn["flip"].to(ctx.device).bool()[:, None, None, None]
    s[p.field] = _back(torch.where(flip, img.flip(2), img), x, p.layout)


_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "uint8": torch.uint8,
    "bool": torch.bool,
}


def normalize(s: State, p: ds.Normalize, drawn: Mapping[str, torch.Tensor], ctx: Context) -> None:
    x = s[p.field].to(ctx.device)
    if not isinstance(x, torch.Tensor):
        raise BadRequest(f"normalize: field {p.field!r} is not a dense batch; resize it first")
    if p.to_chw:
        x = x.permute(0, 3, 1, 2)
    chw = p.to_chw or p.layout == "CHW"
    dt = _DTYPES[p.dtype]
    y = x.to(dt, memory_format=torch.contiguous_format)
    if p.scale != 1.0:
        y *= torch.tensor(p.scale, dtype=dt)
    view = [1] * y.dim()
    if y.dim() == 4:
        view[1 if chw else 3] = -1
    for vals, op in ((p.mean, torch.Tensor.sub_), (p.std, torch.Tensor.div_)):
        if vals is not None:
            t = torch.tensor(vals, dtype=dt, device=y.device)
            op(y, t.reshape(view if len(vals) > 1 else [1]))
    s[p.field] = y


def unpack_torch(x: torch.Tensor, count: int, bitorder: str) -> torch.Tensor:
    """``numpy.unpackbits(x, axis=1, count=count, bitorder=bitorder)`` of uint8 ``[B, n]`` in
    tensor ops, on ``x``'s device: uint8 ``[B, count]``."""
    shifts = torch.arange(7, -1, -1) if bitorder == "big" else torch.arange(8)
    bits = (x.reshape(x.shape[0], -1, 1) >> shifts.to(x.device, torch.uint8)) & 1
    return bits.reshape(x.shape[0], -1)[:, :count]


def unpack_bits(
    s: State, p: ds.UnpackBits, drawn: Mapping[str, torch.Tensor], ctx: Context
) -> None:
    x = s[p.field].to(ctx.device)
    b = x.shape[0]
    need = math.prod(p.shape)
    if x.device.type == "cpu":  # numpy's table-driven unpacking: ~3x torch's shifts here
        flat = np.unpackbits(x.reshape(b, -1).numpy(), axis=1, count=need, bitorder=p.bitorder)
        planes = torch.from_numpy(flat).reshape(b, *p.shape)
    else:
        planes = unpack_torch(x.reshape(b, -1), need, p.bitorder).reshape(b, *p.shape)
    s[p.to or p.field] = planes.to(_DTYPES[p.dtype])


def check_expansion(p: ds.Expand, expansions: Mapping[str, Expansion]) -> Expansion:
    """The expansion ``p`` names, or ``BadRequest`` listing those registered."""
    fn = expansions.get(p.fn)
    if fn is None:
        raise BadRequest(
            f"expand: no expansion {p.fn!r} is registered on this client; registered: "
            f"{sorted(expansions)} (register_expansion({p.fn!r}, fn) before the Loader)"
        )
    return fn


def expand(s: State, p: ds.Expand, drawn: Mapping[str, torch.Tensor], ctx: Context) -> None:
    fn = check_expansion(p, ctx.expansions)
    s[p.to or p.field] = fn(s[p.field].to(ctx.device), p.options)


Op = Callable[[State, Any, Mapping[str, torch.Tensor], Context], None]
#: Every step's execution, by name (the names of ``proto.device_steps.STEPS``).
OPS: dict[str, Op] = {
    "decode_image": decode_image,
    "resize": resize,
    "random_resized_crop": random_resized_crop,
    "random_crop": random_crop,
    "hflip": hflip,
    "normalize": normalize,
    "unpack_bits": unpack_bits,
    "expand": expand,
}
