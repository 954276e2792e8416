"""Cutting a batch's parts into row ranges and putting the results back together, so that
one batch's samples can run on several workers at once."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from shardserve.proto.parts import OFFSETS, SHAPES

from ..source import FRESH, Tail
from .schema import Field


def bounds(n: int, pieces: int) -> list[tuple[int, int]]:
    """``pieces`` contiguous, near-equal row ranges covering ``0..n`` (none empty)."""
    pieces = max(1, min(pieces, n))
    cuts = [n * k // pieces for k in range(pieces + 1)]
    return [(cuts[k], cuts[k + 1]) for k in range(pieces)]


def slice_parts(
    parts: Mapping[str, np.ndarray], schema: Mapping[str, Field], lo: int, hi: int
) -> dict[str, np.ndarray]:
    """Rows ``lo..hi`` of store-layout ``parts`` (ragged offsets rebased to 0)."""
    out: dict[str, np.ndarray] = {}
    for name, f in schema.items():
        if name not in parts:
            continue
        if f.fixed:
            out[name] = parts[name][lo:hi]
            continue
        offsets = parts[name + OFFSETS]
        a, b = int(offsets[lo]), int(offsets[hi])
        out[name] = parts[name][a:b]
        out[name + OFFSETS] = offsets[lo : hi + 1] - a
        if name + SHAPES in parts:
            out[name + SHAPES] = parts[name + SHAPES][lo:hi]
    return out


def concat_parts(
    pieces: Sequence[Mapping[str, np.ndarray]],
    schema: Mapping[str, Field],
    names: Sequence[str],
    out: Mapping[str, np.ndarray] | None = None,
    tail: Tail = FRESH,
) -> dict[str, np.ndarray]:
    """The inverse of :func:`slice_parts` over consecutive pieces (fixed fields into ``out``,
    the values of variable ones joined in ``tail``; one piece's are kept as they are)."""
    if len(pieces) == 1 and out is None:
        return dict(pieces[0])
    joined: dict[str, np.ndarray] = {}
    for name in names:
        f = schema[name]
        if f.fixed:
            dest = out.get(name) if out is not None else None
            rows = sum(len(p[name]) for p in pieces)
            if dest is None or dest.shape[0] != rows or dest.dtype != pieces[0][name].dtype:
                dest = np.empty((rows, *pieces[0][name].shape[1:]), pieces[0][name].dtype)
            if not _in_place([p[name] for p in pieces], dest):
                np.concatenate([p[name] for p in pieces], out=dest)
            joined[name] = dest
            continue
        if len(pieces) == 1:
            joined.update(
                {k: pieces[0][k] for k in (name, name + OFFSETS, name + SHAPES) if k in pieces[0]}
            )
            continue
        values = [p[name] for p in pieces]
        size = sum(v.size for v in values)
        joined[name] = np.concatenate(values, out=tail.empty(name, (size,), values[0].dtype))
        offs = [pieces[0][name + OFFSETS]]
        base = int(offs[0][-1])
        for p in pieces[1:]:
            offs.append(p[name + OFFSETS][1:] + base)
            base += int(p[name + OFFSETS][-1])
        joined[name + OFFSETS] = np.concatenate(offs)
        if name + SHAPES in pieces[0]:
            joined[name + SHAPES] = np.concatenate([p[name + SHAPES] for p in pieces])
    return joined


def _in_place(arrays: Sequence[np.ndarray], dest: np.ndarray) -> bool:
    """Whether ``arrays`` already are ``dest``'s consecutive rows (pieces that wrote their
    rows of a batch where it is sent from): nothing to copy then."""
    row = 0
    for a in arrays:
        if a.shape[1:] != dest.shape[1:] or a.dtype != dest.dtype or not a.flags.c_contiguous:
            return False
        if len(a) and a.ctypes.data != dest[row:].ctypes.data:
            return False
        row += len(a)
    return row == len(dest)
