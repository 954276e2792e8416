"""Consecutive image built-ins run as one batch kernel: ``random_crop`` → ``hflip`` →
``normalize`` (any two or all three, in this order, on one field and one layout).

Alone, each step makes a full-size array the next one reads: a padded copy, the crops, a
flipped copy, a cast, then the normalize's passes. Fused, the crop and the flip are one
gather (flipped samples through a mirrored view) into an array of the input's dtype, and
the normalize writes the final dtype straight into the stream's slot (``out``). The draws
are those of the steps alone, each from its own step's keys (the runner passes one
:class:`~.keys.SampleKeys` per fused step, in order), and the kernels are theirs: the bytes
are the same as unfused.

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
    crop_batch,
    crop_room,
    flip_batch,
    hflip,
    normalize,
    normalize_batch,
    random_crop,
    size2,
)
from .draws import crop_flips, flips
from .kernels import scratch
from .keys import SampleKeys
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
    each = iter(keys)
    crop_keys = next(each) if p.crop is not None else None
    flip_keys = next(each) if p.flip is not None else None
    dest = out.get(p.field)
    # The crops go straight to the slot if nothing follows, else to this thread's scratch.
    last = dest if p.norm is None else scratch("crops", _crop_shape(x, p), x.dtype)
    if p.crop is not None and crop_keys is not None:
        if p.flip is not None and flip_keys is not None:
            # Both steps' draws in one pass: a fifth of the chain's time was drawing.
            oy, ox, flip = crop_flips(crop_keys, flip_keys, *crop_room(x, p.crop), p.flip.p)
            x = crop_at(x, p.crop, oy, ox, flip, last)
        else:
            x = crop_batch(x, p.crop, crop_keys, None, last)
    elif p.flip is not None and flip_keys is not None:
        x = flip_batch(x, p.flip.layout, flips(flip_keys, p.flip.p), last)
    if p.norm is None:
        return {p.field: x}
    if dest is None:
        shape = (x.shape[0], x.shape[3], x.shape[1], x.shape[2]) if p.norm.to_chw else x.shape
        dest = np.empty(shape, np.dtype(p.norm.dtype))
    return {p.field: normalize_batch(x, p.norm, dest)}


def _crop_shape(x: np.ndarray, p: Fused) -> tuple[int, ...]:
    """The shape of the batch ``x`` after the fused crop (if any)."""
    if p.crop is None:
        return tuple(x.shape)
    shape = list(x.shape)
    ah, aw = crop_axes(x, p.crop.layout)
    shape[ah], shape[aw] = size2(p.crop.size)
    return tuple(shape)
