"""Consecutive image built-ins run as one batch kernel: ``random_crop`` → ``hflip`` →
``normalize`` (any two or all three, in this order, on one field and one layout).

Alone, each step makes a full-size array the next one reads: a padded copy, the crops, a
flipped copy, a cast, then the normalize's passes. Fused on a ``uint8`` batch, the steps are
one pass of compiled code (:mod:`.onepass`: each input byte read once, each output element
written once, straight into the stream's slot). Elsewhere (another dtype, or the extension
not built) the crop and the flip are one numpy gather (flipped samples through a mirrored
view) into an array of the input's dtype, and the normalize writes the final dtype into the
slot (``out``). The draws are those of the steps alone, each from its own step's keys (the
runner passes one :class:`~.keys.SampleKeys` per fused step, in order), and the values are
theirs: the bytes are the same as unfused, either way.

>>> from .builtins_images import HFlip, RandomCrop, hflip, random_crop
>>> plan = fusable([(random_crop, RandomCrop(field="x", size=4)), (hflip, HFlip(field="x"))])
>>> plan.transform.name, plan.length
('random_crop+hflip', 2)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import cast

import numpy as np
from pydantic import BaseModel, ConfigDict

from .builtins_images import (
    HFlip,
    ImageParams,
    Normalize,
    RandomCrop,
    crop_at,
    crop_axes,
    crop_room,
    flip_batch,
    hflip,
    norm_table_of,
    normalize,
    normalize_batch,
    random_crop,
    size2,
)
from .draws import crop_flips, crop_offsets, flips
from .kernels import scratch
from .keys import SampleKeys
from .onepass import gather, identity, table_channels
from .registry import Columns, Transform, batch_transform
from .schema import Field, Schema

#: The built-ins that fuse, in the order they must come in a chain, and their part's name.
ORDER = (random_crop, hflip, normalize)
PARTS = ("crop", "flip", "norm")


class Fused(BaseModel):
    """The parameters of each fused step (``None``: not in this run)."""

    model_config = ConfigDict(frozen=True)

    crop: RandomCrop | None = None
    flip: HFlip | None = None
    norm: Normalize | None = None

    @property
    def field(self) -> str:
        return next(p.field for p in (self.crop, self.flip, self.norm) if p is not None)

    @property
    def layout(self) -> str:
        return next(p.layout for p in (self.crop, self.flip, self.norm) if p is not None)


@dataclass(frozen=True)
class Plan:
    """A run of fusable steps: how many steps it replaces, its transform and parameters."""

    length: int
    transform: Transform
    params: Fused


def fusable(steps: Sequence[tuple[Transform, BaseModel]]) -> Plan | None:
    """The longest fusable run at the start of ``steps`` (two or three of :data:`ORDER`, in
    order, on one field and layout), or ``None``."""
    parts: dict[str, ImageParams] = {}
    at = 0
    for t, params in steps:
        pos = next((i for i in range(at, len(ORDER)) if ORDER[i] is t), None)
        if pos is None:
            break
        p = cast(ImageParams, params)  # ORDER[pos] is t: its params are this image model
        first = next(iter(parts.values()), None)
        if first is not None and (p.field, p.layout) != (first.field, first.layout):
            break
        parts[PARTS[pos]] = p
        at = pos + 1
    if len(parts) < 2:
        return None
    names = "+".join(t.name for t, k in zip(ORDER, PARTS, strict=True) if k in parts)
    transform = batch_transform(
        params=Fused, outputs=_fused_outputs, name=names, takes_out=True, takes_keys=True
    )(run_fused)
    return Plan(len(parts), transform, Fused.model_validate(parts))


def passes_only(transforms: Sequence[Transform]) -> bool:
    """Whether each of a compiled chain's ``transforms`` is one of :data:`ORDER` or a fused
    run of them: a few passes over the batch's own fixed-size bytes, with no user code, no
    decoding, no I/O and nothing to wait on. Such a chain's time is bounded by its batch's
    bytes (capped at job creation), so it may run on whichever thread assembles its batch.

    >>> passes_only([random_crop, hflip]), passes_only([])
    (True, False)
    """
    return bool(transforms) and all(
        any(t is o for o in ORDER) or t.fn is run_fused for t in transforms
    )


def unfused(name: str, params: Mapping[str, object]) -> list[dict[str, object]] | None:
    """The steps a fused step named ``name`` runs, as a job names them, or ``None`` if
    ``name`` is not a fused run's. A compiled chain is sent to worker processes by its steps'
    names and params; a fused one is compiled there from its parts (and fused again).

    >>> unfused("random_crop+hflip", {"crop": {"field": "x", "size": 4}, "flip": {"field": "x"}})
    [{'name': 'random_crop', 'params': {'field': 'x', 'size': 4}}, {'name': 'hflip', 'params': {'field': 'x'}}]
    """
    names = {t.name: k for t, k in zip(ORDER, PARTS, strict=True)}
    parts = name.split("+")
    if len(parts) < 2 or any(n not in names for n in parts):
        return None
    return [{"name": n, "params": params.get(names[n]) or {}} for n in parts]


def _fused_outputs(p: Fused, inputs: Schema) -> dict[str, Field]:
    """{field: as the last fused step writes it}"""
    fields = dict(inputs)
    for t, part in zip(ORDER, (p.crop, p.flip, p.norm), strict=True):
        if part is not None:
            fields.update(t.output_fields(part, fields))
    return {p.field: fields[p.field]}


def run_fused(
    batch: Columns,
    p: Fused,
    rng: np.random.Generator | None,
    keys: Sequence[SampleKeys],
    out: Mapping[str, np.ndarray],
) -> Columns:
    """The fused steps on ``batch``; ``keys``: each fused step's keys, in order."""
    x = batch[p.field]
    oy, ox, flip = _draws(x, p, keys)
    dest = out.get(p.field)
    if dest is None:
        dtype = np.dtype(p.norm.dtype) if p.norm is not None else x.dtype
        dest = np.empty(_fused_shape(x, p), dtype)
    if _one_pass(x, p, oy, ox, flip, dest):
        return {p.field: dest}
    # The crops go straight to the slot if nothing follows, else to this thread's scratch.
    last = dest if p.norm is None else scratch("crops", _crop_shape(x, p), x.dtype)
    if p.crop is not None and oy is not None and ox is not None:
        x = crop_at(x, p.crop, oy, ox, flip, last)
    elif p.flip is not None and flip is not None:
        x = flip_batch(x, p.flip.layout, flip, last)
    if p.norm is None:
        return {p.field: x}
    return {p.field: normalize_batch(x, p.norm, dest)}


