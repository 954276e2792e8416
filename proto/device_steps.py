"""Steps a job asks the trainer's device to execute: their parameters, and the small
per-sample arrays the server draws for them and ships beside the compact field.

A job's ``device_transforms`` (``[{"name", "params"}, ...]``) run on the client after the
server's own chain: the server keeps the plan and draws every random parameter from
``(seed, epoch, sample id, step)``; the client decodes and augments with batched tensor
ops on its device. Nothing executable crosses the wire: an ``expand`` step names code
installed on the client (``shardserve.client.device_steps.register_expansion``).

Wire layout: step ``i``'s drawn parameters travel as ordinary fixed-shape fields named
:func:`param_field` (``_device_{i}_{what}``); the client drops them after executing.

>>> steps = parse_steps([{"name": "hflip", "params": {"p": 0.5}}])
>>> param_fields(steps, offset=0)
{'_device_0_flip': ('uint8', ())}
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from .errors import BadRequest

#: The largest height or width a device step may be asked to make.
MAX_SIDE = 1 << 16
Side = Annotated[int, Field(ge=1, le=MAX_SIDE)]
Size = Side | Annotated[list[Side], Field(min_length=2, max_length=2)]
Finite = Annotated[float, Field(ge=-1e12, le=1e12)]
Pair = Annotated[list[Annotated[float, Field(gt=0, le=100)]], Field(min_length=2, max_length=2)]
Name = Annotated[str, Field(min_length=1, max_length=128)]
Layout = Literal["HWC", "CHW"]


class _Params(BaseModel):
    # Strict, like the server's transforms: "32" is not 32; floats are finite.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)

    #: The field the step reads (and, unless said otherwise, writes).
    field: Name = "image"


class DecodeImage(_Params):
    """Encoded bytes (JPEG; PNG where the codec supports it) to uint8 ``[H, W, C]``."""

    mode: Literal["RGB", "L"] = "RGB"


class Resize(_Params):
    """Bilinear resize to ``size`` (half-pixel centres, no antialiasing: the server's
    ``resize`` with ``method="numpy"``)."""

    size: Size
    layout: Layout = "HWC"


class RandomResizedCrop(Resize):
    """torchvision's RandomResizedCrop: the server draws each sample's box, the device
    resamples it bilinearly to ``size``."""

    scale: Pair = Field(default=[0.08, 1.0])
    ratio: Pair = Field(default=[3 / 4, 4 / 3])

    @model_validator(mode="after")
    def _ranges(self) -> RandomResizedCrop:
        for name, (lo, hi) in (("scale", self.scale), ("ratio", self.ratio)):
            if lo > hi:
                raise ValueError(f"{name} [{lo}, {hi}]: the low end is above the high end")
        if self.scale[1] > 1:
            raise ValueError(f"scale {self.scale}: a share of the area is at most 1")
        return self


class RandomCrop(_Params):
    """Pad by ``padding`` (with ``fill``), then crop ``size`` at the offset the server drew."""

    size: Size
    padding: int = Field(default=0, ge=0, le=1024)
    fill: Finite = 0
    layout: Layout = "HWC"


class HFlip(_Params):
    """Mirror left-right the samples the server drew (probability ``p``)."""

    p: float = Field(default=0.5, ge=0, le=1)
    layout: Layout = "HWC"


class Normalize(_Params):
    """``(x * scale - mean) / std`` per channel, as ``dtype`` (CHW if ``to_chw``)."""

    mean: Annotated[list[Finite], Field(min_length=1, max_length=4096)] | None = None
    std: Annotated[list[Finite], Field(min_length=1, max_length=4096)] | None = None
    scale: Finite = 1.0
    dtype: Literal["float32", "float16", "bfloat16", "float64"] = "float32"
    to_chw: bool = False
    layout: Layout = "HWC"


class UnpackBits(_Params):
    """Packed bit records (uint8) into planes of ``shape``: exact, like ``numpy.unpackbits``."""

    shape: list[Annotated[int, Field(ge=1, le=1 << 31)]] = Field(min_length=1, max_length=8)
    dtype: Literal["uint8", "bool", "float32", "float16", "bfloat16"] = "uint8"
    bitorder: Literal["big", "little"] = "big"
    to: Name | None = None


class Expand(_Params):
    """A user expansion registered on the client under ``fn``: it reads ``field`` and writes
    ``to`` (default: ``field``), with JSON ``options``."""

    fn: Name
    to: Name | None = None
    options: dict[str, Any] = Field(default_factory=dict)


Params = (
    DecodeImage | Resize | RandomResizedCrop | RandomCrop | HFlip | Normalize | UnpackBits | Expand
)

#: Every device step by name: what its parameters are.
STEPS: dict[str, type[_Params]] = {
    "decode_image": DecodeImage,
    "resize": Resize,
    "random_resized_crop": RandomResizedCrop,
    "random_crop": RandomCrop,
    "hflip": HFlip,
    "normalize": Normalize,
    "unpack_bits": UnpackBits,
    "expand": Expand,
}

#: What each step's server-drawn parameters are: ``{what: (dtype, per-sample shape)}``.
DRAWN: dict[str, dict[str, tuple[str, tuple[int, ...]]]] = {
    # (y0, x0, h, w) in the decoded image's pixels
    "random_resized_crop": {"box": ("float64", (4,))},
    # (y, x) of the crop's corner in the padded image
    "random_crop": {"offset": ("int64", (2,))},
    "hflip": {"flip": ("uint8", ())},
}


def param_field(step: int, what: str) -> str:
    """The field that carries step ``step``'s drawn ``what``.

    >>> param_field(2, "box")
    '_device_2_box'
    """
    return f"_device_{step}_{what}"


#: Every parameter field's name starts so (a dataset field so named is refused).
PARAM_PREFIX = "_device_"


def size2(v: int | list[int]) -> tuple[int, int]:
    """``N`` or ``[H, W]`` as ``(H, W)``."""
    return (v, v) if isinstance(v, int) else (int(v[0]), int(v[1]))


def parse_steps(raw: Sequence[Mapping[str, Any] | Any]) -> list[tuple[str, _Params]]:
    """``[(name, params)]`` of a job's ``device_transforms``; ``BadRequest`` naming the step
    and what exists."""
    out: list[tuple[str, _Params]] = []
    for i, step in enumerate(raw):
        d = step if isinstance(step, Mapping) else step.model_dump()
        name = d.get("name")
        model = STEPS.get(str(name))
        if model is None:
            raise BadRequest(
                f"device_transforms[{i}]: no device step named {name!r}; there are "
                f"{sorted(STEPS)} (a step of your own: 'expand' with fn= registered on the client)"
            )
        try:
            out.append((str(name), model.model_validate(d.get("params") or {})))
        except ValidationError as e:
            why = "; ".join(
                f"{'.'.join(map(str, x['loc'])) or 'params'}: {x['msg']}" for x in e.errors()
            )
            raise BadRequest(f"device_transforms[{i}] {name!r}: bad params: {why}") from None
    return out


def param_fields(
    steps: Sequence[tuple[str, _Params]], offset: int
) -> dict[str, tuple[str, tuple[int, ...]]]:
    """``{field: (dtype, shape)}`` the server ships for ``steps``; step ``i`` draws as chain
    step ``offset + i`` (after the server's own chain)."""
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    for i, (name, _) in enumerate(steps):
        for what, spec in DRAWN.get(name, {}).items():
            out[param_field(offset + i, what)] = spec
    return out
