"""Tensors over received bytes: a frame or a shared-memory slot becomes typed tensors, and a
batch's parts become its fields.

Ownership: each payload frame is its own libzmq message, allocated for that message alone
(or a disjoint slice of libzmq's receive buffer for small ones), so wrapping it with
``torch.frombuffer`` gives a tensor that shares memory with no other batch. The tensor keeps
the frame alive; the frame is writable, so torch has nothing to warn about. Small frames
that are misaligned for their dtype are copied instead.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from shardserve.proto.errors import ProtocolError
from shardserve.proto.framing import ITEMSIZE, Frame
from shardserve.proto.messages import BatchHeader, PartHeader
from shardserve.proto.parts import LENGTHS, OFFSETS, SHAPES, owner_of

from .types import Batch, VarTensor


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a wire dtype name (``"float32"`` -> ``torch.float32``)."""
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise TypeError(f"wire dtype {name!r} has no torch equivalent")
    return dt


def tensor_from_frame(part: PartHeader, frame: Frame) -> torch.Tensor:
    """A tensor over ``frame``'s memory (no copy), shaped as the header says."""
    dtype = torch_dtype(part.dtype)
    if part.nbytes == 0:
        return torch.empty(part.shape, dtype=dtype)
    t = torch.frombuffer(frame, dtype=torch.uint8)
    if t.data_ptr() % ITEMSIZE[part.dtype]:
        t = t.clone()  # unaligned: a typed view would be undefined behaviour for some kernels
    return t.view(dtype).view(part.shape)


def parts_from_frames(header: BatchHeader, frames: Sequence[Frame]) -> dict[str, torch.Tensor]:
    """Each part of a socket batch as a tensor over its own frame."""
    return {p.name: tensor_from_frame(p, f) for p, f in zip(header.parts, frames, strict=True)}


def views_at(
    base: torch.Tensor, parts: Sequence[PartHeader], start: int = 0
) -> dict[str, torch.Tensor]:
    """Typed tensors over ``base`` (uint8) for each part, found at its offset minus ``start``,
    each with a storage of its own (see :func:`own_storage`)."""
    if base.device.type != "cpu":
        return {
            p.name: base[p.offset - start : p.offset - start + p.nbytes]
            .view(torch_dtype(p.dtype))
            .view(p.shape)
            for p in parts
        }
    out = {}
    for p in parts:
        # Each field's own slice of ``base`` is a tensor of its own (one more user of the slot's
        # storage while the field lives); typed and shaped in numpy, which costs a fraction
        # of torch's per-op dispatch on a small batch's fixed cost.
        view = base[p.offset - start : p.offset - start + p.nbytes]
        np_dtype = _NP_DTYPES.get(p.dtype)
        if np_dtype is None or p.nbytes == 0:
            out[p.name] = own_storage(view.view(torch_dtype(p.dtype))).view(p.shape)
        else:
            out[p.name] = torch.from_numpy(view.numpy().view(np_dtype).reshape(p.shape))
    return out


#: Wire dtypes numpy has, as numpy dtypes (the others go through :func:`own_storage`).
_NP_DTYPES: dict[str, np.dtype] = {n: np.dtype(n) for n in ITEMSIZE if n in np.sctypeDict}


#: Same-size integer dtypes for dtypes numpy lacks (bfloat16, float8 ...).
_AS_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def own_storage(view: torch.Tensor) -> torch.Tensor:
    """``view`` (contiguous, on the CPU) as a tensor whose storage is exactly its bytes.

    A batch's fields then share no storage: ``torch.save`` of a label writes the label, not
    the slot, and ``untyped_storage()`` of one field says nothing about another. The memory is
    the same (no copy): ``torch.from_numpy`` makes a storage per call, and that storage keeps
    the numpy array, hence ``view`` and the slot or block under it, alive, so the slot's
    user count (how a lent slot is known to be free) still counts this field.
    """
    if view.device.type != "cpu" or view.numel() == 0:
        return view
    try:
        return torch.from_numpy(view.numpy())
    except TypeError:  # a dtype numpy does not have: through an integer of the same size
        as_int = _AS_INT[view.element_size()]
        return torch.from_numpy(view.view(as_int).numpy()).view(view.dtype)


