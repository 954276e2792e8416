"""Cutting a message of several batches into those batches.

Small batches travel several to a message: ``count`` consecutive batches of ``rows`` samples
each (the last of an epoch may be short), one after the other in every field. Each batch
cut out is a tensor of its own over its rows (:func:`._frames.own_storage`: no copy on the
CPU), so batches share no storage with each other or with another field, and the slot or
frame under them is free once the last of them is gone. On a device the batches are views
of the message's tensor there.

>>> import torch
>>> parts = cut_rows({"y": torch.arange(5)}, rows=2, count=3)
>>> [p["y"].tolist() for p in parts]
[[0, 1], [2, 3], [4]]
"""

from __future__ import annotations

import itertools

import torch

from shardserve.proto.errors import ProtocolError
from shardserve.proto.graphs import concat_dim
from shardserve.proto.messages import BatchHeader, PartHeader
from shardserve.proto.parts import OFFSETS, SPLITS, owner_of

from ._frames import own_rows, own_storage
from .types import Batch, VarTensor


def check_message(header: BatchHeader, rows: int, num_batches: int, graphs: bool = False) -> None:
    """Refuse a message whose header does not describe what the plan expects: ``count``
    batches from ``index`` within the epoch's ``num_batches``, of ``rows`` samples each (the
    job's batch size; only the epoch's last batch may be short), every part holding that many
    samples. Header arithmetic only, before any tensor is made; a violation is a
    :class:`ProtocolError` naming the field, never a batch of other samples than planned.
    ``graphs``: parts count nodes and edges, not samples (``collate="graph"``); a message of
    several graph batches is checked by its ``.splits`` when cut (:func:`cut_graphs`)."""
    where = f"message of batches {header.index}..{header.index + header.count - 1}"
    if rows and header.rows != rows:
        raise ProtocolError(
            f"{where}: header field rows={header.rows}, but this job's batches hold {rows} samples"
        )
    if header.rows < 1:
        raise ProtocolError(f"{where}: header field rows={header.rows} is not a batch size")
    if header.index + header.count > num_batches:
        raise ProtocolError(
            f"{where}: header field count={header.count} runs past the epoch's {num_batches} batches"
        )
    names = [p.name for p in header.parts]
    if len(set(names)) != len(names):
        raise ProtocolError(f"{where}: a part name appears twice in {names}")
    if graphs or SPLITS in names:
        return
    full = header.count * header.rows
    # Only the message holding the epoch's last batch may be short, by less than a batch.
    least = full if header.index + header.count < num_batches else full - header.rows + 1
    present = set(names)
    for p in header.parts:
        n = _samples(p, present)
        if n is not None and not least <= n <= full:
            raise ProtocolError(
                f"{where}: part {p.name!r} holds {n} samples, but the header says count="
                f"{header.count} batches of rows={header.rows} ({least} to {full} samples)"
            )
        if n is not None and least < full:
            least = full = n  # every part of the short message holds the same samples


def _samples(p: PartHeader, names: set[str]) -> int | None:
    """How many samples part ``p`` holds by its shape (``None``: a variable field's values)."""
    if owner_of(p.name, (OFFSETS,)) in names:
        return p.shape[0] - 1 if p.shape else -1
    if p.name + OFFSETS in names:
        return None
    if not p.shape:
        raise ProtocolError(f"part {p.name!r} has no sample dimension (shape {list(p.shape)})")
    return p.shape[0]


def cut_rows(batch: Batch, rows: int, count: int) -> list[Batch]:
    """The ``count`` batches of ``rows`` samples each that ``batch`` holds, in order."""
    if count == 1:
        return [batch]
    if SPLITS in batch:
        return cut_graphs(batch, count)
    out: list[Batch] = [{} for _ in range(count)]
    for name, t in batch.items():
        if isinstance(t, VarTensor):
            for b, var in zip(out, _cut_var(name, t, rows, count), strict=True):
                b[name] = var
        elif isinstance(t, torch.Tensor):
            total = int(t.shape[0]) if t.dim() else -1
            _check(name, total, rows, count)
            for b, piece in zip(out, own_rows(t, _bounds(total, rows, count)), strict=True):
                b[name] = piece
        else:
            raise ProtocolError(f"field {name!r} of a message of {count} batches has no rows")
    return out


def _bounds(total: int, rows: int, count: int) -> list[tuple[int, int]]:
    return [(j * rows, min((j + 1) * rows, total)) for j in range(count)]


def _check(name: str, total: int, rows: int, count: int) -> None:
    """A message of ``count`` batches has more than ``count - 1`` full batches of rows and at
    most ``count``: anything else is a server bug or a hostile peer."""
    if rows < 1 or not (count - 1) * rows < total <= count * rows:
        raise ProtocolError(f"field {name!r}: {total} rows do not make {count} batches of {rows}")


def _cut_var(name: str, v: VarTensor, rows: int, count: int) -> list[VarTensor]:
    """Each batch's samples of a variable-size field: its values, its offsets from 0."""
    total = len(v)
    _check(name, total, rows, count)
    bounds = _bounds(total, rows, count)
    # Where each batch's values start and end, read in one go.
    edges = v.offsets[[lo for lo, _ in bounds] + [total]].tolist()
    values = own_rows(v.values, list(itertools.pairwise(edges)))
    shapes = own_rows(v.shapes, bounds)
    return [
        # The offsets are a new tensor: rebased to this batch.
        VarTensor(values[j], v.offsets[lo : hi + 1] - edges[j], shapes[j])
        for j, (lo, hi) in enumerate(bounds)
    ]


def cut_graphs(batch: Batch, count: int) -> list[Batch]:
    """The ``count`` graph batches (``collate="graph"``) of one message, cut where its
    ``.splits`` part says, each part along the dimension it joins graphs in. Index fields
    cut along their last dimension are copied (a column range is not one block of memory)."""
    splits_t = batch[SPLITS]
    names = [n for n in batch if n != SPLITS]
    if not isinstance(splits_t, torch.Tensor) or tuple(splits_t.shape) != (len(names), count + 1):
        raise ProtocolError(
            f"a message of {count} graph batches needs {SPLITS} of shape "
            f"[{len(names)}, {count + 1}]"
        )
    splits = splits_t.tolist()
    out: list[Batch] = [{} for _ in range(count)]
    for name, cuts in zip(names, splits, strict=True):
        t = batch[name]
        dim = concat_dim(name)
        if not isinstance(t, torch.Tensor) or not t.dim():
            raise ProtocolError(f"graph part {name!r} has no dimension to cut")
        size = int(t.shape[dim])
        if cuts[0] != 0 or cuts[-1] != size or any(a > b for a, b in itertools.pairwise(cuts)):
            raise ProtocolError(f"{SPLITS} of {name!r} {cuts} do not cut its {size} rows")
        for b, lo, hi in zip(out, cuts[:-1], cuts[1:], strict=True):
            piece = t.narrow(dim, lo, hi - lo)
            b[name] = own_storage(piece) if piece.is_contiguous() else piece.contiguous()
    return out
