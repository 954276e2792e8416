"""Device steps planned here, executed on the trainer's device: the server ships the compact
field as it is (encoded JPEG bytes, packed bits) and draws every sample's random parameters
(crop boxes, crop offsets, flips) beside it as small fixed fields (``proto.device_steps``).

The draws are :mod:`.draws`' over :class:`~.keys.SampleKeys` of ``(seed, epoch, sample id,
step)``, with step ``len(transforms) + i`` for device step ``i``: the same numbers the
server's own transform of that name at that place in a chain would draw, on any machine and
after any resume. A resized crop needs each image's size before anything is decoded: read
from the encoded image's header (Pillow reads the header only).

:func:`compile_plan` checks the steps against the fields the chain serves (``BadRequest``
naming the step); :class:`DevicePlanned` is the source decorator that adds the drawn fields.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from shardserve.proto import device_steps as ds
from shardserve.proto.errors import BadRequest, TransformError
from shardserve.proto.jobs import JobSpec
from shardserve.proto.manifest import FieldSpec, Manifest
from shardserve.proto.parts import OFFSETS, SHAPES, parts_of

from ..source import FRESH, BatchParts, BatchSource, PartShapes, Tail, Wrapped
from .draws import crop_offsets, flips, resized_crop_boxes
from .images import open_image
from .keys import SampleKeys
from .runner import Limits

#: Where a step finds each sample's image size: the encoded header, the stored ``.shapes``
#: part of a variable field, or a size known for every sample.
SizeFrom = tuple[Literal["header", "shapes"], str] | tuple[Literal["fixed"], tuple[int, int]]


@dataclass(frozen=True)
class _Drawn:
    """One device step that draws: its place, params and where its input's size comes from."""

    index: int
    name: str
    params: ds.RandomResizedCrop | ds.RandomCrop | ds.HFlip
    size: SizeFrom | None


@dataclass(frozen=True)
class DevicePlan:
    """A job's device steps, checked: what the server draws for each batch."""

    offset: int
    drawn: tuple[_Drawn, ...]
    #: The fields that carry the draws, in the order they are served.
    fields: tuple[FieldSpec, ...]

    def draw(
        self,
        parts: Mapping[str, np.ndarray],
        ids: np.ndarray,
        seed: int,
        epoch: int,
        limits: Limits,
    ) -> dict[str, np.ndarray]:
        """Every drawn field of the batch of sample ``ids`` (``parts``: its served fields)."""
        out: dict[str, np.ndarray] = {}
        for d in self.drawn:
            step = self.offset + d.index
            keys = SampleKeys(seed=seed, epoch=epoch, step=step, ids=ids)
            what, arr = _DRAWS[d.name](d, keys, parts, limits)
            out[ds.param_field(step, what)] = arr
        return out


def _box(
    d: _Drawn, keys: SampleKeys, parts: Mapping[str, np.ndarray], limits: Limits
) -> tuple[str, np.ndarray]:
    """``random_resized_crop``: each sample's ``(y0, x0, h, w)`` in its decoded image."""
    p = d.params
    assert isinstance(p, ds.RandomResizedCrop)
    h, w = _sizes(d.size, parts, keys.ids, limits)
    return "box", resized_crop_boxes(keys, h, w, p.scale, p.ratio).astype(np.float64)


def _offset(
    d: _Drawn, keys: SampleKeys, parts: Mapping[str, np.ndarray], limits: Limits
) -> tuple[str, np.ndarray]:
    """``random_crop``: each sample's ``(y, x)`` corner in the padded image."""
    p = d.params
    assert isinstance(p, ds.RandomCrop) and d.size is not None and d.size[0] == "fixed"
    (H, W), (h, w) = d.size[1], ds.size2(p.size)
    oy, ox = crop_offsets(keys, H + 2 * p.padding - h, W + 2 * p.padding - w)
    return "offset", np.stack([oy, ox], 1).astype(np.int64)


def _flip(
    d: _Drawn, keys: SampleKeys, parts: Mapping[str, np.ndarray], limits: Limits
) -> tuple[str, np.ndarray]:
    """``hflip``: whether each sample is mirrored."""
    assert isinstance(d.params, ds.HFlip)
    return "flip", flips(keys, d.params.p).astype(np.uint8)


#: What each drawing step draws (the steps of ``proto.device_steps.DRAWN``).
_DRAWS = {"random_resized_crop": _box, "random_crop": _offset, "hflip": _flip}


