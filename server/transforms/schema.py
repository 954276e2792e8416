"""Field layouts as transforms see them: dtype and per-sample shape (``-1``: variable)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from shardserve.proto.manifest import FieldSpec


@dataclass(frozen=True, slots=True)
class Field:
    """One field of a sample: numpy dtype name and per-sample shape, ``-1`` for a dimension
    that varies from sample to sample. ``binary`` marks stored bytes (served as uint8)."""

    dtype: str
    shape: tuple[int, ...] = ()
    binary: bool = False

    @property
    def fixed(self) -> bool:
        return -1 not in self.shape and not self.binary

    def describe(self) -> str:
        return "binary" if self.binary else f"{self.dtype}{list(self.shape)}"

    def to_json(self) -> dict[str, object]:
        return {"dtype": "binary" if self.binary else self.dtype, "shape": list(self.shape)}

    def matches(self, arr: np.ndarray) -> bool:
        """Whether one sample's array has this dtype and shape (``-1`` matches any size)."""
        if arr.dtype != np.dtype(self.dtype) or arr.ndim != len(self.shape):
            return False
        return all(d == -1 or d == a for d, a in zip(self.shape, arr.shape, strict=True))


Schema = Mapping[str, Field]


def from_field_spec(f: FieldSpec) -> Field:
    if f.kind == "binary":
        return Field("uint8", (-1,), binary=True)
    return Field(f.dtype, tuple(f.shape))


def to_field_spec(name: str, f: Field) -> FieldSpec:
    # A binary field is stored bytes, shape () in a manifest (its uint8 view is variable).
    if f.binary:
        return FieldSpec(name=name, dtype="binary", shape=())
    return FieldSpec(name=name, dtype=f.dtype, shape=f.shape)