Draws = tuple[np.ndarray | None, np.ndarray | None, np.ndarray | None]


def _draws(x: np.ndarray, p: Fused, keys: Sequence[SampleKeys]) -> Draws:
    """``(oy, ox, flip)`` of the fused crop and flip (``None`` where a step is not fused),
    each from its own step's keys: the numbers the steps alone draw."""
    each = iter(keys)
    crop_keys = next(each) if p.crop is not None else None
    flip_keys = next(each) if p.flip is not None else None
    if p.crop is not None and crop_keys is not None:
        room = crop_room(x, p.crop)
        if p.flip is not None and flip_keys is not None:
            # Both steps' draws in one pass: a fifth of the chain's time was drawing.
            return crop_flips(crop_keys, flip_keys, *room, p.flip.p)
        return (*crop_offsets(crop_keys, *room), None)
    if p.flip is not None and flip_keys is not None:
        return None, None, flips(flip_keys, p.flip.p)
    return None, None, None


def _one_pass(
    x: np.ndarray,
    p: Fused,
    oy: np.ndarray | None,
    ox: np.ndarray | None,
    flip: np.ndarray | None,
    dest: np.ndarray,
) -> bool:
    """The fused steps by the compiled kernel (:mod:`.onepass`), if it applies."""
    chw_in = p.layout == "CHW"
    c = table_channels(x, chw_in)
    if c is None:
        return False
    chw_out = chw_in or (p.norm is not None and p.norm.to_chw)
    table = norm_table_of(p.norm, c) if p.norm is not None else identity(c)
    pad, fill = (p.crop.padding, int(p.crop.fill)) if p.crop is not None else (0, 0)
    return gather(
        x, dest, table, chw_in=chw_in, chw_out=chw_out, oy=oy, ox=ox, flip=flip, pad=pad, fill=fill
    )


def _fused_shape(x: np.ndarray, p: Fused) -> tuple[int, ...]:
    """The shape of the batch ``x`` after all the fused steps."""
    shape = _crop_shape(x, p)
    if p.norm is not None and p.norm.to_chw:
        return (shape[0], shape[3], shape[1], shape[2])
    return shape


def _crop_shape(x: np.ndarray, p: Fused) -> tuple[int, ...]:
    """The shape of the batch ``x`` after the fused crop (if any)."""
    if p.crop is None:
        return tuple(x.shape)
    shape = list(x.shape)
    ah, aw = crop_axes(x, p.crop.layout)
    shape[ah], shape[aw] = size2(p.crop.size)
    return tuple(shape)