def _sizes(
    src: SizeFrom | None, parts: Mapping[str, np.ndarray], ids: np.ndarray, limits: Limits
) -> tuple[np.ndarray, np.ndarray]:
    """Heights and widths of the images of samples ``ids``, as ``src`` says where to find
    them; ``TransformError`` naming the sample whose header cannot be read or is too big."""
    assert src is not None
    n = len(ids)
    if src[0] == "fixed":
        return np.full(n, src[1][0], np.int64), np.full(n, src[1][1], np.int64)
    if src[0] == "shapes":
        shapes = parts[src[1] + SHAPES]
        return shapes[:, 0].astype(np.int64), shapes[:, 1].astype(np.int64)
    values, offsets = parts[src[1]], parts[src[1] + OFFSETS]
    hw = np.empty((n, 2), np.int64)
    for i in range(n):
        try:
            with open_image(values[int(offsets[i]) : int(offsets[i + 1])], limits) as im:
                hw[i] = (im.size[1], im.size[0])  # Pillow says (width, height)
        except (ValueError, OSError) as e:  # OSError: Pillow's "cannot identify image file"
            raise TransformError(
                f"device step random_resized_crop: field {src[1]!r} of sample {int(ids[i])}: "
                f"cannot read the image's size from its header: {e}"
            ) from None
    return hw[:, 0], hw[:, 1]


def _image_size(name: str, f: FieldSpec, layout: str, i: int, step: str) -> SizeFrom:
    """Where image field ``f`` (as served, before any device step) says its size."""
    if f.dtype == "binary":
        raise BadRequest(
            f"device_transforms[{i}] {step!r}: field {name!r} holds encoded bytes; "
            "decode_image it first"
        )
    if len(f.shape) not in (2, 3):
        raise BadRequest(
            f"device_transforms[{i}] {step!r}: field {name!r} has shape "
            f"{list(f.shape)}, not an image (HW, HWC or CHW)"
        )
    ah, aw = (1, 2) if len(f.shape) == 3 and layout == "CHW" else (0, 1)
    h, w = f.shape[ah], f.shape[aw]
    return ("shapes", name) if -1 in (h, w) else ("fixed", (h, w))


def compile_plan(spec: JobSpec, served: Sequence[FieldSpec]) -> DevicePlan | None:
    """The checked plan of ``spec.device_transforms`` over the fields the chain serves;
    ``None`` without device steps; ``BadRequest`` naming the step and what to change."""
    if not spec.device_transforms:
        return None
    if spec.collate is not None or spec.graph is not None or spec.envs != 1:
        raise BadRequest(
            "device_transforms run on plain batches: leave collate, graphs and "
            "envs out, or run the steps as server transforms"
        )
    steps = ds.parse_steps(spec.device_transforms)
    fields = {f.name: f for f in served}
    offset = len(spec.transforms or ())
    if clash := [n for n in fields if n.startswith(ds.PARAM_PREFIX)]:
        raise BadRequest(
            f"field(s) {clash} start with {ds.PARAM_PREFIX!r}, which device "
            "steps' parameters use: rename them at ingest"
        )
    size: dict[str, SizeFrom] = {}  # an image field's size once a device step changed it
    drawn: list[_Drawn] = []
    for i, (name, p) in enumerate(steps):
        if p.field not in fields and p.field not in size:
            raise BadRequest(
                f"device_transforms[{i}] {name!r}: no field {p.field!r}; the "
                f"served fields are {sorted(fields)}"
            )
        f = fields.get(p.field)
        if isinstance(p, ds.DecodeImage):
            if f is None or f.dtype != "binary":
                raise BadRequest(
                    f"device_transforms[{i}] 'decode_image': field {p.field!r} is not encoded bytes"
                )
            size[p.field] = ("header", p.field)
        elif isinstance(p, ds.UnpackBits):
            _check_bits(i, p, f)
        elif isinstance(p, ds.Resize | ds.RandomCrop | ds.HFlip):
            src = size.get(p.field) or _image_size(p.field, f, p.layout, i, name)  # type: ignore[arg-type]
            if isinstance(p, ds.RandomCrop):
                _check_crop(i, p, src)
            if isinstance(p, ds.Resize):
                size[p.field] = ("fixed", ds.size2(p.size))
            if isinstance(p, ds.RandomResizedCrop | ds.RandomCrop | ds.HFlip):
                drawn.append(_Drawn(i, name, p, src))
    params = [
        FieldSpec(name=n, dtype=dt, shape=sh)
        for n, (dt, sh) in ds.param_fields(steps, offset).items()
    ]
    return DevicePlan(offset, tuple(drawn), tuple(params))


