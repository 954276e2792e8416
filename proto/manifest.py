"""The store's contract: the schema of a dataset's ``manifest.json``.

A dataset is a folder ``<store>/<name>/`` holding ``manifest.json`` and ``shards/*.arrow``
(Arrow IPC *file* format, uncompressed). The manifest is written last, so a folder without
one is never a dataset.

How a field maps to Arrow columns (the writer and reader both follow this table):

============  ==========================  ===========================================
field kind    FieldSpec                   Arrow column(s)
============  ==========================  ===========================================
scalar        dtype numeric, shape ()     primitive column ``name``
fixed tensor  dtype numeric, shape (3,32)  ``fixed_size_list<dtype>[prod(shape)]``
variable      a dim of -1, e.g. (-1, 64)  ``list<dtype>`` of the flattened values, plus
                                           ``fixed_size_list<int64>[ndim]`` column
                                           ``__shape__.<name>`` with each sample's shape
bytes         dtype "binary", shape ()    ``binary`` column ``name``
============  ==========================  ===========================================

Nested samples: a field name may be a dotted path (``params.nu``); the
optional ``structure`` records the tree the sample was saved as (see :data:`Tree`), so a
client can rebuild ``batch["params"]["nu"]`` or a tuple. A field with ``nullable: true`` may
be missing (``None``) in some samples: its column carries Arrow's validity bitmap. Both keys
are written only when used, so a flat dataset's manifest is byte-for-byte what it was.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationError,
    field_validator,
    model_serializer,
    model_validator,
)

from .dtypes import BINARY, NUMERIC_DTYPES
from .errors import InvalidDataError, VersionMismatch
from .parts import COMPANION_SUFFIXES

#: The manifest format this code writes and reads.
FORMAT_VERSION = 1
SUPPORTED_FORMAT_VERSIONS = (1,)

SHAPE_COLUMN_PREFIX = "__shape__."

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
# A field is an identifier, or a dotted path of them for a nested sample (``params.nu``,
# ``_0`` for a tuple's first item).
_FIELD = re.compile(r"^(?=.{1,128}$)[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z0-9_]+)*$")

#: The tree of a nested sample, as JSON: a field name (a leaf); ``None`` (a value that was
#: ``None`` in every sample); ``{"dict": {key: tree}}``; ``{"tuple": [tree, ...]}``;
#: ``{"list": [tree, ...]}`` (a fixed-length list inside a sample).
Tree = Any


def tree_fields(tree: Tree) -> list[str]:
    """The field names at the leaves of ``tree``, depth first in key order."""
    if tree is None:
        return []
    if isinstance(tree, str):
        return [tree]
    if isinstance(tree, dict) and len(tree) == 1:
        ((kind, items),) = tree.items()
        if kind == "dict" and isinstance(items, dict):
            return [f for sub in items.values() for f in tree_fields(sub)]
        if kind in ("tuple", "list") and isinstance(items, list):
            return [f for sub in items for f in tree_fields(sub)]
    raise ValueError(f"structure node {tree!r} is not a field name, null, dict, tuple or list")


FieldKind = Literal["scalar", "tensor", "variable", "binary"]
#: How a binary field's bytes are text: ``utf-8`` one string per sample (the client gives a
#: ``list[str]``), ``utf-8-list`` a list of strings per sample, each UTF-8 and ended by
#: ``\0`` (the client gives a ``list[list[str]]``).
TextEncoding = Literal["utf-8", "utf-8-list"]


def validate_dataset_name(name: str) -> str:
    """Return ``name`` if it is a safe dataset name, else raise ``InvalidDataError``.

    A name is one path component of letters, digits, ``.``, ``_`` and ``-`` (starting with a
    letter or digit, no ``..``), so it can never reach outside the store.

    >>> validate_dataset_name("cifar10-v2")
    'cifar10-v2'
    """
    if not isinstance(name, str) or not _NAME.match(name) or ".." in name:
        raise InvalidDataError(
            f"dataset name {name!r} is not allowed: use 1-128 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit, without '..' or '/'"
        )
    return name


class FieldSpec(BaseModel):
    """One named field of every sample."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    dtype: str
    #: Per-sample shape; ``()`` for a scalar, ``-1`` marks a variable dimension.
    shape: tuple[int, ...] = ()
    #: Some samples have no value (``None``): the column has a validity bitmap.
    nullable: bool = False
    #: A binary field that holds text (:data:`TextEncoding`); ``None``: raw bytes.
    encoding: TextEncoding | None = None

    @model_serializer(mode="wrap")
    def _drop_defaults(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # Written only when set, so manifests of flat datasets stay as they were.
        out: dict[str, Any] = handler(self)
        if not self.nullable:
            out.pop("nullable", None)
        if self.encoding is None:
            out.pop("encoding", None)
        return out

    @field_validator("name")
    @classmethod
    def _check_name(cls, v: str) -> str:
        if not _FIELD.match(v):
            raise ValueError(
                f"field name {v!r} must be an identifier (letters, digits, '_'), or a dotted "
                "path of them"
            )
        if "." in v and v.rsplit(".", 1)[1] in COMPANION_SUFFIXES:
            raise ValueError(f"field name {v!r} ends in a reserved part suffix")
        return v

    @field_validator("dtype")
    @classmethod
    def _check_dtype(cls, v: str) -> str:
        if v not in NUMERIC_DTYPES and v != BINARY:
            raise ValueError(f"dtype {v!r} is not one of {', '.join((*NUMERIC_DTYPES, BINARY))}")
        return v

    @model_validator(mode="after")
    def _check_shape(self) -> FieldSpec:
        if any(d < -1 for d in self.shape):
            raise ValueError(f"field {self.name!r}: shape {self.shape} has a dimension below -1")
        if self.dtype == BINARY and self.shape != ():
            raise ValueError(f"field {self.name!r}: binary fields have shape (), not {self.shape}")
        if self.encoding is not None and self.dtype != BINARY:
            raise ValueError(f"field {self.name!r}: only a binary field can be text")
        if len(self.shape) > 8:
            raise ValueError(f"field {self.name!r}: at most 8 dimensions, got {len(self.shape)}")
        return self

    @property
    def kind(self) -> FieldKind:
        if self.dtype == BINARY:
            return "binary"
        if -1 in self.shape:
            return "variable"
        return "scalar" if self.shape == () else "tensor"

    @property
    def numel(self) -> int:
        """Elements per sample of a fixed-shape field."""
        if self.kind in ("variable", "binary"):
            raise ValueError(f"field {self.name!r} has no fixed size ({self.kind})")
        n = 1
        for d in self.shape:
            n *= d
        return n


_HEX = re.compile(r"[0-9a-f]*")


class ShardInfo(BaseModel):
    """One shard file, relative to the dataset folder."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    path: str
    rows: int = Field(ge=0)
    bytes: int = Field(ge=0)
    #: ``xxh3_64:<16 hex digits>`` of the whole file.
    checksum: str
    #: The size of the blocks in ``blocks``; absent in shards written before blocks were kept.
    #: At least 4 KiB, which bounds what a reader keeps per block (a flag, an index).
    block_bytes: int | None = Field(default=None, ge=4096)
    #: The xxh3_64 of each ``block_bytes`` block of the file (the last one shorter), 16 hex
    #: digits each, concatenated: a reader verifies the blocks a read needs, not the whole file.
    blocks: str | None = None

    @model_serializer(mode="wrap")
    def _drop_defaults(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        out: dict[str, Any] = handler(self)
        if self.block_bytes is None:
            out.pop("block_bytes", None)
            out.pop("blocks", None)
        return out

    @model_validator(mode="after")
    def _check_blocks(self) -> ShardInfo:
        if (self.block_bytes is None) != (self.blocks is None):
            raise ValueError("block_bytes and blocks come together or not at all")
        if self.block_bytes is not None and self.blocks is not None:
            want = 16 * -(-self.bytes // self.block_bytes)
            if len(self.blocks) != want or not _HEX.fullmatch(self.blocks):
                raise ValueError(
                    f"blocks of shard {self.path} must be {want} hex digits (16 per block of "
                    f"{self.block_bytes} bytes), got {len(self.blocks)} characters"
                )
        return self

    @property
    def num_blocks(self) -> int:
        """How many checksummed blocks the file has (1, the whole file, without ``blocks``)."""
        if self.block_bytes is None:
            return 1
        return -(-self.bytes // self.block_bytes)

    @field_validator("path")
    @classmethod
    def _check_path(cls, v: str) -> str:
        parts = v.split("/")
        if v.startswith("/") or "\\" in v or any(p in ("", ".", "..") for p in parts):
            raise ValueError(f"shard path {v!r} must be relative and stay inside the dataset")
        return v


class Manifest(BaseModel):
    """The contents of ``manifest.json``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    format_version: int = FORMAT_VERSION
    name: str
    num_samples: int = Field(ge=0)
    fields: tuple[FieldSpec, ...]
    shards: tuple[ShardInfo, ...]
    created_at: str = ""
    #: Free-form provenance (source path, format, tool version).
    source: dict[str, str] = Field(default_factory=dict)
    #: The tree a nested sample was saved as (:data:`Tree`); ``None`` for a flat dict.
    structure: Tree = None

    @model_serializer(mode="wrap")
    def _drop_defaults(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        out: dict[str, Any] = handler(self)
        if self.structure is None:
            out.pop("structure", None)
        return out

    @field_validator("name")
    @classmethod
    def _check_name(cls, v: str) -> str:
        try:
            return validate_dataset_name(v)
        except InvalidDataError as e:
            raise ValueError(str(e)) from None

    @model_validator(mode="after")
    def _check_counts(self) -> Manifest:
        names = [f.name for f in self.fields]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate field names in {names}")
        if self.structure is not None:
            leaves = tree_fields(self.structure)
            if sorted(leaves) != sorted(names):
                raise ValueError(
                    f"structure names fields {sorted(leaves)}, but the fields are {sorted(names)}"
                )
        total = sum(s.rows for s in self.shards)
        if total != self.num_samples:
            raise ValueError(f"num_samples is {self.num_samples} but the shards hold {total} rows")
        paths = [s.path for s in self.shards]
        if len(set(paths)) != len(paths):
            twice = sorted({p for p in paths if paths.count(p) > 1})
            # Served twice, every sample of such a shard would come twice per epoch.
            raise ValueError(f"shards must be distinct; listed more than once: {twice}")
        return self

    @property
    def total_bytes(self) -> int:
        return sum(s.bytes for s in self.shards)

    def field(self, name: str) -> FieldSpec:
        for f in self.fields:
            if f.name == name:
                return f
        raise KeyError(f"no field {name!r}; fields are {[f.name for f in self.fields]}")


def parse_manifest(text: str | bytes, *, where: str = "manifest.json") -> Manifest:
    """Parse and validate manifest JSON; a format this code does not read is refused by name.

    Raises ``VersionMismatch`` for an unknown ``format_version`` and ``InvalidDataError`` for
    anything else that is wrong, both naming ``where``.
    """
    import json

    try:
        raw = json.loads(text)
    except ValueError as e:
        raise InvalidDataError(f"{where}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise InvalidDataError(f"{where}: expected a JSON object, got {type(raw).__name__}")
    version = raw.get("format_version")
    if version not in SUPPORTED_FORMAT_VERSIONS:
        raise VersionMismatch(
            f"{where}: manifest format_version {version!r} is not supported; this shardserve "
            f"reads format version(s) {list(SUPPORTED_FORMAT_VERSIONS)} — upgrade shardserve or "
            "re-ingest the dataset"
        )
    try:
        return Manifest.model_validate(raw)
    except ValidationError as e:
        raise InvalidDataError(f"{where}: invalid manifest: {e}") from None
