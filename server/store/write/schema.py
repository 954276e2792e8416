"""Field specs: inferred from a first sample, checked against later ones, mapped to Arrow types.

The Arrow mapping follows the table in :mod:`shardserve.proto.manifest`. ``bool`` fields are
stored as Arrow ``bool`` (bit-packed), which cannot be viewed zero-copy; the reader
materialises those columns once at open.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

import numpy as np
import pyarrow as pa

from shardserve.proto.dtypes import BINARY, NUMERIC_DTYPES
from shardserve.proto.errors import InvalidDataError
from shardserve.proto.manifest import SHAPE_COLUMN_PREFIX, FieldSpec

BytesLike = (bytes, bytearray, memoryview)


def _dtype_name(dtype: np.dtype[np.generic], field: str, where: str) -> str:
    name = np.dtype(dtype).name
    if name not in NUMERIC_DTYPES:
        raise InvalidDataError(
            f"{where}: field {field!r} has dtype {name}, which a store cannot hold; "
            f"use one of {', '.join(NUMERIC_DTYPES)}, or bytes"
        )
    return name


def infer_field(
    name: str, value: object, *, variable: bool = False, where: str = "sample 0"
) -> FieldSpec:
    """The spec of field ``name`` from its first value.

    numpy arrays become tensors (``variable=True``: every dimension ``-1``; the writer narrows
    the ones that never change); numbers become scalars; bytes become binary, and str binary
    holding UTF-8 text (the client gives it back as ``str``).
    """
    if isinstance(value, str):
        return FieldSpec(name=name, dtype=BINARY, shape=(), encoding="utf-8")
    if isinstance(value, BytesLike):
        return FieldSpec(name=name, dtype=BINARY, shape=())
    if isinstance(value, bool):
        return FieldSpec(name=name, dtype="bool", shape=())
    if isinstance(value, int):
        return FieldSpec(name=name, dtype="int64", shape=())
    if isinstance(value, float):
        return FieldSpec(name=name, dtype="float64", shape=())
    if isinstance(value, (np.ndarray, np.generic)):
        dtype = _dtype_name(value.dtype, name, where)
        shape = tuple(int(d) for d in np.shape(value))
        if variable:
            if not shape:
                raise InvalidDataError(
                    f"{where}: field {name!r} is a scalar; it cannot be variable"
                )
            shape = (-1,) * len(shape)
        return FieldSpec(name=name, dtype=dtype, shape=shape)
    raise InvalidDataError(
        f"{where}: field {name!r} holds a {type(value).__name__}; a sample field must be a "
        "numpy array / tensor, a number, or bytes"
    )


def infer_fields(
    sample: Mapping[str, object], *, variable: Collection[str] = (), where: str = "sample 0"
) -> tuple[FieldSpec, ...]:
    """Specs for every field of a first sample, in its key order."""
    if not sample:
        raise InvalidDataError(f"{where}: a sample needs at least one field")
    unknown = set(variable) - set(sample)
    if unknown:
        raise InvalidDataError(
            f"--variable names {sorted(unknown)}, but the first sample ({where}) has fields "
            f"{list(sample)}"
        )
    specs = []
    for key, value in sample.items():
        try:
            specs.append(infer_field(key, value, variable=key in variable, where=where))
        except ValueError as e:  # pydantic: a field name that is not an identifier
            if isinstance(e, InvalidDataError):
                raise
            raise InvalidDataError(f"{where}: field {key!r} cannot be stored: {e}") from None
    return tuple(specs)


def arrow_value_type(spec: FieldSpec) -> pa.DataType:
    return pa.from_numpy_dtype(np.dtype(spec.dtype))


def arrow_fields(specs: tuple[FieldSpec, ...]) -> list[pa.Field]:
    """The Arrow schema fields for ``specs`` (a variable field adds its shape column)."""
    out: list[pa.Field] = []
    for s in specs:
        null = s.nullable
        if s.kind == "binary":
            out.append(pa.field(s.name, pa.binary(), nullable=null))
        elif s.kind == "scalar":
            out.append(pa.field(s.name, arrow_value_type(s), nullable=null))
        elif s.kind == "tensor":
            out.append(pa.field(s.name, pa.list_(arrow_value_type(s), s.numel), nullable=null))
        else:
            out.append(pa.field(s.name, pa.list_(arrow_value_type(s)), nullable=null))
            out.append(
                pa.field(
                    SHAPE_COLUMN_PREFIX + s.name, pa.list_(pa.int64(), len(s.shape)), nullable=False
                )
            )
    return out


def arrow_schema(specs: tuple[FieldSpec, ...]) -> pa.Schema:
    return pa.schema(arrow_fields(specs))


def check_arrow_schema(schema: pa.Schema, specs: tuple[FieldSpec, ...], where: str) -> str | None:
    """``None`` if ``schema`` holds every column ``specs`` need with the right type, else why not."""
    for f in arrow_fields(specs):
        idx = schema.get_field_index(f.name)
        if idx < 0:
            return f"{where}: column {f.name!r} is missing"
        if not schema.field(idx).type.equals(f.type):
            return f"{where}: column {f.name!r} is {schema.field(idx).type}, expected {f.type}"
    return None
