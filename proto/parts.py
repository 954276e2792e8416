"""How a field travels as batch parts: the one statement of the layout, used by the store,
transforms, sinks and client alike.

A batch of ``B`` samples is a set of named parts (one frame, or one region of a shared-memory
slot, each). A field ``x`` becomes::

    kind       part          dtype      shape                  what it holds
    scalar     x             its own    [B]
    tensor     x             its own    [B, *shape]
    variable   x             its own    [sum of sizes]         every sample's values, flat
               x.offsets     int64      [B + 1]                where each sample's values start
               x.shapes      int64      [B, ndim]              each sample's shape
    binary     x             uint8      [sum of lengths]       every sample's bytes
               x.offsets     int64      [B + 1]
    nullable   x.mask        bool       [B]                    True where the sample has a value
                                                               (added to any of the above)

A message of several graph batches adds ``.splits`` (see :mod:`.graphs`), a mixture's batch
``source``; the client adds ``x.lengths`` when it pads a variable field into one tensor.

>>> from shardserve.proto.manifest import FieldSpec
>>> parts_of(FieldSpec(name="tokens", dtype="int32", shape=(-1,), nullable=True))
[('tokens', None), ('tokens.offsets', None), ('tokens.shapes', None), ('tokens.mask', ('bool', ()))]
>>> is_companion("tokens.offsets"), is_companion("tokens")
(True, False)
"""

from __future__ import annotations

from typing import Protocol

#: Where each sample's values start in a variable or binary field's values.
OFFSETS = ".offsets"
#: Each sample's shape, for a variable tensor field.
SHAPES = ".shapes"
#: Which samples have a value, for a nullable field.
MASK = ".mask"
#: Each sample's true length (or shape) of a variable field the client padded.
LENGTHS = ".lengths"
#: Where each batch of a message of several graph batches begins in every other part.
SPLITS = ".splits"
#: The part a mixture's batch adds: each sample's source (int16, its index in
#: ``JobSpec.mixture``). No source may serve a field of this name.
SOURCE_PART = "source"

#: ``(dtype, per-sample shape)`` of a fixed-size part; ``None`` for a variable-size one.
PartShape = tuple[str, tuple[int, ...]] | None

_COMPANIONS = (OFFSETS, SHAPES, MASK, LENGTHS)
#: No field's last name segment may be one of these (its parts would collide with another's).
COMPANION_SUFFIXES = tuple(s.lstrip(".") for s in _COMPANIONS)


class FieldLike(Protocol):
    """What :func:`parts_of` reads of a field (a manifest's ``FieldSpec``)."""

    @property
    def name(self) -> str: ...
    @property
    def kind(self) -> str: ...
    @property
    def dtype(self) -> str: ...
    @property
    def shape(self) -> tuple[int, ...]: ...
    @property
    def nullable(self) -> bool: ...


def parts_of(spec: FieldLike) -> list[tuple[str, PartShape]]:
    """The parts field ``spec`` travels as, in frame order (see the module docstring)."""
    n = spec.name
    parts: list[tuple[str, PartShape]]
    if spec.kind in ("scalar", "tensor"):
        parts = [(n, (spec.dtype, spec.shape))]
    else:
        parts = [(n, None), (n + OFFSETS, None)]
        if spec.kind == "variable":
            parts.append((n + SHAPES, None))
    if spec.nullable:
        parts.append((n + MASK, ("bool", ())))
    return parts


def owner_of(name: str, suffixes: tuple[str, ...] = _COMPANIONS) -> str | None:
    """The field companion part ``name`` describes (``"x"`` for ``"x.offsets"``), if it ends
    with one of ``suffixes``; else ``None``.

    >>> owner_of("mol.edge_index.offsets"), owner_of("x", (OFFSETS,))
    ('mol.edge_index', None)
    """
    for suffix in suffixes:
        if name.endswith(suffix) and len(name) > len(suffix):
            return name[: -len(suffix)]
    return None


def is_companion(name: str) -> bool:
    """Whether part ``name`` describes another part (offsets, shapes, mask, lengths, splits)
    rather than holding a field's values."""
    return name == SPLITS or name.endswith(_COMPANIONS)
