"""Hugging Face ``datasets`` features, read from the ``huggingface`` schema metadata that
both ``save_to_disk`` (Arrow streams) and ``to_parquet`` write, without importing
``datasets``.

What a feature changes before the generic Arrow conversion (:func:`.arrow_files.convert`):

* ``Image()`` / ``Audio()`` (a ``{bytes, path}`` struct): the column holds the encoded bytes
  (so ``decode_image`` reads it directly); a non-empty ``path`` is kept beside it as the text
  field ``NAME_path``; a row with a path but no bytes (an image that was never embedded) is
  refused: the bytes are not in the source.
* ``Array2D`` ... ``Array5D`` (nested lists, or datasets' extension type): fixed tensors of
  the declared shape and dtype; a ``None`` first dimension makes them variable.
* ``ClassLabel``: the integer column as it is; its names go into the manifest's ``source``
  (``labels.NAME``), and into ``classes`` when it is the dataset's only ClassLabel.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from shardserve.proto.errors import InvalidDataError

from .source import IngestSource

#: ``datasets``' features, the JSON it writes into a schema's metadata: read leniently as the
#: writer left it (an unexpected shape fails where it is used), so the values stay open.
Features = dict[str, Any]

_ARRAYS = ("Array2D", "Array3D", "Array4D", "Array5D")


def features_of(schema: pa.Schema) -> Features:
    """The top-level features of a schema written by ``datasets`` (``{}`` if none)."""
    raw = (schema.metadata or {}).get(b"huggingface")
    if raw is None:
        return {}
    try:
        feats = json.loads(raw)["info"]["features"]
    except (ValueError, KeyError, TypeError):
        return {}
    return feats if isinstance(feats, dict) else {}


def note_labels(features: Features, source: IngestSource) -> None:
    """ClassLabel names into the manifest's ``source`` (see module docstring)."""
    labels = {
        k: [str(n) for n in f.get("names") or []]
        for k, f in features.items()
        if isinstance(f, dict) and f.get("_type") == "ClassLabel"
    }
    for k, names in labels.items():
        source.info[f"labels.{k}"] = json.dumps(names)
    if len(labels) == 1:
        source.info["classes"] = json.dumps(next(iter(labels.values())))


def fixed_arrays(features: Features) -> set[str]:
    """ArrayND columns of a fixed shape: lists in Arrow, but fixed tensors once read."""
    return {
        k
        for k, f in features.items()
        if isinstance(f, dict) and f.get("_type") in _ARRAYS and (f.get("shape") or [None])[0]
    }


def _storage(arr: pa.Array) -> pa.Array:
    return arr.storage if isinstance(arr, pa.ExtensionArray) else arr


def _media(name: str, arr: pa.Array, where: str) -> list[tuple[str, pa.Array]]:
    arr = _storage(arr)
    if not pa.types.is_struct(arr.type) or arr.type.get_field_index("bytes") < 0:
        raise InvalidDataError(f"{where}: column {name!r} is not an Image/Audio struct")
    data = pc.struct_field(arr, "bytes")
    out = [(name, data)]
    if arr.type.get_field_index("path") >= 0:
        path = pc.struct_field(arr, "path")
        orphan = pc.and_(data.is_null(), path.is_valid()).to_numpy(zero_copy_only=False)
        if orphan.any():
            row = int(np.flatnonzero(orphan)[0])
            raise InvalidDataError(
                f"{where}: column {name!r} row {row} is only a path ({path[row]}), its bytes "
                "are not in the source; save it with the files embedded (Dataset.to_parquet "
                "embeds them) and ingest that"
            )
        if path.null_count < len(path):
            out.append((f"{name}_path", path))
    return out


def _array(name: str, arr: pa.Array, feat: Features, where: str) -> pa.Array:
    """An ArrayND column as a fixed-size list per dimension (first dim ``None``: a list)."""
    shape = list(feat.get("shape") or [])
    arr = _storage(arr)
    values = arr
    for _ in shape:
        if not (
            pa.types.is_list(values.type)
            or pa.types.is_fixed_size_list(values.type)
            or pa.types.is_large_list(values.type)
        ):
            raise InvalidDataError(f"{where}: column {name!r} is not the {feat['_type']} it says")
        values = values.flatten()
    dtype = pa.from_numpy_dtype(np.dtype(feat.get("dtype", "float32")))
    values = values.cast(dtype)
    fixed = [int(d) for d in shape[1:]]
    if None in fixed:
        raise InvalidDataError(
            f"{where}: column {name!r}: only the first dimension of an {feat['_type']} may vary"
        )
    inner: pa.Array = values
    for d in reversed(fixed):
        inner = pa.FixedSizeListArray.from_arrays(inner, d)
    if shape[0] is None:
        offsets = arr.offsets
        return pa.ListArray.from_arrays(
            offsets, inner, mask=arr.is_null() if arr.null_count else None
        )
    return pa.FixedSizeListArray.from_arrays(inner, int(shape[0]))


def prepare(batch: pa.RecordBatch, features: Features, where: str) -> pa.RecordBatch:
    """``batch`` with its Image / Audio / ArrayND columns made plain (module docstring)."""
    if not features:
        return batch
    fields: list[pa.Field] = []
    arrays: list[pa.Array] = []
    for f, col in zip(batch.schema, batch.columns, strict=True):
        feat = features.get(f.name)
        kind = feat.get("_type") if isinstance(feat, dict) else None
        if kind in ("Image", "Audio", "Video", "Pdf"):
            for n, a in _media(f.name, col, where):
                fields.append(pa.field(n, a.type))
                arrays.append(a)
        elif kind in _ARRAYS:
            a = _array(f.name, col, feat, where)  # type: ignore[arg-type]
            fields.append(pa.field(f.name, a.type))
            arrays.append(a)
        else:
            fields.append(f.remove_metadata() if f.metadata else f)
            arrays.append(_storage(col))
    return pa.RecordBatch.from_arrays(arrays, schema=pa.schema(fields))
