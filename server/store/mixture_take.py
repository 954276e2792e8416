"""One batch of a mixture: each source's samples taken from its own dataset, laid out in the
batch's order, with a ``source`` part saying where each sample came from.

A mixture plan deals ids over the sources' concatenated id space (see
:mod:`shardserve.server.planning.mixture`); :func:`take_mixture` splits a batch of them by
source, makes one ``take`` per source present, and assembles the parts in batch order: rows
of fixed parts (``x``, ``x.shapes``, ``x.mask``) are scattered to their positions; a ragged
part (``x`` with ``x.offsets``) gets new offsets from the samples' lengths in batch order and
its values gathered segment by segment, all vectorised.

>>> import numpy as np
>>> class Rows:
...     def __init__(self, base): self.base = base
...     def take(self, indices, fields=None, out=None):
...         return {"v": np.asarray(indices) + self.base}
>>> parts = take_mixture([Rows(0), Rows(100)], np.array([0, 5, 8]), np.array([6, 1, 7, 0]))
>>> parts["v"].tolist(), parts["source"].tolist()
([101, 1, 102, 0], [1, 0, 1, 0])
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

import numpy as np

from shardserve.proto.parts import OFFSETS, SOURCE_PART
from shardserve.server.planning.mixture import split_ids


class Takes(Protocol):
    """What a mixture batch needs of each source: the store's one ``take``."""

    def take(
        self,
        indices: np.ndarray | Sequence[int],
        fields: Sequence[str] | None = None,
        out: Mapping[str, np.ndarray] | None = None,
    ) -> dict[str, np.ndarray]: ...


def take_mixture(
    sources: Sequence[Takes],
    offsets: np.ndarray,
    ids: np.ndarray,
    fields: Sequence[str] | None = None,
) -> dict[str, np.ndarray]:
    """The batch of concatenated ``ids`` (``offsets``: each source's first id, then the
    total) as batch parts in the ids' order, plus :data:`SOURCE_PART`."""
    src, local = split_ids(np.asarray(ids, dtype=np.int64), offsets)
    present = np.unique(src).tolist()
    if not present:  # an empty batch: the first source's empty parts
        parts = sources[0].take(local, fields)
        parts[SOURCE_PART] = src
        return parts
    positions = [np.flatnonzero(src == s) for s in present]
    taken = [sources[s].take(local[pos], fields) for s, pos in zip(present, positions, strict=True)]
    b = len(ids)
    out: dict[str, np.ndarray] = {}
    for name, first in taken[0].items():
        if name.endswith(OFFSETS):
            continue  # assembled with its values
        if name + OFFSETS in taken[0]:
            out[name], out[name + OFFSETS] = _ragged(name, taken, positions, b)
            continue
        rows = np.empty((b, *first.shape[1:]), dtype=first.dtype)
        for pos, parts in zip(positions, taken, strict=True):
            rows[pos] = parts[name]
        out[name] = rows
    out[SOURCE_PART] = src
    return out


def _ragged(
    name: str, taken: list[dict[str, np.ndarray]], positions: list[np.ndarray], b: int
) -> tuple[np.ndarray, np.ndarray]:
    """Values and offsets of ragged part ``name`` in batch order."""
    lengths = np.empty(b, dtype=np.int64)
    starts = np.empty(b, dtype=np.int64)  # of each sample's values in ``joined``
    base = 0
    for pos, parts in zip(positions, taken, strict=True):
        off = parts[name + OFFSETS]
        lengths[pos] = np.diff(off)
        starts[pos] = off[:-1] + base
        base += len(parts[name])
    joined = np.concatenate([parts[name] for parts in taken])
    offsets = np.zeros(b + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    # Value k of the batch is value (k - offsets[i] + starts[i]) of ``joined``, i its sample.
    gather = np.repeat(starts - offsets[:-1], lengths) + np.arange(offsets[-1], dtype=np.int64)
    return joined[gather], offsets