def own_rows(t: torch.Tensor, bounds: Sequence[tuple[int, int]]) -> list[torch.Tensor]:
    """The row ranges ``t[lo:hi]`` of ``t`` (contiguous), each with a storage of its own as
    :func:`own_storage` makes it. Sliced in numpy: a torch slice and ``.numpy()`` per piece
    cost about five times as much, which a step of many small env batches pays per field.

    >>> [p.tolist() for p in own_rows(torch.arange(5), [(0, 2), (2, 5)])]
    [[0, 1], [2, 3, 4]]
    """
    if t.device.type != "cpu":
        return [t[lo:hi] for lo, hi in bounds]
    try:
        rows = t.numpy()
    except TypeError:  # a dtype numpy does not have
        return [own_storage(t[lo:hi]) for lo, hi in bounds]
    return [torch.from_numpy(rows[lo:hi]) for lo, hi in bounds]


def check_variable(parts: Mapping[str, torch.Tensor]) -> None:
    """Refuse variable fields whose companions lie: ``x.offsets`` must start at 0, never
    decrease and end at ``x``'s length; ``x.shapes`` (one row per sample) must multiply out
    to each sample's span. A few vector ops per field on the CPU (parts on a device are
    checked before they are copied there); a violation is a :class:`ProtocolError` naming
    the part, never a sample made of another's bytes."""
    for name, values in parts.items():
        offsets = parts.get(name + OFFSETS)
        if offsets is None or offsets.device.type != "cpu":
            continue
        o = offsets.numpy()
        where = f"part {name + OFFSETS!r}"
        if o.ndim != 1 or o.size < 1 or o.dtype.kind not in "iu":
            raise ProtocolError(
                f"{where}: {o.dtype}{list(o.shape)} is not a 1-d integer offset list"
            )
        spans = np.diff(o)
        if o[0] != 0 or o[-1] != values.numel() or (spans < 0).any():
            bad = int(np.argmax(spans < 0)) if (spans < 0).any() else None
            raise ProtocolError(
                f"{where}: offsets must rise from 0 to {values.numel()} (the values of "
                f"{name!r}); they run {int(o[0])}..{int(o[-1])}"
                + (f" and fall after sample {bad}" if bad is not None else "")
            )
        shapes = parts.get(name + SHAPES)
        if shapes is None:
            continue
        sh = shapes.numpy()
        if sh.ndim != 2 or sh.shape[0] != spans.size or (sh < 0).any():
            raise ProtocolError(
                f"part {name + SHAPES!r}: {list(sh.shape)} is not one shape per sample of "
                f"{spans.size}"
            )
        wrong = np.flatnonzero(sh.prod(axis=1) != spans)
        if wrong.size:
            i = int(wrong[0])
            raise ProtocolError(
                f"part {name + SHAPES!r}: sample {i} has shape {sh[i].tolist()} but "
                f"{name + OFFSETS!r} gives it {int(spans[i])} values"
            )


def assemble(parts: dict[str, torch.Tensor], pad_variable: bool = False) -> Batch:
    """Group a batch's parts into fields: fixed tensors as they are, variable and binary
    fields (``x`` + ``x.offsets`` [+ ``x.shapes``]) as :class:`VarTensor` or, padded, as a
    dense tensor plus ``x.lengths``. Variable fields are checked first (:func:`check_variable`)."""
    check_variable(parts)
    out: Batch = {}
    for name, t in parts.items():
        if owner_of(name, (OFFSETS, SHAPES)) in parts:
            continue  # travels with its field (a nested field's name has dots of its own)
        offsets = parts.get(name + OFFSETS)
        if offsets is None:
            out[name] = t
            continue
        shapes = parts.get(name + SHAPES)
        if shapes is None:  # binary: each sample's length in bytes
            shapes = (offsets[1:] - offsets[:-1]).unsqueeze(1)
        var = VarTensor(t, offsets, shapes)
        if pad_variable:
            dense, true_shapes = var.pad()
            out[name] = dense
            out[name + LENGTHS] = true_shapes[:, 0] if true_shapes.shape[1] == 1 else true_shapes
        else:
            out[name] = var
    return out


def batch_from_frames(
    header: BatchHeader, frames: Sequence[Frame], pad_variable: bool = False
) -> Batch:
    """CPU tensors for a received batch, each owning (a reference to) its own frame."""
    return assemble(parts_from_frames(header, frames), pad_variable)