def _check_bits(i: int, p: ds.UnpackBits, f: FieldSpec | None) -> None:
    if f is None or f.dtype != "uint8" or -1 in f.shape:
        raise BadRequest(
            f"device_transforms[{i}] 'unpack_bits': field {p.field!r} must be fixed "
            "uint8 packed records"
        )
    if math.prod(p.shape) > math.prod(f.shape) * 8:
        raise BadRequest(
            f"device_transforms[{i}] 'unpack_bits': shape {p.shape} needs "
            f"{math.prod(p.shape)} bits; a record holds {math.prod(f.shape) * 8}"
        )


def _check_crop(i: int, p: ds.RandomCrop, src: SizeFrom) -> None:
    if src[0] != "fixed":
        raise BadRequest(
            f"device_transforms[{i}] 'random_crop': field {p.field!r} varies in "
            "size; resize (or random_resized_crop) it first"
        )
    (H, W), (h, w) = src[1], ds.size2(p.size)
    if h > H + 2 * p.padding or w > W + 2 * p.padding:
        raise BadRequest(
            f"device_transforms[{i}] 'random_crop': size {[h, w]} is larger than "
            f"{[H, W]} padded by {p.padding}"
        )


def device_manifest(spec: JobSpec, served: Manifest) -> Manifest:
    """``served`` with the device steps' drawn fields after its own (itself without steps)."""
    plan = compile_plan(spec, served.fields)
    if plan is None:
        return served
    return served.model_copy(update={"fields": (*served.fields, *plan.fields)})


def plan_device(
    source: BatchSource, spec: JobSpec, epoch: int, seed: int, limits: Limits
) -> BatchSource:
    """``source`` with the device steps' parameters drawn for each batch (itself without)."""
    plan = compile_plan(spec, source.manifest.fields)
    return source if plan is None else DevicePlanned(source, plan, epoch, seed, limits)


class DevicePlanned(Wrapped):
    """A source whose batches carry the device steps' drawn parameters beside its fields."""

    def __init__(
        self, inner: BatchSource, plan: DevicePlan, epoch: int, seed: int, limits: Limits
    ) -> None:
        super().__init__(inner)
        self.plan = plan
        self._epoch, self._seed, self._limits = epoch, seed, limits
        self._params = [f.name for f in plan.fields]
        self._manifest = inner.manifest.model_copy(
            update={"fields": (*inner.manifest.fields, *plan.fields)}
        )

    @property
    def manifest(self) -> Manifest:
        """The inner source's, with the drawn fields after its own."""
        return self._manifest

    @property
    def inline_ok(self) -> bool:
        """Not when a step reads image headers (a Pillow call per sample)."""
        headers = any(d.size is not None and d.size[0] == "header" for d in self.plan.drawn)
        return self.inner.inline_ok and not headers

    def field_names(self, fields: Sequence[str] | None = None) -> list[str]:
        """The inner fields asked for, then always every drawn field."""
        asked = [n for n in fields if n not in self._params] if fields is not None else None
        return [*self.inner.field_names(asked), *self._params]

    def part_shapes(self, fields: Sequence[str] | None = None) -> PartShapes:
        inner = [n for n in self.field_names(fields) if n not in self._params]
        shapes = dict(self.inner.part_shapes(inner))
        for f in self.plan.fields:
            shapes.update(parts_of(f))
        return shapes

    def take(
        self,
        indices: np.ndarray | Sequence[int],
        fields: Sequence[str] | None = None,
        out: Mapping[str, np.ndarray] | None = None,
        batch: int = -1,
        tail: Tail = FRESH,
    ) -> BatchParts:
        """The inner fields of ``indices`` and, beside them, their drawn parameters."""
        inner = [n for n in self.field_names(fields) if n not in self._params]
        parts = dict(self.inner.take(indices, inner, out, batch, tail))
        ids = np.asarray(indices, dtype=np.int64).reshape(-1)
        for name, arr in self.plan.draw(parts, ids, self._seed, self._epoch, self._limits).items():
            dest = out.get(name) if out is not None else None
            if dest is not None and dest.shape == arr.shape and dest.dtype == arr.dtype:
                np.copyto(dest, arr)
                arr = dest
            parts[name] = arr
        return parts
